"""The one placement interface, and the placers that ship without a model.

Every policy (the baselines in the simulator, the GNN policy, the policy server's fallback and the
executor's own fallback) is a :class:`Placer`: a callable object that maps a
:class:`~policy.schema.PlacementRequest`, with the full graphs of its runs, to one
:class:`~policy.schema.Decision` per ready task. The simulator builds the same request objects as
the executor, so what the lab measures is what production runs.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping, Protocol, Sequence, runtime_checkable

from policy.graph import GraphView, view
from policy.schema import Decision, PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode


@runtime_checkable
class Placer(Protocol):
    """Decides a pool for every ready task of a request.

    ``graphs`` maps each ``run_key`` of ``request.ready`` to its full :class:`RunGraph` (the server
    resolves :class:`~policy.schema.RunRef` entries from its cache before calling). A placer never
    returns a pool that is down or that cannot hold the task when a feasible one exists.
    """

    name: str
    version: str

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        ...


def feasible(task: TaskNode, pools: Sequence[PoolState]) -> list[PoolState]:
    """Pools that satisfy the task's hard constraints (resources, pinning: a pin no pool can
    honour leaves the resources) and are up; when every pool that satisfies them is down, those
    pools (the task queues there and waits for a worker: a GPU task is not sent to a CPU box, nor
    a pinned task off its pin, because a pool is down)."""
    fit = [p for p in pools if p.fits(task)]
    if not fit and task.pool is not None:
        # a pin no pool honours (not in the catalogue, or too small for the task) is dropped, not
        # the task's resources (found by review: the heuristic then took "the largest" pool by
        # CPUs, one without the memory the task asks while another pool had it)
        fit = [p for p in pools if p.fits(replace(task, pool=None))]
    return [p for p in fit if p.up] or fit


def unfit(task: TaskNode, pools: Sequence[PoolState]) -> str:
    """Why no pool satisfies ``task``'s hard constraints, for a decision's reason: a pin its
    pool cannot honour is named as such (found by review: a task pinned to a pool too small for it
    was placed off its pin with the reason 'no pool fits', while other pools did)."""
    if task.pool is not None:
        unpinned = replace(task, pool=None)
        fits_some = any(p.fits(unpinned) for p in pools)
        if not any(p.name == task.pool for p in pools):
            # found by review: a task that fits no pool either was told only about its pin
            return (f"pinned to {task.pool}, which is not one of the pools: placed off its pin"
                    + ("" if fits_some else f"; no pool fits {task.asks}"))
        if fits_some:
            return f"pinned to {task.pool}, which cannot hold {task.asks}: placed off its pin"
    return f"no pool fits {task.asks}"


def down_note(pool: PoolState) -> str:
    """A reason's note for a decision to a pool that is down (it was the only pool that may run it)."""
    return f"{pool.name} is down, the only pool that may run it: queued for its workers"


def ordered_ready(
    request: PlacementRequest, graphs: Mapping[str, RunGraph]
) -> list[tuple[ReadyTask, TaskNode, GraphView]]:
    """Ready tasks with their nodes, longest remaining critical path first (ties: priority)."""
    items = []
    for ready in request.ready:
        g = view(graphs[ready.run_key])
        items.append((ready, g.graph.tasks[g.index[ready.task_id]], g))
    items.sort(key=lambda it: (-it[2].rank[it[2].index[it[0].task_id]], -it[1].priority))
    return items


class EarliestFinishPlacer:
    """Least-loaded earliest-finish placement: the default heuristic and the executor's fallback.

    Tasks are taken longest remaining critical path first; each goes to the feasible pool with the
    earliest estimated finish, ``wait + duration / effective speed``, where ``wait`` is zero while
    the pool has a free slot; otherwise, with the pool's expected finish times (``free_at``, on the
    request's ``created_at`` clock, as the executor's and the simulator's ledgers send them), until
    the slot the task queues for frees, extrapolated by a run time of the task per slot beyond
    the known ones; without them, a run time of the task per task ahead per slot. Tasks placed
    earlier in the same batch count as backlog. A pool that may still grow (``max_slots``, room
    left after its queued tasks) waits at most its boot delay; a pool with no slot that cannot grow
    never frees one (infinite wait: chosen only when no other pool may run the task, and said so).
    That is the wait the rules' ledgers and the model's features count. Version 1 divided by one
    slot at least (a pool scaled to zero looked like one busy slot, its wait a run time of the
    task, not its boot; found by review), version 2 read no ``free_at`` (a pool whose one busy task
    ends in 10 s looked 100 s away to a 100 s task).
    """

    name = "eft"
    version = "heuristic-3"

    def __init__(self, *, fallback: bool = False) -> None:
        self.fallback = fallback

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        extra: dict[str, int] = {p.name: 0 for p in request.pools}
        # each pool's expected finishes, ascending, once a request (not once a task and pool)
        free = {p.name: tuple(sorted(p.free_at)) for p in request.pools}
        out: list[Decision] = []
        for ready, task, _ in ordered_ready(request, graphs):
            out.append(self._place_one(ready, task, request.pools, extra, request.created_at, free))
        return out

    def _place_one(
        self, ready: ReadyTask, task: TaskNode, pools: Sequence[PoolState], extra: dict[str, int],
        now: float, free: Mapping[str, tuple[float, ...]],
    ) -> Decision:
        candidates = feasible(task, pools)
        note = "" if any(p.fits(task) for p in pools) else f"; {unfit(task, pools)}"
        if not candidates:
            # Nothing satisfies the hard constraints: the largest live pools, scored as any (found
            # by review: the first listed of two as large won, whatever their load) and said so
            live = [p for p in pools if p.up] or list(pools)
            size = max((p.cpus, p.memory_gb, p.gpus) for p in live)
            candidates = [p for p in live if (p.cpus, p.memory_gb, p.gpus) == size]
        scored = []
        for p in candidates:
            run_s = task.duration_s / p.speed_for(task.kind)
            wait_s, queue, why = _wait(p, extra[p.name], run_s, now, free[p.name])
            scored.append((wait_s + run_s, wait_s, run_s, p, queue, why))
        # equal finishes: a pool with a free slot before one with a queue (found by review: a task
        # of 0 s finished "at 0" everywhere, and a batch of them queued behind 50 tasks on the
        # cheapest pool while another had idle slots), then the price, then the name
        scored.sort(key=lambda s: (s[0], s[4], s[3].price_per_hour, s[3].name))
        finish, wait_s, run_s, best, _, why = scored[0]
        if math.isinf(finish):
            # no candidate frees a slot: the fastest of them, the task queues for a worker
            finish, wait_s, run_s, best, _, why = min(scored, key=lambda s: (s[2], s[3].price_per_hour, s[3].name))
            reason = (f"{best.name} ({best.vm_class}): {why}: queued for a worker, run {run_s:.1f}s"
                      f" at speed {best.speed_for(task.kind):g}")
        else:
            reason = (
                f"{best.name} ({best.vm_class}): est. finish {finish:.1f}s = wait {wait_s:.1f}s{why}"
                f" + run {run_s:.1f}s at speed {best.speed_for(task.kind):g}"
            )
        extra[best.name] += 1
        if len(scored) > 1:
            nxt = next(s for s in scored if s[3] is not best)
            reason += f"; next {nxt[3].name} " + (f"{nxt[0]:.1f}s" if math.isfinite(nxt[0]) else nxt[5])
        if task.pool is not None and task.pool == best.name:
            reason += f"; pinned to {task.pool}"
        if not best.up:
            reason += f"; {down_note(best)}"
        return Decision(
            run_key=ready.run_key,
            task_id=ready.task_id,
            pool=best.name,
            vm_class=best.vm_class,
            score=-finish if math.isfinite(finish) else -run_s,
            reason=reason + note,
            fallback=self.fallback,
        )


def _wait(pool: PoolState, placed: int, run_s: float, now: float, free: Sequence[float]) -> tuple[float, float, str]:
    """``(wait seconds, backlog per slot, reason note)`` for a new task of ``run_s`` on ``pool``
    with ``placed`` tasks already sent there in this batch, at ``now`` (the clock of ``free_at``,
    given ascending as ``free``):
    0 with a free slot; otherwise until the ``backlog - slots``-th of the pool's expected finishes
    (the slot it queues for), past the known ones a run time per slot more (as
    :func:`policy.features.wait_terms_reference`), or with none known a run time per task ahead
    per slot; capped by the boot delay while the pool may still grow (its queued tasks and this
    batch's have not used its room); infinite for a pool with no slot that cannot grow."""
    backlog = pool.busy + pool.queued + placed
    if backlog < pool.slots:
        return 0.0, 0.0, ""
    if pool.slots > 0:
        k = backlog - pool.slots  # the slot it queues for frees at the k-th expected finish
        queue = (k + 1) / pool.slots
        known = max(free[min(k, len(free) - 1)] - now, 0.0) if free else 0.0
        beyond = k - len(free) + 1  # tasks ahead past the known finishes: a run time per slot each
        wait_s = known + beyond / pool.slots * run_s if beyond > 0 else known
    else:
        queue = wait_s = math.inf
    top = pool.max_slots if pool.max_slots is not None else pool.slots
    if top > pool.slots and pool.queued + placed < top - pool.slots and pool.boot_s < wait_s:
        return pool.boot_s, queue, " (a worker's boot)"
    return wait_s, queue, "" if pool.slots > 0 else "no worker and it cannot grow"
