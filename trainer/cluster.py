"""Worker pools at run time: live and booting workers, slots, the FIFO queue, autoscaling, billing.

One :class:`PoolRuntime` per :class:`~policy.catalogue.PoolSpec`. It models what a Celery queue
served by a KEDA-scaled worker set looks like to the executor:

* capacity is ``workers * slots_per_worker`` task slots (Celery concurrency);
* a task sent to the pool waits in its FIFO queue until a slot frees;
* an elastic pool (``min_workers != max_workers``) boots workers when its backlog needs them
  (ready ``boot_delay_s`` later) and scales in by one of two rules (``SimConfig.scale_in``):
  ``"sustained"`` (the default, what every figure so far was measured with): once the pool has
  had surplus workers *without a break* for ``idle_scale_down_s``, it removes every worker surplus
  at that moment, a worker idle for a second included (a scale-in alarm on "surplus > 0 for
  300 s"); ``"window"``: as Kubernetes' HPA, and so KEDA, scale down, the pool keeps the most
  workers that any moment of the last ``idle_scale_down_s`` needed, so a worker goes only after
  it has been surplus for that long (found by review: the docstring described ``"window"`` while
  the code did ``"sustained"``); workers are billed per ``billing_s`` started, from boot to
  removal;
* an outage takes the pool down (no slots); a slow-down multiplies its speed for tasks started
  while it lasts.

The simulator owns the event queue; this module only keeps the counts and the bill.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from policy.catalogue import PoolSpec
from policy.schema import PoolState


@dataclass
class PoolRuntime:
    """Mutable state of one pool during a simulation."""

    spec: PoolSpec
    workers: int = 0
    booting: int = 0
    running: int = 0
    inflight: int = 0
    up: bool = True
    speed_factor: float = 1.0
    failure_rate: float = 0.0
    queue: deque[tuple[int, int]] = field(default_factory=deque)
    #: boot times of the workers alive or booting now (billing), newest last
    alive_since: list[float] = field(default_factory=list)
    surplus_since: float | None = None
    cost: float = 0.0
    busy_slot_s: float = 0.0
    capacity_slot_s: float = 0.0
    #: what the autoscaler last saw (running, queued, workers, booting, up, surplus_since)
    scale_key: tuple[object, ...] = ()
    #: expected finish (start + duration / speed, no noise) of each running try, by (run, task)
    expect: dict[tuple[int, int], float] = field(default_factory=dict)
    #: the ``"window"`` scale-in rule's history: (time, workers needed from then on), oldest first
    needed_log: deque[tuple[float, int]] = field(default_factory=deque)
    _last_t: float = 0.0
    _state: PoolState | None = None
    _state_key: tuple[int, int, int, bool] | None = None

    @classmethod
    def start(cls, spec: PoolSpec, failure_rate: float = 0.0) -> PoolRuntime:
        rt = cls(spec=spec, workers=spec.workers, failure_rate=failure_rate)
        rt.alive_since = [0.0] * spec.workers
        # the "window" rule's history starts with the pool: its starting workers were needed at 0
        # (found by review: with no history, they counted as never needed and went at the first event)
        rt.needed_log.append((0.0, spec.workers))
        return rt

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def slots(self) -> int:
        return self.workers * self.spec.slots_per_worker if self.up else 0

    @property
    def queued(self) -> int:
        return len(self.queue) + self.inflight

    @property
    def min_workers(self) -> int:
        return self.spec.workers if self.spec.min_workers is None else self.spec.min_workers

    @property
    def max_workers(self) -> int:
        return self.spec.ceiling

    def can_start(self) -> bool:
        return self.up and bool(self.queue) and self.running < self.slots

    def account(self, now: float) -> None:
        """Accumulate busy and available slot-seconds up to ``now`` (for utilisation)."""
        dt = now - self._last_t
        if dt > 0:
            self.busy_slot_s += self.running * dt
            self.capacity_slot_s += self.slots * dt
            self._last_t = now

    def state(self) -> PoolState:
        """The pool as the executor reports it; reused while nothing it shows has changed."""
        key = (self.slots, self.running, self.queued, self.up)
        if key != self._state_key or self._state is None:
            vm = self.spec.vm_class
            self._state = PoolState(
                name=self.spec.name, vm_class=vm.name, slots=key[0], cpus=vm.cpus,
                memory_gb=vm.memory_gb, gpus=vm.gpus, speed=vm.speed * self.speed_factor,
                price_per_hour=vm.price_per_hour, busy=self.running, queued=key[2], up=self.up,
                failure_rate=self.failure_rate, affinity=vm.affinity,
            )
            self._state_key = key
        return self._state

    def invalidate(self) -> None:
        self._state_key = None

    # --- autoscaling -----------------------------------------------------------------------------

    def wanted_workers(self) -> int:
        spw = self.spec.slots_per_worker
        need = math.ceil((self.running + self.queued) / spw)
        return min(self.max_workers, max(self.min_workers, need))

    def scale_up(self, now: float) -> int:
        """Start booting workers the backlog needs; returns how many were started."""
        if not self.spec.elastic or not self.up:
            return 0
        extra = self.wanted_workers() - self.workers - self.booting
        for _ in range(max(0, extra)):
            self.booting += 1
            self.alive_since.append(now)
        return max(0, extra)

    def surplus(self) -> int:
        """Idle workers beyond what the backlog needs (never below ``min_workers``)."""
        if not self.spec.elastic or not self.up:
            return 0
        return max(0, self.workers - self.needed())

    def needed(self) -> int:
        """Workers the pool needs now: its backlog's, or the ones running tasks, within bounds."""
        busy_workers = math.ceil(self.running / self.spec.slots_per_worker)
        return max(self.wanted_workers(), busy_workers)

    def note_needed(self, now: float) -> bool:
        """Record what the pool needs now (``"window"`` rule); True when it fell, so that a
        scale-in may be due one window later."""
        need = self.needed()
        last = self.needed_log[-1][1] if self.needed_log else None
        if need != last:
            self.needed_log.append((now, need))
        return last is not None and need < last

    def window_surplus(self, now: float, window_s: float) -> int:
        """Workers surplus at every moment of the last ``window_s`` seconds (``"window"`` rule)."""
        if not self.spec.elastic or not self.up:
            return 0
        start = now - window_s + 1e-9
        while len(self.needed_log) > 1 and self.needed_log[1][0] <= start:
            self.needed_log.popleft()  # the value in force at the window's start is the first kept
        peak = max((n for _, n in self.needed_log), default=0)
        return max(0, self.workers - max(peak, self.needed()))

    def remove_workers(self, n: int, now: float) -> None:
        """Remove the ``n`` newest live workers (idle ones: the caller's), billed to ``now``."""
        for _ in range(n):
            self.workers -= 1
            # the booting workers are the last ``booting`` entries (a pool's boots take one delay,
            # so they end in the order they began): the newest live one is just before them (found
            # by review: the newest entry, a booting worker's, was billed for the live one removed)
            self._bill(self.alive_since.pop(len(self.alive_since) - self.booting - 1), now)
        self.invalidate()

    def _bill(self, since: float, until: float) -> None:
        billing = self.spec.billing_s
        life = max(0.0, until - since)
        billed = math.ceil(life / billing - 1e-9) * billing
        self.cost += billed * self.spec.vm_class.price_per_hour / 3600.0

    def close(self, now: float) -> None:
        """Bill every worker still alive (or booting) at the end of the simulation."""
        self.account(now)
        for since in self.alive_since:
            self._bill(since, now)
        self.alive_since.clear()
