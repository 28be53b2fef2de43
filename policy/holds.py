"""How long a held task has been kept back, and when the executor's bounds place it anyway.

A policy may leave a ready task without a decision ("wait for a better pool"); the executor then
keeps it and offers it again at the next heartbeat. Two bounds end a hold, both served by
:class:`HoldClocks` so that the executor (``[drl_executor] max_wait_s`` / ``max_hold_s``) and the
simulator (``SimConfig.max_wait_s`` / ``max_hold_s``) bound holding the same way:

``wait_s``
    the longest a task is held **while a pool that could run it has a free slot**: the time the
    policy chose to wait. Time when every pool that fits the task was full does not count: a
    policy that holds a task then keeps the run order it chose instead of handing the task to a
    pool's first-come-first-served queue (found on 1,000-task runs, where a bound on the whole
    time held placed 80-90% of the tasks by the fallback; docs/policy.md, "At 1,000 tasks the
    60 s hold bound places most tasks by the fallback").
``hold_s``
    the longest a task is held in all. A held task is ``queued`` in Airflow, and the scheduler
    fails or re-queues a task queued longer than ``[scheduler] task_queued_timeout``; this bound
    keeps the executor below it. ``hold_s == wait_s`` is the single bound of earlier versions.

Whether a pool had a free slot is sampled at each decision point (a heartbeat; an event of the
simulator) and holds until the next: the time between two points counts as the first one saw it.
Clocks are keyed by any hashable task key and use the caller's clock (monotonic seconds in the
executor, simulated seconds in the simulator).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from policy.schema import PoolState, TaskNode

#: a bound counts as reached this close to it (float sums of simulated times)
_EPS = 1e-9
#: Airflow's default ``[scheduler] task_queued_timeout``
QUEUED_TIMEOUT_S = 600.0


def default_hold_s(wait_s: float, queued_timeout_s: float = QUEUED_TIMEOUT_S) -> float:
    """The default bound on the whole hold (``max_hold_s`` unset): half of the scheduler's
    ``task_queued_timeout`` (300 s with Airflow's default), never under ``wait_s``."""
    return max(wait_s, queued_timeout_s / 2)


@dataclass(slots=True)
class _Clock:
    since: float  # first held
    waited: float = 0.0  # closed intervals with a free slot
    open_since: float | None = None  # start of the current one, if a slot is free now


class HoldClocks:
    """The hold clocks of the tasks held now. ``wait_s`` / ``hold_s`` None: that bound is off."""

    def __init__(self, wait_s: float | None, hold_s: float | None = None) -> None:
        for name, v in (("wait_s", wait_s), ("hold_s", hold_s)):
            if v is not None and not v >= 0:
                raise ValueError(f"{name} must be None or >= 0, got {v!r}")
        self.wait_s = wait_s
        self.hold_s = hold_s
        self._clocks: dict[Hashable, _Clock] = {}

    def __len__(self) -> int:
        return len(self._clocks)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._clocks

    def since(self, key: Hashable) -> float | None:
        """When ``key`` was first held (None: it is not held)."""
        c = self._clocks.get(key)
        return None if c is None else c.since

    def held_s(self, key: Hashable, now: float) -> float:
        """Seconds ``key`` has been held in all (0 if it is not held)."""
        c = self._clocks.get(key)
        return 0.0 if c is None else now - c.since

    def waited_s(self, key: Hashable, now: float) -> float:
        """Seconds ``key`` has been held while a pool that fits it had a free slot."""
        c = self._clocks.get(key)
        if c is None:
            return 0.0
        return c.waited + (now - c.open_since if c.open_since is not None else 0.0)

    def overdue(self, key: Hashable, now: float) -> str | None:
        """Which bound ``key`` has reached (``"max_wait"`` / ``"max_hold"``), or None. A key not
        held yet is taken as held from ``now`` (a bound of 0 ends every hold at once)."""
        c = self._clocks.get(key)
        if self.hold_s is not None and (now - c.since if c else 0.0) >= self.hold_s - _EPS:
            return "max_hold"
        if self.wait_s is not None and self.waited_s(key, now) >= self.wait_s - _EPS:
            return "max_wait"
        return None

    def hold(self, key: Hashable, now: float, slot_free: bool) -> list[float]:
        """Note that ``key`` is held at ``now``, and whether a pool that fits it has a free slot
        now (it counts until the next call). Returns the instants at which a bound would end the
        hold if nothing changes (new ones only: the hold bound when the hold begins, the wait
        bound when a free-slot interval begins and it comes first)."""
        c = self._clocks.get(key)
        wakes: list[float] = []
        if c is None:
            c = self._clocks[key] = _Clock(now)
            if self.hold_s is not None:
                wakes.append(now + self.hold_s)
        if slot_free:
            if c.open_since is None:
                c.open_since = now
                if self.wait_s is not None:
                    at = now + self.wait_s - c.waited
                    if self.hold_s is None or at < c.since + self.hold_s - _EPS:
                        wakes.append(at)
        elif c.open_since is not None:
            c.waited += now - c.open_since
            c.open_since = None
        return wakes

    def forget(self, key: Hashable) -> None:
        """``key`` is no longer held (placed, or gone)."""
        self._clocks.pop(key, None)

    def keep_only(self, keys: Iterable[Hashable]) -> None:
        """Forget every clock but those of ``keys``."""
        keep = set(keys)
        self._clocks = {k: c for k, c in self._clocks.items() if k in keep}


def slot_free_for(task: TaskNode, pools: Sequence[PoolState], taken: dict[str, int] | None = None) -> bool:
    """Whether some pool that is up and fits ``task`` has a free slot (``taken``: slots already
    given away since ``pools`` was read, by pool name)."""
    for p in pools:
        if p.up and p.fits(task) and p.free_slots - (taken.get(p.name, 0) if taken else 0) > 0:
            return True
    return False
