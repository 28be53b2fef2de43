"""Trace rows the metadata DB refused, kept on local disk until it takes them.

The executor writes a task's placement row before it publishes the task to Celery: after a
scheduler restart, adoption reads those rows to tell a task Celery holds from one never sent
(:meth:`DRLExecutor._never_sent`). While the DB refuses writes (a failover, a full disk) the rows
wait in the executor's memory; a scheduler that dies then would take them along, and the next
scheduler's adoption would send those tasks again while Celery still runs them. So the rows also
wait here, one JSON-lines file per executor process, and the next executor that starts on this
host (or sees this directory) takes over the files of dead ones and writes their rows.

Each process holds an exclusive ``flock`` on ``NAME.lock`` for its life; the kernel releases it
when the process dies, however it dies. A lock file nobody holds marks an orphan: whoever takes
its lock reads ``NAME.jsonl``, and deletes both files once the rows are its own (in its memory and
its own file, written first). ``NAME.jsonl`` is replaced whole (write, fsync, rename), so a crash
mid-write leaves the previous version.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import socket
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_DATES = ("decided_at",)


def default_dir() -> Path:
    """``$AIRFLOW_HOME/drl_executor/spool`` (``~/airflow`` when AIRFLOW_HOME is not set, as Airflow)."""
    home = os.environ.get("AIRFLOW_HOME") or os.path.join(os.path.expanduser("~"), "airflow")
    return Path(home) / "drl_executor" / "spool"


class Spool:
    """This process's file of unwritten trace rows, and the files dead processes left."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.data = self.dir / f"{self.name}.jsonl"
        self._lock_path = self.dir / f"{self.name}.lock"
        self._lock_fd: int | None = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._saved = False
        #: orphans taken by :meth:`adopt_orphans`, their files deleted by :meth:`release`
        self._claimed: list[tuple[int, Path]] = []

    def save(self, rows: list[dict[str, Any]]) -> None:
        """Replace this process's file with ``rows`` (none: remove it). ``OSError`` when the disk
        refuses too."""
        if not rows:
            if self._saved:
                self.data.unlink(missing_ok=True)
                self._saved = False
            return
        _write(self.data, rows)
        self._saved = True

    def adopt_orphans(self) -> list[dict[str, Any]]:
        """The rows of every file whose process is gone, now this process's to write: the caller
        keeps them with its own and :meth:`save` s them before :meth:`release` deletes the
        orphans' files. Files that cannot be read are logged and left in place."""
        rows: list[dict[str, Any]] = []
        for lock in sorted(self.dir.glob("*.lock")):
            if lock == self._lock_path:
                continue
            try:
                fd = os.open(lock, os.O_RDWR)  # no O_CREAT: one another adopter just deleted stays gone
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # its process is alive
                os.close(fd)
                continue
            data = lock.with_suffix(".jsonl")
            try:
                found = _read(data) if data.exists() else []
            except (OSError, ValueError) as exc:
                log.error("DRLExecutor: cannot read the unwritten placements of %s (left in place): %s", data, exc)
                os.close(fd)
                continue
            rows.extend(found)
            self._claimed.append((fd, lock))
        return rows

    def release(self) -> None:
        """Delete the files :meth:`adopt_orphans` took (their rows are saved in this process's)."""
        for fd, lock in self._claimed:
            lock.with_suffix(".jsonl").unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
            os.close(fd)
        self._claimed = []

    def close(self) -> None:
        """At a clean stop: this process's lock goes; its file stays if rows are left in it (the
        next executor here writes them)."""
        if self._lock_fd is None:
            return
        if not self._saved:
            self._lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps({k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in row.items()},
                                sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"not a row: {line[:80]!r}")
            for key in _DATES:
                if isinstance(row.get(key), str):
                    row[key] = dt.datetime.fromisoformat(row[key])
            rows.append(row)
    return rows
