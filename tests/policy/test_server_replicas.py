"""Replicas, crashes, shutdown and lost connections, against real redis-server processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping

import pytest
import redis
from server_helpers import KEYS, ask, chain, request, send, wait_reply

from policy.bench import PrivateRedis, start_redis, wait_for_server
from policy.config import ServerConfig
from policy.placement import EarliestFinishPlacer
from policy.schema import Decision, PlacementRequest, RunGraph, RunRef
from policy.server import PolicyServer

pytestmark = pytest.mark.integration


def _serve_proc(url: str, consumer: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "policy.cli", "--log-level=WARNING", "serve", "--redis", url,
         "--prefix", KEYS.prefix, "--consumer", consumer, "--block-ms", "50", "--heartbeat-s", "0.2",
         *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_two_replicas_share_the_load(start_server, rclient: redis.Redis) -> None:
    a = start_server(consumer="a", batch_max=2)
    b = start_server(consumer="b", batch_max=2)
    g = chain("shared", 20)
    assert ask(rclient, request([g], [("shared", "t0")])).ok  # type: ignore[union-attr]
    reqs = [request([g], [("shared", f"t{i % 20}")]) for i in range(200)]
    pipe = rclient.pipeline(transaction=False)
    for req in reqs:
        pipe.xadd(KEYS.requests, {"payload": json.dumps(req.to_json())})
    pipe.execute()
    replies = [wait_reply(rclient, req.request_id) for req in reqs]
    assert all(r is not None and r.ok for r in replies)
    assert a.server.handled > 10 and b.server.handled > 10


def test_pending_requests_of_a_dead_replica_are_claimed(start_server, rclient: redis.Redis) -> None:
    rclient.xgroup_create(KEYS.requests, KEYS.group, id="0", mkstream=True)
    reqs = [request([chain("orphan")], [("orphan", "t1")], deadline_ms=10_000) for _ in range(5)]
    for req in reqs:
        send(rclient, req)
    # A replica reads them and dies before replying: they sit in its pending list.
    got = rclient.xreadgroup(KEYS.group, "dead", {KEYS.requests: ">"}, count=10)
    assert len(got[0][1]) == 5
    survivor = start_server(consumer="survivor", claim_idle_ms=200)
    replies = [wait_reply(rclient, req.request_id) for req in reqs]
    assert all(r is not None and r.ok for r in replies)
    assert survivor.server.metrics.claimed._value.get() == 5
    assert rclient.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_killing_a_replica_mid_stream_loses_no_request(redis_url: str, rclient: redis.Redis,
                                                       procs: list[subprocess.Popen[bytes]]) -> None:
    procs.append(_serve_proc(redis_url, "victim", "--claim-idle-ms", "300", "--batch-max", "4"))
    procs.append(_serve_proc(redis_url, "survivor", "--claim-idle-ms", "300", "--batch-max", "4"))
    wait_for_server(rclient, KEYS, count=2)
    g = chain("kill", 30)
    assert ask(rclient, request([g], [("kill", "t0")])).ok  # type: ignore[union-attr]
    reqs = [request([g], [("kill", f"t{i % 30}")], deadline_ms=8000) for i in range(400)]

    def produce() -> None:
        r = redis.Redis.from_url(redis_url)
        for req in reqs:
            send(r, req)
            time.sleep(0.002)

    producer = threading.Thread(target=produce)
    producer.start()
    time.sleep(0.3)
    procs[0].send_signal(signal.SIGKILL)
    producer.join()
    replies = [wait_reply(rclient, req.request_id, timeout_s=8) for req in reqs]
    missing = [req.request_id for req, rep in zip(reqs, replies, strict=True) if rep is None]
    assert not missing, f"{len(missing)} requests unanswered"
    assert all(r is not None and r.ok for r in replies)
    assert procs[0].wait(5) == -signal.SIGKILL


def test_sigterm_finishes_and_exits_zero(redis_url: str, rclient: redis.Redis,
                                         procs: list[subprocess.Popen[bytes]]) -> None:
    procs.append(_serve_proc(redis_url, "term"))
    wait_for_server(rclient, KEYS)
    req = request([chain("term")], [("term", "t0")])
    reply = ask(rclient, req)
    assert reply is not None and reply.ok
    procs[0].send_signal(signal.SIGTERM)
    out, _ = procs[0].communicate(timeout=10)
    assert procs[0].returncode == 0, out.decode()
    assert not rclient.hexists(KEYS.heartbeat, "term")  # said goodbye


@pytest.fixture
def own_redis() -> Iterator[PrivateRedis]:
    srv = start_redis()
    yield srv
    srv.stop()


def test_server_reconnects_after_redis_restarts(own_redis: PrivateRedis) -> None:
    config = ServerConfig(redis_url=own_redis.url, prefix=KEYS.prefix, consumer="phoenix", block_ms=50,
                          heartbeat_s=0.2, reconnect_base_s=0.05, reconnect_max_s=0.3)
    server = PolicyServer(config)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    r = own_redis.client()
    assert ask(r, request([chain("x")], [("x", "t0")])).ok  # type: ignore[union-attr]
    own_redis.proc.terminate()
    own_redis.proc.wait(5)
    deadline = time.monotonic() + 5
    while server.connected and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not server.connected and server.health()["status"] == "redis_unavailable"
    restarted = start_redis(port=own_redis.port, password=own_redis.password)
    try:
        r = restarted.client()
        # the restarted Redis is empty: the graph cache survives, the group is recreated
        reply = ask(r, request([chain("x")], [("x", "t1")]), timeout_s=5)
        assert reply is not None and reply.ok
        assert server.metrics.reconnects._value.get() >= 1
        assert thread.is_alive()
    finally:
        server.stop()
        thread.join(5)
        restarted.stop()
    assert not thread.is_alive()


def test_serve_starts_without_torch(redis_url: str, rclient: redis.Redis,
                                    procs: list[subprocess.Popen[bytes]]) -> None:
    code = ("import sys, policy.server, policy.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ})
    assert out.returncode == 0, out.stderr


def test_a_graph_sent_to_one_replica_is_resolved_by_reference_on_another(start_server,
                                                                         rclient: redis.Redis) -> None:
    a = start_server(consumer="a")
    g = chain("shared-graph", 30)
    assert ask(rclient, request([g], [(g.run_key, "t0")])).ok  # type: ignore[union-attr]
    a.stop()  # b never saw the graph: only the shared store has it
    b = start_server(consumer="b")
    by_ref = ask(rclient, request([RunRef(g.run_key, g.digest)], [(g.run_key, "t7")]))
    assert by_ref is not None and by_ref.ok and by_ref.decisions[0].task_id == "t7"
    assert b.server.metrics.graph_store_hits._value.get() == 1
    assert (g.run_key, g.digest) in b.server.cache  # cached locally from then on
    assert 0 < rclient.ttl(KEYS.graph(g.run_key, g.digest)) <= 3600


def test_without_the_graph_store_another_replica_asks_for_the_graph(start_server,
                                                                    rclient: redis.Redis) -> None:
    a = start_server(consumer="a", graph_store_ttl_s=0)
    g = chain("private-graph", 10)
    assert ask(rclient, request([g], [(g.run_key, "t0")])).ok  # type: ignore[union-attr]
    assert not rclient.exists(KEYS.graph(g.run_key, g.digest))
    a.stop()
    start_server(consumer="b", graph_store_ttl_s=0)
    by_ref = ask(rclient, request([RunRef(g.run_key, g.digest)], [(g.run_key, "t1")]))
    assert by_ref is not None and by_ref.error_code == "unknown_graph"


class _SlowPlacer(EarliestFinishPlacer):
    """Takes ``delay_s`` per request: a replica stuck long enough for its entries to be claimed."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        time.sleep(self.delay_s)
        return super().place(request, graphs)


def test_requests_taken_over_from_a_slow_replica_are_answered_exactly_once(start_server,
                                                                           rclient: redis.Redis) -> None:
    g = chain("slow", 10)
    reqs = [request([g], [("slow", f"t{i}")], deadline_ms=10_000) for i in range(8)]
    for req in reqs:
        send(rclient, req)  # queued first, so that the slow replica reads all eight in one batch
    slow = start_server(consumer="slow", placer=_SlowPlacer(0.6), batch_max=8, claim_idle_ms=10_000)
    deadline = time.monotonic() + 5
    while rclient.xpending(KEYS.requests, KEYS.group)["pending"] < 8 and time.monotonic() < deadline:
        time.sleep(0.01)  # the slow replica holds all eight, and sits on them for 4.8 s
    fast = start_server(consumer="fast", claim_idle_ms=100)
    replies = [wait_reply(rclient, req.request_id, timeout_s=5) for req in reqs]
    assert all(r is not None and r.ok for r in replies)
    assert fast.server.metrics.claimed._value.get() == 8
    slow.stop()  # finishes its batch, finds the entries no longer its own, and answers none
    assert slow.server.metrics.requests.labels(outcome="taken_over")._value.get() == 8
    assert slow.server.metrics.requests.labels(outcome="ok")._value.get() == 0
    assert all(rclient.llen(KEYS.reply(req.request_id)) == 0 for req in reqs), "a request answered twice"
    assert rclient.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_heartbeats_of_crashed_replicas_are_pruned(start_server, rclient: redis.Redis) -> None:
    rclient.hset(KEYS.heartbeat, "crashed", json.dumps({"ts": time.time() - 600}))
    rclient.xgroup_create(KEYS.requests, KEYS.group, id="0", mkstream=True)
    rclient.xgroup_createconsumer(KEYS.requests, KEYS.group, "crashed")
    time.sleep(1.1)  # the consumer idles past heartbeat_prune_s
    start_server(consumer="alive", heartbeat_prune_s=1.0)
    deadline = time.monotonic() + 5
    while rclient.hexists(KEYS.heartbeat, "crashed") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not rclient.hexists(KEYS.heartbeat, "crashed")
    assert rclient.hexists(KEYS.heartbeat, "alive")
    time.sleep(0.5)  # a few heartbeats later the live replica still has its own
    assert rclient.hexists(KEYS.heartbeat, "alive")
    names = {c["name"] for c in rclient.xinfo_consumers(KEYS.requests, KEYS.group)}
    assert b"crashed" not in names


def test_a_graph_resent_in_full_is_stored_again_after_redis_lost_it(start_server,
                                                                    rclient: redis.Redis) -> None:
    """Redis restarted without persistence: the replica that still caches a graph is sent it in
    full again (the client resends after an error); it must put it back in the shared store, or
    every reference that lands on another replica is bounced as unknown_graph, forever."""
    a = start_server(consumer="a")
    g = chain("refilled", 10)
    key = KEYS.graph(g.run_key, g.digest)
    assert ask(rclient, request([g], [(g.run_key, "t0")])).ok  # type: ignore[union-attr]
    assert rclient.delete(key) == 1  # what a restart without persistence does to the store
    assert ask(rclient, request([g], [(g.run_key, "t1")])).ok  # type: ignore[union-attr]
    assert rclient.exists(key), "a full graph that a already cached was not stored again"
    a.stop()
    b = start_server(consumer="b")
    by_ref = ask(rclient, request([RunRef(g.run_key, g.digest)], [(g.run_key, "t2")]))
    assert by_ref is not None and by_ref.ok, by_ref
    assert b.server.metrics.graph_store_hits._value.get() == 1


def test_a_reference_resolved_from_the_local_cache_keeps_the_stored_graph_alive(start_server,
                                                                                 rclient: redis.Redis) -> None:
    """A run served for longer than the store's TTL mostly by references to the replica that
    cached it must not lose its store entry: another replica would then ask for the graph."""
    start_server(consumer="a", graph_store_ttl_s=600)
    g = chain("long-run", 10)
    key = KEYS.graph(g.run_key, g.digest)
    assert ask(rclient, request([g], [(g.run_key, "t0")])).ok  # type: ignore[union-attr]
    rclient.expire(key, 5)  # as if most of the TTL had passed
    by_ref = ask(rclient, request([RunRef(g.run_key, g.digest)], [(g.run_key, "t1")]))
    assert by_ref is not None and by_ref.ok
    assert 500 < rclient.ttl(key) <= 600


def test_a_deleted_stream_is_recreated_at_once_not_backed_off(start_server, rclient: redis.Redis) -> None:
    """FLUSHALL (or a DEL of the stream) fails the blocking read with 'UNBLOCKED the stream key no
    longer exists' and XINFO with 'no such key': the group is recreated, Redis is not 'lost'."""
    rs = start_server(consumer="a", heartbeat_s=0.02)
    for _ in range(30):
        rclient.flushall()
        time.sleep(0.03)  # mostly while the replica blocks in XREADGROUP (block_ms 50)
    reply = ask(rclient, request([chain("flushed")], [("flushed", "t0")]))
    assert reply is not None and reply.ok
    assert rs.server.metrics.reconnects._value.get() == 0
    assert rs.server.connected


def test_a_replica_that_crashes_removes_its_heartbeat(redis_url: str, rclient: redis.Redis) -> None:
    """A bug that escapes the loop kills the replica; its heartbeat must not outlive it (the
    executor would count it as live until the others prune it)."""
    config = ServerConfig(redis_url=redis_url, prefix=KEYS.prefix, consumer="doomed", block_ms=50,
                          heartbeat_s=0.2)
    server = PolicyServer(config)
    real_step = server.step
    calls = 0

    def step() -> int:
        nonlocal calls
        calls += 1
        if calls == 3:
            assert rclient.hexists(KEYS.heartbeat, "doomed")
            raise RuntimeError("a bug")
        return real_step()

    server.step = step  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="a bug"):
        server.serve_forever()
    assert not rclient.hexists(KEYS.heartbeat, "doomed")
