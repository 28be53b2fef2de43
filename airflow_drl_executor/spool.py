"""Trace rows the metadata DB refused, kept on local disk until it takes them.

The executor writes a task's placement row before it publishes the task to Celery: after a
scheduler restart, adoption reads those rows to tell a task Celery holds from one never sent
(:meth:`DRLExecutor._never_sent`). While the DB refuses writes (a failover, a full disk) the rows
wait in the executor's memory; a scheduler that dies then would take them along, and the next
scheduler's adoption would send those tasks again while Celery still runs them. So the rows also
wait here, one JSON-lines file per executor process, and the next executor that starts on this
host (or sees this directory) takes over the files of dead ones and writes their rows; its
adoption also counts the Celery ids of every file here as sent, a live executor's included.

Each process holds an exclusive ``flock`` on ``NAME.lock`` for its life; the kernel releases it
when the process dies, however it dies (a forked child closes its copy of the descriptor at once:
Celery's publishing and state-fetching pools outlive a killed scheduler, and would otherwise hold
its lock for ever, found by review). A lock file nobody holds marks an orphan: whoever takes its
lock reads ``NAME.jsonl``, and deletes both files once the rows are its own (in its memory and
its own file, written first). ``NAME.jsonl`` is replaced whole (write, fsync, rename), so a crash
mid-write leaves the previous version. ``NAME.unsent.json`` holds the (Celery id, request id) of
rows whose "not sent" mark (a publish that did not go) the DB has not taken yet, so that the next
scheduler's adoption does not take those tasks for sent either. Rows the DB refuses for what they
hold (not for being down) go to ``NAME.rejected.jsonl``, kept for a person to read.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import socket
import uuid
import weakref
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any, TypeVar

from airflow_drl_executor.traces import ROW_KEYS, row_problem

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_DATES = ("decided_at",)
#: what a row must hold to be written: every column PlacementRecord.row writes
_REQUIRED = ROW_KEYS
#: every open spool of this process: a forked child closes their descriptors (see the module doc)
_OPEN: weakref.WeakSet[Spool] = weakref.WeakSet()


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
        self.rejected = self.dir / f"{self.name}.rejected.jsonl"
        self.unsent = self.dir / f"{self.name}.unsent.json"
        self._lock_path = self.dir / f"{self.name}.lock"
        # locked under a name other adopters do not look at, then renamed (the lock goes with the
        # file): a fresh lock file is never taken for an orphan's (found by review)
        locking = self.dir / f"{self.name}.locking"
        fd = os.open(locking, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(locking, self._lock_path)
        except OSError:
            os.close(fd)
            locking.unlink(missing_ok=True)
            raise
        self._lock_fd: int | None = fd
        self._saved = False
        self._unsent_saved = False
        #: orphans taken by :meth:`adopt_orphans`, their files deleted by :meth:`release`
        self._claimed: list[tuple[int, Path]] = []
        _OPEN.add(self)

    def save(self, rows: list[dict[str, Any]], unsent: Collection[tuple[str, str]] = ()) -> None:
        """Replace this process's files with ``rows`` and the ``unsent`` (Celery id, request id)
        pairs (none: remove them). ``OSError`` when the disk refuses too (no partial file is left)."""
        if unsent:
            _replace(self.unsent, json.dumps(sorted([c, r] for c, r in unsent)))
            self._unsent_saved = True
        elif self._unsent_saved:
            self.unsent.unlink(missing_ok=True)
            self._unsent_saved = False
        if not rows:
            if self._saved:
                self.data.unlink(missing_ok=True)
                self._saved = False
            return
        _write(self.data, rows)
        self._saved = True

    def reject(self, rows: Iterable[dict[str, Any]]) -> None:
        """Keep rows the DB refused for their content, for a person to read (``OSError``)."""
        with open(self.rejected, "a", encoding="utf-8") as fh:
            for row in rows:
                fh.write(_line(row))

    def adopt_orphans(self) -> tuple[list[dict[str, Any]], set[tuple[str, str]]]:
        """The rows and unsent pairs of every process that is gone, now this process's to write:
        the caller keeps them with its own and :meth:`save` s them before :meth:`release` deletes
        the orphans' files. Files that cannot be opened or read are logged and left in place."""
        rows: list[dict[str, Any]] = []
        unsent: set[tuple[str, str]] = set()
        for lock in sorted(self.dir.glob("*.lock")):
            if lock == self._lock_path:
                continue
            try:
                fd = os.open(lock, os.O_RDWR)  # no O_CREAT: one another adopter just deleted stays gone
            except FileNotFoundError:
                continue
            except OSError as exc:  # another user's (a scheduler once run as root): never the scheduler's end
                log.error("DRLExecutor: cannot open %s (its unwritten placements are left in place): %s", lock, exc)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its process is alive
                os.close(fd)
                continue
            data = lock.with_suffix(".jsonl")
            marks = self._marks_of(lock.with_suffix(".unsent.json"))
            try:
                found = _read(data) if data.exists() else []
            except (OSError, ValueError) as exc:
                log.error("DRLExecutor: cannot read the unwritten placements of %s (left in place): %s", data, exc)
                os.close(fd)
                continue
            why = [row_problem(r) if all(k in r for k in _REQUIRED) else "a column is missing" for r in found]
            bad = [r for r, w in zip(found, why, strict=True) if w]
            if bad:  # a file written by hand or by something else: kept aside, never the scheduler's end
                log.error("DRLExecutor: %d row(s) of %s are not placements the DB can take (set aside in %s),"
                          " the first: %s", len(bad), data, self.rejected, next(w for w in why if w))
                try:
                    self.reject(bad)
                except OSError as exc:
                    log.error("DRLExecutor: cannot set them aside: %s", exc)
                    os.close(fd)
                    continue
            rows.extend(r for r, w in zip(found, why, strict=True) if not w)
            unsent |= marks
            self._claimed.append((fd, lock))
        return rows, unsent

    def celery_ids(self) -> set[str]:
        """The Celery ids of the rows of every readable file here, live executors' included: the
        tasks those rows were written for were sent (or are being sent) to Celery."""
        return {str(r["celery_id"]) for path in self.dir.glob("*.jsonl") if not path.name.endswith(".rejected.jsonl")
                for r in _readable(path, _read) if r.get("celery_id")}

    def _marks_of(self, path: Path) -> set[tuple[str, str]]:
        """A dead process's unsent pairs; a file that cannot be read is set aside under a name of
        its own (``.unsent.rejected.json``) and its process's rows are taken all the same."""
        try:
            return _read_unsent(path)
        except (OSError, ValueError) as exc:
            log.error("DRLExecutor: cannot read %s (set aside): %s", path, exc)
            try:
                path.rename(path.with_suffix(".rejected.json"))
            except OSError:
                pass
            return set()

    def unsent_pairs(self) -> set[tuple[str, str]]:
        """The (Celery id, request id) pairs of every readable unsent file here, live executors'
        included: rows whose publish did not go, whatever the DB still says."""
        return {pair for path in self.dir.glob("*.unsent.json") for pair in _readable(path, _read_unsent)}

    def release(self) -> None:
        """Delete the files :meth:`adopt_orphans` took (their rows are saved in this process's)."""
        for fd, lock in self._claimed:
            for path in (lock.with_suffix(".jsonl"), lock.with_suffix(".unsent.json"), lock.with_suffix(".tmp"),
                         lock.with_suffix(".unsent.tmp"), lock):
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    log.error("DRLExecutor: cannot delete %s (its rows are written): %s", path, exc)
            os.close(fd)
        self._claimed = []

    def close(self) -> None:
        """At a clean stop: this process's lock goes; its file stays if rows are left in it (the
        next executor here writes them)."""
        if self._lock_fd is None:
            return
        if not self._saved and not self._unsent_saved:
            self._lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)
        self._lock_fd = None
        _OPEN.discard(self)

    def _forget_in_child(self) -> None:
        """In a forked child: close this process's copies of the lock descriptors (never
        ``LOCK_UN``, which would release the parent's locks too)."""
        for fd in [self._lock_fd, *(fd for fd, _ in self._claimed)]:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._lock_fd, self._claimed = None, []


def _after_fork_in_child() -> None:
    for spool in list(_OPEN):
        spool._forget_in_child()
    _OPEN.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def waiting(directory: Path) -> tuple[int, int]:
    """(placement rows, not-sent marks) waiting for the database in every readable file of
    ``directory``, live processes' included (``airflow drl-executor check``)."""
    rows = sum(len(list(_readable(p, _read))) for p in directory.glob("*.jsonl")
               if not p.name.endswith(".rejected.jsonl"))
    marks = sum(len(list(_readable(p, _read_unsent))) for p in directory.glob("*.unsent.json"))
    return rows, marks


def _readable(path: Path, read: Callable[[Path], Iterable[_T]]) -> Iterable[_T]:
    """What ``read`` finds in ``path``; nothing (logged) for a file it cannot read."""
    try:
        return read(path)
    except (OSError, ValueError) as exc:
        log.warning("DRLExecutor: cannot read %s: %s", path, exc)
        return ()


def _line(row: dict[str, Any]) -> str:
    return json.dumps({k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in row.items()},
                      sort_keys=True) + "\n"


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    _replace(path, "".join(_line(row) for row in rows))


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (write, fsync, rename)."""
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _loads(text: str) -> Any:
    """``json.loads``; ``ValueError`` for anything it cannot take (nesting too deep included)."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError(f"nested too deeply: {exc}") from None


def _read_unsent(path: Path) -> set[tuple[str, str]]:
    if not path.exists():
        return set()
    pairs = _loads(path.read_text(encoding="utf-8"))
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ValueError(f"not a list of [celery id, request id]: {str(pairs)[:80]}")
    return {(str(c), str(r)) for c, r in pairs}


def _read(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = _loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"not a row: {line[:80]!r}")
            for key in _DATES:
                if isinstance(row.get(key), str):
                    row[key] = dt.datetime.fromisoformat(row[key])
            rows.append(row)
    return rows
