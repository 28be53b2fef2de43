"""Which worker pools have a live Celery worker, asked of the workers in a background thread.

The executor marks a pool *down* in its placement requests while no live Celery worker consumes
the pool's queue, so neither the policy nor the fallback heuristic sends work where nothing would
run it; a task that only that pool may run (a GPU task, a task pinned to it) still goes there and
waits for a worker (:func:`policy.placement.feasible`). The live workers also give each pool its
real size: an elastic pool's ``workers`` in the catalogue is only its size at start.

The answer comes from Celery's remote control, ``inspect().active_queues()`` (what ``celery
inspect active_queues`` and Flower use: a broadcast that each worker answers with the queues it
consumes), every ``interval_s`` seconds in a daemon thread with its own broker connection, never
in the scheduler loop. What it does not know it does not guess: before the first answer, when the
broadcast fails or no worker answers at all (a broker hiccup and every worker gone look the same),
or when the last answer is older than three rounds (interval + broadcast timeout),
:meth:`PoolWatch.live_workers` is None and every pool counts as the catalogue says, as if this
check were off.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)

#: worker name -> the queues it consumes, each ``{"name": queue, ...}`` (Celery's reply), or None
Replies = Mapping[str, Sequence[Mapping[str, Any]]] | None


#: seconds a broadcast may take past its own reply timeout (connecting, publishing) before it counts as hung
BROADCAST_GRACE_S = 5.0
#: a hung broadcast is tried again after this many seconds, leaving at most MAX_HUNG threads hanging
RETRY_HUNG_S = 300.0
MAX_HUNG = 3

_R = TypeVar("_R")


class Hung(TimeoutError):
    """A call :func:`run_within` gave up waiting for; ``thread`` still runs it."""

    def __init__(self, message: str, thread: threading.Thread) -> None:
        super().__init__(message)
        self.thread = thread


def run_within(fn: Callable[[], _R], timeout_s: float, what: str) -> _R:
    """``fn()`` in a daemon thread, its result or its exception; :class:`Hung` (a TimeoutError) when
    it has not returned within ``timeout_s`` (the thread is left to finish or hang on its own)."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=call, name=f"drl-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Hung(f"{what}: no answer within {timeout_s:g} s", thread)
    if "error" in out:
        raise out["error"]
    return out["value"]  # type: ignore[no-any-return]


def celery_inspector(app: Any, timeout_s: float) -> Callable[[], Replies]:
    """``active_queues()`` of every worker of Celery ``app``, over a connection of its own.

    Bounded: a broker that accepts and never answers held the broadcast for ever (kombu's ping of
    a silent Redis: found by review), the pool watch's thread with it, so no pool was checked
    again; now such a call raises TimeoutError after ``timeout_s`` + :data:`BROADCAST_GRACE_S`, and
    while it still hangs the next calls raise at once instead of stacking threads."""
    hung: list[tuple[threading.Thread, float]] = []  # broadcasts that have not returned, and since when

    def broadcast() -> Replies:
        with app.connection_for_write() as conn:
            return app.control.inspect(timeout=timeout_s, connection=conn).active_queues()  # type: ignore[no-any-return]

    def ask() -> Replies:
        hung[:] = [(t, since) for t, since in hung if t.is_alive()]
        # one more try after RETRY_HUNG_S (a connection black-holed for good would otherwise end the
        # checks until a restart), at most MAX_HUNG threads left hanging
        if hung and (len(hung) >= MAX_HUNG or time.monotonic() - hung[-1][1] < RETRY_HUNG_S):
            raise TimeoutError("the last Celery broadcast has not returned yet (the broker does not answer)")
        try:
            return run_within(broadcast, timeout_s + BROADCAST_GRACE_S, "pool-broadcast")
        except Hung as exc:
            hung.append((exc.thread, time.monotonic()))
            raise

    return ask


def live_per_pool(replies: Mapping[str, Any], pools: Sequence[str]) -> tuple[dict[str, int], set[str]]:
    """From the workers' ``active_queues`` replies: live workers per pool, and the queues workers
    consume that are no pool."""
    count = dict.fromkeys(pools, 0)
    foreign: set[str] = set()
    for queues in replies.values():
        for name in {q.get("name") for q in queues or () if isinstance(q, Mapping)}:
            if name in count:
                count[name] += 1
            elif isinstance(name, str):
                foreign.add(name)
    return count, foreign


class PoolWatch:
    """Live Celery workers per pool (queue), refreshed every ``interval_s`` by :meth:`start`'s thread."""

    def __init__(self, ask: Callable[[], Replies], pools: Sequence[str], *, interval_s: float,
                 answer_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        """``answer_s``: how long one check may take (the broadcast's timeout): an answer counts
        for three rounds of wait and check (found by review: three intervals alone, shorter than
        one round with a 2 s broadcast every 0.5 s, left every pool up for most of each round)."""
        # finite (found by review: inf ended the thread in Event.wait after one check, and that
        # answer never went stale; NaN broadcast back to back, and no answer ever went stale)
        if not (math.isfinite(interval_s) and math.isfinite(answer_s)) or interval_s <= 0 or answer_s < 0:
            raise ValueError(f"need finite interval_s > 0 and answer_s >= 0, got {interval_s!r}, {answer_s!r}")
        self._ask = ask
        self.pools = tuple(pools)
        self.interval_s = float(interval_s)
        self.shelf_s = 3 * (self.interval_s + float(answer_s))
        self._clock = clock
        self._lock = threading.Lock()
        self._live: dict[str, int] | None = None
        self._at = float("-inf")
        self._blind = False  # the last check learned nothing (logged once until one does)
        self._foreign: frozenset[str] = frozenset()  # queues workers consume that are no pool (last logged)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def live_workers(self) -> dict[str, int] | None:
        """Live workers per pool as of the last answer, or None while that is unknown or stale."""
        with self._lock:
            if self._live is None or self._clock() - self._at > self.shelf_s:
                return None
            return dict(self._live)

    def check(self) -> dict[str, int] | None:
        """Ask the workers once; what :meth:`live_workers` will say (None: no answer to go by)."""
        try:
            replies = self._ask()
        except Exception as exc:  # noqa: BLE001 - a broker failure leaves the pools as the catalogue says
            self._learned_nothing(f"the broadcast failed: {type(exc).__name__}: {exc}")
            return None
        if not replies:
            self._learned_nothing("no Celery worker answered")
            return None
        count, foreign = live_per_pool(replies, self.pools)
        if foreign and foreign != self._foreign:  # a typo in the catalogue shows here (found by review)
            log.info("DRLExecutor: Celery workers consume queues that are not pools of the catalogue: %s "
                     "(tasks routed there are sent unplaced)", ", ".join(sorted(foreign)))
        self._foreign = frozenset(foreign)
        with self._lock:
            before, blind = self._live, self._blind or self._live is None
            self._live, self._at, self._blind = count, self._clock(), False
        if blind:
            log.info("DRLExecutor: pool liveness: %s", ", ".join(f"{p} {n} live worker(s)" for p, n in count.items()))
        for pool, n in count.items():
            was = before.get(pool) if before is not None else None
            if n == 0 and was != 0:
                log.warning("DRLExecutor: no live Celery worker consumes queue %r: pool marked down "
                            "(only tasks no other pool may run are sent there)", pool)
            elif n > 0 and was == 0:
                log.info("DRLExecutor: pool %r is back: %d live worker(s)", pool, n)
        return dict(count)

    def _learned_nothing(self, why: str) -> None:
        if not self._blind:
            log.warning("DRLExecutor: pool liveness unknown (%s); pools count as the catalogue says "
                        "once the last answer is %.0f s old", why, self.shelf_s)
        self._blind = True

    # --- the thread ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        # each thread its own stop event (found by review: stop() gave up on a thread still in a
        # broadcast, start() cleared the shared event, and the old thread looped beside the new)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(self._stop,), name="drl-pool-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a malformed reply must not end the watch
                log.exception("DRLExecutor: pool liveness check failed")
            stop.wait(self.interval_s)
