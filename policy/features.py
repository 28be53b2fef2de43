"""The featurizer: a :class:`~policy.schema.PlacementRequest` plus its run graphs -> numpy arrays.

numpy only (no torch), so the simulator, the trainer and tests can build and inspect features
without the model. The GNN in :mod:`policy.model` consumes exactly these arrays; the list of
feature names below *is* the feature schema, and :data:`FEATURE_SCHEMA_VERSION` must change when
any of them changes (a checkpoint records it and refuses to load against another version).

Three kinds of input, following Decima (Mao et al., SIGCOMM 2019) for the DAG part:

* **task nodes**, per run, *static*: they depend only on the run's graph, so they (and the GNN's
  embeddings of them) are computed once per ``(run_key, digest)`` and cached. Messages flow from
  children to parents (as in Decima): every descendant of a ready task is still waiting, so what a
  ready task's embedding summarises never changes while it is ready.
* **ready rows**, one per ready task: the run's dynamic state (fraction done, age, lateness proxy).
* **pools** and **(ready task, pool) pairs**: pool load, speed, price; per pair the effective
  speed for the task's kind, the estimated run / wait / finish time and cost relative to the best
  feasible pool, and the hard-constraint mask.

Pairs depend on the tasks already placed in the same batch (they add backlog to a pool), so a
placer decodes ready tasks one at a time in :func:`decode_order` and calls :func:`pair_features`
with the backlog placed so far; training uses the teacher's earlier choices (teacher forcing).

Shapes (``N`` task nodes over all runs of the request, ``E`` dependency edges, ``R`` ready tasks,
``P`` pools, ``U`` runs)::

    RunFeatures.x           [n, F_TASK]   float32   static task features of one run
    RunFeatures.edge_index  [2, e]        int64     (child, parent): message source -> target
    FeatureBatch.ready_node [R]           int64     node index (into the run) of each ready task
    FeatureBatch.ready_run  [R]           int64     which run (0..U-1) each ready task belongs to
    FeatureBatch.ready_x    [R, F_READY]  float32   dynamic per-ready-task features
    FeatureBatch.pool_x     [P, F_POOL]   float32
    FeatureBatch.pair_x     [R, P, F_PAIR] float32  (rows in request order)
    FeatureBatch.mask       [R, P]        bool      True where the pool is up and the task fits
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from policy.errors import SchemaError
from policy.graph import GraphMemo, GraphView, view
from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, RunProgress, TaskNode

FEATURE_SCHEMA_VERSION = 7
#: The first schema whose pair wait counts the boot of a pool with no worker (PairStatic.floor)
BOOT_FLOOR_SCHEMA = 7

#: Task kinds are hashed into this many one-hot buckets (crc32, stable across processes).
KIND_BUCKETS = 8

TASK_FEATURES: tuple[str, ...] = (
    "log_duration",  # log1p(duration_s) / 8
    "log_rank",  # log1p(upward rank) / 8: work on the longest path from here to the end
    "rank_frac",  # rank / critical path of the run
    "tlevel_frac",  # longest path from a source to this task (excluded) / critical path
    "on_critical_path",  # 1 when tlevel + rank == critical path
    "log_parents",
    "log_children",
    "log_cpus",
    "log_memory",
    "gpus",  # min(gpus, 4) / 4
    "log_priority",
    "pinned",
    "log_run_tasks",  # log1p(tasks in the run) / 8
    "log_run_cp",  # log1p(critical path of the run) / 8
) + tuple(f"kind_{i}" for i in range(KIND_BUCKETS))

READY_FEATURES: tuple[str, ...] = (
    "run_done_frac",  # finished tasks / tasks
    "run_running_frac",
    "run_work_left_frac",  # expected work not yet finished / total work
    "log_run_age",  # log1p(age_s) / 8
    "run_age_over_cp",  # age / critical path (clipped at 10): how late the run already is
    "log_run_work_left",  # log1p(expected work not yet finished, seconds) / 8: SRPT's key
    "log_ready_in_run",  # ready tasks of this run in this request
    "log_ready_total",  # ready tasks in the whole request
    "retry",  # try_number > 1
    "run_work_left_ratio",  # log((work left + 1) / (least work left of the request's runs + 1)), <= 3
    "rank_over_remaining_cp",  # upward rank / the longest of the run's ready and running tasks: 1 on its critical path
    "log_held_s",  # log1p(seconds the task has waited for a placement) / 8 (ReadyTask.held_s)
    "held_over_duration",  # log1p(held_s / its expected duration), clipped at 3: held long for its size
)

POOL_FEATURES: tuple[str, ...] = (
    "log_speed",
    "log_price",  # log1p(price_per_hour)
    "log_slots",
    "free_frac",  # free slots / slots
    "busy_frac",
    "queued_per_slot",  # clipped at 10
    "up",
    "failure_rate",
    "log_cpus",
    "log_memory",
    "has_gpu",
    "zero_slots",  # an elastic pool scaled to zero workers
)

PAIR_FEATURES: tuple[str, ...] = (
    "log_eff_speed",  # log(speed_for(kind))
    "log_affinity",  # log(affinity of the kind on this VM class)
    "log_run_s",  # log1p(duration / effective speed) / 8
    "log_wait_s",  # log1p(estimated queueing wait) / 8
    "log_finish_s",  # log1p(wait + run) / 8
    "finish_ratio",  # log(finish / best feasible finish), clipped at 3
    "run_ratio",  # log(run / best feasible run), clipped at 3
    "log_cost",  # log1p(run_s * price / 3600 * 100) / 4: cents for this task
    "cost_ratio",  # log((cost + eps) / (cheapest feasible + eps)), clipped at 3
    "has_free_slot",  # after the tasks already placed in this batch
    "backlog_per_slot",  # (busy + queued + placed) / slots, clipped at 10
    "pinned_here",
    "feasible",
)

F_TASK = len(TASK_FEATURES)
F_READY = len(READY_FEATURES)

#: The schemas a checkpoint may have been trained on -> how many of :data:`READY_FEATURES` it
#: reads. Versions since 3 only append ready columns, so a model of an older version reads the
#: first columns of ``ready_x`` and is otherwise unchanged (:class:`policy.model.PlacementGNN`):
#: a checkpoint keeps loading after the code gains a feature.
READY_COLUMNS: dict[int, int] = {3: 9, 4: 10, 5: 11, 6: F_READY, FEATURE_SCHEMA_VERSION: F_READY}
F_POOL = len(POOL_FEATURES)
F_PAIR = len(PAIR_FEATURES)

_LOG = 8.0



#: the largest CPU / memory ask and priority the task features tell apart (Airflow's int32 range;
#: no task asks more, and the lab's priorities are 20 + 10 x depth)
ASK_CAP = float(2**31 - 1)

def kind_bucket(kind: str) -> int:
    """The one-hot bucket of a task kind (stable: crc32, not Python's salted ``hash``)."""
    return zlib.crc32(kind.encode()) % KIND_BUCKETS


@dataclass(frozen=True)
class RunFeatures:
    """Static features of one run's task graph (see the module docstring for shapes)."""

    run_key: str
    digest: str
    x: np.ndarray
    edge_index: np.ndarray
    view: GraphView
    #: expected work of the whole run and its critical path, seconds at speed 1.0
    total_work_s: float = 0.0
    critical_path_s: float = 0.0

    @property
    def num_nodes(self) -> int:
        return int(self.x.shape[0])


def _run_features(graph: RunGraph) -> RunFeatures:
    g = view(graph)
    n = len(graph.tasks)
    x = np.zeros((n, F_TASK), dtype=np.float32)
    rank = np.asarray(g.rank, dtype=np.float64)
    dur = np.array([t.duration_s for t in graph.tasks], dtype=np.float64)
    tlevel = np.zeros(n, dtype=np.float64)
    for i in g.order:
        for c in g.children[i]:
            tlevel[c] = max(tlevel[c], tlevel[i] + dur[i])
    cp = max(g.critical_path_s, 1e-9)
    x[:, 0] = np.log1p(dur) / _LOG
    x[:, 1] = np.log1p(rank) / _LOG
    x[:, 2] = rank / cp
    x[:, 3] = tlevel / cp
    x[:, 4] = (np.abs(tlevel + rank - cp) <= 1e-6 * cp + 1e-9).astype(np.float32)
    x[:, 5] = np.log1p([len(p) for p in g.parents])
    x[:, 6] = np.log1p([len(c) for c in g.children])
    # asks and priorities past ASK_CAP read as ASK_CAP (found by review: a priority of 1e300 made
    # a log feature of 690, and two identical tasks' scores differ past TIE_TOLERANCE in float32)
    x[:, 7] = np.log1p(np.minimum([t.cpus for t in graph.tasks], ASK_CAP))
    x[:, 8] = np.log1p(np.minimum([t.memory_gb for t in graph.tasks], ASK_CAP)) / 2
    x[:, 9] = np.minimum([t.gpus for t in graph.tasks], 4.0) / 4.0
    x[:, 10] = np.log1p(np.minimum([t.priority for t in graph.tasks], ASK_CAP))
    x[:, 11] = [t.pool is not None for t in graph.tasks]
    x[:, 12] = math.log1p(n) / _LOG
    x[:, 13] = math.log1p(cp) / _LOG
    base = F_TASK - KIND_BUCKETS
    for i, t in enumerate(graph.tasks):
        x[i, base + kind_bucket(t.kind)] = 1.0
    if graph.edges:
        e = np.asarray(graph.edges, dtype=np.int64).T  # [2, E] (parent, child)
        edge_index = np.ascontiguousarray(e[::-1])  # (child, parent): messages flow upwards
    else:
        edge_index = np.zeros((2, 0), dtype=np.int64)
    return RunFeatures(graph.run_key, graph.digest, x, edge_index, g, float(dur.sum()), cp)


#: The :class:`RunFeatures` of a graph, cached by ``(run_key, digest)`` (LRU).
run_features: GraphMemo[RunFeatures] = GraphMemo(_run_features, 1024)


def pool_features(pools: Sequence[PoolState]) -> np.ndarray:
    """``[P, F_POOL]`` features of the pools, in request order."""
    x = np.zeros((len(pools), F_POOL), dtype=np.float32)
    for j, p in enumerate(pools):
        slots = max(p.slots, 1)
        x[j] = (
            math.log(max(p.speed, 1e-3)),
            math.log1p(p.price_per_hour),
            math.log1p(p.slots) / 4,
            p.free_slots / slots,
            min(p.busy / slots, 10.0),
            min(p.queued / slots, 10.0),
            float(p.up),
            p.failure_rate,
            math.log1p(p.cpus) / 4,
            math.log1p(p.memory_gb) / 6,
            float(p.gpus > 0),
            float(p.slots == 0),
        )
    return x


@dataclass(frozen=True)
class PairStatic:
    """The parts of the pair features that do not depend on the batch's earlier choices.

    Arrays are ``[R, P]`` (one row per ready task given) except ``slots``/``base_backlog`` ``[P]``.
    """

    speed: np.ndarray
    affinity: np.ndarray
    run_s: np.ndarray
    cost: np.ndarray
    mask: np.ndarray
    pinned: np.ndarray
    slots: np.ndarray
    base_backlog: np.ndarray
    best_run: np.ndarray  # [R]
    best_cost: np.ndarray  # [R]
    ref: np.ndarray  # [R, P] pools the ratios compare against (feasible, or all if none is)
    #: schema 3, per pool: expected seconds until each busy / queued task ends (ascending, from
    #: ``PoolState.free_at``), the most slots it may grow to, its boot delay, its queued count
    free_in: tuple[np.ndarray, ...] = ()
    max_slots: np.ndarray | None = None
    boot_s: np.ndarray | None = None
    queued: np.ndarray | None = None
    #: ``free_in`` as one array ``[P, K]`` (each row padded with its last value, 0 if empty)
    #: and the count of each row ``[P]``
    free_pad: np.ndarray | None = None
    free_n: np.ndarray | None = None
    #: ``[R, P]`` the pairs :func:`gate_premium` took out of ``mask`` (None: no gate)
    gated: np.ndarray | None = None
    #: ``[P]`` seconds before which no task starts on each pool, the least :func:`wait_terms`
    #: gives a busy one (None: none): schema 7's boot delay of a pool with no slot (scaled to zero
    #: workers, nothing runs there before one boots; older schemas read it as one busy slot)
    floor: np.ndarray | None = None

    @property
    def top(self) -> np.ndarray:
        """``[P]`` the most slots each pool may have (``max_slots``; its slots if not given)."""
        return self.max_slots if self.max_slots is not None else self.slots


def pad_free_in(free_in: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``([P, K] padded, [P] counts)`` of per-pool ascending finish times (see PairStatic)."""
    n = np.array([len(f) for f in free_in], dtype=np.int64)
    pad = np.zeros((len(free_in), max(int(n.max()) if len(n) else 0, 1)), dtype=np.float64)
    for j, f in enumerate(free_in):
        if len(f):
            pad[j, : len(f)] = f
            pad[j, len(f):] = f[-1]
    return pad, n


def wait_terms(ps: PairStatic, backlog: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                            np.ndarray]:
    """:func:`wait_terms_reference` for ``backlog [..., P]`` at once (the same float64 values)."""
    s = ps.slots
    b = np.asarray(backlog, dtype=np.float64)
    now_free = b < s
    top = ps.top
    queued = ps.queued if ps.queued is not None else np.zeros_like(s)
    grow = ~now_free & (top > s) & (queued + (b - ps.base_backlog) < top - s)
    free = now_free | grow
    boot = ps.boot_s if ps.boot_s is not None else np.zeros_like(s)
    cap = np.where(grow, boot, np.inf)
    k = np.maximum(b - s, 0.0).astype(np.int64)
    if ps.free_pad is None or ps.free_n is None:
        pad, n = pad_free_in(ps.free_in or tuple(np.zeros(0) for _ in range(len(s))))
    else:
        pad, n = ps.free_pad, ps.free_n
    kk = np.minimum(k, pad.shape[1] - 1)
    alpha = pad[np.arange(pad.shape[0]), kk]  # alpha[..., j] = pad[j, kk[..., j]]
    beta = np.where(k >= n, (k - n + 1) / np.maximum(s, 1.0), 0.0)
    if ps.floor is not None:  # schema 7: a pool with no worker starts nothing before a boot (0: none)
        alpha = np.maximum(alpha, ps.floor)
    alpha = np.where(now_free, 0.0, alpha)
    beta = np.where(now_free, 0.0, beta)
    return now_free, free, alpha, beta, cap


def wait_terms_reference(
    ps: PairStatic, backlog: Sequence[float]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per pool, given ``backlog[j]`` (busy + queued + placed in this batch): ``(now_free,
    free, alpha, beta, cap)``: a new task waits 0 if ``now_free`` (a slot is free), else
    ``min(alpha + beta * its run time, cap)``: ``alpha`` is when the slot it queues for frees
    (the ledger's ``free_at``, from the pool's expected finish times), extrapolated by ``beta``
    run times per slot beyond what the pool reported, and at least ``ps.floor`` (schema 7: the
    boot delay of a pool with no slot, where no task starts before a worker boots); ``cap`` the boot
    delay when the pool can still grow (inf otherwise). ``free``: starts without waiting for a running task (a free slot
    or room to grow), the has-free-slot column."""
    p = len(backlog)
    now_free = np.zeros(p, dtype=bool)
    free = np.zeros(p, dtype=bool)
    alpha = np.zeros(p, dtype=np.float64)
    beta = np.zeros(p, dtype=np.float64)
    cap = np.full(p, np.inf, dtype=np.float64)
    for j in range(p):
        b, s = float(backlog[j]), float(ps.slots[j])
        if b < s:
            now_free[j] = free[j] = True
            continue
        top = float(ps.max_slots[j]) if ps.max_slots is not None else s
        extra = b - float(ps.base_backlog[j])
        queued = float(ps.queued[j]) if ps.queued is not None else 0.0
        if top > s and queued + extra < top - s:
            free[j] = True
            cap[j] = float(ps.boot_s[j]) if ps.boot_s is not None else 0.0
        k = int(b - s)
        f = ps.free_in[j] if ps.free_in else np.zeros(0)
        if k < len(f):
            alpha[j] = f[k]
        else:
            alpha[j] = float(f[-1]) if len(f) else 0.0
            beta[j] = (k - len(f) + 1) / max(s, 1.0)
        if ps.floor is not None:
            alpha[j] = max(alpha[j], float(ps.floor[j]))
    return now_free, free, alpha, beta, cap


def pair_static(tasks: Sequence[TaskNode], pools: Sequence[PoolState], now: float = 0.0,
                boot_floor: bool = True) -> PairStatic:
    """Precompute the choice-independent pair quantities of ``tasks`` x ``pools`` (``now``: the
    request's clock, for the pools' ``free_at``; ``boot_floor``: a pool with no slot waits at
    least its boot, :attr:`PairStatic.floor`, schema 7 on)."""
    r, n = len(tasks), len(pools)
    base_speed = np.array([p.speed for p in pools], dtype=np.float64)
    # Ready tasks share a handful of kinds and resource shapes: each distinct one is looked up
    # against the pools once (a 1,000-task run can have hundreds of ready tasks per request).
    kinds: dict[str, int] = {}
    shapes: dict[tuple[str | None, float, float, float], int] = {}
    kind_of = np.empty(r, dtype=np.int64)
    shape_of = np.empty(r, dtype=np.int64)
    shape_task: list[TaskNode] = []
    for i, t in enumerate(tasks):
        kind_of[i] = kinds.setdefault(t.kind, len(kinds))
        key = (t.pool, t.cpus, t.memory_gb, t.gpus)
        k = shapes.get(key)
        if k is None:
            k = shapes[key] = len(shape_task)
            shape_task.append(t)
        shape_of[i] = k
    kind_aff = np.array([[p.affinity.get(kind, 1.0) for p in pools] for kind in kinds], dtype=np.float64)
    affinity = kind_aff.reshape(len(kinds), n)[kind_of]
    speed = base_speed[None, :] * affinity
    dur = np.array([t.duration_s for t in tasks], dtype=np.float64)
    run_s = dur[:, None] / np.maximum(speed, 1e-3)
    price = np.array([p.price_per_hour for p in pools], dtype=np.float64)
    cost = run_s * price[None, :] / 3600.0
    shape_fit = np.array([[p.fits(t) for p in pools] for t in shape_task], dtype=bool).reshape(len(shape_task), n)
    shape_mask = shape_fit & np.array([p.up for p in pools], dtype=bool)[None, :]
    # a task whose every usable pool is down may use those (it queues and waits: placement.feasible)
    shape_mask |= shape_fit & ~shape_mask.any(axis=1, keepdims=True)
    shape_pin = np.array([[t.pool == p.name for p in pools] for t in shape_task], dtype=bool)
    mask = shape_mask[shape_of]
    pinned = shape_pin.reshape(len(shape_task), n)[shape_of]
    ref = mask | ~mask.any(axis=1, keepdims=True)
    big = np.where(ref, run_s, np.inf)
    best_run = np.maximum(big.min(axis=1) if n else np.ones(r), 1e-6)
    best_cost = np.where(ref, cost, np.inf).min(axis=1) if n else np.zeros(r)
    free_in = tuple(np.maximum(np.sort(np.asarray(p.free_at, dtype=np.float64)) - now, 0.0) for p in pools)
    free_pad, free_n = pad_free_in(free_in)
    return PairStatic(
        speed=speed,
        affinity=affinity,
        run_s=run_s,
        cost=cost,
        mask=mask,
        pinned=pinned,
        slots=np.array([p.slots for p in pools], dtype=np.float64),
        base_backlog=np.array([p.busy + p.queued for p in pools], dtype=np.float64),
        best_run=best_run,
        best_cost=best_cost,
        ref=ref,
        free_in=free_in,
        free_pad=free_pad,
        free_n=free_n,
        max_slots=np.array([p.max_slots if p.max_slots is not None else p.slots for p in pools], dtype=np.float64),
        boot_s=np.array([p.boot_s for p in pools], dtype=np.float64),
        queued=np.array([p.queued for p in pools], dtype=np.float64),
        floor=np.array([p.boot_s if p.slots == 0 else 0.0 for p in pools], dtype=np.float64) if boot_floor else None,
    )


#: pair feature columns that depend on the tasks already placed in the batch (see pair_dynamic)
DYNAMIC_PAIR_COLUMNS = (3, 4, 5, 9, 10)


def pair_dynamic(ps: PairStatic, rows: np.ndarray, placed: np.ndarray) -> np.ndarray:
    """``[r, P, 5]``: the :data:`DYNAMIC_PAIR_COLUMNS` of :func:`pair_rows` (wait, finish, finish
    ratio, free slot, backlog) given ``placed[j]`` tasks already sent to pool ``j`` in this batch.

    Schema 3: the wait is the ledger's (:func:`wait_terms`): when the slot the task would queue
    for frees, from the pools' expected finish times, or a boot when the pool can grow.
    """
    backlog = ps.base_backlog + placed
    return _pair_dynamic(ps, rows, backlog, wait_terms(ps, backlog))


def _pair_dynamic(ps: PairStatic, rows: np.ndarray, backlog: np.ndarray,
                  terms: tuple[np.ndarray, ...]) -> np.ndarray:
    """:func:`pair_dynamic` given the pools' ``backlog`` and its :func:`wait_terms`."""
    run_s = ps.run_s[rows]  # [r, P]
    wait_s = _wait_s(run_s, terms)
    finish = wait_s + run_s
    d = _dynamic_columns(wait_s, finish, terms[1], _load(ps, backlog))
    d[..., 2] = _finish_ratio(ps.ref[rows], finish)
    return d


def _wait_s(run_s: np.ndarray, terms: tuple[np.ndarray, ...]) -> np.ndarray:
    """A task's wait on each pool from its run times and the pools' :func:`wait_terms`
    (broadcast: ``[r, P]`` with terms ``[P]``, or ``[B, r, P]`` with terms ``[B, 1, P]``)."""
    now_free, _, alpha, beta, cap = terms
    return np.where(now_free, 0.0, np.minimum(alpha + beta * run_s, cap))


def _load(ps: PairStatic, backlog: np.ndarray) -> np.ndarray:
    """The backlog column: tasks per slot, at most 10."""
    return np.minimum(backlog / np.maximum(ps.slots, 1.0), 10.0)


def _finish_ratio(ref: np.ndarray, finish: np.ndarray) -> np.ndarray:
    """Column 2: the log of each finish over the row's earliest on a reference pool, at most 3."""
    best_finish = np.maximum(np.where(ref, finish, np.inf).min(axis=-1, keepdims=True), 1e-6)
    return np.minimum(np.log(np.maximum(finish, 1e-6) / best_finish), 3.0)


def _dynamic_columns(wait_s: np.ndarray, finish: np.ndarray, free: np.ndarray, load: np.ndarray) -> np.ndarray:
    """``[..., P, 5]`` from wait and finish times ``[..., P]`` and the pools' free slot and backlog
    per slot (broadcast against them), all but column 2 (the finish ratio, set by the caller)."""
    d = np.empty((*wait_s.shape, len(DYNAMIC_PAIR_COLUMNS)), dtype=np.float32)
    d[..., 0] = np.log1p(wait_s) / _LOG
    d[..., 1] = np.log1p(finish) / _LOG
    d[..., 3] = free
    d[..., 4] = load
    return d


#: :class:`PairDynamics` tabulates every backlog a decode can reach when the table has at most
#: this many (backlog, row, pool) cells (4 MiB of float32 columns); larger requests go step by step
TABLE_CELLS = 1 << 18


class PairDynamics:
    """:func:`pair_dynamic` for a request decoded one placement at a time (the placer's steps):
    ``dynamics(rows)`` equals ``pair_dynamic(ps, rows, placed)`` for the tasks placed so far.

    Given ``steps``, the most placements that will follow, the columns of every row for every
    backlog a pool can reach (``base + 0 .. steps``) are computed once, in a few array calls;
    the current columns of every row are kept, and a placement on pool ``j`` copies in column
    ``j`` at its new backlog and retakes the finish ratios (the one column that depends on the
    other pools). What the ~50 small array calls of :func:`pair_dynamic` per step cost is what a
    one-request decode spends most of its time on. The values are the same, bit for bit (the
    same float operations on the same numbers).
    """

    def __init__(self, ps: PairStatic, steps: int | None = None) -> None:
        self.ps = ps
        self.placed = np.zeros(len(ps.slots), dtype=np.float64)
        self.backlog = ps.base_backlog.astype(np.float64)  # base_backlog + placed
        self._terms: tuple[np.ndarray, ...] | None = None  # wait_terms of the current backlog
        self._table: np.ndarray | None = None
        if steps is not None and 0 < (steps + 1) * ps.run_s.size <= TABLE_CELLS:
            backlogs = ps.base_backlog + np.arange(steps + 1, dtype=np.float64)[:, None]  # [S+1, P]
            terms = wait_terms(ps, backlogs)
            wait_s = _wait_s(ps.run_s, tuple(t[:, None, :] for t in terms))  # [S+1, n, P]
            self._free_table = terms[1]  # [S+1, P]
            self._finish = wait_s + ps.run_s  # [S+1, n, P]
            self._table = _dynamic_columns(wait_s, self._finish, terms[1][:, None, :], _load(ps, backlogs)[:, None, :])
            # the current backlog's: free slots [P], finish times [n, P] and columns [n, P, 5]
            self._free, self._fin, self._cur = self._free_table[0].copy(), self._finish[0].copy(), self._table[0].copy()
            self._cur[..., 2] = _finish_ratio(ps.ref, self._fin)

    def table(self) -> tuple[np.ndarray, ...] | None:
        """``(columns [T, n, P, 5], finish [T, n, P], free [T, P], and the current columns
        [n, P, 5], finish [n, P], free [P])`` when tabulated (else None): what
        :mod:`policy.step_kernel` steps on (the current ones are copies it may update)."""
        if self._table is None:
            return None
        return (self._table, self._finish, self._free_table, self._cur.copy(), self._fin.copy(), self._free.copy())

    def _wait_terms(self) -> tuple[np.ndarray, ...]:
        if self._terms is None:  # once per step: the step's features and its stop guard share them
            self._terms = wait_terms(self.ps, self.backlog)
        return self._terms

    @property
    def free(self) -> np.ndarray:
        if self._table is not None:
            return self._free.copy()
        return self._wait_terms()[1]

    def place(self, pool: int) -> None:
        """One more task sent to ``pool``."""
        self.placed[pool] += 1.0
        self.backlog = self.ps.base_backlog + self.placed
        self._terms = None
        if self._table is not None:
            at = int(self.placed[pool])  # the table's first index: tasks placed on the pool
            self._free[pool] = self._free_table[at, pool]
            self._fin[:, pool] = self._finish[at, :, pool]
            self._cur[:, pool] = self._table[at, :, pool]
            self._cur[..., 2] = _finish_ratio(self.ps.ref, self._fin)

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        """``[r, P, 5]``: :func:`pair_dynamic` of ``rows``."""
        if self._table is None:
            return _pair_dynamic(self.ps, rows, self.backlog, self._wait_terms())
        return self._cur[rows]


def pair_rows(ps: PairStatic, rows: np.ndarray, placed: np.ndarray,
              dynamic: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``([r, P, F_PAIR] features, [r, P] mask)`` of ``rows`` given ``placed[j]`` tasks already
    sent to pool ``j`` in this batch (the dynamic columns come from :func:`pair_dynamic`, or are
    ``dynamic`` when the caller has them, e.g. from :class:`PairDynamics`)."""
    run_s = ps.run_s[rows]  # [r, P]
    cost = ps.cost[rows]
    x = np.empty((*run_s.shape, F_PAIR), dtype=np.float32)
    x[..., 0] = np.log(np.maximum(ps.speed[rows], 1e-3))
    x[..., 1] = np.log(ps.affinity[rows])
    x[..., 2] = np.log1p(run_s) / _LOG
    x[..., 6] = np.minimum(np.log(np.maximum(run_s, 1e-6) / ps.best_run[rows, None]), 3.0)
    x[..., 7] = np.log1p(cost * 100.0) / 4
    x[..., 8] = np.minimum(np.log((cost + 1e-4) / (ps.best_cost[rows, None] + 1e-4)), 3.0)
    x[..., 11] = ps.pinned[rows]
    x[..., 12] = ps.mask[rows]
    x[..., DYNAMIC_PAIR_COLUMNS] = pair_dynamic(ps, rows, placed) if dynamic is None else dynamic
    return x, ps.mask[rows]


def pair_row(ps: PairStatic, i: int, placed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``([P, F_PAIR], [P])``: :func:`pair_rows` for the single row ``i``."""
    x, m = pair_rows(ps, np.array([i]), placed)
    return x[0], m[0]


def pair_features(
    task: TaskNode, pools: Sequence[PoolState], placed: np.ndarray | Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``([P, F_PAIR] features, [P] mask)`` of one ready task against every pool (see
    :func:`pair_row`)."""
    return pair_row(pair_static([task], pools), 0, np.asarray(placed, dtype=np.float64))


@dataclass
class FeatureBatch:
    """Everything the model needs for one request (shapes in the module docstring)."""

    runs: list[RunFeatures]
    ready: tuple[ReadyTask, ...]
    tasks: list[TaskNode]
    pools: tuple[PoolState, ...]
    ready_node: np.ndarray
    ready_run: np.ndarray
    ready_x: np.ndarray
    pool_x: np.ndarray
    pair_x: np.ndarray
    mask: np.ndarray
    order: np.ndarray
    pairs: PairStatic

    @property
    def num_ready(self) -> int:
        return len(self.ready)

    @property
    def num_pools(self) -> int:
        return len(self.pools)


def decode_order(request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> np.ndarray:
    """``[R]`` ready rows in decode order: longest remaining critical path first, then priority.

    The same order as :func:`policy.placement.ordered_ready`, so imitation targets line up.
    The plain definition: :func:`featurize` sorts by the same keys from its arrays (tested equal).
    """
    keys = []
    for i, ready in enumerate(request.ready):
        g = view(graphs[ready.run_key])
        j = g.index[ready.task_id]
        keys.append((-g.rank[j], -g.graph.tasks[j].priority, i))
    keys.sort()
    return np.array([k[2] for k in keys], dtype=np.int64)


def featurize(
    request: PlacementRequest,
    graphs: Mapping[str, RunGraph],
    assigned: Sequence[int] | None = None,
    *,
    pairs: bool = True,
    cp_gate: float = 0.0,
    cp_gate_scope: str = "off-cp",
    boot_floor: bool = True,
) -> FeatureBatch:
    """Build the :class:`FeatureBatch` of ``request``.

    ``assigned`` (optional, one pool index per ready row in request order, -1 for a row held) are choices already
    made for the batch, e.g. a teacher's: the pair features of each row then count the backlog of
    the rows decoded before it. Without it every row sees the pools as the request reports them.
    ``pairs=False`` leaves ``pair_x``/``mask`` zero for a caller that fills them while decoding
    (:class:`policy.gnn.GNNPlacer`). ``cp_gate`` (0 = off): :func:`gate_premium`'s hard
    constraint, premium pools only for the tasks on their run's remaining critical path
    (``cp_gate_scope="all"``: for no task, :data:`CP_GATE_SCOPES`). ``boot_floor``: schema 7's
    wait on a pool with no worker (:attr:`PairStatic.floor`); a placer of an older checkpoint
    turns it off, as that model was trained.
    """
    if assigned is not None and len(assigned) != len(request.ready):
        raise SchemaError(f"assigned: {len(assigned)} choices for {len(request.ready)} ready tasks")
    progress: dict[str, RunProgress] = {p.run_key: p for p in request.progress}
    run_pos: dict[str, int] = {}
    runs: list[RunFeatures] = []
    ready_node = np.zeros(len(request.ready), dtype=np.int64)
    ready_run = np.zeros(len(request.ready), dtype=np.int64)
    tasks: list[TaskNode] = []
    ranks: list[float] = []
    for i, ready in enumerate(request.ready):
        graph = graphs.get(ready.run_key)
        if graph is None:
            raise SchemaError(f"ready task {ready.task_id!r}: no graph for run {ready.run_key!r}")
        if ready.run_key not in run_pos:
            run_pos[ready.run_key] = len(runs)
            runs.append(run_features(graph))
        rf = runs[run_pos[ready.run_key]]
        j = rf.view.index.get(ready.task_id)
        if j is None:
            raise SchemaError(f"ready task {ready.task_id!r} is not in run {ready.run_key!r}")
        ready_node[i] = j
        ready_run[i] = run_pos[ready.run_key]
        tasks.append(graph.tasks[j])
        ranks.append(rf.view.rank[j])

    ready_per_run = np.bincount(ready_run, minlength=len(runs)) if len(request.ready) else np.zeros(0)
    run_dyn = np.zeros((len(runs), 6), dtype=np.float32)
    left = np.zeros(len(runs), dtype=np.float64)  # expected seconds of work left per run
    remaining_cp = np.zeros(len(runs), dtype=np.float64)  # longest upward rank of a running task
    for u, rf in enumerate(runs):
        g = rf.view
        n = max(len(g.graph.tasks), 1)
        prog = progress.get(rf.run_key, RunProgress(rf.run_key))
        # each task once, in the order sent (found by review: a repeated id counted twice, a
        # done fraction of 5/3 and work left below 0)
        done = list(dict.fromkeys(g.index[t] for t in prog.finished if t in g.index))
        running = list(dict.fromkeys(t for t in prog.running if t in g.index))
        work = max(rf.total_work_s, 1e-9)
        done_work = sum(g.graph.tasks[k].duration_s for k in done)
        cp = max(rf.critical_path_s, 1e-9)
        left[u] = max(work - done_work, 0.0)
        remaining_cp[u] = max((g.rank[g.index[t]] for t in running), default=0.0)
        run_dyn[u] = (
            len(done) / n,
            len(running) / n,
            1.0 - done_work / work,
            math.log1p(prog.age_s) / _LOG,
            min(prog.age_s / cp, 10.0),
            math.log1p(left[u]) / _LOG,
        )
    # decode_order's keys, from the arrays at hand: longest remaining critical path, then priority
    up = np.array(ranks, dtype=np.float64)  # [R] upward rank of each ready task
    prio = np.array([t.priority for t in tasks], dtype=np.float64)
    order = np.lexsort((np.arange(len(tasks)), -prio, -up)).astype(np.int64)
    ready_x = np.zeros((len(request.ready), F_READY), dtype=np.float32)
    if len(request.ready):
        ready_x[:, :6] = run_dyn[ready_run]
        ready_x[:, 6] = np.log1p(ready_per_run[ready_run])
        ready_x[:, 7] = math.log1p(len(request.ready))
        ready_x[:, 8] = [r.try_number > 1 for r in request.ready]
        # SRPT's key relative to the request's other runs: 0 for the run with the least work left,
        # on any time scale (the absolute log_run_work_left of 15 s jobs is far from training's)
        ready_x[:, 9] = np.minimum(np.log((left + 1.0) / (left.min() + 1.0)), 3.0)[ready_run]
        # what is left of the run's critical path: the longest upward rank among its ready tasks
        # here and its running ones (rcp's job key); a task at 1 is on it (cost-cp's test)
        np.maximum.at(remaining_cp, ready_run, up)
        rem = remaining_cp[ready_run]
        ready_x[:, 10] = np.where(rem > 0, up / np.where(rem > 0, rem, 1.0), 1.0)
        # how long each task has been held for a better pool (the executor bounds it at max_wait_s)
        held = np.array([r.held_s for r in request.ready], dtype=np.float64)
        if held.any():
            dur = np.array([max(t.duration_s, 1e-3) for t in tasks], dtype=np.float64)
            ready_x[:, 11] = np.log1p(held) / _LOG
            ready_x[:, 12] = np.minimum(np.log1p(held / dur), 3.0)

    pools = request.pools
    pair_x = np.zeros((len(request.ready), len(pools), F_PAIR), dtype=np.float32)
    mask = np.zeros((len(request.ready), len(pools)), dtype=bool)
    placed = np.zeros(len(pools), dtype=np.float64)
    ps = pair_static(tasks, pools, request.created_at, boot_floor)
    if cp_gate and len(request.ready):
        every = check_gate_scope(cp_gate_scope) == "all"
        ps = gate_premium(ps, np.ones(len(up), dtype=bool) if every else up < rem, cp_gate)
    for i in order if pairs else ():
        pair_x[i], mask[i] = pair_row(ps, int(i), placed)
        if assigned is not None and assigned[i] >= 0:  # -1: held, nothing sent (found by review:
            placed[assigned[i]] += 1                    # counted on the last pool)
    return FeatureBatch(
        runs=runs,
        ready=request.ready,
        tasks=tasks,
        pools=pools,
        ready_node=ready_node,
        ready_run=ready_run,
        ready_x=ready_x,
        pool_x=pool_features(pools),
        pair_x=pair_x,
        mask=mask,
        order=order,
        pairs=ps,
    )


#: "Stop" is refused while some remaining task has a feasible pool with a free slot whose
#: estimated finish is within this factor of the task's earliest (:func:`pool_free_within`).
#: ``inf`` (the default) makes the policy work-conserving: it holds a task only when no feasible
#: pool can start it now. ``1`` is the rule through commit 8d49468 (refused only while a task's
#: best pool is free), which let some trained models hold tasks on idle capacity until the
#: executor's ``max_wait_s`` (docs/policy.md, "A work-conserving stop").
HOLD_RATIO = math.inf


#: Late binding for a pair chosen on a pool with no free slot (and no room to grow): the task
#: holds that pool's next slot for the rest of the batch (later choices see the backlog) but is
#: not sent; it stays ready and is offered again, as ``srpt+eft`` reserves its ledger's slot.
RESERVE_BUSY = False


#: Premium pools in the decoder's guards (a cost-weighted checkpoint's ``premium_ratio``; 0 =
#: off): a pool whose cost for a task is more than this factor x the task's cheapest feasible
#: pool's (price per unit of its work, as ``cost-cp`` reads it) does not count as a free pool in
#: the work-conserving stop (:func:`pool_free_within`) or the late-binding rule
#: (:func:`late_blocked`). The policy may still choose it; it is no longer made to when it is the
#: only free slot, so "hold this task for a cheaper slot" becomes a legal step.
PREMIUM_RATIO = 0.0


def check_premium_ratio(ratio: float, name: str = "premium_ratio") -> float:
    """``ratio`` if it is a valid premium ratio (0 = off, or >= 1), else ``ValueError`` naming
    the setting ``name``."""
    if not (ratio == 0.0 or ratio >= 1.0) or math.isinf(ratio):
        raise ValueError(f"{name} must be 0 (off) or a finite ratio >= 1, got {ratio!r}")
    return float(ratio)


def guard_fit(ps: PairStatic, rows: np.ndarray, fit: np.ndarray, ratio: float) -> np.ndarray:
    """``fit [r, P]`` (the feasible pairs of ``rows``) less the premium ones (:data:`PREMIUM_RATIO`):
    the pools the decoder's guards count. ``fit`` itself when ``ratio`` is 0."""
    if not ratio:
        return fit
    return fit & ~(ps.cost[rows] > ratio * ps.best_cost[rows, None])


#: Premium pools only for critical-path tasks, as a hard constraint after the policy (0 = off;
#: ``drl-policy serve --cp-gate``, ``GNNPlacer(cp_gate=)``): a ready task off its run's remaining
#: critical path (its upward rank below the longest among the run's ready and running tasks)
#: may not take a pool whose cost per unit of its work is more than this factor x its cheapest
#: feasible pool's. ``cost-cp``'s rule (``trainer.baselines.rules.CriticalPathCost``) as a mask:
#: the policy still orders the tasks and picks among the pools left (docs/policy.md).
CP_GATE = 0.0
#: Which tasks the premium gate applies to: ``off-cp`` (the default, ``cost-cp``'s rule: those
#: off their run's remaining critical path) or ``all`` (every task: no task takes a premium pool,
#: so none boots a premium worker or keeps an idle one billed; ``drl-policy serve
#: --cp-gate-scope``). On the held-out families the policy's critical-path tasks kept the GPU
#: pool's workers alive for most of the stream (docs/policy.md, "The gate for every task").
CP_GATE_SCOPES = ("off-cp", "all")
#: the default scope, and every checkpoint's that predates the option
CP_GATE_SCOPE = "off-cp"


def check_gate_scope(scope: str) -> str:
    """``scope`` if it is one of :data:`CP_GATE_SCOPES`, else ``ValueError``."""
    if scope not in CP_GATE_SCOPES:
        raise ValueError(f"cp_gate_scope must be one of {CP_GATE_SCOPES}, got {scope!r}")
    return scope


def gate_premium(ps: PairStatic, off_cp: np.ndarray, ratio: float) -> PairStatic:
    """``ps`` with the premium pools (cost per unit of work more than ``ratio`` x the row's
    cheapest feasible pool's) masked for the rows ``off_cp [R]`` (:data:`CP_GATE`). A row keeps
    its cheapest feasible pool, so no feasible row is left without one."""
    premium = ps.cost > check_premium_ratio(ratio, "cp_gate") * ps.best_cost[:, None]
    gated = ps.mask & off_cp[:, None] & premium
    return replace(ps, mask=ps.mask & ~gated, gated=gated)


def reserves(free: Any, top: Any) -> Any:
    """Whether a task chosen for a pool is reserved rather than sent, from the pool's free-slot
    flag at that step (:func:`wait_terms`' ``free``: a free slot or room to grow) and ``top``, the
    most slots it may have (its slots if fixed): no free slot, but the pool can hold a task at
    some point (an elastic pool scaled to zero that has used its room to grow waits for its boot
    like any busy pool; one that can never have a slot gets the task). numpy or torch,
    elementwise (the one-request and batched decoders share it)."""
    return ~free & (top > 0)


def _min_last(x: np.ndarray) -> np.ndarray:
    return x.min(axis=-1, keepdims=True)


def late_blocked(d: Any, fit: Any, where: Callable[..., Any] = np.where,
                 min_last: Callable[[Any], Any] = _min_last) -> Any:
    """``[..., R, P]`` the pairs a late-binding decoder (``reserve_busy``) may not choose: a pool
    with no free slot (dynamic column 3) whose estimated finish (column 2, the log of its factor
    over the row's earliest) is not earlier than that of every free feasible (``fit``) pool of
    the row. A reservation waits for a slot, so it is only worth it when it beats every pool the
    task could start on now, the only busy pool ``srpt+eft`` reserves (its earliest finish).
    Rows with no free feasible pool keep every pool. numpy by default; the batched decoder
    passes its array dialect's ``where`` and kept-dimension minimum over the last axis."""
    free = d[..., 3] > 0.5
    best = min_last(where(fit & free, d[..., 2], math.inf))
    return ~free & (d[..., 2] >= best)


def check_hold_ratio(ratio: float) -> float:
    """``ratio`` if it is a valid :data:`HOLD_RATIO` (>= 1, not NaN), else ``ValueError``."""
    if not ratio >= 1.0:
        raise ValueError(f"hold_ratio must be >= 1 (1: refuse stop only while a task's best pool is free; "
                         f"inf: work-conserving), got {ratio!r}")
    return ratio


def pool_free_within(d: Any, fit: Any, ratio: float = HOLD_RATIO) -> Any:
    """Whether some row could start now on a feasible (``fit [..., R, P]``) pool with a free slot
    (dynamic column 3) whose estimated finish is within ``ratio`` x the row's earliest (column 2
    is the log of that factor, clipped at 3). ``d [..., R, P, 5]`` are :func:`pair_dynamic`'s
    columns; numpy or torch, reduced over the last two axes. "Stop" is refused then
    (:mod:`policy.gnn`, :mod:`policy.batch_decoder`)."""
    return (fit & (d[..., 3] > 0.5) & (d[..., 2] <= math.log(ratio))).any(-1).any(-1)
