"""Dispatch rules as :class:`~policy.placement.Placer`\\ s: random, round-robin, static queue, FIFO,
list scheduling (a job order x a placement), min-min and two cost-aware rules (``cost-aware``,
``cost-cp``).

Every rule sees only the request (and the catalogue an operator would configure it with) and
keeps a :class:`~trainer.baselines.ledger.Ledger` of its own decisions. Rules that *wait* for a
busy, faster pool leave the task out of their reply (late binding: the task stays ready and is
offered again), except when waiting is on an elastic pool that can still grow: then the task is
queued there, because KEDA-style scaling only sees queued tasks.

Job orders (issue 3; Decima, Mao et al. 2019, for SRPT across jobs):

* ``fifo`` -- oldest run first; inside a run, longest remaining critical path first;
* ``srpt`` -- run with the least remaining work first (then critical path);
* ``rcp``  -- run with the shortest remaining critical path first;
* ``cpf``  -- critical-path tasks first across all runs (largest upward rank).

Placements:

* ``ff``  -- fastest pool with a free slot (never waits);
* ``eft`` -- earliest estimated finish, which may wait for a busy faster pool;
* ``eftm`` -- earliest finish, but waits only if it beats the best free pool by ``margin``.
"""

from __future__ import annotations

import math
import random
from contextlib import nullcontext
from typing import Callable, Mapping

import numpy as np

from policy.catalogue import Catalogue
from policy.graph import GraphView, view
from policy.placement import feasible
from policy.schema import Decision, PlacementRequest, PoolState, ReadyTask, RunGraph, RunProgress, TaskNode
from trainer.baselines.ledger import INF, Ledger, run_time

ORDERS = ("fifo", "srpt", "rcp", "cpf")
PLACEMENTS = ("ff", "eft", "eftm")

Item = tuple[ReadyTask, TaskNode, GraphView, int]


def _decision(ready: ReadyTask, pool: PoolState, finish: float, why: str) -> Decision:
    return Decision(ready.run_key, ready.task_id, pool.name, pool.vm_class, score=-finish, reason=why)


def _items(request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Item]:
    out = []
    views: dict[str, GraphView] = {}
    for ready in request.ready:
        g = views.get(ready.run_key)
        if g is None:
            g = views[ready.run_key] = view(graphs[ready.run_key])
        i = g.index[ready.task_id]
        out.append((ready, g.graph.tasks[i], g, i))
    return out


def _remaining_cp(items: list[Item], request: PlacementRequest) -> dict[str, float]:
    """Per run, the longest upward rank among its ready tasks in ``items`` and its running tasks:
    what is left of its critical path (``rcp``'s job key; ``cost-cp``'s critical-path test)."""
    progress = {p.run_key: p for p in request.progress}
    out: dict[str, float] = {}
    for _, _, g, i in items:
        rk = g.graph.run_key
        cur = out.get(rk)
        if cur is None:
            prog = progress.get(rk)
            cur = max((g.rank[g.index[t]] for t in prog.running), default=0.0) if prog else 0.0
        out[rk] = max(cur, g.rank[i])
    return out


class _Rule:
    """Shared machinery: the ledger, and sending / reserving one task."""

    name = "rule"
    version = "baseline-1"

    def __init__(self, catalogue: Catalogue | None = None) -> None:
        self.ledger = Ledger(catalogue)
        #: the last reply's tasks in the order the rule took them, each ``(run_key, task_id,
        #: pool, sent)``: ``sent=False`` for a task that reserved a busy pool's next slot and
        #: waits (what imitation with ``reserve_busy`` learns from; not part of the reply)
        self.trace: list[tuple[str, str, str, bool]] = []

    def _begin(self, request: PlacementRequest) -> None:
        self.ledger.begin(request)
        self.trace = []

    def _reserve(self, ready: ReadyTask, pool: PoolState, finish: float) -> None:
        """``ready`` waits for ``pool``'s next slot: later tasks of this batch see the slot held."""
        self.ledger.reserve(pool, finish)
        self.trace.append((ready.run_key, ready.task_id, pool.name, False))

    def _any_slot(self, request: PlacementRequest) -> bool:
        led = self.ledger
        return any(led.has_free_slot(p) or (p.up and led.can_grow(p)) for p in request.pools)

    def _send_or_reserve(self, out: list[Decision], ready: ReadyTask, pool: PoolState, run_s: float,
                         finish: float, why: str) -> None:
        """Send ``ready`` to ``pool`` when it has a free slot or can grow; else it waits for the
        pool's next slot (``finish``: its estimated finish there)."""
        if self.ledger.has_free_slot(pool) or self.ledger.can_grow(pool):
            self._send(out, ready, pool, run_s, why)
        else:
            self._reserve(ready, pool, finish)

    def _send(self, out: list[Decision], ready: ReadyTask, pool: PoolState, run_s: float, why: str) -> None:
        finish = max(self.ledger.free_at(pool), self.ledger.now) + run_s
        self.ledger.commit(pool, finish)
        out.append(_decision(ready, pool, finish, why))
        self.trace.append((ready.run_key, ready.task_id, pool.name, True))

    def _place_eft(self, out: list[Decision], ready: ReadyTask, task: TaskNode, pools: list[PoolState],
                   margin: float | None) -> None:
        """Earliest finish: send if the best pool has a free slot (or can grow), else wait."""
        led = self.ledger
        now = led.now
        best: tuple[float, float, str] | None = None
        best_pool = None
        best_free: tuple[float, float, str] | None = None
        best_free_pool = None
        for p in pools:
            run_s = run_time(task, p)
            f = led.free_at(p) + run_s
            key = (f, p.price_per_hour, p.name)
            if best is None or key < best:
                best, best_pool = key, p
            if led.has_free_slot(p) and (best_free is None or key < best_free):
                best_free, best_free_pool = key, p
        if best is None or best_pool is None or best[0] == INF:
            return
        if margin is not None and best_free is not None and best_free_pool is not best_pool:
            if (best_free[0] - now) <= (1.0 + margin) * (best[0] - now):
                best, best_pool = best_free, best_free_pool
        assert best_pool is not None
        run_s = run_time(task, best_pool)
        self._send_or_reserve(out, ready, best_pool, run_s, best[0], f"eft {best[0] - now:.1f}s on {best_pool.name}")

    def _place_ff(
        self, out: list[Decision], ready: ReadyTask, task: TaskNode, pools: list[PoolState]
    ) -> None:
        led = self.ledger
        free = [p for p in pools if led.has_free_slot(p)]
        if not free:
            free = [p for p in pools if led.can_grow(p)]
        if not free:
            return
        p = max(free, key=lambda q: (q.speed_for(task.kind), -q.price_per_hour))
        self._send(out, ready, p, run_time(task, p), f"fastest free: {p.name}")


class ListScheduler(_Rule):
    """A job order combined with a placement (see the module docstring)."""

    def __init__(self, order: str, placement: str, catalogue: Catalogue | None = None,
                 margin: float = 0.25) -> None:
        super().__init__(catalogue)
        if order not in ORDERS:
            raise ValueError(f"unknown job order {order!r}; expected one of {ORDERS}")
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")
        self.order, self.placement, self.margin = order, placement, margin
        self._live: tuple[ReadyTask, ...] = ()
        self.name = f"{order}+{placement}"
        #: run_key -> (finished count seen, work done, total work); dropped when a run leaves
        self._work: dict[str, tuple[int, float, float]] = {}

    def _remaining_work(self, g: GraphView, prog: RunProgress | None) -> float:
        key = g.graph.run_key
        hit = self._work.get(key)
        if hit is None:
            hit = (0, 0.0, g.total_work_s)
        n, done, total = hit
        if prog is not None and n != len(prog.finished):
            tasks, index = g.graph.tasks, g.index
            done = sum(tasks[index[t]].duration_s for t in prog.finished)
            hit = (len(prog.finished), done, total)
        self._work[key] = hit
        if len(self._work) > 4 * 4096:  # forget runs that have left the system
            self._work = {k: v for k, v in self._work.items() if k in {r.run_key for r in self._live}}
        return total - done

    def sort(self, items: list[Item], request: PlacementRequest) -> None:
        order = self.order
        if order == "cpf":
            items.sort(key=lambda it: (-it[2].rank[it[3]], -it[1].priority))
            return
        if order == "rcp":  # the longest upward rank among the run's ready and running tasks
            job_key = _remaining_cp(items, request)
        else:
            progress = {p.run_key: p for p in request.progress}
            job_key = {}
            for _, _, g, _ in items:
                rk = g.graph.run_key
                if order == "fifo":
                    prog = progress.get(rk)
                    job_key[rk] = request.created_at - (prog.age_s if prog else 0.0)
                elif rk not in job_key:  # srpt
                    job_key[rk] = self._remaining_work(g, progress.get(rk))
        items.sort(key=lambda it: (job_key[it[0].run_key], it[0].run_key, -it[2].rank[it[3]]))

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        self._begin(request)
        self._live = request.ready
        items = _items(request, graphs)
        self.sort(items, request)
        out: list[Decision] = []
        for ready, task, _, _ in items:
            if not self._any_slot(request):
                break  # nothing can be sent any more in this batch: the rest waits
            pools = feasible(task, request.pools)
            if self.placement == "ff":
                self._place_ff(out, ready, task, pools)
            else:
                self._place_eft(out, ready, task, pools, self.margin if self.placement == "eftm" else None)
        return out


class MinMin(_Rule):
    """Min-min (Ibarra & Kim 1977), online: repeatedly send the ready task with the earliest
    achievable finish to the pool achieving it; tasks whose best pool is busy wait."""

    name = "min-min"

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        led = self.ledger
        self._begin(request)
        items = _items(request, graphs)
        pools = list(request.pools)
        if not items:
            return []
        # run[k, p]: task k's run time on pool p (inf where infeasible); one row per ready task
        run = np.full((len(items), len(pools)), INF)
        for k, (_, t, _, _) in enumerate(items):
            for j, p in enumerate(pools):
                if p.up and p.fits(t):
                    run[k, j] = run_time(t, p)
        out: list[Decision] = []
        while self._any_slot(request):
            free = np.array([led.free_at(p) for p in pools])
            finish = run + free
            flat = int(np.argmin(finish))
            k, j = divmod(flat, len(pools))
            f = float(finish[k, j])
            if f == INF:
                break
            run[k, :] = INF
            ready, task, _, _ = items[k]
            p = pools[j]
            self._send_or_reserve(out, ready, p, run_time(task, p), f, f"min-min finish {f - led.now:.1f}s")
        return out


class CostAware(ListScheduler):
    """The cheapest pool whose estimated finish is within ``slack`` of the earliest one.

    Jobs in SRPT order; a task waits (late binding) when its chosen pool is busy.
    """

    def __init__(self, catalogue: Catalogue | None = None, slack: float = 0.5) -> None:
        super().__init__("srpt", "eft", catalogue)
        self.slack = slack
        self.name = "cost-aware"

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        led = self.ledger
        self._begin(request)
        self._live = request.ready
        items = _items(request, graphs)
        self.sort(items, request)
        out: list[Decision] = []
        now = led.now
        for ready, task, _, _ in items:
            if not self._any_slot(request):
                break
            scored = [(led.free_at(p) + run_time(task, p), p) for p in feasible(task, request.pools)]
            scored = [s for s in scored if s[0] < INF]
            if not scored:
                continue
            best_f = min(f for f, _ in scored)
            within = [(f, p) for f, p in scored if f - now <= (1.0 + self.slack) * (best_f - now)]
            ok = [(run_time(task, p) * p.price_per_hour, f, p) for f, p in within]
            if any(math.isinf(c) for c, _, _ in ok):  # found by review: huge prices overflowed to a
                # tie at inf, and the earlier finish took a pool 17x the price; their ratio compares
                top = max(p.price_per_hour for _, p in within)
                ok = [(run_time(task, p) * (p.price_per_hour / top), f, p) for f, p in within]
            _, f, p = min(ok, key=lambda s: (s[0], s[1], s[2].name))
            self._send_or_reserve(out, ready, p, run_time(task, p), f, f"cheapest within {self.slack:.0%} of eft")
        return out


class CriticalPathCost(ListScheduler):
    """``srpt+eft`` that keeps premium-priced pools for critical-path tasks (``cost-cp``).

    A pool is *premium* for a task when its price per unit of that task's work (price per hour
    / speed for the task's kind) is more than ``ratio`` x the cheapest feasible pool's. A task
    off its run's critical path (its upward rank below the longest upward rank among the run's
    ready and running tasks) never goes to a premium pool (with ``premium_free_slots``, only to
    one that has a free slot, so that no worker boots for it); a critical-path task may (with
    ``every_task``, none may: the premium gate of ``policy.features.CP_GATE_SCOPES``' ``all``).
    Everything else is ``srpt+eft`` (``order``: another list order).

    Variants measured by ``scripts/cost_frontier.py --cp`` (docs/policy.md, "Riding a premium
    worker"): with ``ride`` = f > 0, a task with slack may take a premium pool's free slot when
    its run time is at most f x the time left of the latest task running or queued there (the
    worker is billed for that time anyway);
    with ``near`` < 1 a task counts as critical when its upward rank is at least ``near`` x the
    run's critical path; with ``slack`` = k it may take a premium pool when the cheap pools'
    earliest finish is later than all pools' by more than k x its slack (the critical path's rank
    less its own). With ``soft`` = s and ``slack`` = k, the pools priced within ``ratio`` but over
    s x the cheapest are a second tier a task with slack takes only when the cheapest pools would
    finish it later by more than k x its slack. With ``noboot`` = k a task with slack makes no
    pool grow (it waits for a busy slot) unless the boot would finish it earlier by more than
    k x its slack.

    Why it saves money on elastic pools: a worker the autoscaler boots is removed only after
    ``idle_scale_down_s`` of surplus, which a stream of arrivals rarely leaves it, so using a
    premium pool for work that has slack keeps its workers billed for the rest of the stream;
    critical-path tasks are the ones whose finish sets the run's. The idea is the partial
    critical paths of IC-PCP (Abrishami et al. 2013): cheap resources for work with slack.
    """

    def __init__(self, catalogue: Catalogue | None = None, ratio: float = 3.0,
                 premium_free_slots: bool = False, every_task: bool = False, ride: float = 0.0,
                 near: float = 1.0, slack: float | None = None, order: str = "srpt",
                 soft: float | None = None, noboot: float | None = None) -> None:
        super().__init__(order, "eft", catalogue)
        if not ratio >= 1.0:
            raise ValueError(f"cost-cp needs a premium ratio >= 1, got {ratio!r}")
        self.ratio, self.premium_free_slots, self.every_task = ratio, premium_free_slots, every_task
        self.ride, self.near, self.slack, self.soft, self.noboot = ride, near, slack, soft, noboot
        self.name = "cost-cp"

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        led = self.ledger
        self._begin(request)
        self._live = request.ready
        items = _items(request, graphs)
        self.sort(items, request)
        crit = _remaining_cp(items, request)
        out: list[Decision] = []
        for ready, task, g, i in items:
            if not self._any_slot(request):
                break
            pools = feasible(task, request.pools)
            off_cp = g.rank[i] < self.near * crit[ready.run_key]
            slack_s = crit[ready.run_key] - g.rank[i]
            if len(pools) > 1 and (self.every_task or off_cp):
                per_work = [p.price_per_hour / p.speed_for(task.kind) for p in pools]
                lowest = min(per_work)
                priced = [(p, c) for p, c in zip(pools, per_work, strict=True)
                          if c <= self.ratio * lowest or (self.premium_free_slots and led.has_free_slot(p))
                          or (self.ride > 0 and self._rides(p, task))]
                cheap = [p for p, _ in priced]
                if self.soft is not None:  # a second tier: the pools within soft x the cheapest
                    cheapest = [p for p, c in priced if c <= self.soft * lowest]
                    pools = cheap if self._late(task, cheapest, cheap, (self.slack or 0.0) * slack_s) else cheapest
                elif self.slack is None or not self._late(task, cheap, pools, self.slack * slack_s):
                    pools = cheap
            no_boot = self.noboot is not None and off_cp and pools and not self._boot_pays(
                task, pools, self.noboot * slack_s)
            with led.no_growth(p.name for p in pools) if no_boot else nullcontext():
                self._place_eft(out, ready, task, pools, None)
        return out

    def _boot_pays(self, task: TaskNode, pools: list[PoolState], allowed_s: float) -> bool:
        """Growing a pool (a worker boots) finishes ``task`` earlier than the busy slots would by
        more than ``allowed_s`` (``noboot`` x its slack)."""
        led = self.ledger
        grown = min(led.free_at(p) + run_time(task, p) for p in pools)
        with led.no_growth(p.name for p in pools):
            kept = min(led.free_at(p) + run_time(task, p) for p in pools)
        return kept - grown > allowed_s

    def _late(self, task: TaskNode, cheap: list[PoolState], pools: list[PoolState], allowed_s: float) -> bool:
        """The cheap pools' earliest finish is later than all pools' by more than ``allowed_s``
        (``slack`` x the task's slack: the critical path's rank less its own)."""
        led = self.ledger
        finish = {p.name: led.free_at(p) + run_time(task, p) for p in pools}
        return min((finish[p.name] for p in cheap), default=INF) - min(finish.values()) > allowed_s

    def _rides(self, pool: PoolState, task: TaskNode) -> bool:
        """A free slot of ``pool`` that a task already running there keeps billed past this
        task's finish (its run time at most ``ride`` x that task's time left): taking it extends
        no worker's life."""
        led = self.ledger
        busy = led.view[pool.name]
        return (led.has_free_slot(pool) and bool(busy)
                and self.ride * (busy[-1] - led.now) >= run_time(task, pool))


class Fifo(_Rule):
    """First come, first served: ready tasks in the order they became ready, each to the first
    pool (catalogue order) with a free slot; the rest waits."""

    name = "fifo"

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        led = self.ledger
        self._begin(request)
        out: list[Decision] = []
        for ready, task, _, _ in _items(request, graphs):
            if not self._any_slot(request):
                break
            pools = feasible(task, request.pools)
            p = next((q for q in pools if led.has_free_slot(q)), None)
            p = p or next((q for q in pools if led.can_grow(q)), None)
            if p is not None:
                self._send(out, ready, p, run_time(task, p), "first free pool")
        return out


class _Committing(_Rule):
    """Rules that send every ready task at once to a pool chosen by ``pick`` (Celery-style)."""

    def pick(self, task: TaskNode, pools: list[PoolState]) -> PoolState:
        raise NotImplementedError

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        self._begin(request)
        out: list[Decision] = []
        for ready, task, _, _ in _items(request, graphs):
            pools = feasible(task, request.pools)
            if pools:
                p = self.pick(task, pools)
                self._send(out, ready, p, run_time(task, p), self.name)
        return out


class RandomPlacer(_Committing):
    """A uniformly random feasible pool."""

    name = "random"

    def __init__(self, catalogue: Catalogue | None = None, seed: int = 0) -> None:
        super().__init__(catalogue)
        self.rng = random.Random(seed)

    def pick(self, task: TaskNode, pools: list[PoolState]) -> PoolState:
        return pools[self.rng.randrange(len(pools))]


class RoundRobin(_Committing):
    """Feasible pools in turn."""

    name = "round-robin"

    def __init__(self, catalogue: Catalogue | None = None) -> None:
        super().__init__(catalogue)
        self.turn = 0

    def pick(self, task: TaskNode, pools: list[PoolState]) -> PoolState:
        self.turn += 1
        return pools[self.turn % len(pools)]


class StaticQueue(_Committing):
    """What Airflow does today: each task to the queue its author typed. Authors send the task
    kinds a VM class is built for (affinity > 1) to that pool, everything else to the default
    (first) pool that can hold it."""

    name = "static"

    def pick(self, task: TaskNode, pools: list[PoolState]) -> PoolState:
        special = [p for p in pools if p.affinity.get(task.kind, 1.0) > 1.0]
        if special:
            return max(special, key=lambda p: p.affinity.get(task.kind, 1.0))
        return pools[0]


Factory = Callable[[Catalogue, int], object]
