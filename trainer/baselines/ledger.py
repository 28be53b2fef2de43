"""What a placer can know about pool availability from its own decisions and the pool counts.

A request tells a placer, per pool, how many slots exist and how many tasks are running or
queued; it does not say when they will finish. A placer that remembers its own decisions (as an
executor-side placer can) keeps an estimated finish time per task it sent, and reconciles that
list with the counts at every request: the pool holds ``busy + queued`` tasks, so the estimates
beyond that count are dropped (the earliest first), overdue ones are moved to "now".

``free_at(pool)`` is then the estimated time a slot frees for a NEW task sent to the pool's FIFO
queue: now when a slot is free, else the ``(k - slots + 1)``-th smallest finish estimate.
Elastic pools (from the catalogue) that may still grow free a slot after a boot delay.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from policy.catalogue import Catalogue
from policy.schema import PlacementRequest, PoolState, TaskNode

INF = float("inf")


@dataclass(frozen=True)
class PoolLimits:
    """Static facts about a pool an operator's placer is configured with (from the catalogue)."""

    max_slots: int
    boot_delay_s: float


def pool_limits(catalogue: Catalogue | None) -> dict[str, PoolLimits]:
    if catalogue is None:
        return {}
    out = {}
    for p in catalogue.pools:
        out[p.name] = PoolLimits(p.ceiling_slots, p.boot_delay_s)
    return out


class Ledger:
    """Finish-time estimates of the tasks this placer sent to each pool."""

    def __init__(self, catalogue: Catalogue | None = None) -> None:
        self.limits = pool_limits(catalogue)
        self._sent: dict[str, list[float]] = {}
        #: the working copy for the current request: committed + tentative (reserved) finishes
        self.view: dict[str, list[float]] = {}
        self.pools: dict[str, PoolState] = {}
        self.now = 0.0
        self._extra_queued: dict[str, int] = {}
        #: pools that may not grow while a rule places one task (:meth:`no_growth`)
        self.no_grow: frozenset[str] = frozenset()

    def begin(self, request: PlacementRequest) -> None:
        """Reconcile with the request's pool counts and start a fresh working copy."""
        self.now = now = request.created_at
        self.pools = {p.name: p for p in request.pools}
        self.view = {}
        self._extra_queued = {}
        for p in request.pools:
            sent = self._sent.get(p.name, [])
            k = p.busy + p.queued
            if len(sent) > k:
                del sent[: len(sent) - k]
            elif len(sent) < k:  # tasks someone else sent: assume they free "soon"
                sent[:0] = [now] * (k - len(sent))
            for i, f in enumerate(sent):
                if f < now:
                    sent[i] = now
                else:
                    break
            self._sent[p.name] = sent
            self.view[p.name] = list(sent)

    def free_at(self, pool: PoolState) -> float:
        """Estimated time a slot of ``pool`` is free for a new task (inf if never)."""
        if not pool.up:
            return INF
        lst = self.view[pool.name]
        k = len(lst)
        s = pool.slots
        t = INF
        if k < s:
            return self.now
        if s > 0:
            t = max(self.now, lst[k - s])
        if self.can_grow(pool):
            t = min(t, self.now + self.limits[pool.name].boot_delay_s)
        return t

    def can_grow(self, pool: PoolState) -> bool:
        """An elastic pool below its maximum, whose queue does not already cover the growth (and
        not in ``no_grow``)."""
        lim = self.limits.get(pool.name)
        if lim is None or pool.slots >= lim.max_slots or pool.name in self.no_grow:
            return False
        queued = pool.queued + self._extra_queued.get(pool.name, 0)
        return queued < lim.max_slots - pool.slots

    @contextmanager
    def no_growth(self, pools: Iterable[str]) -> Iterator[None]:
        """Within the block the named pools cannot grow: ``free_at`` and ``can_grow`` count only
        their live slots (``cost-cp``'s ``noboot``: a task with slack waits for a busy slot)."""
        self.no_grow = frozenset(pools)
        try:
            yield
        finally:
            self.no_grow = frozenset()

    def has_free_slot(self, pool: PoolState) -> bool:
        return pool.up and len(self.view[pool.name]) < pool.slots

    def commit(self, pool: PoolState, finish: float) -> None:
        """A task was sent to ``pool`` with estimated finish ``finish``."""
        if not self.has_free_slot(pool):
            self._extra_queued[pool.name] = self._extra_queued.get(pool.name, 0) + 1
        bisect.insort(self._sent.setdefault(pool.name, []), finish)
        bisect.insort(self.view[pool.name], finish)

    def reserve(self, pool: PoolState, finish: float) -> None:
        """Hold a slot of ``pool`` in this request only (a task waits for it, not yet sent)."""
        bisect.insort(self.view[pool.name], finish)


def run_time(task: TaskNode, pool: PoolState) -> float:
    return task.duration_s / pool.speed_for(task.kind)
