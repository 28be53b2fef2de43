"""The model registry: a folder whose manifest names the active checkpoint, watched for changes.

Layout (``<root>/active.json``, written atomically by :func:`activate`)::

    {"checkpoint": "gnn-2024-06-01",      # path, relative to <root> or absolute
     "sha256": "9f2c...",                 # optional: content hash of the checkpoint (see below)
     "note": "nightly fine-tune",         # optional, logged
     "objective": "sla_violation_rate"}   # optional: what the deployment optimises (OBJECTIVES)

The objective is the deployment's, not the checkpoint's: every activation keeps the one the
manifest had unless it is given (:func:`activate`; a rollback restores the one its history
entry recorded), the nightly fine-tune trains and judges its candidates on it, and the servers
report it in their heartbeats. An empty registry is seeded with the packaged checkpoint of the
objective its first server was given (:data:`PACKAGED_CHECKPOINTS`, :func:`ensure_active`).

The server polls the manifest between batches. When it names a new checkpoint, the registry
checks the hash (when given), then loads the checkpoint in a background thread through a *loader*
(``loader(path, device) -> Placer``; the GNN loader checks schema version and shapes and raises
:class:`~policy.errors.CheckpointError` on mismatch). The server swaps to the new placer between
two batches; if anything fails, the old model keeps serving and the reason is logged and counted.
Torch is imported only by the GNN loader, so a heuristic-only server starts without it.

A registry this host cannot read (permissions, a network mount gone) is an I/O error, not a bad
checkpoint: at start-up it is a :class:`~policy.errors.CheckpointError` like any other (``--placer
auto`` serves the heuristic); while serving, the current model keeps serving, the error is logged and
counted once, and the next poll tries again, with the same manifest.

Each checkpoint that loads is recorded in ``<root>/last_good.json`` (same fields, plus the
model's version). A server that starts while ``active.json`` names a checkpoint that does not
load serves that last good one instead, and says so: a bad push survives a restart as a refusal,
not as the loss of the learned policy. Paths under ``<root>`` are written relative to it (by the
fine-tune and in ``last_good.json``), so a registry volume mounted at different paths on different
hosts names the same checkpoints on each.

:meth:`ModelRegistry.serving_checkpoint` says which checkpoint a server would serve, without loading
it; writers that compare the active checkpoint before replacing it hold :func:`activation_lock`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from policy.errors import CheckpointError
from policy.files import read_bounded
from policy.placement import Placer

log = logging.getLogger(__name__)

MANIFEST = "active.json"
#: The last checkpoint that loaded here (written by the servers; read at start-up).
LAST_GOOD = "last_good.json"
#: Held (``flock``) by writers around "read the active checkpoint, compare, activate".
ACTIVATION_LOCK = ".activate.lock"
#: Every activation, one JSON line each (read by :func:`history`, ``drl-policy registry``).
HISTORY = "history.jsonl"
#: a history longer than this is not read (one activation is a line of ~300 bytes)
MAX_HISTORY_BYTES = 64 * 1024 * 1024
#: What an I/O failure was reading, for reporting each distinct one once (see ModelRegistry._io_failure).
_MANIFEST_READ, _CHECKPOINT_READ = "manifest", "checkpoint"

Loader = Callable[[Path, str], Placer]


@dataclass(frozen=True)
class LoadedModel:
    """A placer loaded from a checkpoint, and where it came from."""

    placer: Placer
    checkpoint: str
    sha256: str
    device: str
    loaded_at: float

    @property
    def version(self) -> str:
        return f"{self.placer.name}:{self.placer.version}"


@dataclass(frozen=True)
class ServingCheckpoint:
    """The checkpoint the servers serve: its path, its content hash and the file that named it."""

    path: Path
    sha256: str
    #: MANIFEST or LAST_GOOD; not compared: the same checkpoint is the same, whoever names it
    source: str = field(compare=False)


def _files_under(root: Path) -> list[Path]:
    """Every file under ``root``; a folder that cannot be read raises OSError (``rglob`` skipped it
    silently, and a checkpoint the servers' user could not read looked empty: a bad checkpoint,
    refused for good, not an I/O error retried; found by review)."""
    out: list[Path] = []

    def fail(exc: OSError) -> None:
        raise exc

    for folder, _, names in os.walk(root, onerror=fail):
        out.extend(Path(folder) / n for n in names if (Path(folder) / n).is_file())
    return out


def checkpoint_sha256(path: Path) -> str:
    """Content hash of a checkpoint: the file itself, or every file of a folder in name order."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(_files_under(path))
    if not files:
        raise CheckpointError(f"{path}: no checkpoint file there")
    for f in files:
        if path.is_dir():
            # the name's bytes as the file system has them (found by review: a name that is not
            # UTF-8, e.g. notes-\xe9.txt, raised UnicodeEncodeError out of the server's start)
            h.update(os.fsencode(f.relative_to(path)) + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def activate(root: str | Path, checkpoint: str | Path, *, sha256: str | None = None,
             note: str = "", objective: str | None = None) -> Path:
    """Point the registry at ``checkpoint`` (atomic rename; servers pick it up on their next poll).

    ``checkpoint`` is written as given: a relative path is relative to ``root`` (see the module's
    docstring); nothing is checked here (``drl-policy registry activate`` checks first).
    ``objective`` (one of :data:`OBJECTIVES`): None keeps the manifest's (none: the default,
    ``mean_jct``, is not written). Each activation is also appended to ``<root>/history.jsonl``
    (:func:`history`), best effort."""
    objective = check_objective(objective) if objective is not None else kept_objective(Path(root))
    doc: dict[str, str] = {"checkpoint": str(checkpoint)}
    if sha256:
        doc["sha256"] = sha256
    if note:
        doc["note"] = note
    if objective:
        doc["objective"] = objective
    manifest = _write_json(Path(root), MANIFEST, doc)
    # each record starts with a newline too: a line an earlier writer left cut short (a full disk)
    # ends there instead of swallowing this one; history() skips the empty lines
    line = ("\n" + json.dumps({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **doc}) + "\n").encode()
    try:
        fd = _open_shared(Path(root) / HISTORY)
        try:
            while line:  # one write of a short line is whole under O_APPEND on a local disk
                line = line[os.write(fd, line):]
        finally:
            os.close(fd)
    except OSError as exc:  # the manifest is what the servers read; the history is for people
        log.warning("registry %s: activated %s but could not append to %s: %s", root, checkpoint, HISTORY, exc)
    return manifest


def deployment_objective(root: str | Path) -> str:
    """What the deployment optimises: the manifest's objective (:func:`registry_objective`), or, when
    the manifest cannot be read or parsed, the last one the history recorded (the servers then
    serve the last good checkpoint, and the nightly fine-tune starts from it as before, found by
    review); :data:`DEFAULT_OBJECTIVE` when neither names one. A manifest value that is not an
    objective raises :class:`ObjectiveError`."""
    return kept_objective(Path(root)) or DEFAULT_OBJECTIVE


def kept_objective(root: Path) -> str:
    """The objective an activation without one keeps: the manifest's ("" for none); when the
    manifest cannot be read or parsed (an activation is how one repairs it), the last one the
    history recorded. A manifest value that is not an objective raises :class:`ObjectiveError`."""
    try:
        return registry_objective(root, explicit=True)
    except ObjectiveError:
        raise
    except CheckpointError as exc:
        kept = next((e["objective"] for e in reversed(history(root)) if e.get("objective") in OBJECTIVES), "")
        log.warning("registry %s: %s; keeping the objective the history recorded last (%s)", root, exc,
                    kept or DEFAULT_OBJECTIVE)
        return kept


def history(root: str | Path) -> list[dict[str, str]]:
    """The activations recorded in ``<root>/history.jsonl``, oldest first (lines that are not an
    activation, e.g. one cut short by a full disk, are skipped; a history that cannot be read is
    empty, with a warning: the manifest, not the history, is what the servers serve)."""
    try:
        text = read_bounded(Path(root) / HISTORY, MAX_HISTORY_BYTES).decode(errors="replace")
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("registry %s: cannot read %s: %s", root, HISTORY, exc)
        return []
    out: list[dict[str, str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("checkpoint"), str):
            out.append({k: str(v) for k, v in doc.items()})
    return out


@contextmanager
def activation_lock(root: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<root>/.activate.lock`` while the block runs.

    Taken by writers that decide against the active checkpoint (the nightly fine-tune: re-read it,
    check it is still the incumbent it evaluated against, activate), so two of them cannot both
    promote over the same incumbent. Servers take it only to seed an empty registry. ``flock`` is advisory and
    holds across hosts only on a shared file system that supports it (Linux maps it to whole-file
    byte-range locks on NFS).
    """
    root = Path(root)
    make_registry_dir(root)
    fd = _open_shared(root / ACTIVATION_LOCK)
    with os.fdopen(fd, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


#: the registry's own files (manifest, last good, the activation lock): the group reads and writes
REGISTRY_FILE_MODE = 0o664
#: folders written into the registry (candidates, the packaged copy): the group's, setgid
REGISTRY_DIR_MODE = 0o2775


def _open_shared(path: Path) -> int:
    """``path`` opened for appending, created if missing, and made group-writable whatever the umask
    when this user owns it (see _write_json): the registry's lock and history files."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, REGISTRY_FILE_MODE)
    if os.fstat(fd).st_uid == os.getuid():
        os.fchmod(fd, REGISTRY_FILE_MODE)
    return fd


def share_tree(path: str | Path, *, recursive: bool = True) -> None:
    """Make ``path`` (a folder written into the registry) and everything under it the group's:
    folders 2775, files 664, whatever the umask of the process that wrote them (found by review: a
    Celery worker started with ``-D`` runs under ``[core] daemon_umask`` 077, so a promoted
    candidate was 0700 / 0600 and every policy server of another user refused it, for ever)."""
    root = Path(path)
    for p in [root, *(root.rglob("*") if recursive else ())]:
        try:
            if p.is_symlink() or p.stat().st_uid != os.getuid():
                continue  # not ours to change (and chmod would fail)
            os.chmod(p, REGISTRY_DIR_MODE if p.is_dir() else REGISTRY_FILE_MODE)
        except OSError as exc:  # a file system without modes (vfat, some FUSE/SMB mounts): as it is
            log.warning("registry: cannot make %s the group's (%s); left as it is", p, exc)
            return


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    """What tells one version of the manifest from the next: written by rename, each is a new
    inode (found by review: mtime and size alone missed an activation of a same-length name
    within the file system's timestamp tick: NFS, SMB, FAT's 2 s)."""
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size


def make_registry_dir(root: Path) -> None:
    """``root`` created if missing, the group's (2775) when this process made it (found by review:
    a folder a server made under its umask, 0755, kept the fine-tune's worker out of it)."""
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        share_tree(root, recursive=False)


def _write_json(root: Path, name: str, doc: dict[str, str]) -> Path:
    """Write ``root/name`` by an atomic rename, so a reader never sees half a file."""
    make_registry_dir(root)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{Path(name).stem}.", suffix=".json")
    try:
        # mkstemp makes it 0600: the servers and the workers that promote run as different users of
        # one group on a shared registry (docker-compose.yaml), so each must read what the other wrote
        os.fchmod(fd, REGISTRY_FILE_MODE)
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, root / name)
    except BaseException:  # a full disk: no temporary file left behind (found by review)
        Path(tmp).unlink(missing_ok=True)
        raise
    return root / name


#: The checkpoint shipped with the package (trained by the command in its manifest).
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "default"
#: What a deployment may optimise (``drl-trainer train --objective`` names the same; the
#: nightly fine-tune trains and judges its candidates on the registry's).
OBJECTIVES = ("mean_jct", "p95_jct", "sla_violation_rate", "cost")
DEFAULT_OBJECTIVE = "mean_jct"
#: what a server reports for a manifest that does not say a valid objective
UNKNOWN_OBJECTIVE = "unknown"
#: The packaged checkpoint an empty registry is seeded with, per objective: the default for each.
#: Chosen on the validation families, as the default was: the one checkpoint measured better on
#: the held-out families for an objective (e3t, SLA violations: 0.937 x the per-seed best against
#: e2's 0.979) is worse than e2 on the validation families on all three metrics (SLA violations
#: 1.064 against 1.018 over three seed pairs), so it is not packaged (docs/policy.md, "Objectives
#: as configuration"). Objectives with a checkpoint selected for them name it here.
PACKAGED_CHECKPOINTS = {"mean_jct": DEFAULT_CHECKPOINT, "p95_jct": DEFAULT_CHECKPOINT,
                        "sla_violation_rate": DEFAULT_CHECKPOINT, "cost": DEFAULT_CHECKPOINT}


def check_objective(objective: str) -> str:
    """``objective`` if it is one of :data:`OBJECTIVES`; a :class:`CheckpointError` naming them if not."""
    if objective not in OBJECTIVES:
        raise CheckpointError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    return objective


#: what :func:`_read_doc` returns for a file that does not exist
_MISSING = object()


def _read_doc(file: Path) -> Any:
    """``file`` (the manifest or ``last_good.json``) parsed, :data:`_MISSING` if it does not exist;
    one that cannot be read or is not JSON (not UTF-8 included: was, out of poll(), the server
    down) is a :class:`CheckpointError`."""
    try:
        blob = read_bounded(file)
    except FileNotFoundError:
        return _MISSING
    except OSError as exc:
        raise CheckpointError(f"{file}: cannot read: {exc}") from exc
    try:
        return json.loads(blob.decode())
    except ValueError as exc:
        raise CheckpointError(f"{file}: not JSON: {exc}") from exc


class ObjectiveError(CheckpointError):
    """``active.json`` names an objective that is not one of :data:`OBJECTIVES`."""


def registry_objective(root: str | Path, *, explicit: bool = False) -> str:
    """The objective ``<root>/active.json`` names; :data:`DEFAULT_OBJECTIVE` when there is no
    manifest or it names none (``explicit``: "" then). A manifest that cannot be read or parsed is a
    :class:`CheckpointError` (not the default: the deployment would silently go back to the mean),
    a value that is not one of :data:`OBJECTIVES` an :class:`ObjectiveError` naming the fix (a
    typo must not train the nightly candidates for another metric)."""
    path = Path(root) / MANIFEST
    doc = _read_doc(path)
    if doc is _MISSING:
        return "" if explicit else DEFAULT_OBJECTIVE
    if not isinstance(doc, dict):  # names no checkpoint either (found by review: read as mean_jct)
        raise CheckpointError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    value = doc.get("objective")
    if value is None:
        return "" if explicit else DEFAULT_OBJECTIVE
    if not isinstance(value, str) or value not in OBJECTIVES:
        raise ObjectiveError(f"{path}: objective {value!r} is not one of {', '.join(OBJECTIVES)}; "
                             f"`drl-policy registry activate --registry {root} --objective O` sets it")
    return value


#: the note of a manifest :func:`ensure_active` wrote
PACKAGED_NOTE = "packaged default checkpoint"
#: where :func:`ensure_active` copies the packaged default, relative to the registry
PACKAGED_DIR = "packaged"


def ensure_active(root: str | Path, default: str | Path | None = None, *,
                  objective: str | None = None) -> Path | None:
    """Name the packaged checkpoint of ``objective`` (``default``: that one instead) in an empty
    registry, so a fresh install serves a trained policy from the first request, for the
    objective its first server was given; a registry that already has a manifest is left alone,
    with a warning when it optimises another objective (``drl-policy registry activate
    --objective`` switches it: servers given different objectives must not seed over each other's
    choice at every restart, found by review). Returns the manifest.

    The checkpoint is copied into the registry (:func:`copy_packaged`, named relative to it); a
    registry seeded by naming the package's own folder (the note, an absolute path) is seeded
    again. Decided and written under :func:`activation_lock`: a promotion landing meanwhile is
    not overwritten (found by review)."""
    root = Path(root)
    given = check_objective(objective) if objective is not None else None
    objective = given or DEFAULT_OBJECTIVE
    try:
        if not _needs_seed(root, given):
            return root / MANIFEST
        source = Path(default) if default is not None else PACKAGED_CHECKPOINTS[objective]
        if not (source / "manifest.json").exists():
            log.warning("registry %s is empty and there is no packaged checkpoint at %s", root, source)
            return None
        copy, sha = copy_packaged(root, source)  # outside the lock: a copy no manifest names yet is harmless
        with activation_lock(root):
            if not _needs_seed(root, given, quiet=True):  # another replica seeded meanwhile
                return root / MANIFEST
            log.info("registry %s: activating the packaged checkpoint for %s (copied to %s)", root, objective, copy)
            return activate(root, copy, sha256=sha, note=PACKAGED_NOTE, objective=objective)
    except OSError as exc:  # the caller decides, as for a bad checkpoint (auto: the heuristic)
        raise CheckpointError(f"{root}: cannot read or write the registry: {exc}") from exc


def _needs_seed(root: Path, objective: str | None, *, quiet: bool = False) -> bool:
    """Whether :func:`ensure_active` seeds ``root``: no manifest, or one naming the package's own
    folder (the seeding before copies). A manifest of another objective than the one the server
    was given (``objective``; None: none given) is kept, with a warning (``quiet``: no info log)."""
    try:
        doc = json.loads(read_bounded(root / MANIFEST).decode())
    except FileNotFoundError:
        return True
    except ValueError:
        return False  # the registry says what is wrong with it
    if not isinstance(doc, dict):
        return False
    if doc.get("note") == PACKAGED_NOTE and Path(str(doc.get("checkpoint", ""))).is_absolute():
        if not quiet:
            log.info("registry %s names the package's own default checkpoint: seeding it with a copy", root)
        return True
    named = doc.get("objective", DEFAULT_OBJECTIVE)
    if objective is not None and named != objective:  # also when another replica seeded meanwhile
        log.warning("registry %s optimises %s (its active.json), not the %s this server was given: serving "
                    "what it names; `drl-policy registry activate --registry %s --objective %s` switches it",
                    root, named, objective, root, objective)
    return False


def copy_packaged(root: Path, source: Path) -> tuple[Path, str]:
    """``(copy, sha256)``: ``source`` copied to ``root/packaged/<sha256[:12]>`` (``copy`` relative to
    ``root``), whole or not at all, unless it is there already. The package's own folder is
    replaced by every upgrade: a manifest naming it, pinned to the old content's hash, left every
    server refusing it and its last good one alike (found by review)."""
    sha = checkpoint_sha256(source)
    copy = Path(PACKAGED_DIR) / sha[:12]
    if not (root / copy).exists():
        make_registry_dir(root)
        (root / PACKAGED_DIR).mkdir(parents=True, exist_ok=True)
        # the group's whatever the umask (found by review: under 077 the servers, another user of
        # the group, could not reach packaged/ and refused what the CLI had activated)
        share_tree(root / PACKAGED_DIR, recursive=False)
        staging = Path(tempfile.mkdtemp(prefix=f".{sha[:12]}.", dir=root / PACKAGED_DIR))
        shutil.copytree(source, staging, dirs_exist_ok=True)
        share_tree(staging)  # mkdtemp's 0700 would hide it from servers of another user
        try:
            os.rename(staging, root / copy)  # whole or not at all; a replica starting beside us
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not (root / copy).exists():
                raise
    return copy, sha


def resolve_device(spec: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; other values are kept."""
    if spec != "auto":
        return spec
    import torch  # lazy: only a model needs it

    return "cuda" if torch.cuda.is_available() else "cpu"


def gnn_loader(path: Path, device: str, **kwargs: Any) -> Placer:
    """Load the GNN policy (issue 4's ``policy.gnn.GNNPlacer``) from a checkpoint directory.

    ``kwargs`` go to ``GNNPlacer`` (``temperature``, ``seed``, ``hold_ratio``). The placer verifies the
    checkpoint's manifest (feature schema version and names, weights hash, parameter shapes) and
    raises :class:`CheckpointError` on any mismatch.
    """
    # Lazy and dynamic: torch is imported only when a model is loaded.
    gnn = importlib.import_module("policy.gnn")
    placer: Placer = gnn.GNNPlacer.from_checkpoint(path, device=device, **kwargs)
    return placer


def _probe(placer: Placer, path: Path) -> None:
    """Place a small request with ``placer`` before it serves: a model that loads but cannot
    decide is refused like a bad checkpoint (the old model keeps serving), and the first real
    request does not pay the first call's set-up (tens of ms on a CPU, more on a GPU)."""
    from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, RunProgress, TaskNode

    graph = RunGraph("probe/run", (TaskNode("a", duration_s=30), TaskNode("b", duration_s=60, gpus=1, kind="gpu_train"),
                                   TaskNode("c", duration_s=10)), ((0, 2), (1, 2)))
    pools = (PoolState("cpu", "cpu", slots=4, cpus=4, memory_gb=16, price_per_hour=0.2),
             PoolState("gpu", "gpu", slots=2, cpus=8, memory_gb=64, gpus=1, speed=1.5, price_per_hour=1.2,
                       affinity={"gpu_train": 8.0}))
    request = PlacementRequest("probe", (ReadyTask("probe/run", "a"), ReadyTask("probe/run", "b")), pools,
                               runs=(graph,), progress=(RunProgress("probe/run"),), created_at=time.time())
    try:
        decisions = placer.place(request, {"probe/run": graph})
    except Exception as exc:  # noqa: BLE001 - reported as the checkpoint's fault, with the cause
        raise CheckpointError(f"{path}: the model loads but fails on a probe request: "
                              f"{type(exc).__name__}: {exc}") from exc
    bad = [d for d in decisions if d.pool not in ("cpu", "gpu") or d.task_id not in ("a", "b")]
    if bad or not decisions:
        raise CheckpointError(f"{path}: the model loads but answers a probe request with "
                              f"{[(d.task_id, d.pool) for d in decisions]!r}")


def _io_error(exc: BaseException) -> bool:
    """The files could not be read (permissions, a mount gone): says nothing about their content."""
    return isinstance(exc, OSError) or isinstance(exc.__cause__, OSError)


def _relative(root: Path, path: Path) -> str:
    """``path`` relative to ``root`` when it lies under it (lexically), else as it is."""
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


class ModelRegistry:
    """Watches ``<root>/active.json``; loads what it names off the serving thread.

    Call :meth:`poll` between batches: it returns a newly loaded model exactly once, when one is
    ready to be swapped in, and None otherwise. ``on_failure(reason)`` is called for each refused
    checkpoint (the server counts them).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        loader: Loader = gnn_loader,
        device: str = "cpu",
        poll_s: float = 2.0,
        on_failure: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self.loader = loader
        self.device = device
        self.poll_s = poll_s
        self.on_failure = on_failure or (lambda reason: None)
        self._clock = clock
        self._next_check = 0.0
        self._seen: tuple[int, ...] | None = None  # _stamp of the manifest last read
        self._current: str | None = None  # checkpoint path + hash last accepted or refused
        self._lock = threading.Lock()
        self._ready: LoadedModel | None = None
        self._loading: threading.Thread | None = None
        #: the I/O failure last reported, per thing read (_MANIFEST_READ, _CHECKPOINT_READ): a
        #: poll retries it every poll_s, and the same error is logged and counted only once
        self._io_errors: dict[str, str] = {}
        self._objective: str | None = None
        self._objective_at = 0.0

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    def load_now(self) -> LoadedModel | None:
        """Synchronously load what the manifest names (at start-up); None if there is no manifest.

        When the manifest or its checkpoint is bad, the last checkpoint that loaded here
        (``last_good.json``) is loaded instead, the refusal logged and counted; with none that
        loads, the manifest's :class:`CheckpointError` is raised.
        """
        try:
            st = self.manifest.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:  # _seen stays unset: the first poll reads the manifest again
            self._io_errors[_MANIFEST_READ] = f"{self.manifest}: cannot read: {exc}"
            raise CheckpointError(self._io_errors[_MANIFEST_READ]) from exc
        self._seen = _stamp(st)
        try:
            spec = self._read_manifest()
            if spec is None:
                return None
            self._current = f"{spec[0]}#{spec[1]}"  # accepted or refused: not retried until it changes
            return self._remember(self._load(*spec))
        except CheckpointError as exc:
            model = self._load_last_good(exc)
            if _io_error(exc):  # reported here (raised or counted); the polls try again
                self._io_errors[_CHECKPOINT_READ if self._current else _MANIFEST_READ] = str(exc)
                self._seen = None
            self._current = None  # refused: the same checkpoint activated again is tried again
            if model is None:
                raise
            return model

    def _load_last_good(self, refused: CheckpointError) -> LoadedModel | None:
        try:
            spec = self._read_spec(self.root / LAST_GOOD)
        except CheckpointError as exc:
            log.warning("model registry: last good checkpoint not used: %s", exc)
            return None
        if spec is None:
            return None
        path, sha = spec
        if self._current == f"{path}#{sha}":
            return None  # the active checkpoint is the last good one: it failed itself
        try:
            model = self._load(path, sha)
        except Exception as exc:  # noqa: BLE001 - the manifest's refusal is what gets raised
            log.warning("model registry: the last good checkpoint %s does not load either: %s", path, exc)
            return None
        log.error("model registry: refused %s; serving the last good checkpoint %s (%s) until the "
                  "manifest names one that loads", refused, path, model.version)
        self.on_failure(str(refused))
        return model

    def _remember(self, model: LoadedModel) -> LoadedModel:
        """Record ``model`` as the last good checkpoint (best effort: a read-only registry serves on)."""
        doc = {"checkpoint": _relative(self.root, Path(model.checkpoint)), "sha256": model.sha256,
               "version": model.version}
        try:
            _write_json(self.root, LAST_GOOD, doc)
        except OSError as exc:
            log.warning("model registry: cannot record the last good checkpoint in %s: %s", self.root, exc)
        return model

    def poll(self) -> LoadedModel | None:
        """A newly loaded model to swap in, or None. Cheap: one ``stat`` every ``poll_s``."""
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is not None:
            return ready
        now = self._clock()
        if now < self._next_check or (self._loading is not None and self._loading.is_alive()):
            return None
        self._next_check = now + self.poll_s
        try:
            st = self.manifest.stat()
        except FileNotFoundError:
            self._io_errors.pop(_MANIFEST_READ, None)
            return None
        except OSError as exc:
            self._io_failure(_MANIFEST_READ, f"{self.manifest}: cannot read: {exc}")
            return None
        stamp = _stamp(st)
        if stamp == self._seen:
            self._io_errors.pop(_MANIFEST_READ, None)
            return None
        self._seen = stamp
        try:
            spec = self._read_manifest()
        except CheckpointError as exc:
            if _io_error(exc):
                self._seen = None  # not the manifest's content: read it again at the next poll
                self._io_failure(_MANIFEST_READ, str(exc))
            else:
                self._refuse(str(exc))
            return None
        self._io_errors.pop(_MANIFEST_READ, None)
        if spec is None or f"{spec[0]}#{spec[1]}" == self._current:
            return None
        self._current = f"{spec[0]}#{spec[1]}"
        self._loading = threading.Thread(
            target=self._load_in_background, args=spec, name="model-loader", daemon=True
        )
        self._loading.start()
        return None

    def serving_checkpoint(self) -> ServingCheckpoint:
        """The checkpoint a server starting now would serve, checked but not loaded: the one the
        manifest names when it exists and its content matches the manifest's sha256 (any content
        when the manifest names none), else the last good one when its content still matches.

        Raises the manifest's :class:`CheckpointError` when neither does. A checkpoint that passes
        these checks can still fail the loader's (schema, shapes, the probe request).
        """
        try:
            return self._verified(self.manifest, self._read_manifest())
        except CheckpointError as refused:
            try:
                return self._verified(self.root / LAST_GOOD, self._read_spec(self.root / LAST_GOOD))
            except CheckpointError as exc:
                raise refused from exc

    def named_checkpoints(self, *, strict: bool = False) -> list[Path]:
        """The checkpoints ``active.json`` and ``last_good.json`` name (what a server serves or may
        fall back to), relative names resolved against the registry; a file that is missing names
        none, and so does one that does not read unless ``strict`` (then: :class:`CheckpointError`;
        what deletes checkpoints asks so, found by review: a half-written ``active.json`` named
        nothing, and the nightly prune deleted the candidate it served)."""
        out = []
        for file in (self.manifest, self.root / LAST_GOOD):
            try:
                spec = self._read_spec(file)
            except CheckpointError:
                if strict:
                    raise
                continue
            if spec is not None:
                out.append(spec[0])
        return out

    def objective(self) -> str:
        """The objective the manifest names (:func:`registry_objective`), read at most once a
        ``poll_s`` (heartbeats and /health ask); ``unknown`` for a manifest that does not say one
        (a value that is not an objective, a manifest that cannot be read or parsed)."""
        now = self._clock()
        if self._objective is None or now >= self._objective_at:
            self._objective_at = now + self.poll_s
            try:
                self._objective = registry_objective(self.root)
            except ObjectiveError as exc:
                if self._objective != UNKNOWN_OBJECTIVE:
                    log.error("model registry: %s", exc)
                self._objective = UNKNOWN_OBJECTIVE
            except CheckpointError as exc:  # a manifest that does not read: poll() reports it
                log.debug("model registry: objective unknown: %s", exc)
                self._objective = UNKNOWN_OBJECTIVE
        return self._objective

    def check(self, path: str | Path, sha256: str = "") -> LoadedModel:
        """Load ``path`` as a server would (hash, the loader's schema and shape checks, the probe
        request), on this registry's device; raises :class:`CheckpointError` saying why not.
        Records nothing: ``drl-policy registry activate`` checks a checkpoint before naming it."""
        return self._load(Path(path), sha256)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait for a background load to finish (tests, shutdown)."""
        if self._loading is not None:
            self._loading.join(timeout_s)

    # --- internals ---------------------------------------------------------------------------

    def _read_manifest(self) -> tuple[Path, str] | None:
        return self._read_spec(self.manifest)

    def _read_spec(self, file: Path) -> tuple[Path, str] | None:
        """``(checkpoint path, sha256)`` named by ``file`` (the manifest or ``last_good.json``)."""
        doc = _read_doc(file)
        if doc is _MISSING:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("checkpoint"), str) or "\0" in doc["checkpoint"]:
            raise CheckpointError(f"{file}: expected {{\"checkpoint\": path, ...}}, got {doc!r}")
        sha = doc.get("sha256") or ""
        if not isinstance(sha, str):
            raise CheckpointError(f"{file}.sha256: expected a hex string, got {sha!r}")
        path = Path(doc["checkpoint"])
        if not path.is_absolute():
            path = self.root / path
        return path, sha

    def _verified(self, file: Path, spec: tuple[Path, str] | None) -> ServingCheckpoint:
        if spec is None:
            raise CheckpointError(f"{file}: does not exist: it names no checkpoint")
        return ServingCheckpoint(spec[0], self._check(*spec), file.name)

    def _check(self, path: Path, sha256: str) -> str:
        """The content hash of ``path``, which must exist and match ``sha256`` when one is given."""
        try:
            if not path.exists():
                raise CheckpointError(f"{path}: checkpoint named by {self.manifest} does not exist")
            actual = checkpoint_sha256(path)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read: {exc}") from exc
        if sha256 and actual != sha256:
            raise CheckpointError(
                f"{path}: sha256 {actual[:16]}... does not match the manifest's {sha256[:16]}..."
            )
        return actual

    def _load(self, path: Path, sha256: str) -> LoadedModel:
        actual = self._check(path, sha256)
        t0 = time.perf_counter()
        device = resolve_device(self.device)
        try:
            placer = self.loader(path, device)
        except CheckpointError:
            raise
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a manifest value the loader rejects is a bad checkpoint
            # (found by review: a ValueError or AttributeError passed start-up's last-good fallback
            # and put every restarted replica in a crash loop, where a hot reload refused it)
            raise CheckpointError(f"{path}: cannot load: {type(exc).__name__}: {exc}") from exc
        if not isinstance(placer, Placer):
            raise CheckpointError(f"{path}: loader returned {type(placer).__name__}, not a Placer")
        loaded_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        _probe(placer, path)
        log.info("loaded %s %s from %s on %s in %.0f ms (probe request %.0f ms)", placer.name, placer.version,
                 path, device, loaded_ms, (time.perf_counter() - t0) * 1e3)
        return LoadedModel(placer, str(path), actual, device, time.time())

    def _load_in_background(self, path: Path, sha256: str) -> None:
        try:
            model = self._load(path, sha256)
        except Exception as exc:  # noqa: BLE001 - any failure keeps the old model; we say why
            if _io_error(exc):
                # Not the checkpoint's fault: forget it was tried, so that the next poll (this
                # thread has ended by then) tries it again, instead of refusing it until the
                # manifest changes.
                self._seen = self._current = None
                self._io_failure(_CHECKPOINT_READ, str(exc))
            else:
                # not loaded: an activation of the same checkpoint again (a new manifest) tries it again
                # (found by review: after one failed load, say CUDA out of memory, only a restart did)
                self._current = None
                self._refuse(f"{path}: {type(exc).__name__}: {exc}")
            return
        self._io_errors.pop(_CHECKPOINT_READ, None)
        with self._lock:
            self._ready = self._remember(model)

    def _refuse(self, reason: str) -> None:
        log.error("model registry: refused, keeping the current model: %s", reason)
        self.on_failure(reason)

    def _io_failure(self, what: str, reason: str) -> None:
        """An I/O error reading ``what``: the current model keeps serving and the next poll tries
        again; logged and counted once per distinct error, not once per poll."""
        if self._io_errors.get(what) == reason:
            log.debug("model registry: still cannot read the %s: %s", what, reason)
            return
        self._io_errors[what] = reason
        log.error("model registry: cannot read the %s, keeping the current model and retrying every "
                  "%.1f s: %s", what, self.poll_s, reason)
        self.on_failure(reason)
