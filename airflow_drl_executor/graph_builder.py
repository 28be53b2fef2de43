"""Turns the DAG runs of a batch of ready task instances into placement-request pieces.

Runs in the scheduler process, on the scheduler's metadata database: the DAG structure comes from
the serialized DAG of each task instance's ``dag_version_id`` (cached per version), expected
durations from the successful task instances of the DAG's latest ``HISTORY_RUNS`` runs, brought back
to speed 1 by the speed of the pool each ran on (cached per DAG for ``history_ttl_s``; a task with
history takes it over its ``duration_s`` hint), hints from the task's ``executor_config={"drl": {...}}``, and progress
from the run's task instance states. Mapped task instances of one task share one graph node (and one placement).

Task hints (all optional)::

    executor_config={"drl": {"duration_s": 120, "cpus": 2, "memory_gb": 8, "gpus": 1,
                             "kind": "gpu_train", "pool": "gpu"}}
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from policy.catalogue import VMClass
from policy.errors import PolicyError, SchemaError
from policy.graph import view
from policy.lru import LRU
from policy.schema import ReadyTask, RunGraph, RunProgress, TaskNode

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

FINISHED_STATES = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})
RUNNING_STATES = frozenset({"running", "queued", "restarting"})
_HINTS = ("duration_s", "cpus", "memory_gb", "gpus", "priority")
#: expected durations are the mean of a task's successful tries in the DAG's latest runs
HISTORY_RUNS = 20
#: DAG versions (structures) and DAGs (duration history) kept, least recently used out
MAX_VERSIONS = 2048
#: task nodes of the run graphs kept between heartbeats (~300 B each)
MAX_CACHED_NODES = 200_000


@dataclass(frozen=True)
class ReadyInstance:
    """What the graph builder needs from one ready task instance (an ``ExecuteTask`` workload)."""

    dag_id: str
    run_id: str
    task_id: str
    try_number: int
    dag_version_id: str

    @property
    def run_key(self) -> str:
        return f"{self.dag_id}/{self.run_id}"


@dataclass(frozen=True)
class _Structure:
    task_ids: tuple[str, ...]
    edges: tuple[tuple[int, int], ...]
    hints: tuple[Mapping[str, Any], ...]
    queues: tuple[str, ...]
    weights: tuple[float, ...]


def task_node(task_id: str, hints: Mapping[str, Any], queue: str, weight: float, *, duration_s: float,
              pool_names: Iterable[str], default_queue: str) -> TaskNode:
    """One graph node from a task's queue, priority weight and ``executor_config["drl"]`` hints;
    :class:`SchemaError` naming the task and the field for a hint that is not valid."""
    node, problems = lenient_node(task_id, hints, queue, weight, duration_s=duration_s, pool_names=pool_names,
                                  default_queue=default_queue)
    if problems:
        raise SchemaError(problems[0])
    return node


def lenient_node(task_id: str, hints: Mapping[str, Any], queue: str, weight: float, *, duration_s: float,
                 pool_names: Iterable[str], default_queue: str) -> tuple[TaskNode, tuple[str, ...]]:
    """:func:`task_node` without the hints that are not valid, and what was wrong with each: one
    DAG author's typo must not take the placement of every other task (of that run, or of the
    batch) off the policy; the placement's reason names what was ignored."""
    values: dict[str, Any] = {"duration_s": duration_s, "priority": max(weight, 0.0)}
    problems: list[str] = []
    for key in _HINTS:
        if key in hints:
            value = hints[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                problems.append(f"task {task_id!r}: executor_config drl.{key} must be a finite number >= 0, "
                                f"got {value!r}")
            else:
                values[key] = float(value)
    kind = hints.get("kind", "default")
    if not isinstance(kind, str) or not kind:
        problems.append(f"task {task_id!r}: executor_config drl.kind must be a string, got {kind!r}")
        kind = "default"
    pool = hints.get("pool")
    names = set(pool_names)
    if pool is None and queue in names and queue != default_queue:
        pool = queue  # the DAG author typed one of our pools: honour it as a pin
    if pool is not None and pool not in names:
        problems.append(f"task {task_id!r}: pinned pool {pool!r} is not one of {sorted(names)}")
        pool = None
    return TaskNode(task_id=task_id, kind=kind, pool=pool, **values), tuple(problems)


def drl_hints(executor_config: Any) -> Mapping[str, Any]:
    """The ``"drl"`` mapping of a task's ``executor_config`` (empty when it has none)."""
    drl = executor_config.get("drl", {}) if isinstance(executor_config, Mapping) else {}
    return drl if isinstance(drl, Mapping) else {}


@dataclass(frozen=True)
class Batch:
    """What :meth:`GraphBuilder.build` makes of a batch of ready instances."""

    graphs: dict[str, RunGraph]
    progress: list[RunProgress]
    ready: list[ReadyTask]
    #: (run key, task id) of a ready task -> the hints of it that were ignored, and why
    ignored: dict[tuple[str, str], str] = field(default_factory=dict)
    #: run key -> why its graph could not be built (its tasks are not in ``ready``)
    failed: dict[str, str] = field(default_factory=dict)


class GraphBuilder:
    """Builds :class:`RunGraph`, :class:`RunProgress` and :class:`ReadyTask` for ready instances."""

    def __init__(self, *, pool_names: Sequence[str], default_queue: str, default_duration_s: float,
                 history_ttl_s: float, vm_classes: Mapping[str, VMClass] | None = None) -> None:
        self.pool_names = tuple(pool_names)
        #: each pool's VM class: observed durations are divided back to speed 1 by its speed
        self.vm_classes = dict(vm_classes or {})
        self.default_queue = default_queue
        self.default_duration_s = default_duration_s
        self.history_ttl_s = history_ttl_s
        self._structures: LRU[str, _Structure] = LRU(MAX_VERSIONS)
        self._history: LRU[str, tuple[float, dict[str, list[tuple[str, float, int]]]]] = LRU(MAX_VERSIONS)
        #: (run key, dag version) -> (built at, graph, ignored hints), oldest first
        self._graphs: dict[tuple[str, str], tuple[float, RunGraph, Mapping[str, str]]] = {}
        self._cached_nodes = 0

    def build(self, ready: Sequence[ReadyInstance], session: Session,
              not_sent: Iterable[tuple[str, str]] = ()) -> Batch:
        """The graphs, progress and ready tasks of a batch. A run whose graph cannot be built (no
        serialized DAG for its version) is left out with the reason, not the whole batch."""
        graphs: dict[str, RunGraph] = {}
        ignored: dict[tuple[str, str], str] = {}
        failed: dict[str, str] = {}
        problems: dict[str, Mapping[str, str]] = {}
        tasks: dict[tuple[str, str], ReadyTask] = {}
        # One graph per run, of the newest DAG version among its instances (version ids are
        # UUIDv7: newest sorts last). Instances of one run can carry different versions: a clear
        # "on the latest version" re-versions only what it clears, and a workload held back keeps
        # the version it was queued with.
        newest: dict[str, ReadyInstance] = {}
        for inst in ready:
            if inst.run_key not in newest or inst.dag_version_id > newest[inst.run_key].dag_version_id:
                newest[inst.run_key] = inst
        for run_key, inst in newest.items():
            try:
                graphs[run_key], problems[run_key] = self._graph(inst, session)
            except PolicyError as exc:
                failed[run_key] = str(exc)
        for inst in ready:
            if inst.run_key in failed or inst.task_id not in view(graphs[inst.run_key]).index:
                continue  # not in that version: the executor places it itself (no ReadyTask)
            key = (inst.run_key, inst.task_id)
            if inst.task_id in problems[inst.run_key]:
                ignored[key] = problems[inst.run_key][inst.task_id]
            if key not in tasks:  # mapped instances share one node
                tasks[key] = ReadyTask(run_key=inst.run_key, task_id=inst.task_id, try_number=inst.try_number)
        progress = self._progress({(i.dag_id, i.run_id) for i in ready}, session)
        # The ready tasks, and the others queued to the executor and not sent to Celery (``not_sent``:
        # held, or not offered for want of a slot), are "queued" in the database but not
        # dispatched yet: not running, as in the simulator the policy was trained in.
        waiting: dict[str, set[str]] = {}
        for run_key, task_id in (*tasks, *not_sent):
            waiting.setdefault(run_key, set()).add(task_id)
        progress = [replace(p, running=tuple(t for t in p.running if t not in waiting.get(p.run_key, ())))
                    for p in progress]
        self._evict(set(graphs))
        return Batch(graphs, progress, list(tasks.values()), ignored, failed)

    # --- structure, history, progress --------------------------------------------------------

    def _graph(self, inst: ReadyInstance, session: Session) -> tuple[RunGraph, Mapping[str, str]]:
        """The run's graph, and the hints of its tasks that were ignored (task id -> why)."""
        now = time.monotonic()
        cache_key = (inst.run_key, inst.dag_version_id)
        cached = self._graphs.get(cache_key)
        if cached is not None and now - cached[0] < self.history_ttl_s:
            return cached[1], cached[2]
        structure = self.structure(inst.dag_version_id, session)
        durations = self._durations(inst.dag_id, session)
        nodes, problems = [], {}
        for tid, hints, queue, weight in zip(structure.task_ids, structure.hints, structure.queues,
                                             structure.weights, strict=True):
            node, wrong = lenient_node(tid, hints, queue, weight, duration_s=self.default_duration_s,
                                       pool_names=self.pool_names, default_queue=self.default_queue)
            if tid in durations:  # what it took replaces what it declared
                node = replace(node, duration_s=self.at_speed_one(durations[tid], node.kind))
            nodes.append(node)
            if wrong:
                problems[tid] = "; ".join(wrong)
        if problems and cached is None:
            log.warning("DRLExecutor: %s: invalid executor_config hints ignored: %s", inst.run_key,
                        "; ".join(problems.values()))
        graph = RunGraph(run_key=inst.run_key, tasks=tuple(nodes), edges=structure.edges)
        if cached is not None:
            self._cached_nodes -= len(cached[1].tasks)
            del self._graphs[cache_key]  # re-inserted: newest
        self._graphs[cache_key] = (now, graph, problems)
        self._cached_nodes += len(nodes)
        return graph, problems

    def structure(self, version_id: str, session: Session) -> _Structure:
        """Task ids (sorted), dependency edges, hints, queues and weights of one DAG version."""
        hit = self._structures.get(version_id)
        if hit is not None:
            return hit
        from airflow.models.dagbag import DBDagBag

        dag = DBDagBag(load_op_links=False).get_dag(version_id, session)
        if dag is None:
            raise SchemaError(f"dag version {version_id}: no serialized DAG in the metadata database")
        ops = sorted(dag.tasks, key=lambda t: t.task_id)
        index = {t.task_id: i for i, t in enumerate(ops)}
        edges = tuple(sorted(
            (index[t.task_id], index[d]) for t in ops for d in t.downstream_task_ids if d in index
        ))
        structure = _Structure(
            task_ids=tuple(t.task_id for t in ops),
            edges=edges,
            hints=tuple(drl_hints(t.executor_config) for t in ops),
            queues=tuple(str(t.queue) for t in ops),
            weights=tuple(float(t.priority_weight or 1) for t in ops),
        )
        return self._structures.put(version_id, structure)

    def at_speed_one(self, observed: Sequence[tuple[str, float, int]], kind: str) -> float:
        """The mean duration at speed 1 of ``observed`` ``(pool, mean seconds, count)`` groups: each
        pool's seconds times its VM class's speed for ``kind`` (1 for a queue not in the
        catalogue), weighted by count. What the policy and the simulator take as ``duration_s``."""
        total = sum(n for _, _, n in observed)
        seconds = sum(mean * n * (self.vm_classes[pool].speed_for(kind) if pool in self.vm_classes else 1.0)
                      for pool, mean, n in observed)
        return max(seconds / max(total, 1), 0.001)

    def _durations(self, dag_id: str, session: Session) -> dict[str, list[tuple[str, float, int]]]:
        """Per task, ``(queue, mean seconds, count)`` of its successful tries in the DAG's latest
        ``HISTORY_RUNS`` runs."""
        now = time.monotonic()
        hit = self._history.get(dag_id)
        if hit is not None and now - hit[0] < self.history_ttl_s:
            return hit[1]
        from airflow.models.dagrun import DagRun
        from airflow.models.taskinstance import TaskInstance
        from sqlalchemy import func, select

        # Two bounded reads (MySQL takes no LIMIT in an IN subquery): the DAG's latest runs by the
        # dag_run primary key, then their successful task instances by (dag_id, run_id); the
        # history of a DAG that has run hourly for years stays HISTORY_RUNS runs of work.
        recent = session.execute(
            select(DagRun.run_id).where(DagRun.dag_id == dag_id).order_by(DagRun.id.desc()).limit(HISTORY_RUNS)
        ).scalars().all()
        rows = session.execute(
            select(TaskInstance.task_id, TaskInstance.queue, func.avg(TaskInstance.duration), func.count())
            .where(TaskInstance.dag_id == dag_id, TaskInstance.run_id.in_(list(recent)),
                   TaskInstance.state == "success", TaskInstance.duration.is_not(None))
            .group_by(TaskInstance.task_id, TaskInstance.queue)
        ).all() if recent else []
        durations: dict[str, list[tuple[str, float, int]]] = {}
        for task_id, queue, mean, n in rows:
            if mean is not None:
                durations.setdefault(task_id, []).append((str(queue), float(mean), int(n)))
        self._history.put(dag_id, (now, durations))
        return durations

    def running_by_pool(self, session: Session) -> dict[str, int]:
        """Task instances running on each pool, whichever scheduler sent them (by ``ti_state``)."""
        from airflow.models.taskinstance import TaskInstance
        from sqlalchemy import func, select

        rows = session.execute(
            select(TaskInstance.queue, func.count())
            .where(TaskInstance.state == "running", TaskInstance.queue.in_(self.pool_names))
            .group_by(TaskInstance.queue)
        ).all()
        return {str(queue): int(n) for queue, n in rows}

    def started(self, session: Session, ti_ids: Sequence[str]) -> dict[str, float]:
        """Of these task instances (ids), the ones running, with their start (epoch seconds)."""
        from airflow.models.taskinstance import TaskInstance
        from sqlalchemy import select

        out: dict[str, float] = {}
        ids = sorted({uuid.UUID(str(i)) for i in ti_ids})
        for i in range(0, len(ids), 1000):  # bounded IN lists
            rows = session.execute(
                select(TaskInstance.id, TaskInstance.start_date)
                .where(TaskInstance.id.in_(ids[i:i + 1000]), TaskInstance.state == "running")
            ).all()
            for ti_id, start in rows:
                if start is not None:  # Airflow's dates are UTC; a naive one is too
                    aware = start if start.tzinfo is not None else start.replace(tzinfo=dt.UTC)
                    out[_uuid_text(ti_id)] = aware.timestamp()
        return out

    def _progress(self, runs: set[tuple[str, str]], session: Session) -> list[RunProgress]:
        from airflow.models.dagrun import DagRun
        from airflow.models.taskinstance import TaskInstance
        from sqlalchemy import and_, or_, select

        if not runs:
            return []
        ti_rows = session.execute(
            select(TaskInstance.dag_id, TaskInstance.run_id, TaskInstance.task_id, TaskInstance.state)
            .where(or_(*(and_(TaskInstance.dag_id == d, TaskInstance.run_id == r) for d, r in runs)))
        ).all()
        run_rows = session.execute(
            select(DagRun.dag_id, DagRun.run_id, DagRun.start_date)
            .where(or_(*(and_(DagRun.dag_id == d, DagRun.run_id == r) for d, r in runs)))
        ).all()
        finished: dict[str, set[str]] = {f"{d}/{r}": set() for d, r in runs}
        running: dict[str, set[str]] = {f"{d}/{r}": set() for d, r in runs}
        # A mapped task has one row per instance: it is finished when every instance is, and
        # running while any is.
        states: dict[tuple[str, str], set[str]] = {}
        for dag_id, run_id, task_id, state in ti_rows:
            text = str(state.value if hasattr(state, "value") else state) if state else ""
            states.setdefault((f"{dag_id}/{run_id}", task_id), set()).add(text)
        for (key, task_id), seen in states.items():
            if seen <= FINISHED_STATES:
                finished[key].add(task_id)
            elif seen & RUNNING_STATES:
                running[key].add(task_id)
        ages = {f"{d}/{r}": (time.time() - start.timestamp()) if start else 0.0 for d, r, start in run_rows}
        return [
            RunProgress(run_key=key, finished=tuple(sorted(finished[key])),
                        running=tuple(sorted(running[key] - finished[key])), age_s=max(ages.get(key, 0.0), 0.0))
            for key in sorted(finished)
        ]

    def _evict(self, active: set[str]) -> None:
        """Drop the oldest graphs of runs not in this batch while the cache holds more than
        ``MAX_CACHED_NODES`` task nodes (a bound on memory, whatever the runs' sizes)."""
        if self._cached_nodes <= MAX_CACHED_NODES:
            return
        for key in [k for k in self._graphs if k[0] not in active]:
            self._cached_nodes -= len(self._graphs.pop(key)[1].tasks)
            if self._cached_nodes <= MAX_CACHED_NODES:
                break


def _uuid_text(value: object) -> str:
    """A task instance id as ``str(uuid)`` writes it, whatever type the database gave it back."""
    return str(value if isinstance(value, uuid.UUID) else uuid.UUID(str(value)))
