"""The executor's ledger: what it sent to each pool, and when each task is expected to finish.

The policy was trained on pool states as the simulator reports them (``policy.schema.PoolState``,
``trainer/simulator.py::_pool_state``): ``busy`` the slots running tasks (never more than the
slots), ``queued`` the tasks sent and not yet started, and ``free_at`` the expected finish of
each, a running task at its start plus its expected run time, the queued ones chained FIFO on the
slots from now. The executor does not see Celery's queues, so it keeps what it sent, in dispatch
order, with each task's expected run time on its pool; the metadata DB tells which of them have
started, and when, and how many task instances run on each pool whichever scheduler sent them.
Until a task is seen running its start is the estimate made when it was sent. The states are
rebuilt at every request, so a pool whose tasks overrun shows its backlog's wait, not the
estimates of the moment each task was sent (found by review: a pool's queued tasks counted as
busy, ``queued`` was always 0, and expected finishes were never refreshed).

Several schedulers (Airflow HA): each knows the run times of the tasks it sent; a running task
another scheduler sent is charged its start plus its task's expected run time from the DAG's
history (``others``; was: its slot taken to free now, so a pool whose two slots both ran the
other scheduler's tasks, ending in 100 s and 300 s, showed its queue starting now).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policy.schema import MAX_FREE_AT

#: the longest run time the ledger counts a task for (about 31 years): finite on the wire
MAX_RUN_S = 1e9


@dataclass
class Sent:
    """One task instance try sent to a pool's Celery queue."""

    pool: str
    ti_id: str
    #: expected run time on that pool (speed-1 seconds over the pool's speed for the task's kind)
    run_s: float
    #: expected start when it was sent (epoch seconds): the slot the ledger expected to free first
    start_at: float


@dataclass(frozen=True)
class PoolLoad:
    """A pool's load as ``PoolState`` reports it."""

    busy: int = 0
    queued: int = 0
    free_at: tuple[float, ...] = ()


class Ledger:
    """Tasks in flight per pool, in dispatch order (keys as in the executor's ``running``)."""

    def __init__(self) -> None:
        self._sent: dict[Any, Sent] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def __contains__(self, key: object) -> bool:
        return key in self._sent

    def pool_of(self, key: Any) -> str | None:
        entry = self._sent.get(key)
        return entry.pool if entry is not None else None

    def add(self, key: Any, pool: str, ti_id: str, run_s: float, start_at: float) -> None:
        if run_s < 0 or run_s != run_s:
            raise ValueError(f"run_s must be a number >= 0, got {run_s!r}")
        # bounded: an expected finish must stay finite on the wire (found by review: a hint of
        # 1e308 s on a pool of speed 0.5 was inf, and every request was refused while it ran)
        run_s = min(run_s, MAX_RUN_S)
        self._sent.pop(key, None)  # a new try goes to the back of its pool's queue
        self._sent[key] = Sent(pool, ti_id, run_s, start_at)

    def drop(self, key: Any) -> None:
        self._sent.pop(key, None)

    def keep(self, alive: Collection[Any]) -> None:
        """Forget every task not in ``alive`` (finished, revoked, lost)."""
        if len(self._sent) > len(alive) or any(k not in alive for k in self._sent):
            self._sent = {k: e for k, e in self._sent.items() if k in alive}

    def started_by_pool(self, started: Mapping[str, float], alive: Collection[Any]) -> dict[str, int]:
        """How many of the tasks in flight that ``started`` shows running are on each pool."""
        out: dict[str, int] = {}
        for k, e in self._sent.items():
            if k in alive and e.ti_id in started:
                out[e.pool] = out.get(e.pool, 0) + 1
        return out

    def in_flight(self, alive: Collection[Any]) -> list[str]:
        """The ti ids of the tasks in flight (the ones to ask the metadata DB about)."""
        return [e.ti_id for k, e in self._sent.items() if k in alive]

    def _by_pool(self, names: Iterable[str], alive: Collection[Any] | None) -> dict[str, list[Sent]]:
        """The entries of each of these pools, in dispatch order, in one pass over the ledger
        (only those in ``alive``, when given)."""
        out: dict[str, list[Sent]] = {name: [] for name in names}
        for k, e in self._sent.items():
            if e.pool in out and (alive is None or k in alive):
                out[e.pool].append(e)
        return out

    def load(self, name: str, slots: int, now: float, *, alive: Collection[Any],
             started: Mapping[str, float] | None = None, running_there: int | None = None,
             others: Sequence[float] = ()) -> PoolLoad:
        """Pool ``name``'s load at ``now`` (see :meth:`loads`)."""
        there = None if running_there is None else {name: running_there}
        return self.loads({name: slots}, now, alive=alive, started=started, running_there=there,
                          others={name: others})[name]

    def loads(self, slots: Mapping[str, int], now: float, *, alive: Collection[Any],
              started: Mapping[str, float] | None = None,
              running_there: Mapping[str, int] | None = None,
              others: Mapping[str, Sequence[float]] | None = None) -> dict[str, PoolLoad]:
        """Each pool's load at ``now`` (``slots``: pool -> its slots). ``started``: ti id -> start
        (epoch seconds) of the tasks the metadata DB shows running; ``running_there``: how many
        task instances run on each pool, whichever scheduler sent them; ``others``: the expected
        finishes of those running there that this executor did not send. Without ``started`` (no
        DB read yet) the first tasks sent are taken to be the running ones, as a FIFO queue runs
        them."""
        out = {}
        for name, mine in self._by_pool(slots, alive).items():
            n_slots = slots[name]
            if started is None:
                n = min(len(mine), max(n_slots, 0))
                running = [(e.start_at + e.run_s) for e in mine[:n]]
                waiting = mine[n:]
                executing = n
            else:
                running = [started[e.ti_id] + e.run_s for e in mine if e.ti_id in started]
                running += (others or {}).get(name, ())
                waiting = [e for e in mine if e.ti_id not in started]
                executing = max((running_there or {}).get(name, 0), len(running))
            busy = min(executing, max(n_slots, 0))
            out[name] = PoolLoad(busy=busy, queued=len(waiting) + max(0, executing - busy),
                                 free_at=_chain(running, waiting, n_slots, now))
        return out

    def expected_start(self, name: str, slots: int, now: float) -> float:
        """When a task sent to pool ``name`` now should start: after every task sent there before
        it (this batch's earlier ones included) has taken a slot in turn."""
        return self.planner({name: slots}, now).start(name, 0.0)

    def planner(self, slots: Mapping[str, int], now: float) -> SlotPlanner:
        """The pools' slots as the tasks already sent will leave them (one pass over the ledger),
        for a batch of placements: each :meth:`SlotPlanner.start` takes the first slot to free
        (was: a scan of the whole ledger per placement, 28 ms a heartbeat with 2,000 in flight)."""
        sent = self._by_pool(slots, None)
        heaps: dict[str, list[float]] = {}
        for name, n in slots.items():
            mine = sent[name]
            if n <= 0:
                heaps[name] = []
                continue
            heap = [max(now, e.start_at + e.run_s) for e in mine[:n]] + [now] * max(0, n - len(mine))
            heapq.heapify(heap)
            for e in mine[n:]:
                heapq.heappush(heap, max(heapq.heappop(heap), now) + e.run_s)
            heaps[name] = heap
        return SlotPlanner(heaps, now)


class SlotPlanner:
    """Each pool's slots as a heap of the times they free; see :meth:`Ledger.planner`."""

    def __init__(self, heaps: dict[str, list[float]], now: float) -> None:
        self._heaps = heaps
        self.now = now

    def start(self, name: str, run_s: float) -> float:
        """The start of a task of ``run_s`` seconds sent to pool ``name`` now (its slot is then
        taken until start + run_s); ``now`` on a pool without slots."""
        heap = self._heaps.get(name)
        if not heap:
            return self.now
        start = max(heap[0], self.now)
        heapq.heapreplace(heap, start + run_s)
        return start


def _chain(running: list[float], waiting: list[Sent], slots: int, now: float) -> tuple[float, ...]:
    """Expected finishes: the running tasks', then each waiting task's on the first slot to free
    (as ``trainer/simulator.py::_pool_state`` chains a pool's queue), the earliest
    ``MAX_FREE_AT``."""
    out = sorted(running)
    heap = list(out) + [now] * max(0, slots - len(out))
    heapq.heapify(heap)
    if heap:
        for e in waiting[:MAX_FREE_AT]:
            t = max(heapq.heappop(heap), now) + e.run_s
            heapq.heappush(heap, t)
            out.append(t)
    out.sort()
    return tuple(out[:MAX_FREE_AT])
