"""Turns the DAG runs of a batch of ready task instances into placement-request pieces.

Runs in the scheduler process, on the scheduler's metadata database: the DAG structure comes from
the serialized DAG of each task instance's ``dag_version_id`` (cached per version), expected
durations from the successful task instances of the DAG's latest ``HISTORY_RUNS`` runs, brought back
to speed 1 by the speed of the pool each ran on (cached per DAG for ``history_ttl_s``; a task with
history takes it over its ``duration_s`` hint), hints from the task's ``executor_config={"drl": {...}}``, and progress
from the run's task instance states. A mapped task, once expanded, is one node per instance
(``task_id[map_index]``, each with the task's hints and expected duration, and its task's edges:
every instance of an upstream task before every instance of a downstream one, or index by index
where two mapped tasks would make more than ``MAX_CROSS_EDGES`` edges), so each instance is
placed on its own, as the simulator's parallel tasks are.

Task hints (all optional)::

    executor_config={"drl": {"duration_s": 120, "cpus": 2, "memory_gb": 8, "gpus": 1,
                             "kind": "gpu_train", "pool": "gpu"}}
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from airflow_drl_executor.traces import LastPlacement
from policy.catalogue import VMClass
from policy.errors import PolicyError, SchemaError
from policy.graph import view
from policy.lru import LRU
from policy.schema import (
    MAX_EDGES_PER_RUN,
    MAX_TASKS_PER_RUN,
    ReadyTask,
    RunGraph,
    RunProgress,
    TaskNode,
    _finite,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_T = TypeVar("_T")

log = logging.getLogger(__name__)

FINISHED_STATES = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})
#: dispatched and not finished, as the simulator the policy learnt in counts a task: a deferred
#: task (waiting in the triggerer) and a sensor between pokes (reschedule mode) included
RUNNING_STATES = frozenset({"running", "queued", "restarting", "deferred", "up_for_reschedule"})
_HINTS = ("duration_s", "cpus", "memory_gb", "gpus", "priority")
#: expected durations are the mean of a task's successful tries in the DAG's latest runs
HISTORY_RUNS = 20
#: DAG versions (structures) and DAGs (duration history) kept, least recently used out
MAX_VERSIONS = 2048
#: task nodes of the run graphs kept between heartbeats (~300 B each)
MAX_CACHED_NODES = 200_000
#: an edge between two mapped tasks joins every pair of their instances up to this many edges
MAX_CROSS_EDGES = 4096


def node_id(task_id: str, map_index: int = -1) -> str:
    """The graph node of a task instance: the task id, or ``task_id[map_index]`` for an
    instance of an expanded mapped task."""
    return task_id if map_index < 0 else f"{task_id}[{map_index}]"


@dataclass(frozen=True)
class ReadyInstance:
    """What the graph builder needs from one ready task instance (an ``ExecuteTask`` workload)."""

    dag_id: str
    run_id: str
    task_id: str
    try_number: int
    dag_version_id: str
    map_index: int = -1
    #: the task instance's queue as the scheduler queued it (a pool, when a mutation hook pinned it)
    queue: str = ""

    @property
    def run_key(self) -> str:
        return f"{self.dag_id}/{self.run_id}"

    @property
    def node(self) -> str:
        """Its node in the run's graph (:func:`node_id`)."""
        return node_id(self.task_id, self.map_index)


@dataclass(frozen=True)
class _Structure:
    task_ids: tuple[str, ...]
    edges: tuple[tuple[int, int], ...]
    hints: tuple[Mapping[str, Any], ...]
    queues: tuple[str, ...]
    #: the edges between two tasks of one mapped task group: instance k runs after instance k only
    paired: frozenset[tuple[int, int]] = frozenset()
    #: each task's ``retries`` (to tell a retry from a cleared task's new try; :func:`attempt`)
    retries: tuple[int | None, ...] = ()


def task_node(task_id: str, hints: Mapping[str, Any], queue: str, *, duration_s: float,
              pool_names: Iterable[str], default_queue: str) -> TaskNode:
    """One graph node from a task's queue and ``executor_config["drl"]`` hints;
    :class:`SchemaError` naming the task and the field for a hint that is not valid.

    Airflow's ``priority_weight`` is not the node's ``priority``: the policy learnt ``priority``
    from the lab's WfFormat traces, where it is Pegasus's 20 + 10 x the task's depth (higher =
    deeper = less left after it), or 1, so it reads a higher value as a later stage and put the
    *lower* of two otherwise identical tasks first in 199 of 200 requests
    (``scripts/priority_probe.py``): a user's ``priority_weight=10`` would have sent that task
    last. The node keeps the 1 the policy saw for every Airflow-like family (a ``priority``
    hint sets it, in the lab's sense), and the user's priority orders the request instead: the
    scheduler queues tasks by ``priority_weight`` and the executor lists them in that order, the
    last key of the policy's decode order (critical path first)."""
    node, problems = lenient_node(task_id, hints, queue, duration_s=duration_s, pool_names=pool_names,
                                  default_queue=default_queue)
    if problems:
        raise SchemaError(problems[0])
    return node


def lenient_node(task_id: str, hints: Mapping[str, Any], queue: str, *, duration_s: float,
                 pool_names: Iterable[str], default_queue: str) -> tuple[TaskNode, tuple[str, ...]]:
    """:func:`task_node` without the hints that are not valid, and what was wrong with each: one
    DAG author's typo must not take the placement of every other task (of that run, or of the
    batch) off the policy; the placement's reason names what was ignored. It never raises:
    ``executor_config`` is any object a DAG pickled (found by review: a list as ``drl.pool``
    raised TypeError out of the scheduler loop at every heartbeat that queued the task)."""
    try:
        return _lenient_node(task_id, hints, queue, duration_s=duration_s, pool_names=pool_names,
                             default_queue=default_queue)
    except Exception as exc:  # noqa: BLE001 - see above: the task is placed without its hints
        node, _ = _lenient_node(task_id, {}, queue, duration_s=duration_s, pool_names=pool_names,
                                default_queue=default_queue)
        return node, (f"task {task_id!r}: executor_config drl hints unreadable ({type(exc).__name__}: {exc})",)


def _lenient_node(task_id: str, hints: Mapping[str, Any], queue: str, *, duration_s: float,
                  pool_names: Iterable[str], default_queue: str) -> tuple[TaskNode, tuple[str, ...]]:
    values: dict[str, Any] = {"duration_s": duration_s}  # priority 1 unless hinted: task_node
    problems: list[str] = []
    for key in _HINTS:
        if key in hints:
            value = hints[key]
            if not _finite(value) or value < 0:  # _finite: a 400-digit integer raised OverflowError
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
    if pool is not None and (not isinstance(pool, str) or pool not in names):  # a list: unhashable
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
    #: (run key, task id) of a ready task pinned by its task instance's queue -> that pool
    queue_pins: dict[tuple[str, str], str] = field(default_factory=dict)


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
        #: DAG versions :meth:`structure` failed to read for :meth:`_declared` (not tried again)
        self._unreadable: LRU[str, bool] = LRU(MAX_VERSIONS)
        self._history: LRU[str, tuple[float, dict[str, list[tuple[str, float, int]]]]] = LRU(MAX_VERSIONS)
        #: (run key, dag version) -> (built at, graph, ignored hints, mapped expansion), oldest first
        self._graphs: dict[tuple[str, str], tuple[float, RunGraph, Mapping[str, str], dict[str, tuple[int, ...]]]] = {}
        self._cached_nodes = 0

    def build(self, ready: Sequence[ReadyInstance], session: Session,
              not_sent: Iterable[tuple[str, str]] = (),
              placed_before: Mapping[tuple[str, str], LastPlacement] | None = None) -> Batch:
        """The graphs, progress and ready tasks of a batch. A run whose graph cannot be built (no
        serialized DAG for its version) is left out with the reason, not the whole batch.

        ``placed_before``: (run key, node) -> its latest placement (of any try), for the ready
        instances queued on a pool
        (None: no placement traces, no pins read from the queue). A task instance whose queue
        names a pool its DAG did not pin it to is pinned there (:func:`queue_pin`): a
        ``task_instance_mutation_hook`` set it (was: a pin was read from the DAG only)."""
        graphs: dict[str, RunGraph] = {}
        ignored: dict[tuple[str, str], str] = {}
        failed: dict[str, str] = {}
        problems: dict[str, Mapping[str, str]] = {}
        tasks: dict[tuple[str, str], ReadyTask] = {}
        retries: dict[str, dict[str, int | None]] = {}  # run key -> task id -> its retries
        pins: dict[tuple[str, str], str] = {}
        # One graph per run, of the newest DAG version among its instances (version ids are
        # UUIDv7: newest sorts last). Instances of one run can carry different versions: a clear
        # "on the latest version" re-versions only what it clears, and a workload held back keeps
        # the version it was queued with.
        newest: dict[str, ReadyInstance] = {}
        for inst in ready:
            if inst.run_key not in newest or inst.dag_version_id > newest[inst.run_key].dag_version_id:
                newest[inst.run_key] = inst
        runs = {(i.dag_id, i.run_id) for i in ready}
        # a first try is sent as one; the others' max_tries tell a retry from a cleared task's try
        rows, max_tries = self._ti_rows(runs, session, {(i.run_key, i.node) for i in ready if i.try_number > 1})
        expanded = expansions(rows)
        for run_key, inst in newest.items():
            try:
                graphs[run_key], problems[run_key] = self._graph(inst, session, expanded.get(run_key, {}))
            except PolicyError as exc:
                failed[run_key] = str(exc)
            except SQLAlchemyError:
                raise  # the database, not this run: the heartbeat's fallback for every run
            except Exception as exc:  # noqa: BLE001 - found by review: a DAG version this scheduler cannot
                # deserialize (another release's, a timetable not registered here) sent every run of
                # the batch to the fallback, at every heartbeat; now that run only
                failed[run_key] = (f"DAG version {inst.dag_version_id} cannot be read here: "
                                   f"{type(exc).__name__}: {exc}")
        for inst in ready:
            if inst.run_key in failed or inst.node not in view(graphs[inst.run_key]).index:
                continue  # not in that version: the executor places it itself (no ReadyTask)
            key = (inst.run_key, inst.node)
            if inst.task_id in problems[inst.run_key]:
                ignored[key] = problems[inst.run_key][inst.task_id]
            if key not in tasks:
                n = inst.try_number
                if key in max_tries:  # a try past the first: a retry, or the first since a clear
                    if inst.run_key not in retries:
                        structure = self.structure(newest[inst.run_key].dag_version_id, session)  # cached by _graph
                        retries[inst.run_key] = dict(zip(structure.task_ids, structure.retries, strict=False))
                    n = attempt(inst.try_number, max_tries[key], retries[inst.run_key].get(inst.task_id))
                tasks[key] = ReadyTask(run_key=inst.run_key, task_id=inst.node, try_number=n)
                if placed_before is not None and queue_pin(
                        inst, n, placed_before.get(key), self.pool_names, self.default_queue):
                    graph = graphs[inst.run_key]
                    if graph.tasks[view(graph).index[inst.node]].pool is None:  # not pinned by its DAG
                        pins[key] = inst.queue
        progress = _progress(rows, self._run_ages(runs, session))
        # The ready tasks, and the others queued to the executor and not sent to Celery (``not_sent``:
        # held, or not offered for want of a slot), are "queued" in the database but not
        # dispatched yet: not running, as in the simulator the policy was trained in.
        waiting: dict[str, set[str]] = {}
        for run_key, task_id in (*tasks, *not_sent):
            waiting.setdefault(run_key, set()).add(task_id)
        progress = [replace(p, running=tuple(t for t in p.running if t not in waiting.get(p.run_key, ())))
                    for p in progress]
        self._evict(set(graphs))
        for run_key in {k for k, _ in pins}:  # a copy: the cached graph stays the DAG's
            g = graphs[run_key]
            graphs[run_key] = RunGraph(run_key=run_key, edges=g.edges, tasks=tuple(  # a digest of its own
                replace(t, pool=pins[(run_key, t.task_id)]) if (run_key, t.task_id) in pins else t for t in g.tasks))
        return Batch(graphs, progress, list(tasks.values()), ignored, failed, pins)

    # --- structure, history, progress --------------------------------------------------------

    def _graph(self, inst: ReadyInstance, session: Session, expansion: Mapping[str, tuple[int, ...]] | None = None
               ) -> tuple[RunGraph, Mapping[str, str]]:
        """The run's graph, with its mapped tasks expanded as ``expansion`` says (task id -> map
        indexes), and the hints of its tasks that were ignored (task id -> why)."""
        now = time.monotonic()
        expansion = dict(expansion or {})
        cache_key = (inst.run_key, inst.dag_version_id)
        cached = self._graphs.get(cache_key)
        if cached is not None and now - cached[0] < self.history_ttl_s and cached[3] == expansion:
            return cached[1], cached[2]
        structure = self.structure(inst.dag_version_id, session)
        durations = self._durations(inst.dag_id, session)
        nodes, problems = [], {}
        for tid, hints, queue in zip(structure.task_ids, structure.hints, structure.queues, strict=True):
            node, wrong = lenient_node(tid, hints, queue, duration_s=self.default_duration_s,
                                       pool_names=self.pool_names, default_queue=self.default_queue)
            if tid in durations:  # what it took replaces what it declared
                node = replace(node, duration_s=self.at_speed_one(durations[tid], node.kind))
            nodes.append(node)
            if wrong:
                problems[tid] = "; ".join(wrong)
        if problems and cached is None:
            log.warning("DRLExecutor: %s: invalid executor_config hints ignored: %s", inst.run_key,
                        "; ".join(problems.values()))
        tasks, edges = expand_mapped(nodes, structure.edges, expansion, paired=structure.paired)
        if len(tasks) > MAX_TASKS_PER_RUN or len(edges) > MAX_EDGES_PER_RUN:
            # found by review: the server refused the request, and every run of the batch fell back
            raise SchemaError(f"{inst.run_key}: {len(tasks)} tasks and {len(edges)} edges with its mapped tasks "
                              f"expanded, more than the policy server takes ({MAX_TASKS_PER_RUN} and "
                              f"{MAX_EDGES_PER_RUN})")
        graph = RunGraph(run_key=inst.run_key, tasks=tasks, edges=edges)
        if cached is not None:
            self._cached_nodes -= len(cached[1].tasks)
            del self._graphs[cache_key]  # re-inserted: newest
        self._graphs[cache_key] = (now, graph, problems, expansion)
        self._cached_nodes += len(tasks)
        return graph, problems

    def structure(self, version_id: str, session: Session) -> _Structure:
        """Task ids (sorted), dependency edges, hints and queues of one DAG version."""
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
            paired=frozenset((u, v) for u, v in edges if _same_mapped_group(ops[u], ops[v])),
            retries=tuple(_retries(t) for t in ops),
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
        ``HISTORY_RUNS`` runs: the time each held a worker slot, as the simulator's durations are.

        A try resumed from deferral keeps its first start date (Airflow 3.3's ``ti_run`` leaves it
        when resuming), so its ``duration`` counts the wait in the triggerer too: 2 s of work that
        waited an hour for its trigger has a ``duration`` of ~3,600 s (found by review). Such a try
        was queued again after it started (``queued_dttm`` > ``start_date``, the scheduler stamps
        every queueing): it is counted from its worker's last start (the ``running`` row Airflow
        writes to its ``log`` table at every start; its last queueing when that row is gone) to its
        end, its run after the trigger fired (what it ran before deferring is not recorded
        anywhere, usually a submit; from the queueing, found by review, the wait in its pool's
        Celery queue counted as run time).
        A try that ended in the triggerer (``end_from_trigger``: Airflow leaves its
        ``next_method`` set, a worker's end clears it) held its slot only until it deferred, a
        time recorded nowhere: it is left out (its task takes its hint, or the default)."""
        now = time.monotonic()
        hit = self._history.get(dag_id)
        if hit is not None and now - hit[0] < self.history_ttl_s:
            return hit[1]
        from airflow.models.dagrun import DagRun
        from airflow.models.taskinstance import TaskInstance as TI
        from sqlalchemy import func, or_, select

        # Two bounded reads (MySQL takes no LIMIT in an IN subquery): the DAG's latest runs by the
        # dag_run primary key, then their successful task instances by (dag_id, run_id); the
        # history of a DAG that has run hourly for years stays HISTORY_RUNS runs of work.
        # Runs that started: a backfill creates all its runs at once, queued (found by review: while
        # one of 20+ runs lasted, the latest runs by id had run nothing and every task lost its history)
        recent = session.execute(
            select(DagRun.run_id).where(DagRun.dag_id == dag_id, DagRun.start_date.is_not(None))
            .order_by(DagRun.id.desc()).limit(HISTORY_RUNS)
        ).scalars().all()
        done = (TI.dag_id == dag_id, TI.run_id.in_(list(recent)), TI.state == "success", TI.next_method.is_(None))
        resumed = TI.queued_dttm > TI.start_date
        rows = session.execute(
            select(TI.task_id, TI.queue, func.avg(TI.duration), func.count())
            # not NULL, nor negative (a worker's clock stepped back), nor 0: a task marked success
            # without running (set_state writes start = end; found by review: counted as a 0 s run)
            .where(*done, TI.duration > 0,
                   or_(TI.queued_dttm.is_(None), TI.start_date.is_(None), ~resumed))
            .group_by(TI.task_id, TI.queue)
        ).all() if recent else []
        totals: dict[tuple[str, str], list[float]] = {}  # (task, queue) -> [seconds, count]
        for task_id, queue, mean, n in rows:
            if mean is not None:
                totals[(str(task_id), str(queue))] = [float(mean) * int(n), int(n)]
        # the resumed tries one by one (few: the deferrable tasks' own), in Python: date
        # arithmetic differs between PostgreSQL, MySQL and SQLite
        again = session.execute(
            select(TI.task_id, TI.queue, TI.start_date, TI.queued_dttm, TI.end_date, TI.run_id, TI.map_index,
                   TI.try_number)
            .where(*done, resumed, TI.end_date.is_not(None))
        ).all() if recent else []
        starts = worker_starts(session, [(dag_id, t, r, m, n) for t, _, _, _, _, r, m, n in again])
        for task_id, queue, start, queued, end, run_id, map_index, try_number in again:
            seconds = worker_seconds(start, end, queued, starts.get((dag_id, task_id, run_id, map_index, try_number)))
            if seconds >= 0:
                total = totals.setdefault((str(task_id), str(queue)), [0.0, 0])
                total[0] += seconds
                total[1] += 1
        durations: dict[str, list[tuple[str, float, int]]] = {}
        for (task_id, queue), (seconds, n) in sorted(totals.items()):
            if n:
                durations.setdefault(task_id, []).append((queue, seconds / n, int(n)))
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

    def running_ids(self, session: Session) -> list[tuple[str, str, str]]:
        """``(ti id, pool, last queueing)`` of the task instances running on each pool, whichever
        scheduler sent them (read at every heartbeat while another scheduler runs tasks; the
        queueing tells a resumed deferral or a sensor's next poke, same id, from the run before)."""
        from airflow.models.taskinstance import TaskInstance as TI
        from sqlalchemy import select

        rows = session.execute(
            select(TI.id, TI.queue, TI.queued_dttm).where(TI.state == "running", TI.queue.in_(self.pool_names))
        ).all()
        return [(uuid_text(ti_id), str(queue), str(queued)) for ti_id, queue, queued in rows]

    def running_rows(self, session: Session, ti_ids: Sequence[str]
                     ) -> list[tuple[str, str, str, str, float, str | None]]:
        """``(ti id, dag id, task id, pool, start on a worker, DAG version id)`` of these task
        instances that run."""
        from airflow.models.taskinstance import TaskInstance as TI
        from sqlalchemy import select

        out: list[tuple[str, str, str, str, float, str | None]] = []
        for ids in _id_chunks(ti_ids):
            rows = session.execute(
                select(TI.id, TI.queue, TI.dag_version_id, *_try_columns(TI))
                .where(TI.id.in_(ids), TI.state == "running")
            ).all()
            starts = _worker_start(session, [r[3:] for r in rows])
            out.extend((uuid_text(r[0]), str(r[3]), str(r[4]), str(r[1]), starts[i],
                        None if r[2] is None else uuid_text(r[2])) for i, r in enumerate(rows) if i in starts)
        return out

    def expected_run_s(self, dag_id: str, task_id: str, pool: str, session: Session,
                       version_id: str | None = None) -> float:
        """Expected seconds of a try of ``task_id`` on ``pool`` from the DAG's history: its mean
        there, else its mean wherever it ran brought to that pool's speed for the task's kind,
        else its declared duration (its ``duration_s`` hint, or the default) at that speed. The
        kind and hints are read from DAG version ``version_id`` (cached per version, as the
        graphs'; was: every task taken for the default kind, so a GPU task's 30 min on the GPU
        pool, seen elsewhere, was converted at a CPU task's speed ratio)."""
        observed = self._durations(dag_id, session).get(task_id, [])
        there = [(q, mean, n) for q, mean, n in observed if q == pool]
        if there:
            return sum(mean * n for _, mean, n in there) / max(sum(n for _, _, n in there), 1)
        node = self._declared(version_id, task_id, session)
        speed = self.vm_classes[pool].speed_for(node.kind) if pool in self.vm_classes else 1.0
        at_one = self.at_speed_one(observed, node.kind) if observed else node.duration_s
        return at_one / max(speed, 1e-3)

    def _declared(self, version_id: str | None, task_id: str, session: Session) -> TaskNode:
        """``task_id``'s node as its DAG version declares it (kind, hinted duration at speed 1); a
        task of the default kind and duration when the version or the task cannot be read."""
        default = TaskNode(task_id=task_id, duration_s=self.default_duration_s)
        if not version_id or self._unreadable.get(version_id):
            return default
        try:
            structure = self.structure(version_id, session)
        except SQLAlchemyError:  # the DB, not the version: placing fails over this heartbeat, as on any DB error
            raise
        except Exception as exc:  # noqa: BLE001 - another scheduler's DAG version this one cannot read
            # (a rolling upgrade: DeserializationError, "Unsure how to deserialize version N", a
            # timetable not registered here) is a default task, not every placement on the fallback
            # (found by review), and it is not read again
            self._unreadable.put(version_id, True)
            log.warning("DRLExecutor: DAG version %s (of a task another scheduler runs) cannot be read here; "
                        "its tasks are taken for default tasks: %s", version_id, exc)
            return default
        if task_id not in structure.task_ids:
            return default
        i = structure.task_ids.index(task_id)
        node, _ = lenient_node(task_id, structure.hints[i], structure.queues[i], duration_s=self.default_duration_s,
                               pool_names=self.pool_names, default_queue=self.default_queue)
        return node

    def started(self, session: Session, ti_ids: Sequence[str]) -> dict[str, float]:
        """Of these task instances (ids), the ones running, with their start on a worker (epoch
        seconds; :func:`_worker_start`)."""
        from airflow.models.taskinstance import TaskInstance as TI
        from sqlalchemy import select

        out: dict[str, float] = {}
        for ids in _id_chunks(ti_ids):
            rows = session.execute(
                select(TI.id, *_try_columns(TI)).where(TI.id.in_(ids), TI.state == "running")
            ).all()
            starts = _worker_start(session, [r[1:] for r in rows])
            out.update((uuid_text(r[0]), starts[i]) for i, r in enumerate(rows) if i in starts)
        return out

    def not_queued(self, session: Session, ti_ids: Sequence[object]) -> set[str]:
        """Of these task instances (ids), those no longer ``queued`` in the metadata DB (marked
        success or failed, cleared to a new id: no row with it in ``queued``)."""
        from airflow.models.taskinstance import TaskInstance
        from sqlalchemy import select

        queued: set[str] = set()
        for ids in _id_chunks(ti_ids):
            rows = session.execute(
                select(TaskInstance.id).where(TaskInstance.id.in_(ids), TaskInstance.state == "queued")
            ).scalars().all()
            queued.update(uuid_text(ti_id) for ti_id in rows)
        return {uuid_text(i) for i in ti_ids} - queued

    def airflow_pools(self, session: Session, ti_ids: Sequence[object]) -> dict[str, str]:
        """Of these task instances (ids), those in an Airflow pool other than ``default_pool``, with
        that pool. An executor's workload does not carry it (``TaskInstanceDTO`` has ``pool_slots``
        only; found by review: the executor read ``ti.pool`` from it, always None)."""
        from airflow.models.taskinstance import TaskInstance
        from sqlalchemy import select

        out: dict[str, str] = {}
        for ids in _id_chunks(ti_ids):
            rows = session.execute(
                select(TaskInstance.id, TaskInstance.pool)
                .where(TaskInstance.id.in_(ids), TaskInstance.pool != "default_pool")
            ).all()
            out.update((uuid_text(ti_id), str(pool)) for ti_id, pool in rows if pool)
        return out

    def _ti_rows(self, runs: set[tuple[str, str]], session: Session, tries_of: Collection[tuple[str, str]] = ()
                 ) -> tuple[list[tuple[str, str, int, str]], dict[tuple[str, str], int]]:
        """``(run key, task id, map index, state)`` of every task instance of these runs, and the
        ``max_tries`` of those in ``tries_of`` (run key, node)."""
        from airflow.models.taskinstance import TaskInstance
        from sqlalchemy import and_, or_, select

        if not runs:
            return [], {}
        rows: list[Any] = []
        for chunk in _chunks(runs):  # found by review: ~1,000 runs in one OR overflowed SQLite's depth
            rows.extend(session.execute(
                select(TaskInstance.dag_id, TaskInstance.run_id, TaskInstance.task_id, TaskInstance.map_index,
                       TaskInstance.state, TaskInstance.max_tries)
                .where(or_(*(and_(TaskInstance.dag_id == d, TaskInstance.run_id == r) for d, r in chunk)))
            ).all())
        out: list[tuple[str, str, int, str]] = []
        max_tries: dict[tuple[str, str], int] = {}
        for d, r, t, m, state, tries in rows:
            row = (f"{d}/{r}", str(t), -1 if m is None else int(m),
                   str(state.value if hasattr(state, "value") else state) if state else "")
            out.append(row)
            if tries_of and tries is not None and (key := (row[0], node_id(row[1], row[2]))) in tries_of:
                max_tries[key] = int(tries)
        return out, max_tries

    def _run_ages(self, runs: set[tuple[str, str]], session: Session) -> dict[str, float]:
        """Seconds since each run started (0 for a run not started)."""
        from airflow.models.dagrun import DagRun
        from sqlalchemy import and_, or_, select

        if not runs:
            return {}
        run_rows: list[Any] = []
        for chunk in _chunks(runs):
            run_rows.extend(session.execute(
                select(DagRun.dag_id, DagRun.run_id, DagRun.start_date)
                .where(or_(*(and_(DagRun.dag_id == d, DagRun.run_id == r) for d, r in chunk)))
            ).all())
        ages = {f"{d}/{r}": max(time.time() - start.timestamp(), 0.0) if start else 0.0 for d, r, start in run_rows}
        return {f"{d}/{r}": ages.get(f"{d}/{r}", 0.0) for d, r in runs}

    def _evict(self, active: set[str]) -> None:
        """Drop the oldest graphs of runs not in this batch while the cache holds more than
        ``MAX_CACHED_NODES`` task nodes (a bound on memory, whatever the runs' sizes)."""
        if self._cached_nodes <= MAX_CACHED_NODES:
            return
        for key in [k for k in self._graphs if k[0] not in active]:
            self._cached_nodes -= len(self._graphs.pop(key)[1].tasks)
            if self._cached_nodes <= MAX_CACHED_NODES:
                break


def queue_pin(inst: ReadyInstance, attempt: int, last: LastPlacement | None, pool_names: Collection[str],
              default_queue: str) -> bool:
    """Whether ``inst``'s queue pins it to that pool (for a task its DAG does not pin). Airflow
    sets a task instance's queue from its task, then runs the ``task_instance_mutation_hook``, at
    creation and at a clear (of a task not running), and runs the hook again on the run's task
    instances when it verifies the run's integrity; the executor writes its own choice there when
    it places a try, and a retry, a resumed deferral, a sensor's next poke or a clear while running
    keep it. So the queue is the hook's when the instance was never placed (``last``, its latest
    placement of any try, None); the executor's own when it names the pool last placed on, a pin
    only if that placement was pinned; and the hook's again when it names another pool on the
    first try since a clear."""
    if inst.queue not in pool_names or inst.queue == default_queue:
        return False
    if last is None:
        return True
    if inst.queue == last.pool:
        return last.pinned
    return attempt == 1 and last.try_number < inst.try_number


def attempt(try_number: int, max_tries: int | None, retries: int | None) -> int:
    """The try of a task instance since it was last cleared (1 for its first try then): what the
    policy's ``retry`` input means, a try after a failure. Airflow raises ``try_number`` at every
    scheduling, a clear's new try included, and a clear sets ``max_tries`` to the try number then
    plus the task's ``retries``, so ``max_tries - retries`` is the tries before the last clear
    (found by review: a cleared and re-run task reached the policy as a retry). Unknown
    ``max_tries`` (-1: never set) or ``retries``: ``try_number``."""
    if max_tries is None or retries is None or max_tries < 0:
        return try_number
    return min(max(try_number - max(max_tries - retries, 0), 1), try_number)


def _retries(task: Any) -> int | None:
    """A serialized task's ``retries``, when it is a number."""
    value = getattr(task, "retries", None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def worker_starts(session: Session, tries: Collection[tuple[str, str, str, int, int]]
                  ) -> dict[tuple[str, str, str, int, int], dt.datetime]:
    """The latest start on a worker of each of these tries ``(dag id, task id, run id, map index,
    try number)``, from the ``running`` rows Airflow 3.3 writes to its ``log`` table at every start
    of a try (``ti_run``; ``idx_log_task_instance``); none for a try whose rows are gone (``airflow
    db clean``). For tries resumed from deferral, whose ``start_date`` stays the first start."""
    if not tries:
        return {}
    from airflow.models.log import Log
    from sqlalchemy import and_, func, or_, select

    wanted = set(tries)
    runs: dict[tuple[str, str], set[str]] = {}
    for dag_id, task_id, run_id, _, _ in wanted:
        runs.setdefault((dag_id, run_id), set()).add(task_id)
    rows: list[Any] = []
    for chunk in _chunks(runs.items()):  # bounded OR lists (SQLite's expression depth is 1,000)
        rows.extend(session.execute(
            select(Log.dag_id, Log.task_id, Log.run_id, Log.map_index, Log.try_number, func.max(Log.dttm))
            .where(Log.event == "running", or_(*(and_(Log.dag_id == d, Log.run_id == r, Log.task_id.in_(sorted(t)))
                                                 for (d, r), t in chunk)))
            .group_by(Log.dag_id, Log.task_id, Log.run_id, Log.map_index, Log.try_number)
        ).all())
    out = {}
    for d, t, r, m, n, when in rows:
        key = (str(d), str(t), str(r), -1 if m is None else int(m), int(n or 0))
        if key in wanted and when is not None:
            out[key] = _utc(when)
    return out


def worker_seconds(start: dt.datetime, end: dt.datetime, queued: dt.datetime | None,
                   logged: dt.datetime | None = None) -> float:
    """Seconds a finished try held its worker slot: ``end - start``; for a try resumed from
    deferral (queued again after it started: Airflow keeps its first start date), from its last
    start on a worker (``logged``, :func:`worker_starts`), else from its last queueing."""
    return (_utc(end) - worker_begin(start, queued, logged)).total_seconds()


def worker_begin(start: dt.datetime, queued: dt.datetime | None, logged: dt.datetime | None = None) -> dt.datetime:
    """When a try last took its worker slot: its start date; for a try resumed from deferral
    (queued again after it started), its last start on a worker (``logged``), else its last
    queueing."""
    begin = _utc(start)
    if queued is not None and _utc(queued) > begin:
        begin = max(_utc(queued), logged or _utc(queued))
    return begin


def _utc(when: dt.datetime) -> dt.datetime:
    """Airflow's dates are UTC; a naive one (SQLite, MySQL) is too."""
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def _try_columns(TI: Any) -> tuple[Any, ...]:
    """The columns :func:`_worker_start` takes, in its order."""
    return (TI.dag_id, TI.task_id, TI.run_id, TI.map_index, TI.try_number, TI.start_date, TI.queued_dttm)


def _worker_start(session: Session, rows: Sequence[Sequence[Any]]) -> dict[int, float]:
    """When each running try (``_try_columns`` rows, by position) took its worker slot, epoch
    seconds: its start date; for a try resumed from deferral (queued again after it started:
    Airflow keeps its first start date) its last start from Airflow's log (:func:`worker_starts`),
    else its last queueing. None (left out) without a start date."""
    resumed = [tuple(r[:5]) for r in rows if r[5] is not None and r[6] is not None and _utc(r[6]) > _utc(r[5])]
    logged = worker_starts(session, resumed) if resumed else {}
    return {i: worker_begin(r[5], r[6], logged.get(tuple(r[:5]))).timestamp()
            for i, r in enumerate(rows) if r[5] is not None}


def uuid_text(value: object) -> str:
    """A task instance id as ``str(uuid)`` writes it, whatever type the database gave it back."""
    return str(uuid.UUID(str(value)))


def _id_chunks(ti_ids: Iterable[object], size: int = 1000) -> Iterable[list[uuid.UUID]]:
    """These task instance ids as UUIDs, sorted, in lists of at most ``size`` (bounded IN lists)."""
    ids = sorted({uuid.UUID(str(i)) for i in ti_ids})
    return (ids[i:i + size] for i in range(0, len(ids), size))


def expansions(rows: Iterable[tuple[str, str, int, str]]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Run key -> task id -> the map indexes of each expanded mapped task."""
    found: dict[str, dict[str, set[int]]] = {}
    for run_key, task_id, map_index, _ in rows:
        if map_index >= 0:
            found.setdefault(run_key, {}).setdefault(task_id, set()).add(map_index)
    return {k: {t: tuple(sorted(m)) for t, m in v.items()} for k, v in found.items()}


def _same_mapped_group(a: Any, b: Any) -> bool:
    """Whether two tasks sit in one mapped task group (Airflow then runs ``b[k]`` after ``a[k]``)."""
    group = a.get_closest_mapped_task_group()
    return group is not None and group is b.get_closest_mapped_task_group()


def expand_mapped(
    nodes: Sequence[TaskNode], edges: Sequence[tuple[int, int]], expansion: Mapping[str, tuple[int, ...]],
    *, paired: Collection[tuple[int, int]] = (),
) -> tuple[tuple[TaskNode, ...], tuple[tuple[int, int], ...]]:
    """``nodes`` with each expanded mapped task replaced by one node per instance, and ``edges``
    between them (see the module docstring); an edge in ``paired`` (two tasks of one mapped task
    group) joins instance k to instance k only, as Airflow runs them (found by review: every to
    every, 440 edges for a 2-task group of 20 instances between a split and an aggregate where
    Airflow has 60)."""
    if not expansion:
        return tuple(nodes), tuple(edges)
    out: list[TaskNode] = []
    at: list[dict[int, int]] = []  # each task's nodes by map index (-1: not expanded)
    for node in nodes:
        indexes = expansion.get(node.task_id) or (-1,)
        at.append({m: len(out) + i for i, m in enumerate(indexes)})
        out.extend(replace(node, task_id=node_id(node.task_id, m)) for m in indexes)
    new_edges: set[tuple[int, int]] = set()
    for u, v in edges:
        us, vs = list(at[u].values()), list(at[v].values())
        if (u, v) in paired and -1 not in at[u] and -1 not in at[v]:
            new_edges.update((a, at[v][m]) for m, a in at[u].items() if m in at[v])
        elif len(us) * len(vs) <= MAX_CROSS_EDGES or len(us) == 1 or len(vs) == 1:
            new_edges.update((a, b) for a in us for b in vs)
        else:  # two wide mapped tasks: instance k before instance k (as a mapped task group runs)
            longer = max(len(us), len(vs))
            new_edges.update((us[k % len(us)], vs[k % len(vs)]) for k in range(longer))
    return tuple(out), tuple(sorted(new_edges))


def _progress(rows: Iterable[tuple[str, str, int, str]], ages: Mapping[str, float]) -> list[RunProgress]:
    """Each run's finished and running nodes (an expanded mapped task's instances one by one;
    its unexpanded row, map index -1, stands for the task until it expands)."""
    rows = list(rows)
    expanded = {(run_key, task_id) for run_key, task_id, m, _ in rows if m >= 0}
    finished: dict[str, set[str]] = {key: set() for key in ages}
    running: dict[str, set[str]] = {key: set() for key in ages}
    for run_key, task_id, map_index, state in rows:
        if run_key not in finished or (map_index < 0 and (run_key, task_id) in expanded):
            continue
        node = node_id(task_id, map_index)
        if state in FINISHED_STATES:
            finished[run_key].add(node)
        elif state in RUNNING_STATES:
            running[run_key].add(node)
    return [RunProgress(run_key=key, finished=tuple(sorted(finished[key])),
                        running=tuple(sorted(running[key] - finished[key])), age_s=ages[key])
            for key in sorted(finished)]


def _chunks(items: Iterable[_T], size: int = 200) -> list[list[_T]]:
    """``items`` sorted, in lists of at most ``size``: OR lists SQLite can parse (its expression
    depth is 1,000)."""
    ordered = sorted(items)  # type: ignore[type-var]
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]
