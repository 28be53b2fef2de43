"""The placement wire schema: what the executor, the policy server and the simulator exchange.

One module, imported by every floor (Airflow side, policy server, trainer); it imports neither
torch nor Airflow. Messages are plain JSON objects with a ``schema_version``; every decoder checks
types and limits at the boundary and raises :class:`SchemaError` naming the offending field, so a
malformed request becomes an error reply, never a dead server.

A request carries, for each DAG run with ready tasks, either the run's whole task graph
(:class:`RunGraph`) or a reference to one already sent (:class:`RunRef`, matched by ``digest``),
the run's progress, the ready tasks to place and the state of every worker pool. The reply carries
one :class:`Decision` per ready task: a pool (Celery queue), its VM class, a score and a reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field, fields
from json.encoder import encode_basestring_ascii as _json_string
from typing import Any, Iterable, Mapping, Sequence, Union

from policy.errors import SchemaError

SCHEMA_VERSION = 1

#: Limits a server enforces on decoded requests (a request is also capped in bytes by the server).
MAX_TASKS_PER_RUN = 50_000
MAX_EDGES_PER_RUN = MAX_TASKS_PER_RUN * 64
MAX_READY_PER_REQUEST = 4_096
MAX_POOLS = 256
MAX_RUNS_PER_REQUEST = 1_024
#: the largest integer a count (slots, busy, queued tasks) may be
MAX_INT = 2**31 - 1


# --- small checked readers -------------------------------------------------------------------
#
# Each reader first tries the common case on a plain dict (what json.loads returns) with exact
# type checks, which costs a fraction of the general path's ``isinstance(obj, Mapping)`` (an ABC
# check); anything else takes the general path, which raises the same errors as before.

_ABSENT = object()


def _get(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(obj, Mapping):
        raise SchemaError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise SchemaError(f"{where}.{key}: missing")
    return obj[key]


def _str(obj: Mapping[str, Any], key: str, where: str, *, default: str | None = None) -> str:
    if type(obj) is dict:
        value = obj.get(key, _ABSENT)
        if type(value) is str and value:
            return value
    if default is not None and key not in obj:
        return default
    value = _get(obj, key, where)
    if not isinstance(value, str) or not value:
        raise SchemaError(f"{where}.{key}: expected a non-empty string, got {value!r}")
    return value


def _opt_str(obj: Mapping[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SchemaError(f"{where}.{key}: expected a non-empty string or null, got {value!r}")
    return value


def _finite(value: Any) -> bool:
    """A JSON number (not a boolean) that is finite as a float: an integer of 400 digits is not
    (``math.isfinite`` raised OverflowError on it, an internal error instead of bad_request)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


#: the smallest relative speed and affinity speed-up a pool may have (as the catalogue's): 1e-320
#: made scores -inf, 0 divided by zero in the heuristic (found by review)
MIN_SPEED = 0.001


def _num(
    obj: Mapping[str, Any], key: str, where: str, *, default: float | None = None, lo: float = 0.0
) -> float:
    if type(obj) is dict:
        value = obj.get(key)
        if type(value) is float and math.isfinite(value) and value >= lo:
            return value
    if default is not None and obj.get(key) is None:
        return default
    value = _get(obj, key, where)
    if not _finite(value):
        raise SchemaError(f"{where}.{key}: expected a finite number, got {value!r:.80}")
    if value < lo:
        raise SchemaError(f"{where}.{key}: must be >= {lo}, got {value!r}")
    return float(value)


def _int(
    obj: Mapping[str, Any], key: str, where: str, *, default: int | None = None, lo: int = 0
) -> int:
    if type(obj) is dict:
        value = obj.get(key)
        if type(value) is int and lo <= value <= MAX_INT:
            return value
    if default is not None and obj.get(key) is None:
        return default
    value = _get(obj, key, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(f"{where}.{key}: expected an integer, got {value!r:.80}")
    if value < lo:
        raise SchemaError(f"{where}.{key}: must be >= {lo}, got {value!r:.80}")
    if value > MAX_INT:  # a count past any cluster's (an integer of 400 digits overflowed as a float)
        raise SchemaError(f"{where}.{key}: must be <= {MAX_INT}, got {value!r:.80}")
    return value


def _list(obj: Mapping[str, Any], key: str, where: str, *, limit: int, default: bool = False) -> list[Any]:
    if type(obj) is dict:
        value = obj.get(key)
        if type(value) is list and len(value) <= limit:
            return value
    if default and obj.get(key) is None:
        return []
    value = _get(obj, key, where)
    if not isinstance(value, list):
        raise SchemaError(f"{where}.{key}: expected a list, got {type(value).__name__}")
    if len(value) > limit:
        raise SchemaError(f"{where}.{key}: {len(value)} entries, limit is {limit}")
    return value


def _str_list(obj: Mapping[str, Any], key: str, where: str, *, limit: int) -> tuple[str, ...]:
    items = _list(obj, key, where, limit=limit, default=True)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise SchemaError(f"{where}.{key}[{i}]: expected a string, got {item!r}")
    return tuple(items)


# --- the task graph of one DAG run ---------------------------------------------------------------


@dataclass(frozen=True)
class TaskNode:
    """One task of a DAG run, as the policy sees it.

    ``duration_s`` is the expected run time on a VM of relative speed 1.0 (from history or the
    task's ``executor_config``); ``kind`` names a task type for pool affinity (e.g. ``"gpu_train"``);
    ``pool`` is set when the DAG author pinned the task to one queue. ``priority`` is in the lab's
    sense, as the WfFormat traces the policy trained on give it (Pegasus: 20 + 10 x the task's
    depth, a later stage higher; 1 where a trace has none), not Airflow's ``priority_weight``: the
    executor sends 1 and lists ready tasks in Airflow's priority order instead
    (``airflow_drl_executor.graph_builder.task_node``).
    """

    task_id: str
    duration_s: float = 60.0
    cpus: float = 1.0
    memory_gb: float = 1.0
    gpus: float = 0.0
    priority: float = 1.0
    kind: str = "default"
    pool: str | None = None

    @property
    def asks(self) -> str:
        """What it asks of a pool, as reasons and errors say it: ``cpus=4 mem=16GB gpus=1``."""
        return f"cpus={self.cpus:g} mem={self.memory_gb:g}GB gpus={self.gpus:g}"

    def to_json(self) -> dict[str, Any]:
        # float() so that 10 and 10.0 encode (and hash, see graph_digest) the same way
        out: dict[str, Any] = {
            "task_id": self.task_id,
            "duration_s": float(self.duration_s),
            "cpus": float(self.cpus),
            "memory_gb": float(self.memory_gb),
            "gpus": float(self.gpus),
            "priority": float(self.priority),
            "kind": self.kind,
        }
        if self.pool is not None:
            out["pool"] = self.pool
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "task") -> TaskNode:
        dft = _TASK_DEFAULTS
        if type(obj) is dict:  # what the executor sends: every number a float, checked at once
            get = obj.get
            tid, kind, pool = get("task_id"), get("kind", dft["kind"]), get("pool")
            d, c, m = get("duration_s", dft["duration_s"]), get("cpus", dft["cpus"]), get("memory_gb", dft["memory_gb"])
            g, p = get("gpus", dft["gpus"]), get("priority", dft["priority"])
            if (type(tid) is str and tid and type(kind) is str and kind
                    and (pool is None or (type(pool) is str and pool))
                    and type(d) is float and type(c) is float and type(m) is float
                    and type(g) is float and type(p) is float
                    and math.isfinite(d + c + m + g + p) and min(d, c, m, g, p) >= 0.0):
                return cls(tid, d, c, m, g, p, kind, pool)
        return cls(
            task_id=_str(obj, "task_id", where),
            duration_s=_num(obj, "duration_s", where, default=dft["duration_s"]),
            cpus=_num(obj, "cpus", where, default=dft["cpus"]),
            memory_gb=_num(obj, "memory_gb", where, default=dft["memory_gb"]),
            gpus=_num(obj, "gpus", where, default=dft["gpus"]),
            priority=_num(obj, "priority", where, default=dft["priority"]),
            kind=_str(obj, "kind", where, default=dft["kind"]),
            pool=_opt_str(obj, "pool", where),
        )


#: TaskNode's field defaults, the ones from_json fills in for absent keys
_TASK_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(TaskNode)}


@dataclass(frozen=True)
class RunGraph:
    """The task graph of one DAG run: tasks and dependency edges ``(parent_index, child_index)``.

    ``run_key`` identifies the run (``dag_id/run_id`` in Airflow); ``digest`` is a hash of the
    content, so a later request can refer to the graph by :class:`RunRef` instead of resending it.
    """

    run_key: str
    tasks: tuple[TaskNode, ...]
    edges: tuple[tuple[int, int], ...]
    digest: str = ""

    def __post_init__(self) -> None:
        n = len(self.tasks)
        for parent, child in self.edges:
            if not (0 <= parent < n and 0 <= child < n) or parent == child:
                raise SchemaError(f"run {self.run_key!r}: bad edge ({parent}, {child}) for {n} tasks")
        if not self.digest:
            object.__setattr__(self, "digest", graph_digest(self.tasks, self.edges))

    def index(self) -> dict[str, int]:
        """Map task_id -> position in ``tasks``."""
        return {t.task_id: i for i, t in enumerate(self.tasks)}

    def to_json(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "digest": self.digest,
            "tasks": [t.to_json() for t in self.tasks],
            "edges": [list(e) for e in self.edges],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "run") -> RunGraph:
        run_key = _str(obj, "run_key", where)
        where = f"{where}[{run_key}]"
        tasks = tuple(
            TaskNode.from_json(t, f"{where}.tasks[{i}]")
            for i, t in enumerate(_list(obj, "tasks", where, limit=MAX_TASKS_PER_RUN))
        )
        edges: list[tuple[int, int]] = []
        for i, e in enumerate(_list(obj, "edges", where, limit=MAX_EDGES_PER_RUN)):
            if type(e) is list and len(e) == 2 and type(e[0]) is int and type(e[1]) is int:
                edges.append((e[0], e[1]))
                continue
            if (
                not isinstance(e, list)
                or len(e) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in e)
            ):
                raise SchemaError(f"{where}.edges[{i}]: expected [parent, child] indices, got {e!r}")
            edges.append((e[0], e[1]))
        ids = [t.task_id for t in tasks]
        if len(set(ids)) != len(ids):
            raise SchemaError(f"{where}.tasks: duplicate task_id")
        # found by review: a repeated edge doubled its child's parent count and its message
        _unique(edges, f"{where}.edges", "edge")
        graph = cls(run_key=run_key, tasks=tasks, edges=tuple(edges))
        sent = obj.get("digest")
        if sent and sent != graph.digest:
            raise SchemaError(f"{where}.digest: {sent!r} does not match the content ({graph.digest!r})")
        return graph


def graph_digest(tasks: Sequence[TaskNode], edges: Sequence[tuple[int, int]]) -> str:
    """A stable content hash of a task graph (sha256 of its canonical JSON, 16 hex digits).

    The canonical JSON is ``json.dumps({"tasks": [t.to_json() ...], "edges": [...]},
    sort_keys=True, separators=(",", ":"))`` (:func:`graph_digest_reference`); the tasks' part
    is written here directly, in the same bytes, ~1.6x faster (the executor hashes
    every run it builds, the server every graph it is sent). A task with a non-finite number
    goes the reference way."""
    parts = []
    for t in tasks:
        d, c, m = float(t.duration_s), float(t.cpus), float(t.memory_gb)
        g, p = float(t.gpus), float(t.priority)
        if not math.isfinite(d + c + m + g + p):
            return graph_digest_reference(tasks, edges)
        pool = "" if t.pool is None else f'"pool":{_json_string(t.pool)},'
        parts.append(f'{{"cpus":{c!r},"duration_s":{d!r},"gpus":{g!r},"kind":{_json_string(t.kind)},'
                     f'"memory_gb":{m!r},{pool}"priority":{p!r},"task_id":{_json_string(t.task_id)}}}')
    blob = ('{"edges":' + json.dumps([list(e) for e in edges], separators=(",", ":"))
            + ',"tasks":[' + ",".join(parts) + "]}")
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def graph_digest_reference(tasks: Sequence[TaskNode], edges: Sequence[tuple[int, int]]) -> str:
    """:func:`graph_digest` by its definition (the tests compare the two)."""
    blob = json.dumps(
        {"tasks": [t.to_json() for t in tasks], "edges": [list(e) for e in edges]},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RunRef:
    """A reference to a :class:`RunGraph` the server has already been sent."""

    run_key: str
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"run_key": self.run_key, "digest": self.digest, "ref": True}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "run") -> RunRef:
        digest = _str(obj, "digest", where)
        if not _DIGEST.fullmatch(digest):  # what graph_digest makes (found by review: "<D>:dag" named
            # the store's entry of another run, "dag:x", whose key ends the same)
            raise SchemaError(f"{where}.digest: expected 16 hex digits, got {digest[:40]!r}")
        return cls(run_key=_str(obj, "run_key", where), digest=digest)


RunEntry = Union[RunGraph, RunRef]
#: a graph's digest as :func:`graph_digest` writes it
_DIGEST = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class RunProgress:
    """What changed in a run: task ids finished (any terminal state) and running now."""

    run_key: str
    finished: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    #: seconds since the run started (for lateness against its SLA)
    age_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "finished": list(self.finished),
            "running": list(self.running),
            "age_s": self.age_s,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "progress") -> RunProgress:
        return cls(
            run_key=_str(obj, "run_key", where),
            finished=_str_list(obj, "finished", where, limit=MAX_TASKS_PER_RUN),
            running=_str_list(obj, "running", where, limit=MAX_TASKS_PER_RUN),
            age_s=_num(obj, "age_s", where, default=0.0),
        )


@dataclass(frozen=True)
class ReadyTask:
    """A task instance ready to run now: which run, which task, which try, and how long it has
    already waited for a placement (``held_s``: seconds since it was first offered and left
    without a decision, 0 when it is offered for the first time)."""

    run_key: str
    task_id: str
    try_number: int = 1
    #: not part of the task's identity (equality, hash): the same try held longer is the same task
    held_s: float = field(default=0.0, compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.run_key, self.task_id)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run_key": self.run_key, "task_id": self.task_id, "try_number": self.try_number}
        if self.held_s:
            out["held_s"] = self.held_s
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "ready") -> ReadyTask:
        return cls(
            run_key=_str(obj, "run_key", where),
            task_id=_str(obj, "task_id", where),
            try_number=_int(obj, "try_number", where, default=1),
            held_s=_num(obj, "held_s", where, default=0.0),
        )


@dataclass(frozen=True)
class PoolState:
    """One worker pool (a Celery queue) on one VM class, and its load now.

    ``slots`` is the total task slots of the pool's live workers, ``busy`` the slots running
    tasks, ``queued`` the tasks sent and not yet started. ``speed`` is relative (1.0 = reference
    VM); ``affinity`` maps a task ``kind`` to an extra speed-up on this VM class (a GPU box runs
    ``gpu_train`` tasks many times faster). ``up`` is False for a pool marked down.
    """

    name: str
    vm_class: str
    slots: int
    cpus: float
    memory_gb: float
    gpus: float = 0.0
    speed: float = 1.0
    price_per_hour: float = 0.0
    busy: int = 0
    queued: int = 0
    up: bool = True
    failure_rate: float = 0.0
    affinity: Mapping[str, float] = field(default_factory=dict)
    #: what a placer's ledger knows (optional; feature schema 3 uses them): the most slots the
    #: pool can grow to (None: it cannot grow), the seconds a new worker takes to boot, and the
    #: expected finish times (same clock as the request's ``created_at``) of its busy and queued
    #: tasks, ascending
    max_slots: int | None = None
    boot_s: float = 0.0
    free_at: tuple[float, ...] = ()

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - self.busy - self.queued)

    def speed_for(self, kind: str) -> float:
        """Effective speed of this pool for a task of type ``kind``."""
        return self.speed * self.affinity.get(kind, 1.0)

    def fits(self, task: TaskNode) -> bool:
        """Hard constraints: the VM class has the resources, and the pin (if any) names it."""
        if task.pool is not None and task.pool != self.name:
            return False
        return task.cpus <= self.cpus and task.memory_gb <= self.memory_gb and task.gpus <= self.gpus

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "vm_class": self.vm_class,
            "slots": self.slots,
            "cpus": self.cpus,
            "memory_gb": self.memory_gb,
            "gpus": self.gpus,
            "speed": self.speed,
            "price_per_hour": self.price_per_hour,
            "busy": self.busy,
            "queued": self.queued,
            "up": self.up,
            "failure_rate": self.failure_rate,
            "affinity": dict(self.affinity),
            "max_slots": self.max_slots,
            "boot_s": self.boot_s,
            "free_at": list(self.free_at),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "pool") -> PoolState:
        name = _str(obj, "name", where)
        where = f"{where}[{name}]"
        affinity = obj.get("affinity") or {}
        if not isinstance(affinity, Mapping) or not all(
            isinstance(k, str) and _finite(v) and v >= MIN_SPEED for k, v in affinity.items()
        ):
            raise SchemaError(f"{where}.affinity: expected {{kind: finite speed-up >= {MIN_SPEED}}}, "
                              f"got {affinity!r:.200}")
        failure_rate = _num(obj, "failure_rate", where, default=0.0)
        if failure_rate > 1.0:
            raise SchemaError(f"{where}.failure_rate: a share of tries, must be <= 1, got {failure_rate!r}")
        up = obj.get("up", True)
        if not isinstance(up, bool):
            raise SchemaError(f"{where}.up: expected a boolean, got {up!r}")
        return cls(
            name=name,
            vm_class=_str(obj, "vm_class", where),
            slots=_int(obj, "slots", where),
            cpus=_num(obj, "cpus", where),
            memory_gb=_num(obj, "memory_gb", where),
            gpus=_num(obj, "gpus", where, default=0.0),
            speed=_num(obj, "speed", where, default=1.0, lo=MIN_SPEED),
            price_per_hour=_num(obj, "price_per_hour", where, default=0.0),
            busy=_int(obj, "busy", where, default=0),
            queued=_int(obj, "queued", where, default=0),
            up=up,
            failure_rate=failure_rate,
            affinity={k: float(v) for k, v in affinity.items()},
            max_slots=None if obj.get("max_slots") is None else _int(obj, "max_slots", where),
            boot_s=_num(obj, "boot_s", where, default=0.0),
            free_at=_free_at(obj, where),
        )


#: at most this many expected finish times per pool on the wire
MAX_FREE_AT = 512


def _free_at(obj: Mapping[str, Any], where: str) -> tuple[float, ...]:
    raw = obj.get("free_at") or []
    if not isinstance(raw, list) or len(raw) > MAX_FREE_AT or not all(
        _finite(v) for v in raw
    ):
        raise SchemaError(f"{where}.free_at: expected at most {MAX_FREE_AT} finite numbers, got {raw!r:.80}")
    return tuple(sorted(float(v) for v in raw))


# --- request and reply ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacementRequest:
    """One batched question: where should each of these ready tasks run?"""

    request_id: str
    ready: tuple[ReadyTask, ...]
    pools: tuple[PoolState, ...]
    runs: tuple[RunEntry, ...] = ()
    progress: tuple[RunProgress, ...] = ()
    #: wall-clock time the request was made (seconds since the epoch) and how long it may take
    created_at: float = 0.0
    deadline_ms: float = 250.0
    schema_version: int = SCHEMA_VERSION

    def graphs(self) -> dict[str, RunGraph]:
        """The full graphs carried by this request, by run_key."""
        return {r.run_key: r for r in self.runs if isinstance(r, RunGraph)}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "request_id": self.request_id,
            "created_at": self.created_at,
            "deadline_ms": self.deadline_ms,
            "runs": [r.to_json() for r in self.runs],
            "progress": [p.to_json() for p in self.progress],
            "ready": [t.to_json() for t in self.ready],
            "pools": [p.to_json() for p in self.pools],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PlacementRequest:
        where = "request"
        version = _int(obj, "schema_version", where)
        if version != SCHEMA_VERSION:
            raise SchemaError(f"{where}.schema_version: {version} not supported (want {SCHEMA_VERSION})")
        runs: list[RunEntry] = []
        for i, r in enumerate(_list(obj, "runs", where, limit=MAX_RUNS_PER_REQUEST, default=True)):
            if isinstance(r, Mapping) and r.get("ref"):
                runs.append(RunRef.from_json(r, f"{where}.runs[{i}]"))
            else:
                runs.append(RunGraph.from_json(r, f"{where}.runs[{i}]"))
        request = cls(
            request_id=_str(obj, "request_id", where),
            created_at=_num(obj, "created_at", where, default=0.0),
            deadline_ms=_num(obj, "deadline_ms", where, default=250.0),
            runs=tuple(runs),
            progress=tuple(
                RunProgress.from_json(p, f"{where}.progress[{i}]")
                for i, p in enumerate(
                    _list(obj, "progress", where, limit=MAX_RUNS_PER_REQUEST, default=True)
                )
            ),
            ready=tuple(
                ReadyTask.from_json(t, f"{where}.ready[{i}]")
                for i, t in enumerate(_list(obj, "ready", where, limit=MAX_READY_PER_REQUEST))
            ),
            pools=tuple(
                PoolState.from_json(p, f"{where}.pools[{i}]")
                for i, p in enumerate(_list(obj, "pools", where, limit=MAX_POOLS))
            ),
        )
        # found by review: a ready task listed twice was placed twice, a repeated pool's load
        # counted apart from its twin's, a run sent twice with two graphs kept the last
        _unique((t.key for t in request.ready), f"{where}.ready", "task")
        _unique((p.name for p in request.pools), f"{where}.pools", "pool")
        _unique((r.run_key for r in request.runs), f"{where}.runs", "run")
        return request


def _unique(keys: Iterable[Any], where: str, what: str) -> None:
    """Raise :class:`SchemaError` naming the first key ``keys`` repeats."""
    seen: set[Any] = set()
    for key in keys:
        if key in seen:
            raise SchemaError(f"{where}: {what} {key!r} is listed twice")
        seen.add(key)


@dataclass(frozen=True)
class Decision:
    """Where one ready task goes, and why.

    ``pool`` is the Celery queue, ``vm_class`` the VM class serving it, ``score`` the policy's
    confidence or (for heuristics) the negated estimated finish time; ``fallback`` marks a
    decision the executor made itself because the policy server did not answer.
    """

    run_key: str
    task_id: str
    pool: str
    vm_class: str
    score: float = 0.0
    reason: str = ""
    fallback: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "task_id": self.task_id,
            "pool": self.pool,
            "vm_class": self.vm_class,
            "score": self.score if math.isfinite(self.score) else 0.0,  # strict JSON, whatever a placer scored
            "reason": self.reason,
            "fallback": self.fallback,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], where: str = "decision") -> Decision:
        # found by review: a decision that was not an object raised AttributeError, and a score of
        # 400 digits OverflowError, out of the client (which maps SchemaError to the fallback)
        if not isinstance(obj, Mapping):
            raise SchemaError(f"{where}: expected an object, got {obj!r}")
        score = obj.get("score", 0.0)
        if not _finite(score):
            raise SchemaError(f"{where}.score: expected a finite number, got {score!r}")
        reason = obj.get("reason", "")
        if not isinstance(reason, str):
            raise SchemaError(f"{where}.reason: expected a string, got {reason!r}")
        fallback = obj.get("fallback", False)
        if not isinstance(fallback, bool):  # bool("false") is True
            raise SchemaError(f"{where}.fallback: expected true or false, got {fallback!r}")
        return cls(
            run_key=_str(obj, "run_key", where),
            task_id=_str(obj, "task_id", where),
            pool=_str(obj, "pool", where),
            vm_class=_str(obj, "vm_class", where),
            score=float(score),
            reason=reason,
            fallback=fallback,
        )


@dataclass(frozen=True)
class PlacementReply:
    """The answer to one :class:`PlacementRequest`: a decision per ready task, or an error.

    ``error_code`` is one of ``bad_request``, ``unknown_graph`` (a :class:`RunRef` the server has no
    graph for: resend the full graph), ``overloaded`` or ``internal``.
    """

    request_id: str
    decisions: tuple[Decision, ...] = ()
    policy: str = ""
    policy_version: str = ""
    error_code: str | None = None
    error: str | None = None
    server_ms: float = 0.0
    schema_version: int = SCHEMA_VERSION

    @property
    def ok(self) -> bool:
        return self.error_code is None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "request_id": self.request_id,
            "policy": self.policy,
            "policy_version": self.policy_version,
            "decisions": [d.to_json() for d in self.decisions],
            "server_ms": self.server_ms,
        }
        if self.error_code is not None:
            out["error_code"] = self.error_code
            out["error"] = self.error or ""
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PlacementReply:
        where = "reply"
        version = _int(obj, "schema_version", where)
        if version != SCHEMA_VERSION:
            raise SchemaError(f"{where}.schema_version: {version} not supported (want {SCHEMA_VERSION})")
        return cls(
            request_id=_str(obj, "request_id", where),
            policy=str(obj.get("policy", "")),
            policy_version=str(obj.get("policy_version", "")),
            decisions=tuple(
                Decision.from_json(d, f"{where}.decisions[{i}]")
                for i, d in enumerate(
                    _list(obj, "decisions", where, limit=MAX_READY_PER_REQUEST, default=True)
                )
            ),
            error_code=_opt_str(obj, "error_code", where),
            error=obj.get("error") if isinstance(obj.get("error"), str) else None,
            server_ms=_num(obj, "server_ms", where, default=0.0),
        )


def dumps(message: PlacementRequest | PlacementReply) -> bytes:
    """Encode a message as compact UTF-8 JSON."""
    return json.dumps(message.to_json(), separators=(",", ":")).encode()


def loads_json(data: bytes | str, *, max_bytes: int) -> Mapping[str, Any]:
    """Decode one JSON object, refusing payloads over ``max_bytes`` before parsing them."""
    if len(data) > max_bytes:
        raise SchemaError(f"payload of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        # strict UTF-8 first: json.loads(bytes) also takes UTF-16 and UTF-8-encoded surrogates,
        # which no reply key or graph key can be written with (found by review: the batch's replies lost)
        text = data.decode("utf-8-sig") if isinstance(data, bytes) else data  # -sig: a BOM, as json.loads took it
        obj = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(f"payload is not JSON: {exc}") from exc
    except RecursionError:
        raise SchemaError("payload is not JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise SchemaError(f"payload: expected a JSON object, got {type(obj).__name__}")
    if "\\u" in text or (isinstance(data, str) and not data.isascii()):  # a str may hold a raw surrogate
        # JSON may escape half a UTF-16 pair ("\ud800"), which no UTF-8 string holds: a request id or
        # run key with one crashed the replica writing it to Redis, then each that took it over
        # (found by review). Checked only when an escape is there (rare), on the decoded strings.
        try:
            json.dumps(obj, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise SchemaError("payload: a string holds half a UTF-16 surrogate pair (not valid Unicode)") from None
    return obj
