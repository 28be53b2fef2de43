"""A discrete-event simulator of what the DRL executor controls: DAG runs on Celery worker pools.

Python API (stable; the training code and the benchmark build on it)::

    from policy.catalogue import load_catalogue
    from policy.placement import EarliestFinishPlacer
    from trainer.simulator import Job, SimConfig, Simulator

    catalogue = load_catalogue("policy/catalogues/gpu-affinity.yaml")
    jobs = [Job(graph, arrival_s=0.0), Job(other_graph, arrival_s=30.0)]
    result = Simulator(catalogue, jobs, EarliestFinishPlacer(), seed=1, duration_noise=0.3).run()
    result.jobs[0].jct_s, result.tasks[0].pool, result.cost, result.utilization

Step-wise, for reinforcement learning (no placer needed)::

    sim = Simulator(catalogue, jobs, seed=1)
    request = sim.reset()                  # first PlacementRequest, or None when nothing to place
    while request is not None:
        decisions = my_policy(request, sim.graphs)
        request = sim.step(decisions)      # advance to the next decision point
    result = sim.result()

What a placer sees
    At every decision point (after all events of one instant are applied, if any task is ready
    and unplaced) the simulator builds a :class:`~policy.schema.PlacementRequest` exactly as the
    executor does: ``ready`` = every ready, not yet dispatched task (oldest first), ``runs`` = the
    full :class:`~policy.schema.RunGraph` of each run with ready tasks (the same object every time,
    so ``policy.graph.view`` hits its cache), ``progress`` = one
    :class:`~policy.schema.RunProgress` per such run (``finished``: task ids done; ``running``: task
    ids dispatched and not finished, i.e. queued in a pool or executing; ``age_s``), ``pools`` =
    one :class:`~policy.schema.PoolState` per pool (``slots`` of live workers, ``busy`` running,
    ``queued`` sent and not started, ``up``, the current ``speed`` including slow-downs).
    ``created_at`` is the simulated time in seconds. ``graphs`` maps run_key -> RunGraph for every
    run in the system. The placer is any :class:`~policy.placement.Placer`; nothing here is
    simulator-only.

What decisions do
    A decision sends its task to that pool's FIFO queue (after ``dispatch_latency_s``); it starts
    when a slot is free. **A placer may return decisions for a subset of the ready tasks**: a
    task without a decision stays ready and is offered again at the next decision point (this is
    how a list scheduler "waits" for a busy faster pool: late binding). A decision naming a pool
    that is down or cannot hold the task is refused the same way (counted in
    ``SimResult.refused_decisions``). A decision for a task that is not ready raises
    :class:`SimulationError`, as does a placer that leaves tasks ready while nothing can happen.
    With ``SimConfig.max_wait_s`` / ``max_hold_s`` set, holding is bounded as the executor bounds
    it (its ``[drl_executor] max_wait_s`` / ``max_hold_s``, ``policy/holds.py``): a task left
    without a decision is offered again until it has been held ``max_wait_s`` while a pool that
    fits it had a free slot, or ``max_hold_s`` in all (a wake-up event makes that instant a
    decision point), then the executor's fallback (:class:`~policy.placement.EarliestFinishPlacer`)
    places it, counted in ``SimResult.wait_fallbacks``.

Airflow's limits
    Airflow's scheduler hands the executor only the task instances its concurrency limits allow:
    at most ``[core] max_active_tasks_per_dag`` (a DAG's ``max_active_tasks``; per DAG run since
    Airflow 3, 16 by default) of one run queued or running, at most ``default_pool``'s slots (128)
    of all runs, and the executor sends at most ``[core] parallelism`` (32) not yet finished. A
    task held for a better pool is queued in Airflow, so it counts against the first two and not
    against the third (``DRLExecutor.slots_available``). With ``SimConfig.max_active_tasks`` /
    ``pool_slots`` set, a task whose parents are done waits, unseen by the placer, until the
    scheduler would queue it: by priority weight (``downstream_weights``, Airflow's default rule:
    one plus the task's descendants), then oldest run, then task; a try that fails or is killed
    waits again. With ``parallelism`` set, decisions past it are not applied (the tasks stay
    ready, held). All three default to None: no limit, what every figure before 2026-12-07 night
    assumed (the executor offered every ready task).

Durations and randomness
    ``TaskNode.duration_s`` is the *expected* run time at speed 1.0. The realised time of a try is
    ``duration_s * noise / (pool speed * affinity[kind] * slow-down)`` with ``noise`` log-normal of
    mean 1 and sigma ``duration_noise``. Noise and failure draws come from a generator seeded by
    ``(seed, job index)`` and drawn at arrival, so every policy sees the same realised durations
    (common random numbers). A try fails with the pool's failure rate, after a uniform fraction of
    its run time, and the task is ready again with ``try_number + 1`` (retries are unlimited, so
    every task finishes exactly once). An outage takes a pool down: its running tries are killed
    (and retried), its queued tasks return to the ready set.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
import logging
import math
import time as _time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from policy.catalogue import Catalogue
from policy.errors import PolicyError
from policy.graph import GraphView, view
from policy.holds import HoldClocks, default_hold_s, slot_free_for
from policy.placement import EarliestFinishPlacer, Placer
from policy.schema import (
    MAX_FREE_AT,
    Decision,
    PlacementRequest,
    PoolState,
    ReadyTask,
    RunGraph,
    RunProgress,
)
from trainer.cluster import PoolRuntime

log = logging.getLogger(__name__)


class SimulationError(PolicyError):
    """The simulation cannot go on (bad job list, a decision for a task that is not ready, deadlock)."""


# --- inputs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One DAG run arriving at ``arrival_s``; ``deadline_s`` (absolute) is its SLA, if any."""

    graph: RunGraph
    arrival_s: float = 0.0
    deadline_s: float | None = None

    @property
    def run_key(self) -> str:
        return self.graph.run_key


@dataclass(frozen=True)
class Outage:
    """Pool ``pool`` is down from ``start_s`` to ``end_s``."""

    pool: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Slowdown:
    """Pool ``pool`` runs at ``factor`` times its speed (0 < factor <= 1) for tries started in the window."""

    pool: str
    start_s: float
    end_s: float
    factor: float = 0.5


@dataclass(frozen=True)
class SimConfig:
    """Everything about the simulated world that is not the workload or the pools."""

    #: sigma of the log-normal (mean 1) multiplier on every try's run time; 0 = deterministic
    duration_noise: float = 0.0
    #: seconds between a decision and the task landing in the pool's queue
    dispatch_latency_s: float = 0.0
    #: probability that a try fails (every pool), and per-pool overrides
    failure_rate: float = 0.0
    pool_failure_rate: Mapping[str, float] = field(default_factory=dict)
    outages: tuple[Outage, ...] = ()
    slowdowns: tuple[Slowdown, ...] = ()
    #: KEDA-style scaling of elastic pools; False keeps every pool at its ``workers``
    autoscale: bool = True
    #: how an elastic pool scales in (``trainer/cluster.py``): ``"sustained"`` removes every
    #: surplus worker once the pool has had surplus for ``idle_scale_down_s`` without a break;
    #: ``"window"`` keeps the most workers any moment of the last ``idle_scale_down_s`` needed
    #: (Kubernetes HPA's scale-down stabilisation window, which KEDA uses)
    scale_in: str = "sustained"
    #: longest a task may be held (left without a decision) while a pool that fits it has a free
    #: slot, before the executor's fallback places it, as ``[drl_executor] max_wait_s`` (default
    #: there 60); None = unbounded (``policy/holds.py``)
    max_wait_s: float | None = None
    #: longest a task may be held in all, as ``[drl_executor] max_hold_s`` (default there 300);
    #: None = unbounded. Equal to ``max_wait_s``: the single bound of earlier versions
    max_hold_s: float | None = None
    #: Airflow's concurrency limits on what its scheduler hands the executor (section "Airflow's
    #: limits" above; None = no limit, as every figure before 2026-12-07 night ran):
    #: ``max_active_tasks`` tasks of one DAG run queued (held or sent) or running at once
    #: (``[core] max_active_tasks_per_dag``, per DAG run since Airflow 3; 16 by default),
    #: ``pool_slots`` of all runs (``default_pool``'s slots, 128 by default), ``parallelism`` tasks
    #: sent and not finished (``[core] parallelism``, 32 by default; held tasks do not count, as
    #: ``DRLExecutor.slots_available`` leaves them out)
    max_active_tasks: int | None = None
    pool_slots: int | None = None
    parallelism: int | None = None

    def __post_init__(self) -> None:
        if self.duration_noise < 0 or not math.isfinite(self.duration_noise):
            raise ValueError(f"duration_noise must be >= 0, got {self.duration_noise!r}")
        if self.scale_in not in SCALE_IN_RULES:
            raise ValueError(f"scale_in must be one of {', '.join(SCALE_IN_RULES)}, got {self.scale_in!r}")
        if self.dispatch_latency_s < 0:
            raise ValueError(f"dispatch_latency_s must be >= 0, got {self.dispatch_latency_s!r}")
        for name in ("max_wait_s", "max_hold_s"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be None or a finite number >= 0, got {v!r}")
        for name in ("max_active_tasks", "pool_slots", "parallelism"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name} must be None or an integer >= 1, got {n!r}")
        for name, rate in [("*", self.failure_rate), *self.pool_failure_rate.items()]:
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"failure rate of pool {name!r} must be in [0, 1), got {rate!r}")
        for o in self.outages:
            if not o.end_s > o.start_s >= 0:
                raise ValueError(f"outage of {o.pool!r}: need 0 <= start < end, got {o}")
        # (found by review: the first of two overlapping outages brought the pool back up in the
        # second; a factor over 1 sped the pool up past the speed the lower bounds assume)
        for s in self.slowdowns:
            if not (s.end_s > s.start_s >= 0 and 0 < s.factor <= 1):
                raise ValueError(f"slow-down of {s.pool!r}: need 0 <= start < end and 0 < factor <= 1, got {s}")
        # (slow-downs too: the first's end restored full speed in the second, found by review)
        windows: tuple[tuple[str, Sequence[Outage | Slowdown]], ...] = (
            ("outages", self.outages), ("slow-downs", self.slowdowns))
        for what, spans in windows:
            for a, b in itertools.combinations(spans, 2):
                if a.pool == b.pool and a.start_s < b.end_s and b.start_s < a.end_s:
                    raise ValueError(f"{what} of {a.pool!r} overlap: {a} and {b} (merge them into one)")


# --- outputs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskRecord:
    """One try of one task: where and when it ran; ``ok`` False for a failed or killed try."""

    run_key: str
    task_id: str
    try_number: int
    pool: str
    start_s: float
    end_s: float
    ok: bool = True


@dataclass(frozen=True)
class JobRecord:
    """One DAG run: when it arrived and finished."""

    run_key: str
    arrival_s: float
    finish_s: float
    n_tasks: int
    deadline_s: float | None = None

    @property
    def jct_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass
class SimResult:
    """What happened: per job, per try, per pool, and how the placer did."""

    policy: str
    jobs: list[JobRecord]
    tasks: list[TaskRecord]
    cost: float
    utilization: dict[str, float]
    makespan_s: float
    #: tasks the placer dispatched, placer calls, seconds spent inside ``place``
    decisions: int = 0
    requests: int = 0
    placer_s: float = 0.0
    refused_decisions: int = 0
    #: tasks placed by the executor's fallback after being held ``max_wait_s`` / ``max_hold_s``
    wait_fallbacks: int = 0
    failed_tries: int = 0
    events: int = 0
    wall_s: float = 0.0
    pool_names: tuple[str, ...] = ()


# --- the simulator ------------------------------------------------------------------------------

#: a task's states; _SCHEDULED: its parents are done but Airflow's limits keep it from the executor
_WAITING, _READY, _QUEUED, _RUNNING, _DONE, _SCHEDULED = range(6)
_ARRIVE, _FINISH, _LAND, _BOOT, _SCALE, _DOWN, _UP, _SLOW, _FAST, _WAKE = range(10)
#: added to the sequence number of an event that must come after every other of its instant
_AFTER_ALL = 1 << 62
SCALE_IN_RULES = ("sustained", "window")
def executor_holds(max_wait_s: float | None, max_hold_s: float | None = None) -> tuple[float | None, float | None]:
    """``(max_wait_s, max_hold_s)`` of :class:`SimConfig` for an executor with this ``max_wait_s``
    (None: holds unbounded) and ``max_hold_s`` (None: its default, ``max(max_wait_s, 300)``)."""
    if max_wait_s is None:
        return None, max_hold_s
    return max_wait_s, default_hold_s(max_wait_s) if max_hold_s is None else max_hold_s


#: what places a task held past ``max_wait_s``: the executor's fallback
_WAIT_FALLBACK = EarliestFinishPlacer(fallback=True)


class _Run:
    """A DAG run in the system."""

    __slots__ = (
        "idx", "job", "graph", "view", "pending", "state", "tries", "token", "pool", "started",
        "noise", "fail_u", "fail_frac", "seed", "finished", "active", "remaining", "_finished_t",
        "admitted", "weight",
    )

    def __init__(self, idx: int, job: Job, seed: int, noise: float) -> None:
        self.idx = idx
        self.job = job
        self.graph = job.graph
        self.view: GraphView = view(job.graph)
        n = len(job.graph.tasks)
        self.pending = [len(p) for p in self.view.parents]
        self.state = [_WAITING] * n
        self.tries = [1] * n
        self.token = [0] * n
        self.pool = [-1] * n
        self.started = [0.0] * n
        self.seed = seed
        rng = np.random.default_rng([seed, idx])
        self.noise = _lognormal(rng, noise, n)
        self.fail_u = rng.random(n).tolist()
        self.fail_frac = rng.random(n).tolist()
        self.finished: list[str] = []
        self.active: dict[int, None] = {}
        self.remaining = n
        self._finished_t: tuple[str, ...] | None = None
        self.admitted = 0  # tasks Airflow's limits count: handed to the executor and not finished
        self.weight: list[int] = []  # Airflow's priority_weight of each task (when limits are set)

    def retry_draws(self, i: int, sigma: float) -> tuple[float, float, float]:
        """Noise, failure draw and failed fraction of task ``i``'s current try past the first: from
        a generator of its own (run, task, try), so every policy sees the same ones whatever order
        it starts retries in (found by review: drawn from the run's generator as tries started)."""
        rng = np.random.default_rng([self.seed, self.idx, i, self.tries[i]])
        fail_u, frac = rng.random(2).tolist()
        return _lognormal(rng, sigma, 1)[0], fail_u, frac

    def finished_ids(self) -> tuple[str, ...]:
        if self._finished_t is None or len(self._finished_t) != len(self.finished):
            self._finished_t = tuple(self.finished)
        return self._finished_t


def downstream_weights(g: GraphView) -> list[int]:
    """Airflow's ``priority_weight`` of each task under its default ``weight_rule`` (downstream)
    with every task's own weight 1: one plus the number of its descendants."""
    below: list[int] = [0] * len(g.children)  # bit set of each task's descendants
    for i in reversed(g.order):
        bits = 0
        for c in g.children[i]:
            bits |= below[c] | (1 << c)
        below[i] = bits
    return [1 + b.bit_count() for b in below]


def _lognormal(rng: np.random.Generator, sigma: float, n: int) -> list[float]:
    if sigma <= 0:
        return [1.0] * n
    return np.exp(rng.normal(-0.5 * sigma * sigma, sigma, n)).tolist()


class Simulator:
    """Discrete-event simulation of DAG runs on a catalogue's pools under one placer.

    ``overrides`` are :class:`SimConfig` fields (e.g. ``duration_noise=0.3``) applied on top of
    ``config``. ``placer`` may be None when the caller drives :meth:`reset` / :meth:`step` itself.
    A placer with a ``bind(simulator)`` method is handed the simulator before :meth:`run` starts
    (only the rollout reference planner uses this: it searches on :meth:`fork` copies).
    """

    def __init__(
        self,
        catalogue: Catalogue,
        jobs: Sequence[Job],
        placer: Placer | None = None,
        *,
        seed: int = 0,
        config: SimConfig | None = None,
        **overrides: Any,
    ) -> None:
        self.catalogue = catalogue
        self.jobs = sorted(jobs, key=lambda j: j.arrival_s)
        self.placer = placer
        self.seed = int(seed)
        self.config = dataclasses.replace(config or SimConfig(), **overrides)
        keys = [j.run_key for j in self.jobs]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise SimulationError(f"two jobs share run_key {dup!r}")
        for j in self.jobs:
            if j.arrival_s < 0 or not math.isfinite(j.arrival_s):
                raise SimulationError(f"job {j.run_key!r}: bad arrival time {j.arrival_s!r}")
        names = set(catalogue.names)
        events: list[Outage | Slowdown] = [*self.config.outages, *self.config.slowdowns]
        for ev in events:
            if ev.pool not in names:
                raise SimulationError(f"{type(ev).__name__} names pool {ev.pool!r}, not in {sorted(names)}")
        self._pool_index = {p.name: i for i, p in enumerate(catalogue.pools)}
        self.reset_state()

    # --- public API ------------------------------------------------------------------------------

    @property
    def graphs(self) -> Mapping[str, RunGraph]:
        """run_key -> RunGraph of every run in the system now."""
        return self._graphs

    @property
    def now(self) -> float:
        return self._now

    @property
    def done(self) -> bool:
        return self._done

    @property
    def jobs_in_system(self) -> int:
        return len(self._active)

    @property
    def jobs_in_system_area(self) -> float:
        """Integral of the number of runs in the system over time so far (sum of JCTs so far)."""
        return self._area

    def area_until(self, t: float) -> float:
        """The jobs-in-system integral from 0 to ``t`` (at most now): each run counts from its
        arrival to its finish or ``t``, whichever is first (what :attr:`jobs_in_system_area` was
        at ``t``)."""
        t = min(t, self._now)
        done = sum(max(0.0, min(r.finish_s, t) - r.arrival_s) for r in self._job_records)
        return done + sum(max(0.0, t - run.job.arrival_s) for run in self._active.values())

    @property
    def pools(self) -> Sequence[PoolRuntime]:
        return self._pools

    def reset_state(self) -> None:
        cfg = self.config
        self._pools = [
            PoolRuntime.start(p, cfg.pool_failure_rate.get(p.name, cfg.failure_rate))
            for p in self.catalogue.pools
        ]
        self._elastic = [p for p in self._pools if p.spec.elastic and cfg.autoscale]
        self._heap: list[tuple[float, int, int, int, int, int]] = []
        self._seq = 0
        self._now = 0.0
        self._area = 0.0
        self._runs: list[_Run | None] = [None] * len(self.jobs)
        self._active: dict[int, _Run] = {}
        self._graphs: dict[str, RunGraph] = {}
        self._ready: dict[tuple[int, int], ReadyTask] = {}
        self._ready_t: tuple[ReadyTask, ...] | None = None
        self._holds = HoldClocks(cfg.max_wait_s, cfg.max_hold_s)
        # Airflow's limits: tasks whose parents are done but which the scheduler has not handed
        # over yet, a heap of (-priority_weight, task) per run; and how many it has handed over
        self._gate = cfg.max_active_tasks is not None or cfg.pool_slots is not None
        self._scheduled: dict[int, list[tuple[int, int]]] = {}
        self._admitted = 0
        self._wait_fallbacks = 0
        self._dirty = False
        self._done = False
        self._result: SimResult | None = None
        self._job_records: list[JobRecord] = []
        self._task_records: list[TaskRecord] = []
        self._decisions = 0
        self._requests = 0
        self._placer_s = 0.0
        self._refused = 0
        self._failed = 0
        self._events = 0
        self._wall0 = _time.perf_counter()
        for i, job in enumerate(self.jobs):
            self._push(job.arrival_s, _ARRIVE, i)
        # by start: back-to-back windows listed later-first ended the second at its start (found by
        # review: the heap orders events of one time as pushed, so the first window's end came after)
        for o in sorted(cfg.outages, key=lambda o: o.start_s):
            p = self._pool_index[o.pool]
            # after every other event of its instant (found by review: a try finishing exactly as
            # the outage began was killed, its whole run time spent, and retried)
            self._push(o.start_s, _DOWN, p, last=True)
            self._push(o.end_s, _UP, p)
        for k, s in sorted(enumerate(cfg.slowdowns), key=lambda ks: ks[1].start_s):
            p = self._pool_index[s.pool]
            self._push(s.start_s, _SLOW, p, k)
            self._push(s.end_s, _FAST, p, k)
        # the autoscaler sees the pools at 0 too (found by review: it first looked after the first
        # event, so a replay whose first run came at 500 s billed idle starting workers 500 s more)
        self._autoscale()

    def reset(self) -> PlacementRequest | None:
        """Start over; returns the first request (None if the workload needs no decision)."""
        self.reset_state()
        return self._advance()

    def step(self, decisions: Iterable[Decision]) -> PlacementRequest | None:
        """Apply the decisions for the last request, then run to the next decision point."""
        self._apply(decisions)
        if self._ready:
            self._note_holds()
        self._dirty = False
        return self._advance()

    def run(self) -> SimResult:
        """Simulate the whole workload under ``placer`` and return the result."""
        if self.placer is None:
            raise SimulationError("run() needs a placer; drive reset()/step() yourself otherwise")
        place = self.placer.place
        bind = getattr(self.placer, "bind", None)
        if callable(bind):
            bind(self)  # search-based placers (the rollout reference) plan on forks of this simulator
        request = self.reset()
        clock = _time.perf_counter
        while request is not None:
            t0 = clock()
            decisions = place(request, self._graphs)
            self._placer_s += clock() - t0
            request = self.step(decisions)
        return self.result()

    def fork(self) -> Simulator:
        """An independent copy of the simulation now (graphs, jobs and the catalogue are shared).

        The copy has no placer; drive it with :meth:`step`. Used by search-based placers.
        """
        memo: dict[int, Any] = {id(self.catalogue): self.catalogue, id(self.config): self.config,
                                id(self.jobs): self.jobs, id(self.placer): None}
        for job in self.jobs:
            memo[id(job)] = job
            memo[id(job.graph)] = job.graph
        for run in self._active.values():
            memo[id(run.view)] = run.view
        clone = copy.deepcopy(self, memo)
        clone.placer = None
        return clone

    def result(self) -> SimResult:
        if not self._done:
            raise SimulationError("the simulation has not finished")
        if self._result is not None:
            return self._result
        end = max((j.finish_s for j in self._job_records), default=0.0)
        for p in self._pools:
            p.close(end)
        self._result = SimResult(
            policy=getattr(self.placer, "name", "external"),
            jobs=sorted(self._job_records, key=lambda j: j.arrival_s),
            tasks=self._task_records,
            cost=sum(p.cost for p in self._pools),
            utilization={
                p.name: (p.busy_slot_s / p.capacity_slot_s if p.capacity_slot_s > 0 else 0.0)
                for p in self._pools
            },
            makespan_s=end,
            decisions=self._decisions,
            requests=self._requests,
            placer_s=self._placer_s,
            refused_decisions=self._refused,
            wait_fallbacks=self._wait_fallbacks,
            failed_tries=self._failed,
            events=self._events,
            wall_s=_time.perf_counter() - self._wall0,
            pool_names=tuple(p.name for p in self._pools),
        )
        return self._result

    # --- event loop ------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: int = 0, b: int = 0, c: int = 0, *, last: bool = False) -> None:
        """Schedule an event; events of one instant run as pushed, those pushed ``last`` after all others."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq + (_AFTER_ALL if last else 0), kind, a, b, c))

    def _advance(self) -> PlacementRequest | None:
        heap = self._heap
        while True:
            if self._dirty and self._ready:
                return self._request()
            if not heap:
                if self._ready:
                    raise SimulationError(
                        f"placer {getattr(self.placer, 'name', 'external')!r} left {len(self._ready)} "
                        f"ready task(s) unplaced at t={self._now:.1f}s while nothing else can happen"
                    )
                if self._active:  # queued where no slot will ever be (found by review: reported done)
                    stuck = sorted(r.job.run_key for r in self._active.values())
                    raise SimulationError(
                        f"{len(stuck)} run(s) can never finish at t={self._now:.1f}s, e.g. {stuck[0]!r}: "
                        f"tasks queued on pools with no worker and none to come (autoscale off?)")
                self._done = True
                return None
            t = heap[0][0]
            if t > self._now:
                self._area += len(self._active) * (t - self._now)
                self._now = t
            while heap and heap[0][0] <= t:
                _, _, kind, a, b, c = heapq.heappop(heap)
                self._events += 1
                self._handle(kind, a, b, c)
            if self._scheduled:
                self._admit()
            self._autoscale()
            self._dirty = True

    def _handle(self, kind: int, a: int, b: int, c: int) -> None:
        if kind == _FINISH:
            self._finish(a, b, c)
        elif kind == _ARRIVE:
            self._arrive(a)
        elif kind == _LAND:
            run = self._runs[a]
            if run is not None and run.token[b] == c:
                pool = self._pools[run.pool[b]]
                pool.inflight -= 1
                pool.queue.append((a, b))
                self._fill(pool)
        elif kind == _BOOT:
            pool = self._pools[a]
            pool.account(self._now)
            pool.booting -= 1
            pool.workers += 1
            pool.invalidate()
            self._fill(pool)
        elif kind == _SCALE:
            pool = self._pools[a]
            if self.config.scale_in == "window":
                self._scale_in_window(pool)
            else:
                since = pool.surplus_since
                if since is not None and self._now - since >= pool.spec.idle_scale_down_s - 1e-9:
                    n = pool.surplus()
                    if n:
                        pool.account(self._now)
                        pool.remove_workers(n, self._now)
                    pool.surplus_since = None
        elif kind == _DOWN:
            self._outage(self._pools[a])
        elif kind == _UP:
            pool = self._pools[a]
            pool.account(self._now)
            pool.up = True
            pool.invalidate()
            self._fill(pool)
        elif kind == _SLOW:
            pool = self._pools[a]
            pool.speed_factor = self.config.slowdowns[b].factor
            pool.invalidate()
        elif kind == _FAST:
            pool = self._pools[a]
            pool.speed_factor = 1.0
            pool.invalidate()
        # _WAKE: nothing to apply; the instant is a decision point (a held task's wait ends)

    def _arrive(self, idx: int) -> None:
        job = self.jobs[idx]
        run = _Run(idx, job, self.seed, self.config.duration_noise)
        self._runs[idx] = run
        if run.remaining == 0:
            self._job_records.append(
                JobRecord(job.run_key, job.arrival_s, self._now, 0, job.deadline_s)
            )
            return
        self._active[idx] = run
        self._graphs[job.run_key] = job.graph
        if self._gate:
            run.weight = downstream_weights(run.view)
        for i, n in enumerate(run.pending):
            if n == 0:
                self._make_ready(run, i)

    def _make_ready(self, run: _Run, i: int) -> None:
        if self._gate:  # the scheduler hands it over when Airflow's limits let it (_admit)
            run.state[i] = _SCHEDULED
            heapq.heappush(self._scheduled.setdefault(run.idx, []), (-run.weight[i], i))
            return
        run.state[i] = _READY
        self._ready[(run.idx, i)] = ReadyTask(run.graph.run_key, run.graph.tasks[i].task_id, run.tries[i])
        self._ready_t = None

    def _admit(self) -> None:
        """Hand scheduled tasks to the executor as Airflow's scheduler queues them: by priority
        weight (highest first), then by run (oldest first), then by task, while the run has fewer
        than ``max_active_tasks`` and all runs fewer than ``pool_slots`` queued or running."""
        cfg = self.config
        if cfg.pool_slots is not None and self._admitted >= cfg.pool_slots:
            return
        per_run = cfg.max_active_tasks
        candidates: list[tuple[int, int, int]] = []
        for r, heap in self._scheduled.items():
            run = self._runs[r]
            assert run is not None
            k = len(heap) if per_run is None else min(len(heap), per_run - run.admitted)
            if k > 0:
                candidates.extend((w, r, i) for w, i in (heap if k == len(heap) else heapq.nsmallest(k, heap)))
        if not candidates:
            return
        candidates.sort()
        if cfg.pool_slots is not None:
            del candidates[cfg.pool_slots - self._admitted:]
        taken = Counter(r for _, r, _ in candidates)
        for r, k in taken.items():  # a run's admitted tasks are the first of its own order
            run = self._runs[r]
            assert run is not None
            heap = self._scheduled[r]
            for _ in range(k):
                _, i = heapq.heappop(heap)
                run.state[i] = _READY
                self._ready[(r, i)] = ReadyTask(run.graph.run_key, run.graph.tasks[i].task_id, run.tries[i])
            if not heap:
                del self._scheduled[r]
            run.admitted += k
            self._admitted += k
        self._ready_t = None

    def _release(self, run: _Run) -> None:
        """One of ``run``'s handed-over tasks finished or went back to scheduled."""
        if self._gate:
            run.admitted -= 1
            self._admitted -= 1

    def _start(self, pool: PoolRuntime, r: int, i: int) -> None:
        run = self._runs[r]
        assert run is not None
        task = run.graph.tasks[i]
        run.state[i] = _RUNNING
        run.started[i] = self._now
        pool.running += 1
        vm = pool.spec.vm_class
        speed = vm.speed * vm.affinity.get(task.kind, 1.0) * pool.speed_factor
        if run.tries[i] == 1:
            noise, fail_u, frac = run.noise[i], run.fail_u[i], run.fail_frac[i]
        else:
            noise, fail_u, frac = run.retry_draws(i, self.config.duration_noise)
        pool.expect[(r, i)] = self._now + task.duration_s / speed
        dur = task.duration_s * noise / speed
        ok = fail_u >= pool.failure_rate
        if not ok:
            dur *= frac
        self._push(self._now + dur, _FINISH, r, i, run.token[i] * 2 + (1 if ok else 0))

    def _fill(self, pool: PoolRuntime) -> None:
        """Start queued tasks while the pool has free slots."""
        if not pool.can_start():
            return
        pool.account(self._now)
        while pool.can_start():
            r, i = pool.queue.popleft()
            self._start(pool, r, i)
        pool.invalidate()

    def _finish(self, r: int, i: int, code: int) -> None:
        run = self._runs[r]
        assert run is not None
        if run.token[i] != code >> 1 or run.state[i] != _RUNNING:
            return  # a try killed by an outage
        ok = bool(code & 1)
        pool = self._pools[run.pool[i]]
        pool.account(self._now)
        pool.running -= 1
        pool.expect.pop((r, i), None)
        pool.invalidate()
        task_id = run.graph.tasks[i].task_id
        self._task_records.append(
            TaskRecord(run.graph.run_key, task_id, run.tries[i], pool.name, run.started[i], self._now, ok)
        )
        run.active.pop(i, None)
        self._release(run)
        if not ok:
            self._failed += 1
            run.tries[i] += 1
            run.token[i] += 1
            self._make_ready(run, i)
        else:
            run.state[i] = _DONE
            run.finished.append(task_id)
            run.remaining -= 1
            pending = run.pending
            for ch in run.view.children[i]:
                pending[ch] -= 1
                if pending[ch] == 0:
                    self._make_ready(run, ch)
            if run.remaining == 0:
                job = run.job
                self._job_records.append(
                    JobRecord(job.run_key, job.arrival_s, self._now, len(run.graph.tasks), job.deadline_s)
                )
                del self._active[r]
                del self._graphs[job.run_key]
        self._fill(pool)

    def _outage(self, pool: PoolRuntime) -> None:
        pool.account(self._now)
        pool.up = False
        p = self._pool_index[pool.name]
        for run in list(self._active.values()):
            for i in list(run.active):
                if run.pool[i] != p:
                    continue
                run.active.pop(i)
                self._release(run)
                if run.state[i] == _RUNNING:
                    pool.running -= 1
                    pool.expect.pop((run.idx, i), None)
                    self._task_records.append(
                        TaskRecord(run.graph.run_key, run.graph.tasks[i].task_id, run.tries[i],
                                   pool.name, run.started[i], self._now, False)
                    )
                    self._failed += 1
                    run.tries[i] += 1
                run.token[i] += 1
                self._make_ready(run, i)
        pool.queue.clear()
        pool.inflight = 0
        pool.invalidate()

    def _scale_in_window(self, pool: PoolRuntime) -> None:
        n = pool.window_surplus(self._now, pool.spec.idle_scale_down_s)
        if n:
            pool.account(self._now)
            pool.remove_workers(n, self._now)

    def _autoscale(self) -> None:
        for pool in self._elastic:
            key = (pool.running, pool.queued, pool.workers, pool.booting, pool.up, pool.surplus_since)
            if key == pool.scale_key:
                continue  # nothing the autoscaler looks at has changed
            started = pool.scale_up(self._now)
            if started:
                p = self._pool_index[pool.name]
                for _ in range(started):
                    self._push(self._now + pool.spec.boot_delay_s, _BOOT, p)
            if self.config.scale_in == "window":
                if pool.note_needed(self._now):  # the need fell: workers may go one window on
                    self._push(self._now + pool.spec.idle_scale_down_s, _SCALE, self._pool_index[pool.name])
                if pool.surplus() > 0:  # e.g. a worker booted for a need that passed a window ago
                    self._scale_in_window(pool)
            elif pool.surplus() > 0:
                if pool.surplus_since is None:
                    pool.surplus_since = self._now
                    self._push(self._now + pool.spec.idle_scale_down_s, _SCALE, self._pool_index[pool.name])
            else:
                pool.surplus_since = None
            pool.scale_key = (pool.running, pool.queued, pool.workers, pool.booting, pool.up,
                              pool.surplus_since)

    # --- requests and decisions ------------------------------------------------------------------

    def _pool_state(self, pool: PoolRuntime) -> PoolState:
        """The pool's state with what a ledger would know: growth limit, boot delay, and the
        expected finish of every running and queued try (queued ones chained FIFO on the slots)."""
        st = pool.state()
        now = self._now
        heap = sorted(pool.expect.values())
        out = list(heap)
        heap += [now] * max(0, st.slots - len(heap))
        heapq.heapify(heap)
        vm = pool.spec.vm_class
        if heap:
            for r, i in list(pool.queue)[:MAX_FREE_AT]:
                run = self._runs[r]
                assert run is not None
                task = run.graph.tasks[i]
                speed = vm.speed * vm.affinity.get(task.kind, 1.0) * pool.speed_factor
                t = max(heapq.heappop(heap), now) + task.duration_s / speed
                heapq.heappush(heap, t)
                out.append(t)
        out.sort()
        # a pool grows only under the autoscaler (autoscale=False keeps every pool at its workers)
        top = pool.max_workers * pool.spec.slots_per_worker if pool.up and self.config.autoscale else 0
        return dataclasses.replace(st, max_slots=top if top > st.slots else None,
                                   boot_s=pool.spec.boot_delay_s, free_at=tuple(out[:MAX_FREE_AT]))

    def _note_holds(self) -> None:
        """Note each task left without a decision on its hold clock (requests report how long it
        has been held as ``ReadyTask.held_s``, as the executor does) and whether a pool that fits
        it has a free slot now; with ``max_wait_s`` / ``max_hold_s`` set, the executor's bounds on
        holding (``policy/holds.py``): tasks past either are placed by its fallback."""
        now = self._now
        holds = self._holds
        bounded = holds.wait_s is not None or holds.hold_s is not None
        free: list[PoolState] = []
        if holds.wait_s is not None:
            free = [st for p in self._pools if (st := p.state()).up and st.free_slots > 0]
        overdue = []
        runs = self._runs
        for key in self._ready:
            slot_free = False
            if free:
                run = runs[key[0]]
                assert run is not None
                slot_free = slot_free_for(run.graph.tasks[key[1]], free)
            for at in holds.hold(key, now, slot_free):
                self._push(at, _WAKE)
            if bounded and holds.overdue(key, now):
                overdue.append(key)
        if overdue:
            decisions = _WAIT_FALLBACK.place(self._request(overdue), self._graphs)
            self._wait_fallbacks += self._apply(decisions)

    def _request(self, keys: Sequence[tuple[int, int]] | None = None) -> PlacementRequest:
        """The request for every ready task, or for ``keys`` only."""
        if keys is not None:
            ready = tuple(self._ready[k] for k in keys)
        else:
            if self._ready_t is None:
                self._ready_t = tuple(self._ready.values())
            ready, keys = self._ready_t, list(self._ready)
        now = self._now
        if len(self._holds):  # how long each held task has waited (ReadyTask.held_s)
            get = self._holds.since
            ready = tuple(t if (s := get(k)) is None or s >= now else
                          ReadyTask(t.run_key, t.task_id, t.try_number, now - s)
                          for k, t in zip(keys, ready, strict=True))
        seen: dict[int, None] = {}
        for r, _ in keys:
            seen[r] = None
        runs = []
        progress = []
        for r in seen:
            run = self._runs[r]
            assert run is not None
            runs.append(run.graph)
            tasks = run.graph.tasks
            progress.append(
                RunProgress(
                    run.graph.run_key,
                    run.finished_ids(),
                    tuple(tasks[i].task_id for i in run.active),
                    now - run.job.arrival_s,
                )
            )
        self._requests += 1
        return PlacementRequest(
            request_id=f"sim-{self.seed}-{self._requests}",
            ready=ready,
            pools=tuple(self._pool_state(p) for p in self._pools),
            runs=tuple(runs),
            progress=tuple(progress),
            created_at=now,
        )

    def _apply(self, decisions: Iterable[Decision]) -> int:
        """Send the tasks of ``decisions``; returns how many were sent."""
        latency = self.config.dispatch_latency_s
        touched: dict[int, None] = {}
        run_idx = {run.graph.run_key: r for r, run in self._active.items()}
        placed: set[tuple[int, int]] = set()  # by this batch: a duplicate decision is skipped
        # [core] parallelism: the executor sends at most its open slots; the rest stay held
        room = (math.inf if self.config.parallelism is None else
                self.config.parallelism - sum(p.running + p.queued for p in self._pools))
        for d in decisions:
            if room <= 0:
                break
            r = run_idx.get(d.run_key)
            run = self._runs[r] if r is not None else None
            i = run.view.index.get(d.task_id) if run is not None else None
            if run is None or i is None or r is None:
                raise SimulationError(f"decision for unknown task {d.run_key!r}/{d.task_id!r}")
            if run.state[i] != _READY:
                if (r, i) in placed:
                    continue  # a duplicate decision for a task placed in this batch
                # found by review: one queued at an earlier decision point was skipped silently too
                raise SimulationError(f"decision for {d.run_key!r}/{d.task_id!r}, which is not ready")
            p = self._pool_index.get(d.pool)
            if p is None:
                raise SimulationError(
                    f"decision for {d.run_key!r}/{d.task_id!r} names unknown pool {d.pool!r}"
                )
            pool = self._pools[p]
            if not pool.up or not pool.state().fits(run.graph.tasks[i]):
                self._refused += 1
                continue
            del self._ready[(r, i)]
            placed.add((r, i))
            self._holds.forget((r, i))
            self._ready_t = None
            run.state[i] = _QUEUED
            room -= 1
            run.pool[i] = p
            run.active[i] = None
            self._decisions += 1
            if latency > 0:
                pool.inflight += 1
                self._push(self._now + latency, _LAND, r, i, run.token[i])
            else:
                pool.queue.append((r, i))
            touched[p] = None
        for p in touched:
            pool = self._pools[p]
            pool.invalidate()
            self._fill(pool)
        if touched:
            self._autoscale()
        return len(placed)

