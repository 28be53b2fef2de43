"""The serve loop (policy/server.py) at its edges: claims, deadlines, the graph store and shutdown.

Each test failed on the code before its fix, for the reason its docstring gives.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import redis
from server_helpers import KEYS, chain, request, send, send_raw, wait_reply

from policy.config import ServerConfig
from policy.placement import EarliestFinishPlacer
from policy.schema import RunRef, dumps
from policy.server import PolicyServer

pytestmark = pytest.mark.integration


def _server(redis_url: str, **overrides) -> PolicyServer:  # type: ignore[no-untyped-def]
    base = ServerConfig(redis_url=redis_url, prefix=KEYS.prefix, consumer="me", block_ms=50,
                        heartbeat_s=0.2, claim_interval_s=0.1, reconnect_base_s=0.05,
                        reconnect_max_s=0.4)
    return PolicyServer(replace(base, **overrides))


def _orphan(rclient: redis.Redis, payload: bytes, dead: str = "dead") -> bytes:
    """Add a request and have consumer ``dead`` read it in the same transaction (so that no
    replica blocked in XREADGROUP is handed it first): it sits in ``dead``'s pending list."""
    pipe = rclient.pipeline(transaction=True)
    pipe.xadd(KEYS.requests, {"payload": payload})
    pipe.xreadgroup(KEYS.group, dead, {KEYS.requests: ">"}, count=1)
    entry_id, got = pipe.execute()
    assert got and got[0][1][0][0] == entry_id
    return entry_id


def test_an_idle_replica_sweeps_for_a_crashed_replicas_requests_every_claim_interval(
    start_server, rclient: redis.Redis
) -> None:
    """Operator: two replicas, light traffic; one is OOM-killed holding a request. The survivor
    sits in ``XREADGROUP BLOCK block_ms`` and looks at the crashed replica's pending entries only
    when that read returns, so the request is claimed up to ``block_ms`` after the documented
    ``claim_idle_ms`` + ``claim_interval_s`` (default 100 + 50 ms against a 200 ms block: past the
    executor's 200 ms deadline). Expected: the sweep runs every ``claim_interval_s`` whatever
    ``block_ms`` is (a blocking read must not outlast the next sweep)."""
    rclient.xgroup_create(KEYS.requests, KEYS.group, id="0", mkstream=True)
    survivor = start_server(consumer="survivor", block_ms=4000, claim_interval_s=0.05, claim_idle_ms=50)
    time.sleep(0.3)  # the survivor has swept once and now blocks in its 4 s read
    req = request([chain("orphan")], [("orphan", "t0")], deadline_ms=10_000)
    _orphan(rclient, dumps(req))
    reply = wait_reply(rclient, req.request_id, timeout_s=1.5)  # 10 x the 50 + 50 ms promised
    assert reply is not None and reply.ok, "the crashed replica's request waited for the read's BLOCK to end"
    assert survivor.server.metrics.claimed._value.get() == 1


class _SlowPlacer(EarliestFinishPlacer):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def place(self, request, graphs):  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return super().place(request, graphs)


def test_a_request_slower_than_claim_idle_is_not_taken_back_and_forth_until_its_deadline(
    start_server, rclient: redis.Redis
) -> None:
    """Operator: a batch takes longer than ``claim_idle_ms`` to decide (a big GNN batch on a
    loaded CPU). One replica answers it. With two, the idle one claims it mid-decision, the first
    finds it taken over and, on its next sweep, claims it back from the second (still deciding),
    and so on: each replica's answer is thrown away as ``taken_over`` and the request is never
    answered, until its deadline drops it. Expected: a request is answered by some replica within
    its deadline (a replica that is alive and working keeps its entries, e.g. by refreshing their
    idle time, or only a silent replica's entries are claimed)."""
    placer_a, placer_b = _SlowPlacer(0.35), _SlowPlacer(0.35)
    start_server(consumer="a", placer=placer_a, claim_idle_ms=100, claim_interval_s=0.02, block_ms=20)
    start_server(consumer="b", placer=placer_b, claim_idle_ms=100, claim_interval_s=0.02, block_ms=20)
    req = request([chain("slow")], [("slow", "t0")], deadline_ms=3000)
    send(rclient, req)
    reply = wait_reply(rclient, req.request_id, timeout_s=4)
    assert reply is not None and reply.ok, "claimed back and forth between two live replicas until late"


def test_a_graph_store_ttl_under_a_second_still_resolves_references_from_the_store(
    redis_url: str, rclient: redis.Redis
) -> None:
    """Operator: ``--graph-store-ttl-s 0.5`` (accepted: it must only be >= 0). The reply script
    stores graphs with ``EX max(1, int(ttl))`` = 1 s, but the lookup reads them with
    ``GETEX ... EX int(0.5)`` = ``EX 0``, which Redis refuses ("invalid expire time"): every
    reference that lands on a replica without the graph is answered ``unknown_graph`` although the
    graph is in the store. Expected: the store is read with the same (at least 1 s) TTL it is
    written with."""
    g = chain("short-ttl", 6)
    writer = _server(redis_url, consumer="writer", graph_store_ttl_s=0.5)
    writer._connect()
    try:
        send(rclient, request([g], [(g.run_key, "t0")], request_id="full"))
        assert writer.step() == 1
        assert rclient.exists(KEYS.graph(g.run_key, g.digest)), "the writer did not store the graph"
    finally:
        writer._goodbye()
    reader = _server(redis_url, consumer="reader", graph_store_ttl_s=0.5)
    reader._connect()
    try:
        send(rclient, request([RunRef(g.run_key, g.digest)], [(g.run_key, "t1")], request_id="by-ref"))
        assert reader.step() == 1
    finally:
        reader._goodbye()
    reply = wait_reply(rclient, "by-ref", timeout_s=1)
    assert reply is not None
    assert reply.ok, f"a graph in the store was not found: {reply.error_code} {reply.error}"


def test_an_error_reply_is_not_written_after_the_deadline(redis_url: str, rclient: redis.Redis) -> None:
    """Operator: a batch took long (a slow model call); a request in it that failed to parse, or
    was oversized, is answered ``bad_request`` although its deadline passed while the batch was
    decided, while a good request of the same batch is (rightly) dropped. docs/server.md: a
    request past ``created_at + deadline_ms`` (checked on arrival and again before replying) gets
    no reply. Expected: the check before replying covers error replies too (their deadline is in
    the payload, or counts from the entry id)."""
    server = _server(redis_url)
    server._connect()
    try:
        good = request([chain("g")], [("g", "t0")], deadline_ms=500, request_id="good")
        bad = json.loads(dumps(request([chain("b")], [("b", "t0")], deadline_ms=500, request_id="bad")))
        bad["pools"] = "not a list"  # a schema error: bad_request
        send(rclient, good)
        send_raw(rclient, json.dumps(bad))
        entries = server._read(server._redis, 10, None)  # type: ignore[arg-type]
        assert len(entries) == 2
        jobs = server.handle(entries)
        assert [j.reply is not None for j in jobs] == [True, True]
        server._clock_offset = (server._clock_offset or 0.0) + 5.0  # the batch took 5 s on Redis's clock
        server._reply(server._redis, jobs)  # type: ignore[arg-type]
    finally:
        server._goodbye()
    assert not rclient.exists(KEYS.reply("good"))  # dropped late, as documented
    assert not rclient.exists(KEYS.reply("bad")), "an error reply was written after the request's deadline"


def test_a_replica_stopped_while_reconnecting_removes_its_heartbeat(redis_url: str, rclient: redis.Redis) -> None:
    """Operator: Redis blips (a failover, a restart with persistence) and a rolling deploy sends
    SIGTERM while the replica waits in its reconnect back-off. It exits 0 without removing its
    heartbeat, although Redis is reachable again: the executors count a stopped replica as live
    (until ``server_stale_after_s``) and wait out each decision's deadline instead of falling back
    at once; ``drl-executor check`` lists it. Expected: the goodbye reconnects (briefly) to remove
    the heartbeat, as a clean stop does."""
    server = _server(redis_url, consumer="leaving")
    real_step = server.step
    calls = 0

    def step() -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            assert rclient.hexists(KEYS.heartbeat, "leaving")
            server.stop()  # SIGTERM arrives ...
            raise redis.ConnectionError("Connection reset by peer")  # ... as Redis blips
        return real_step()

    server.step = step  # type: ignore[method-assign]
    assert server.serve_forever() == 0
    assert not rclient.hexists(KEYS.heartbeat, "leaving"), "a stopped replica's heartbeat was left behind"
