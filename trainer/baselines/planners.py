"""Static list-scheduling planners run online: HEFT with insertion, and CPOP.

HEFT (Topcuoglu, Hariri & Wu, IEEE TPDS 2002): tasks in decreasing upward rank (mean cost over
the pools that can run them), each on the slot giving the earliest finish, inserted into an idle
gap of that slot's timeline when one is long enough ("insertion-based policy"). CPOP (same paper):
priority = upward + downward rank; the critical-path tasks all go to the one pool that runs the
critical path fastest, the others to their earliest-finish slot.

Online use: a run is planned against the timelines of the runs planned before it the first time
a request carries it; the plan fixes each task's pool and its planned start. At every request a
ready task is sent to its planned pool, earliest planned start first, when that pool has a free
slot (or can still grow); otherwise it waits. A task whose planned pool is down or cannot hold
it is placed by earliest finish instead. Data transfer costs are zero (Celery tasks exchange
data through shared storage, not through the scheduler).
"""

from __future__ import annotations

import heapq
from typing import Mapping

from policy.catalogue import Catalogue
from policy.graph import view
from policy.placement import feasible
from policy.schema import Decision, PlacementRequest, PoolState, RunGraph
from trainer.baselines.ledger import run_time
from trainer.baselines.rules import _Rule

Plan = dict[int, tuple[str, float, float]]  # task index -> (pool, start, finish)


def _insert_at(slot: list[tuple[float, float]], ready: float, dur: float) -> tuple[float, int]:
    """Earliest start >= ready of a gap of length ``dur`` in ``slot`` (sorted intervals)."""
    t = ready
    for k, (s, e) in enumerate(slot):
        if t + dur <= s + 1e-9:
            return t, k
        t = max(t, e)
    return t, len(slot)


class _Planner(_Rule):
    version = "baseline-1"

    def __init__(self, catalogue: Catalogue | None = None) -> None:
        super().__init__(catalogue)
        self.timelines: dict[str, list[list[tuple[float, float]]]] = {}
        self.plans: dict[str, Plan] = {}

    # -- planning ---------------------------------------------------------------------------------

    def _slots(self, pool: PoolState) -> list[list[tuple[float, float]]]:
        tl = self.timelines.setdefault(pool.name, [])
        n = max(pool.slots, 1)
        while len(tl) < n:
            tl.append([])
        return tl[:n]

    def _prune(self, now: float) -> None:
        for tl in self.timelines.values():
            for slot in tl:
                k = 0
                while k < len(slot) and slot[k][1] < now:
                    k += 1
                if k:
                    del slot[:k]

    def _best_slot(self, dur: float, ready: float, pool: PoolState) -> tuple[float, float, list, int]:
        best = None
        for slot in self._slots(pool):
            start, k = _insert_at(slot, ready, dur)
            if best is None or start < best[0]:
                best = (start, start + dur, slot, k)
        assert best is not None
        return best

    def _mean_costs(self, graph: RunGraph, pools: tuple[PoolState, ...]) -> list[float]:
        out = []
        for t in graph.tasks:
            cand = feasible(t, pools) or [p for p in pools if p.up]
            w = sum(p.slots * run_time(t, p) for p in cand) / max(1, sum(p.slots for p in cand))
            out.append(w if w > 0 else sum(run_time(t, p) for p in cand) / max(1, len(cand)))
        return out

    def plan(self, graph: RunGraph, pools: tuple[PoolState, ...], now: float) -> Plan:
        raise NotImplementedError

    def _assign(self, plan: Plan, graph: RunGraph, i: int, ready: float,
                pools: list[PoolState]) -> None:
        task = graph.tasks[i]
        best = None
        for p in pools:
            start, finish, slot, k = self._best_slot(run_time(task, p), ready, p)
            if best is None or (finish, p.price_per_hour) < (best[1], best[4].price_per_hour):
                best = (start, finish, slot, k, p)
        assert best is not None
        start, finish, slot, k, p = best
        slot.insert(k, (start, finish))
        plan[i] = (p.name, start, finish)

    # -- dispatching ------------------------------------------------------------------------------

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        led = self.ledger
        self._begin(request)
        now = request.created_at
        if any(r.run_key not in self.plans for r in request.ready):
            self._prune(now)
            for key in list(self.plans):
                if key not in graphs:
                    del self.plans[key]
            for ready in request.ready:
                if ready.run_key not in self.plans:
                    self.plans[ready.run_key] = self.plan(graphs[ready.run_key], request.pools, now)
        pools = {p.name: p for p in request.pools}
        todo = []
        for ready in request.ready:
            g = view(graphs[ready.run_key])
            i = g.index[ready.task_id]
            pool_name, start, _ = self.plans[ready.run_key].get(i, ("", now, now))
            todo.append((start, -g.rank[i], ready, g.graph.tasks[i], pools.get(pool_name)))
        todo.sort(key=lambda x: (x[0], x[1]))
        out: list[Decision] = []
        for _, _, ready, task, pool in todo:
            if not self._any_slot(request):
                break
            if pool is None or not pool.up or not pool.fits(task):
                self._place_eft(out, ready, task, feasible(task, request.pools), None)
            elif led.has_free_slot(pool) or led.can_grow(pool):
                self._send(out, ready, pool, run_time(task, pool), f"{self.name} plan: {pool.name}")
        return out


class Heft(_Planner):
    """Online HEFT with insertion (see the module docstring)."""

    name = "heft"

    def plan(self, graph: RunGraph, pools: tuple[PoolState, ...], now: float) -> Plan:
        g = view(graph)
        w = self._mean_costs(graph, pools)
        rank = [0.0] * len(w)
        for i in reversed(g.order):
            rank[i] = w[i] + max((rank[c] for c in g.children[i]), default=0.0)
        plan: Plan = {}
        # decreasing rank is a topological order; ties (zero-cost tasks) broken by topological position
        pos = {i: k for k, i in enumerate(g.order)}
        for i in sorted(range(len(w)), key=lambda i: (-rank[i], pos[i])):
            ready = max([now] + [plan[p][2] for p in g.parents[i] if p in plan])
            cand = feasible(graph.tasks[i], pools) or [p for p in pools if p.up] or list(pools)
            self._assign(plan, graph, i, ready, cand)
        return plan


class Cpop(_Planner):
    """Online CPOP (see the module docstring)."""

    name = "cpop"

    def plan(self, graph: RunGraph, pools: tuple[PoolState, ...], now: float) -> Plan:
        g = view(graph)
        n = len(graph.tasks)
        w = self._mean_costs(graph, pools)
        up = [0.0] * n
        for i in reversed(g.order):
            up[i] = w[i] + max((up[c] for c in g.children[i]), default=0.0)
        down = [0.0] * n
        for i in g.order:
            down[i] = max((down[p] + w[p] for p in g.parents[i]), default=0.0)
        prio = [up[i] + down[i] for i in range(n)]
        cp_len = max(prio, default=0.0)
        on_cp = [abs(prio[i] - cp_len) <= 1e-6 * max(cp_len, 1.0) for i in range(n)]
        live = [p for p in pools if p.up] or list(pools)
        cp_tasks = [graph.tasks[i] for i in range(n) if on_cp[i]]
        # the pool that runs the critical path fastest; when none holds all of it, the one that
        # runs it fastest with the tasks it cannot hold at their best feasible pool (found by
        # review: every pool scored inf, and the cheapest, the slowest, was taken)
        best = [min((run_time(t, q) for q in feasible(t, pools)), default=float("inf")) for t in cp_tasks]
        cp_pool = min(live, key=lambda p: (not all(p.fits(t) for t in cp_tasks),
                                          sum(run_time(t, p) if p.fits(t) else b for t, b in zip(cp_tasks, best,
                                                                                                 strict=True)),
                                          p.price_per_hour))
        plan: Plan = {}
        indeg = [len(ps) for ps in g.parents]
        heap = [(-prio[i], i) for i in range(n) if indeg[i] == 0]
        heapq.heapify(heap)
        while heap:
            _, i = heapq.heappop(heap)
            ready = max([now] + [plan[p][2] for p in g.parents[i]])
            task = graph.tasks[i]
            if on_cp[i] and cp_pool.fits(task):
                self._assign(plan, graph, i, ready, [cp_pool])
            else:
                self._assign(plan, graph, i, ready, feasible(task, pools) or live)
            for c in g.children[i]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    heapq.heappush(heap, (-prio[c], c))
        return plan
