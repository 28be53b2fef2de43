"""The server's wire protocol against a real redis-server: replies, graph cache, errors, deadlines."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace

import pytest
import redis
from server_helpers import CATALOGUE, KEYS, ask, chain, request, send, send_raw, wait_reply

from policy.placement import EarliestFinishPlacer
from policy.schema import RunRef
from policy.transport import REPLY_TTL_S

pytestmark = pytest.mark.integration


def test_full_graph_request_gets_one_decision_per_ready_task(start_server, rclient: redis.Redis) -> None:
    start_server()
    g = chain("dag/run1")
    reply = ask(rclient, request([g], [("dag/run1", "t0"), ("dag/run1", "t1")]))
    assert reply is not None and reply.ok, reply
    assert [(d.run_key, d.task_id) for d in reply.decisions] == [("dag/run1", "t0"), ("dag/run1", "t1")]
    assert {d.pool for d in reply.decisions} <= set(CATALOGUE.names)
    assert all(d.reason for d in reply.decisions)
    assert reply.policy == "eft"
    # the stream holds no answered entries, and nothing is left pending
    assert rclient.xlen(KEYS.requests) == 0
    assert rclient.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_reply_key_expires(start_server, rclient: redis.Redis) -> None:
    start_server()
    req = request([chain("r")], [("r", "t0")])
    send(rclient, req)
    deadline = time.monotonic() + 5
    while not rclient.exists(KEYS.reply(req.request_id)) and time.monotonic() < deadline:
        time.sleep(0.01)
    ttl = rclient.ttl(KEYS.reply(req.request_id))
    assert 0 < ttl <= REPLY_TTL_S


def test_run_ref_resolves_from_the_cache_and_unknown_ref_asks_for_the_graph(
    start_server, rclient: redis.Redis
) -> None:
    start_server()
    g = chain("dag/run2")
    unknown = ask(rclient, request([RunRef(g.run_key, g.digest)], [(g.run_key, "t0")]))
    assert unknown is not None and unknown.error_code == "unknown_graph"
    assert ask(rclient, request([g], [(g.run_key, "t0")])).ok  # type: ignore[union-attr]
    by_ref = ask(rclient, request([RunRef(g.run_key, g.digest)], [(g.run_key, "t3")]))
    assert by_ref is not None and by_ref.ok and by_ref.decisions[0].task_id == "t3"
    # a ready task whose run has no entry at all resolves to the run's latest graph
    implicit = ask(rclient, request([], [(g.run_key, "t4")]))
    assert implicit is not None and implicit.ok
    stale = ask(rclient, request([RunRef(g.run_key, "0" * 16)], [(g.run_key, "t0")]))
    assert stale is not None and stale.error_code == "unknown_graph"


@pytest.mark.parametrize(
    "payload, code",
    [
        ('{"schema_version": 1, "request_id": "bad-1", "ready": "nope", "pools": []}', "bad_request"),
        ('{"schema_version": 99, "request_id": "bad-2", "ready": [], "pools": []}', "bad_request"),
        ('{"schema_version": 1, "request_id": "bad-3", "ready": [{"run_key": "x", "task_id": "a"}],'
         ' "pools": [], "runs": [{"run_key": "x", "tasks": [{"task_id": "a"}, {"task_id": "b"}],'
         ' "edges": [[0, 1], [1, 0]]}]}', "bad_request"),  # a cycle
        ('{"schema_version": 1, "request_id": "bad-4", "ready": [{"run_key": "x", "task_id": "zz"}],'
         ' "pools": [], "runs": [{"run_key": "x", "tasks": [{"task_id": "a"}], "edges": []}]}',
         "bad_request"),  # ready task not in its graph
        ('{"request_id": "bad-5", "oops": ', "bad_request"),  # truncated JSON, id still recovered
        # half a UTF-16 pair in a run key: was, the replica writing the graph to Redis crashed, then
        # each that took the entry over (found by review)
        ('{"schema_version": 1, "request_id": "bad-6", "ready": [{"run_key": "x\\ud800", "task_id": "a"}],'
         ' "pools": [], "runs": [{"run_key": "x\\ud800", "tasks": [{"task_id": "a"}], "edges": []}]}', "bad_request"),
        ('{"request_id": "bad-7", "pools": ' + "[" * 100_000, "bad_request"),  # was: no reply (RecursionError)
    ],
)
def test_malformed_requests_get_error_replies(start_server, rclient: redis.Redis, payload: str,
                                              code: str) -> None:
    rs = start_server(catalogue=None)
    send_raw(rclient, payload)
    rid = payload.split('"request_id": "')[1].split('"')[0]
    reply = wait_reply(rclient, rid)
    assert reply is not None and reply.error_code == code and reply.error
    assert rs.thread.is_alive()
    # and the server still answers good requests
    assert ask(rclient, request([chain("ok")], [("ok", "t0")])).ok  # type: ignore[union-attr]


def test_garbage_without_request_id_is_acknowledged_and_dropped(start_server, rclient: redis.Redis) -> None:
    rs = start_server()
    send_raw(rclient, b"\xff\xfe not json")
    rclient.xadd(KEYS.requests, {"other": "field"})
    send_raw(rclient, '{"request_id": "r\\ud800", "ready": [], "pools": []}')  # no reply key can be made of it
    assert ask(rclient, request([chain("ok")], [("ok", "t0")])).ok  # type: ignore[union-attr]
    assert rclient.xpending(KEYS.requests, KEYS.group)["pending"] == 0
    assert rs.server.metrics.requests.labels(outcome="bad_request")._value.get() == 3
    assert rs.thread.is_alive()


def test_a_batch_whose_replies_cannot_be_written_is_dropped_not_fatal(start_server, rclient: redis.Redis) -> None:
    """was: an error other than Redis's while writing the replies (redis-py failing to encode a
    key) ended the replica's loop, and each replica that took the pending entry over"""
    rs = start_server()
    real, calls = rs.server._reply, []

    def reply(r, jobs):  # type: ignore[no-untyped-def]
        calls.append(len(jobs))
        if len(calls) == 1:
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        return real(r, jobs)
    rs.server._reply = reply
    lost = request([chain("lost")], [("lost", "t0")], request_id="lost")
    send(rclient, lost)
    assert wait_reply(rclient, "lost", timeout_s=1.0) is None
    assert ask(rclient, request([chain("ok")], [("ok", "t0")])).ok  # type: ignore[union-attr]
    assert rs.thread.is_alive() and calls[0] == 1
    assert rclient.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_oversized_request_gets_bad_request(start_server, rclient: redis.Redis) -> None:
    start_server(max_request_bytes=4096)
    big = request([chain("big", 200)], [("big", "t0")], request_id="too-big")
    reply = ask(rclient, big)
    assert reply is not None and reply.error_code == "bad_request"
    assert "exceeds the limit of 4096" in (reply.error or "")


def test_request_past_its_deadline_gets_no_reply(start_server, rclient: redis.Redis) -> None:
    late = request([chain("late")], [("late", "t0")], deadline_ms=100)
    send(rclient, late)  # queued while no replica runs, and 100 ms pass on Redis's clock
    time.sleep(0.3)
    rs = start_server()
    assert wait_reply(rclient, late.request_id, timeout_s=0.5) is None
    assert rs.server.metrics.requests.labels(outcome="dropped_late")._value.get() == 1
    assert rclient.xpending(KEYS.requests, KEYS.group)["pending"] == 0


@pytest.mark.parametrize("skew_s", [-30.0, 30.0])
def test_a_client_with_a_skewed_clock_is_answered_within_its_deadline(start_server, rclient: redis.Redis,
                                                                       skew_s: float) -> None:
    """The deadline counts from when Redis added the request: the client's clock never enters."""
    rs = start_server()
    req = request([chain("skew")], [("skew", "t0")], created_at=time.time() + skew_s, deadline_ms=2000)
    reply = ask(rclient, req, timeout_s=2)
    assert reply is not None and reply.ok
    assert rs.server.metrics.requests.labels(outcome="dropped_late")._value.get() == 0


def test_pools_default_to_the_catalogue(start_server, rclient: redis.Redis) -> None:
    from dataclasses import replace

    from policy.bench import DEFAULT_CATALOGUE

    start_server(catalogue=str(DEFAULT_CATALOGUE))
    req = replace(request([chain("c")], [("c", "t0")]), pools=())
    reply = ask(rclient, req)
    assert reply is not None and reply.ok and reply.decisions[0].pool in CATALOGUE.names


def test_heartbeat_names_the_model_and_device(start_server, rclient: redis.Redis) -> None:
    start_server(consumer="hb")
    deadline = time.monotonic() + 5
    while not rclient.hexists(KEYS.heartbeat, "hb") and time.monotonic() < deadline:
        time.sleep(0.02)
    beat = json.loads(rclient.hget(KEYS.heartbeat, "hb"))  # type: ignore[arg-type]
    assert beat["version"] == f"eft:{EarliestFinishPlacer.version}" and beat["device"] == "cpu"


def test_a_redis_it_cannot_use_at_start_up_is_a_warning_once(caplog: pytest.LogCaptureFixture) -> None:
    """was: a server started with a wrong Redis URL or password logged only 'serving ...' (each
    failure at DEBUG), so a deployment looked up while it served nothing"""
    import logging
    import threading

    from policy.bench import free_port
    from policy.config import ServerConfig
    from policy.server import PolicyServer

    server = PolicyServer(ServerConfig(redis_url=f"redis://:wrong@127.0.0.1:{free_port()}/0", prefix="t",
                                       reconnect_base_s=0.01, reconnect_max_s=0.02))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    with caplog.at_level(logging.DEBUG, logger="policy.server"):
        thread.start()
        time.sleep(0.5)
        server.stop()
        thread.join(5)
    failures = [r for r in caplog.records if "Redis" in r.getMessage() and r.levelno >= logging.DEBUG
                and ("cannot use" in r.getMessage() or "still unavailable" in r.getMessage())]
    assert len(failures) > 3, "it kept retrying"
    warned = [r for r in failures if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "cannot use Redis at redis://:***@127.0.0.1" in warned[0].getMessage(), "no password"


def test_bytes_that_are_not_utf8_get_bad_request_and_the_rest_of_the_batch_its_replies(
        start_server, rclient: redis.Redis) -> None:
    """Found by review: json.loads(bytes) took a surrogate encoded in UTF-8 (and UTF-16 payloads);
    no reply or graph key could then be written, and the whole batch's replies were lost."""
    good = [request([chain(f"g{i}")], [(f"g{i}", "t0")], request_id=f"good-{i}") for i in range(4)]
    bad = ('{"schema_version": 1, "request_id": "raw-surrogate", "ready": [{"run_key": "x\xed\xa0\x80", '
           '"task_id": "a"}], "pools": [], "runs": [{"run_key": "x\xed\xa0\x80", "tasks": [{"task_id": "a"}], '
           '"edges": []}]}').encode("latin-1")
    for req in good[:2]:
        send(rclient, req)
    send_raw(rclient, bad)
    send_raw(rclient, '{"request_id": "utf16", "ready": [], "pools": []}'.encode("utf-16"))
    for req in good[2:]:
        send(rclient, req)
    rs = start_server()  # all six in its first batch
    for req in good:
        reply = wait_reply(rclient, req.request_id)
        assert reply is not None and reply.ok, req.request_id
    reply = wait_reply(rclient, "raw-surrogate")
    assert reply is not None and reply.error_code == "bad_request" and "JSON" in (reply.error or "")
    deadline = time.monotonic() + 5  # counted once the replies are written, just after a client reads them
    while rs.server.metrics.requests.labels(outcome="bad_request")._value.get() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rs.server.metrics.requests.labels(outcome="bad_request")._value.get() == 2
    assert rclient.xpending(KEYS.requests, KEYS.group)["pending"] == 0 and rs.thread.is_alive()


def test_a_reply_key_of_another_type_is_skipped_not_retried_for_ever(start_server, rclient: redis.Redis) -> None:
    """Found by review: RPUSH on a key someone made a string failed the reply script (WRONGTYPE), which the
    server took for a lost Redis: reconnects, the entry claimed back again and again, its batch unanswered."""
    rclient.set(KEYS.reply("taken"), "not a list")
    send(rclient, request([chain("w")], [("w", "t0")], request_id="taken"))
    send(rclient, request([chain("v")], [("v", "t0")], request_id="after"))
    rs = start_server()
    reply = wait_reply(rclient, "after")
    assert reply is not None and reply.ok
    assert rclient.get(KEYS.reply("taken")) == b"not a list"  # left as it was, the entry acknowledged
    assert rclient.xpending(KEYS.requests, KEYS.group)["pending"] == 0
    time.sleep(0.5)
    assert rs.server.metrics.reconnects._value.get() == 0


def test_a_heartbeat_key_of_another_type_is_replaced_not_a_reconnect_loop(start_server, rclient: redis.Redis,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: HSET on a heartbeat key someone made a string failed (WRONGTYPE), which the server
    took for a lost Redis: it reconnected for ever and answered nothing, and the executors, finding no
    heartbeat, fell back on every decision."""
    rclient.set(KEYS.heartbeat, "not a hash")
    with caplog.at_level(logging.WARNING, logger="policy.server"):
        rs = start_server()
        assert ask(rclient, request([chain("hb")], [("hb", "t0")])).ok  # type: ignore[union-attr]
    assert rclient.type(KEYS.heartbeat) == b"hash" and set(rclient.hkeys(KEYS.heartbeat)) == {b"replica-a"}
    assert rs.server.metrics.reconnects._value.get() == 0
    assert any(KEYS.heartbeat in r.getMessage() and "a string" in r.getMessage() for r in caplog.records)


def test_what_others_wrote_in_redis_does_not_end_a_replica(start_server, rclient: redis.Redis) -> None:
    """Found by review: a heartbeat field or consumer group named in bytes that are not UTF-8, or a heartbeat
    of "[" x 100,000 or {"ts": <400 digits>}, raised out of the housekeeping: every replica down, at every restart."""
    rclient.hset(KEYS.heartbeat, b"\xffdead", "[" * 100_000)
    rclient.hset(KEYS.heartbeat, "huge", '{"ts": ' + "9" * 400 + "}")
    rclient.hset(KEYS.heartbeat, "ahead", '{"ts": 1e300}')  # finite, far ahead: was never pruned
    rs = start_server(heartbeat_prune_s=0.7)
    rclient.xgroup_create(KEYS.requests, b"mon\xff", id="$")
    time.sleep(1.5)  # several heartbeats and a prune
    assert rs.thread.is_alive()
    assert ask(rclient, request([chain("ok")], [("ok", "t0")])).ok  # type: ignore[union-attr]
    # the junk heartbeats read as long dead and are pruned, under their raw names
    assert set(rclient.hkeys(KEYS.heartbeat)) == {b"replica-a"}


def test_pool_names_label_the_decision_metrics_within_a_bound(start_server, rclient: redis.Redis) -> None:
    """Found by review: every pool name a request brought became a label series for ever (40 MB of
    /metrics after 200 requests naming long new pools)."""
    rs = start_server(catalogue=None)
    for i in range(3):
        req = request([chain(f"p{i}")], [(f"p{i}", "t0")])
        pools = tuple(replace(p, name=("x" * 200) + f"{i}-{j}") for j, p in enumerate(req.pools))
        reply = ask(rclient, replace(req, pools=pools))
        assert reply is not None and reply.ok
    labels = {s.labels["pool"] for m in rs.server.metrics.decisions.collect() for s in m.samples}
    assert labels == {"other"}


def test_a_housekeeping_failure_keeps_the_heartbeat_and_is_logged_once(start_server, rclient: redis.Redis,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: the heartbeat was written after the part that may fail, so a persistent failure there left
    a live replica without a heartbeat (every client fell back), logging a traceback at every heartbeat."""
    rs = start_server()

    def broken(r: redis.Redis) -> None:
        raise ValueError("a heartbeat nobody can read")

    rs.server._next_prune = 0.0
    rs.server._prune_heartbeats = broken
    rs.server.config = replace(rs.server.config, heartbeat_prune_s=0.7)
    rclient.hdel(KEYS.heartbeat, "replica-a")
    time.sleep(1.2)  # six heartbeats, several prunes
    assert rclient.hexists(KEYS.heartbeat, "replica-a") and rs.thread.is_alive()
    assert sum("pruning heartbeats" in r.getMessage() for r in caplog.records) == 1


def test_a_unix_socket_redis_url_is_served(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Found by review: ``unix://`` is an accepted scheme, but the server passed ``socket_keepalive``,
    which a unix socket connection refuses: every such server crashed at its first connection."""
    import shutil
    import subprocess

    from policy.config import ServerConfig
    from policy.server import PolicyServer

    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([str(shutil.which("redis-server")), "--port", "0", "--unixsocket", str(sock),
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        server = PolicyServer(ServerConfig(redis_url=f"unix://{sock}", prefix=KEYS.prefix, placer="eft",
                                           catalogue=None))
        server._connect()
        r = redis.Redis(unix_socket_path=str(sock))
        send(r, request([chain("u")], [("u", "t0")], request_id="over-unix"))
        assert server.step() == 1
        reply = wait_reply(r, "over-unix")
        assert reply is not None and reply.ok
        r.close()
    finally:
        proc.terminate()
        proc.wait(10)

