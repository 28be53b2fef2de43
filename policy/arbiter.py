"""The action arbiter: what stands between the model's proposal and the reply.

Three duties, in this order (the execution layer of the source design, issue 5):

1. **Load-skew breaker.** If the utilisation spread of the live pools (max - min of
   ``(busy + queued) / slots``) exceeds ``skew_threshold`` while work queues behind a full pool and
   another live pool has a free slot (a full fast pool beside idle slow ones is what a good
   placement looks like at light load, not herding), the next ``skew_fallback_n`` decisions
   are made by the fallback heuristic (least-loaded earliest finish), and each such decision's
   reason says so. A model that herds work onto one pool is cut off before the pool drowns.
2. **Sampling.** A placer that exposes per-pool scores (:class:`ScoringPlacer`) is sampled with
   a temperature over its *feasible* pools: ``temperature == 0`` (the production default) is
   greedy, ~1.0 is for exploration while training.
3. **Hard constraints.** Every decision must name a known pool that is up and can hold the task
   (resources, explicit pinning). A decision that breaks them, or a placer that raises, is
   replaced by the fallback heuristic's decision, with the reason saying why.

A ready task the placer gives no decision for *waits* (late binding, as in the simulator and in
Decima): the reply leaves it out, the executor keeps it back and offers it again with its next
request, when a better pool may be free. The executor bounds how long a task may wait.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from policy.graph import view
from policy.placement import EarliestFinishPlacer, Placer, feasible
from policy.schema import Decision, PlacementRequest, PoolState, RunGraph

log = logging.getLogger(__name__)

#: Fallback reasons counted in metrics.
FALLBACK_REASONS = ("load_skew", "infeasible", "placer_error")


@runtime_checkable
class ScoringPlacer(Protocol):
    """A placer that can also expose its raw preference over pools, for temperature sampling.

    ``pool_scores`` returns, for each task of ``request.ready`` in order, a mapping of pool name to
    a logit (higher is better). Pools absent from a mapping are never chosen.
    """

    name: str
    version: str

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        ...

    def pool_scores(
        self, request: PlacementRequest, graphs: Mapping[str, RunGraph]
    ) -> list[Mapping[str, float]]:
        ...


@runtime_checkable
class BatchPlacer(Protocol):
    """A placer that decides a micro-batch of requests in one call (the GNN: one model call per
    phase instead of one per request). ``place_many`` returns, per request, what ``place`` would."""

    name: str
    version: str

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        ...

    def place_many(
        self, requests: Sequence[PlacementRequest], graphs: Sequence[Mapping[str, RunGraph]]
    ) -> list[list[Decision]]:
        ...


@dataclass(frozen=True)
class ArbiterConfig:
    """Arbiter settings (see :class:`policy.config.ServerConfig` for their documentation)."""

    temperature: float = 0.0
    seed: int = 0
    skew_threshold: float = 0.75
    skew_fallback_n: int = 32

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.skew_threshold <= 1:
            raise ValueError(f"skew_threshold must be in (0, 1], got {self.skew_threshold!r}")
        if self.skew_fallback_n < 0:
            raise ValueError(f"skew_fallback_n must be >= 0, got {self.skew_fallback_n!r}")


def utilisation_spread(pools: Sequence[PoolState]) -> tuple[float, str]:
    """Max - min utilisation over live pools with slots, and a short text naming the extremes."""
    live = [p for p in pools if p.up and p.slots > 0]
    if len(live) < 2:
        return 0.0, ""
    util = sorted((min(1.0, (p.busy + p.queued) / p.slots), p.name) for p in live)
    lo, hi = util[0], util[-1]
    return hi[0] - lo[0], f"{hi[1]} {hi[0]:.2f}, {lo[1]} {lo[0]:.2f}"


def backlog_beside_idle(pools: Sequence[PoolState]) -> bool:
    """Tasks wait on a full live pool while another live pool has a free slot."""
    live = [p for p in pools if p.up and p.slots > 0]
    return any(p.busy + p.queued > p.slots for p in live) and any(p.free_slots > 0 for p in live)


def violation(decision: Decision, request: PlacementRequest, graph: RunGraph | None) -> str | None:
    """Why ``decision`` breaks a hard constraint, or None if it is acceptable."""
    pools = {p.name: p for p in request.pools}
    pool = pools.get(decision.pool)
    if pool is None:
        return f"pool {decision.pool!r} is not in the request"
    if graph is None:
        return None
    idx = view(graph).index.get(decision.task_id)
    if idx is None:
        return f"task {decision.task_id!r} is not in run {decision.run_key!r}"
    task = graph.tasks[idx]
    options = feasible(task, request.pools)
    if not options:
        # Nothing can hold it: any live pool is as good as the heuristic's "largest" guess (and
        # with every pool down, any pool: was a fallback to another down pool, counted infeasible)
        return None if pool.up or not any(p.up for p in request.pools) else f"pool {pool.name} is down"
    if any(p.name == pool.name for p in options):
        return None
    if task.pool is not None and task.pool != pool.name and any(p.fits(task) for p in request.pools):
        return f"task is pinned to {task.pool}"
    if not pool.fits(task):
        return f"{pool.name} cannot hold {task.asks}"
    return f"pool {pool.name} is down"


class Arbiter:
    """Applies the breaker, sampling and hard constraints to one placer's proposals.

    ``on_fallback(reason, n)`` is called with one of :data:`FALLBACK_REASONS` and the number of
    decisions it replaced (the server counts them in metrics). Stateful (the breaker's counter,
    the sampling generator); one per server loop.
    """

    def __init__(
        self,
        config: ArbiterConfig | None = None,
        *,
        fallback: Placer | None = None,
        on_fallback: Callable[[str, int], None] | None = None,
    ) -> None:
        self.config = config or ArbiterConfig()
        self.fallback = fallback or EarliestFinishPlacer()
        self.on_fallback = on_fallback or (lambda reason, n: None)
        self.rng = np.random.default_rng(self.config.seed)
        #: decisions still to be made by the fallback after the breaker tripped
        self.breaker_left = 0
        self._breaker_note = ""

    def decide(
        self, placer: Placer, request: PlacementRequest, graphs: Mapping[str, RunGraph]
    ) -> list[Decision]:
        """A decision per ready task the placer placed, in ``request.ready`` order; the others wait."""
        if not request.ready:
            return []
        tripped = self._breaker(request, graphs)
        if tripped is None:
            return self._settle(placer, request, graphs, None)
        head, rest = tripped
        return head if rest is None else head + self._settle(placer, rest, graphs, None)

    def decide_many(
        self, placer: Placer, items: Sequence[tuple[PlacementRequest, Mapping[str, RunGraph]]]
    ) -> list[list[Decision] | Exception]:
        """:meth:`decide` for each ``(request, graphs)`` of a micro-batch, in order.

        A :class:`BatchPlacer` gets every request the breaker leaves to it in one ``place_many``
        call (unless sampling applies); if that call raises, each request is retried alone, so
        one bad request costs only its own decisions. What :meth:`decide` would raise for a
        request is returned in its place, never raised.
        """
        out: list[list[Decision] | Exception] = []
        todo: list[tuple[int, PlacementRequest]] = []  # (item, what of its request the placer decides)
        for i, (request, graphs) in enumerate(items):
            out.append([])
            if not request.ready:
                continue
            try:
                tripped = self._breaker(request, graphs)
            except Exception as exc:  # noqa: BLE001 - returned to the caller as this request's error
                out[i] = exc
                continue
            if tripped is None:
                todo.append((i, request))
            else:
                out[i], rest = tripped
                if rest is not None:
                    todo.append((i, rest))
        batched: list[list[Decision]] | None = None
        sampled = self.config.temperature > 0 and isinstance(placer, ScoringPlacer)
        if len(todo) > 1 and not sampled and isinstance(placer, BatchPlacer):
            try:
                batched = placer.place_many([req for _, req in todo], [items[i][1] for i, _ in todo])
                if len(batched) != len(todo):
                    raise ValueError(f"place_many answered {len(batched)} of {len(todo)} requests")
            except Exception:  # noqa: BLE001 - retried request by request below
                log.exception("placer %s %s failed on a batch of %d requests; deciding them one by one",
                              placer.name, placer.version, len(todo))
        for k, (i, request) in enumerate(todo):
            head = out[i]
            assert isinstance(head, list)
            try:
                out[i] = head + self._settle(placer, request, items[i][1],
                                             batched[k] if batched is not None else None)
            except Exception as exc:  # noqa: BLE001 - returned to the caller as this request's error
                out[i] = exc
        return out

    def _settle(
        self,
        placer: Placer,
        request: PlacementRequest,
        graphs: Mapping[str, RunGraph],
        proposed: Sequence[Decision] | None,
    ) -> list[Decision]:
        """The placer's proposal (asked for here when ``proposed`` is None: sampled when the
        placer scores and temperature > 0) under the hard constraints; if the placer raises,
        the fallback's decision for every ready task, saying why."""
        try:
            if proposed is None and self.config.temperature > 0 and isinstance(placer, ScoringPlacer):
                proposed = self._sample(placer, request, graphs)
            elif proposed is None:
                proposed = placer.place(request, graphs)
        except Exception as exc:  # noqa: BLE001 - a failing model must not fail the reply
            log.exception("placer %s %s failed on request %s", placer.name, placer.version,
                          request.request_id)
            self.on_fallback("placer_error", len(request.ready))
            return self._fallback_all(request, graphs, f"{placer.name} failed ({type(exc).__name__}: {exc})")
        return self._enforce(placer, request, graphs, proposed)

    # --- duties ------------------------------------------------------------------------------

    def _breaker(
        self, request: PlacementRequest, graphs: Mapping[str, RunGraph]
    ) -> tuple[list[Decision], PlacementRequest | None] | None:
        """While the breaker is open: the fallback's decisions for the first of the ready tasks it
        has decisions left for, and the request of the others (None: none left), which the placer
        decides (found by review: a request of 5 ready tasks with 2 decisions left gave all 5 to
        the fallback, counted 5); None while it is closed."""
        if self.config.skew_fallback_n == 0:
            return None
        if self.breaker_left <= 0:
            spread, extremes = utilisation_spread(request.pools)
            if spread <= self.config.skew_threshold or not backlog_beside_idle(request.pools):
                return None
            self.breaker_left = self.config.skew_fallback_n
            self._breaker_note = (
                f"load-skew breaker: utilisation spread {spread:.2f} > {self.config.skew_threshold:.2f}"
                f" ({extremes})"
            )
            log.warning("%s; %s decides the next %d decisions (request %s)", self._breaker_note,
                        self.fallback.name, self.breaker_left, request.request_id)
        n = min(len(request.ready), self.breaker_left)
        note = f"{self._breaker_note}; {self.fallback.name} for {self.breaker_left} more decisions"
        self.breaker_left -= n
        self.on_fallback("load_skew", n)
        if n == len(request.ready):
            return self._fallback_all(request, graphs, note), None
        return (self._fallback_all(replace(request, ready=request.ready[:n]), graphs, note),
                replace(request, ready=request.ready[n:]))

    def _sample(
        self, placer: ScoringPlacer, request: PlacementRequest, graphs: Mapping[str, RunGraph]
    ) -> list[Decision]:
        scores = placer.pool_scores(request, graphs)
        pools = {p.name: p for p in request.pools}
        out: list[Decision] = []
        t = self.config.temperature
        for ready, logits in zip(request.ready, scores, strict=False):
            g = graphs[ready.run_key]
            task = g.tasks[view(g).index[ready.task_id]]
            allowed = {p.name for p in feasible(task, request.pools)}
            names = [n for n in logits if n in pools and (n in allowed or not allowed)]
            if not names:
                # only pools that cannot run it were scored: a decision on one of them, which
                # _enforce replaces by the fallback's (found by review: skipped here, the task
                # read as held by the policy, and waited for the executor's max_wait_s)
                scored = next((n for n in logits if n in pools), None)
                if scored is not None:
                    out.append(Decision(ready.run_key, ready.task_id, scored, pools[scored].vm_class,
                                        score=float(logits[scored]), reason=f"{placer.name} {placer.version}"))
                continue
            z = np.array([logits[n] for n in names], dtype=np.float64)
            # the maximum first: a tiny temperature divided first made inf - inf = NaN (found by review)
            with np.errstate(over="ignore"):
                z = (z - z.max()) / t
            prob = np.exp(z) / np.exp(z).sum()
            k = int(self.rng.choice(len(names), p=prob))
            pool = pools[names[k]]
            reason = f"{placer.name} {placer.version}: p={prob[k]:.2f} at temperature {t:g}"
            out.append(Decision(ready.run_key, ready.task_id, pool.name, pool.vm_class,
                                score=float(logits[names[k]]), reason=reason))
        return out

    def _enforce(
        self,
        placer: Placer,
        request: PlacementRequest,
        graphs: Mapping[str, RunGraph],
        proposed: Sequence[Decision],
    ) -> list[Decision]:
        by_key = {(d.run_key, d.task_id): d for d in proposed}
        out: list[Decision] = []
        redo: dict[int, str] = {}
        for ready in request.ready:
            d = by_key.get(ready.key)
            if d is None:
                continue  # the placer chose to wait for a better pool
            why = violation(d, request, graphs.get(ready.run_key))
            if why is not None:
                redo[len(out)] = f"arbiter: {placer.name} chose {d.pool}, but {why}"
                self.on_fallback("infeasible", 1)
            out.append(d)
        if redo:
            fb = {(d.run_key, d.task_id): d for d in self.fallback.place(request, graphs)}
            for i, note in redo.items():
                alt = fb[(out[i].run_key, out[i].task_id)]
                out[i] = _with_reason(alt, f"{note}; {self.fallback.name}: {alt.reason}")
        return out

    def _fallback_all(
        self, request: PlacementRequest, graphs: Mapping[str, RunGraph], note: str
    ) -> list[Decision]:
        fb = {(d.run_key, d.task_id): d for d in self.fallback.place(request, graphs)}
        return [
            _with_reason(fb[r.key], f"{note}; {self.fallback.name}: {fb[r.key].reason}")
            for r in request.ready
        ]


def _with_reason(d: Decision, reason: str) -> Decision:
    return Decision(d.run_key, d.task_id, d.pool, d.vm_class, d.score, reason, d.fallback)

