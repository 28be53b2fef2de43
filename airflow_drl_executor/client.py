"""The executor's side of the placement queues: one batched request, one reply, a hard deadline.

The client never raises anything but :class:`PlacementUnavailable`, whose ``reason`` the executor
copies into every fallback decision. Redis connection loss starts a capped exponential back-off
during which requests fail at once, so a dead Redis costs the scheduler loop nothing; a policy
server whose heartbeat is stale is skipped at once too.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace

import redis

from policy.errors import SchemaError
from policy.placement import EarliestFinishPlacer
from policy.schema import (
    MAX_READY_PER_REQUEST,
    MAX_RUNS_PER_REQUEST,
    Decision,
    PlacementReply,
    PlacementRequest,
    ReadyTask,
    RunEntry,
    RunGraph,
    RunRef,
    dumps,
    loads_json,
)
from policy.transport import PAYLOAD_FIELD, STREAM_MAXLEN, Keys, freshest_heartbeat, tls_options

log = logging.getLogger(__name__)

MAX_REPLY_BYTES = 8 * 1024 * 1024


class PlacementUnavailable(Exception):
    """The policy server gave no usable answer in time; ``reason`` says why, for the fallback."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PlacementClient:
    """Sends :class:`PlacementRequest` s to the policy servers and waits for the reply.

    Graphs a server has accepted (sent in full, and the reply was not an error) are remembered
    (``run_key -> digest``, bounded LRU) and sent again as :class:`RunRef`; an ``unknown_graph``
    reply (server restarted, cache evicted) makes the client resend the full graphs once, if the
    deadline allows, under a request id of its own (``<id>.r``), so a late reply to the first try
    is never taken for the answer. A request larger than ``max_request_bytes`` (the servers'
    limit) is not sent at all: the fallback places it.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        prefix: str = "drl",
        ca_cert: str | None = None,
        timeout_ms: int = 200,
        stale_after_s: float = 15.0,
        backoff_max_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        remembered_runs: int = 10_000,
        max_request_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self.keys = Keys(prefix)
        self.timeout_s = timeout_ms / 1000.0
        self.stale_after_s = stale_after_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._redis = redis.Redis.from_url(
            redis_url,
            # A hung Redis (accepts, never answers) must not hold the scheduler loop much past the
            # deadline (was + 0.5 s: 0.7 s of a 0.2 s budget); the margin covers a BLPOP's own
            # timeout, which may reach the client a little after the deadline.
            socket_timeout=self.timeout_s + 0.1,
            socket_connect_timeout=min(1.0, self.timeout_s + 0.1),
            health_check_interval=30,
            **tls_options(redis_url, ca_cert),
        )
        self._sent: OrderedDict[str, str] = OrderedDict()
        self._remembered_runs = remembered_runs
        self.max_request_bytes = max_request_bytes
        self._failures = 0
        self._retry_at = 0.0
        self._last_error = ""
        self._live_checked_at = -1e9
        self._live_reason: str | None = None

    # --- public -----------------------------------------------------------------------------

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> PlacementReply:
        """Ask for a placement of every ready task in ``request``; ``graphs`` holds the full graphs.

        Raises :class:`PlacementUnavailable` on timeout, error reply, dead server or dead Redis.
        """
        start = self._clock()
        deadline = start + self.timeout_s
        if start < self._retry_at:
            raise PlacementUnavailable(
                f"redis unreachable ({self._last_error}); retrying in {self._retry_at - start:.1f}s"
            )
        try:
            self._check_live(start)
            reply = self._round_trip(request, graphs, deadline, resend=False)
            if reply.error_code == "unknown_graph" and self._clock() < deadline:
                reply = self._round_trip(request, graphs, deadline, resend=True)
        except redis.RedisError as exc:
            self._on_redis_error(exc)
            raise PlacementUnavailable(f"redis error: {exc}") from exc
        self._failures = 0
        if not reply.ok:
            raise PlacementUnavailable(f"policy server error {reply.error_code}: {reply.error}")
        return replace(reply, request_id=request.request_id)

    def close(self) -> None:
        self._redis.close()

    # --- internals --------------------------------------------------------------------------

    def _check_live(self, now: float) -> None:
        """Fail fast when no server replica has a fresh heartbeat (checked at most once a second)."""
        if now - self._live_checked_at >= 1.0:
            self._live_checked_at = now
            self._live_reason = self._liveness()
        if self._live_reason is not None:
            raise PlacementUnavailable(self._live_reason)

    def _liveness(self) -> str | None:
        age = freshest_heartbeat(self._redis, self.keys)  # on Redis's clock, as the heartbeats
        if age is None:
            return "no policy server has registered a heartbeat"
        if age > self.stale_after_s:
            return f"no live policy server (freshest heartbeat {age:.0f}s old)"
        return None

    def _entries(self, graphs: Mapping[str, RunGraph], resend: bool) -> tuple[RunEntry, ...]:
        out: list[RunEntry] = []
        for run_key, graph in graphs.items():
            if not resend and self._sent.get(run_key) == graph.digest:
                out.append(RunRef(run_key=run_key, digest=graph.digest))
            else:
                out.append(graph)
        return tuple(out)

    def _round_trip(
        self, request: PlacementRequest, graphs: Mapping[str, RunGraph], deadline: float, *, resend: bool
    ) -> PlacementReply:
        remaining = deadline - self._clock()
        if remaining <= 0:
            raise PlacementUnavailable(f"no reply within {self.timeout_s * 1000:.0f} ms")
        message = replace(
            request,
            request_id=f"{request.request_id}.r" if resend else request.request_id,
            runs=self._entries(graphs, resend),
            created_at=time.time(),
            deadline_ms=remaining * 1000.0,
        )
        if len(message.ready) > MAX_READY_PER_REQUEST or len(message.runs) > MAX_RUNS_PER_REQUEST:
            message = self._cap(message)
        payload = dumps(message)
        too_big: dict[str, int] = {}
        if len(payload) > self.max_request_bytes:
            message, payload, too_big = self._fit(message, len(payload))
        if len(payload) > self.max_request_bytes:
            self._forget(graphs)
            raise PlacementUnavailable(f"request of {len(payload)} bytes exceeds the policy servers' limit "
                                       f"of {self.max_request_bytes}; not sent")
        reply_key = self.keys.reply(message.request_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.delete(reply_key)
        pipe.xadd(self.keys.requests, {PAYLOAD_FIELD: payload}, maxlen=STREAM_MAXLEN, approximate=True)
        pipe.execute()
        remaining = deadline - self._clock()
        if remaining <= 0:  # found by review: a slow Redis had a BLPOP sent past the deadline, and
            self._forget(graphs)  # the scheduler loop held up to its socket timeout more
            raise PlacementUnavailable(f"no reply within {self.timeout_s * 1000:.0f} ms (Redis took it all)")
        got = self._redis.blpop([reply_key], timeout=remaining)
        if got is None:  # the server may or may not hold the graphs: send them in full next time
            self._forget(graphs)
            raise PlacementUnavailable(f"no reply within {self.timeout_s * 1000:.0f} ms")
        try:
            reply = PlacementReply.from_json(loads_json(got[1], max_bytes=MAX_REPLY_BYTES))
        except SchemaError as exc:
            raise PlacementUnavailable(f"malformed reply: {exc}") from exc
        if reply.request_id != message.request_id:
            raise PlacementUnavailable(f"reply for {reply.request_id!r}, expected {message.request_id!r}")
        if too_big and reply.ok:
            reply = replace(reply, decisions=reply.decisions + self._never_fit(request, graphs, too_big))
        if reply.ok:  # the server has them now (cached, and in the shared store)
            for entry in message.runs:
                if isinstance(entry, RunGraph):
                    self._remember(entry)
        else:  # an error reply: which graphs it kept is unknown; resend them next time
            self._forget(graphs)
        return reply

    def _never_fit(self, request: PlacementRequest, graphs: Mapping[str, RunGraph],
                   too_big: Mapping[str, int]) -> tuple[Decision, ...]:
        """Fallback decisions for the ready tasks of runs whose graph alone is over the servers'
        limit: no later heartbeat can send it, and a task left without a decision is taken for one
        the policy holds (found by review: such tasks waited ``max_wait_s`` at every heartbeat)."""
        ready = tuple(t for t in request.ready if t.run_key in too_big)
        sub = replace(request, ready=ready, runs=(), progress=())
        return tuple(replace(d, fallback=True, reason=f"fallback: the run's graph ({too_big[d.run_key]} bytes) is over "
                             f"the policy servers' request limit of {self.max_request_bytes}; {d.reason}")
                     for d in EarliestFinishPlacer(fallback=True).place(sub, graphs))

    def _fit(self, message: PlacementRequest, size: int) -> tuple[PlacementRequest, bytes, dict[str, int]]:
        """``message`` cut to the runs whose graphs fit the servers' limit (the runs sent by
        reference first, then the smallest new graphs), and its JSON: the ready tasks of the runs
        left out get no decision now (the executor offers them again at the next heartbeat, when
        the graphs sent now go by reference). Without this, runs whose graphs exceed the limit
        together were placed by the fallback at every heartbeat they shared (found by review: six
        10,000-task runs ready at once, 9 MB). Also the runs whose graph alone does not fit beside the
        rest of the request (their sizes): no heartbeat can send them (:meth:`_never_fit`)."""
        sizes = {e.run_key: len(json.dumps(e.to_json(), separators=(",", ":")).encode()) for e in message.runs}
        room = self.max_request_bytes - (size - sum(sizes.values()))  # what the rest of the request takes
        too_big = {e.run_key: sizes[e.run_key] for e in message.runs
                   if isinstance(e, RunGraph) and sizes[e.run_key] + 2 > room}
        keep: set[str] = set()
        for entry in sorted(message.runs, key=lambda e: (isinstance(e, RunGraph), sizes[e.run_key])):
            if sizes[entry.run_key] + 2 > room:  # (+2: the separator and some slack per run)
                break
            room -= sizes[entry.run_key] + 2
            keep.add(entry.run_key)
        ready = tuple(t for t in message.ready if t.run_key in keep)
        if not ready:
            return message, dumps(message), {}
        left = sorted({e.run_key for e in message.runs} - keep)
        log.warning("request %s of %d bytes over the servers' limit of %d: %d run(s) sent now, %d left for the next "
                    "heartbeat (%s)", message.request_id, size, self.max_request_bytes, len(keep), len(left),
                    ", ".join(left[:5]) + (" ..." if len(left) > 5 else ""))
        cut = replace(message, ready=ready, runs=tuple(e for e in message.runs if e.run_key in keep),
                      progress=tuple(p for p in message.progress if p.run_key in keep))
        return cut, dumps(cut), too_big

    def _cap(self, message: PlacementRequest) -> PlacementRequest:
        """``message`` cut to the first ready tasks (the executor's order: priority) that the
        servers take in one request, of at most that many runs: the others get no decision now
        and are offered again at the next heartbeat, as the tasks of runs :meth:`_fit` leaves out
        (found by review: with [core] parallelism over 4,096, or ready tasks of over 1,024 runs,
        every request was refused and every task placed by the fallback)."""
        runs: set[str] = set()
        ready: list[ReadyTask] = []
        for t in message.ready:
            if len(ready) == MAX_READY_PER_REQUEST:
                break
            if t.run_key in runs or len(runs) < MAX_RUNS_PER_REQUEST:
                runs.add(t.run_key)
                ready.append(t)
        log.warning("request %s: %d ready tasks of %d runs, more than one request takes (%d tasks, %d runs): "
                    "%d sent now, the others at the next heartbeat", message.request_id, len(message.ready),
                    len({t.run_key for t in message.ready}), MAX_READY_PER_REQUEST, MAX_RUNS_PER_REQUEST,
                    len(ready))
        return replace(message, ready=tuple(ready), runs=tuple(e for e in message.runs if e.run_key in runs),
                       progress=tuple(p for p in message.progress if p.run_key in runs))

    def _forget(self, graphs: Mapping[str, RunGraph]) -> None:
        """Send these runs' graphs in full next time."""
        for run_key in graphs:
            self._sent.pop(run_key, None)

    def _remember(self, graph: RunGraph) -> None:
        self._sent[graph.run_key] = graph.digest
        self._sent.move_to_end(graph.run_key)
        while len(self._sent) > self._remembered_runs:
            self._sent.popitem(last=False)

    def _on_redis_error(self, exc: Exception) -> None:
        self._failures += 1
        # the exponent capped: 2 ** 1024 does not convert to a float (found by review: an
        # OverflowError at every heartbeat after ~85 minutes of outage)
        delay = min(self.backoff_max_s, 0.5 * 2.0 ** min(self._failures - 1, 60))
        self._retry_at = self._clock() + delay
        self._last_error = str(exc)
        self._sent.clear()  # the server side may have restarted with the Redis
        log.warning("Redis error %s (failure %d); placement falls back for %.1fs", exc, self._failures, delay)

