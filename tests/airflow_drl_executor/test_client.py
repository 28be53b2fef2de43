"""PlacementClient against a real redis-server and a real (in-process) policy server."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import redis

from airflow_drl_executor.client import PlacementClient, PlacementUnavailable
from policy.bench import free_port
from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode
from policy.server import PolicyServer
from policy.transport import Keys

POOLS = (PoolState("small", "s", slots=2, cpus=4, memory_gb=16),
         PoolState("large", "l", slots=2, cpus=16, memory_gb=128, speed=2.0))


def _graph(run: str = "d/r1") -> RunGraph:
    return RunGraph(run, (TaskNode("a", duration_s=10), TaskNode("b", memory_gb=64)), ((0, 1),))


def _request(rid: str, run: str = "d/r1", task: str = "a") -> PlacementRequest:
    return PlacementRequest(rid, (ReadyTask(run, task),), POOLS)


def _client(url: str, **kw: object) -> PlacementClient:
    return PlacementClient(url, prefix="t", timeout_ms=kw.pop("timeout_ms", 500), **kw)  # type: ignore[arg-type]


def test_round_trip_then_graph_by_reference(redis_url: str, policy_server: Callable[..., PolicyServer]) -> None:
    server = policy_server()
    client = _client(redis_url)
    g = _graph()
    first = client.place(_request("r1"), {g.run_key: g})
    assert [(d.task_id, d.pool) for d in first.decisions] == [("a", "large")]
    assert first.policy and not first.decisions[0].fallback
    second = client.place(_request("r2", task="b"), {g.run_key: g})  # sent as a RunRef this time
    assert second.decisions[0].pool == "large"
    assert (g.run_key, g.digest) in server.cache


def test_unknown_graph_is_resent_in_full(redis_url: str, policy_server: Callable[..., PolicyServer]) -> None:
    first = policy_server(graph_store_ttl_s=0)  # no shared store: nothing but the client has it
    client = _client(redis_url)
    g = _graph()
    client.place(_request("r1"), {g.run_key: g})
    first.stop()  # a restarted server has an empty graph cache
    time.sleep(0.1)
    second = policy_server(graph_store_ttl_s=0)
    reply = client.place(_request("r2"), {g.run_key: g})
    assert reply.ok and reply.decisions[0].task_id == "a"
    assert reply.request_id == "r2"  # the resend went as "r2.r"; a late reply to "r2" is not it
    assert second.metrics.requests.labels(outcome="unknown_graph")._value.get() == 1


def _big_graph(run: str = "d/big", n: int = 200) -> RunGraph:
    tasks = tuple(TaskNode(f"task-{i:04d}", duration_s=10) for i in range(n))
    return RunGraph(run, tasks, tuple((i, i + 1) for i in range(n - 1)))


def test_a_refused_graph_is_not_taken_for_sent(redis_url: str,
                                               policy_server: Callable[..., PolicyServer]) -> None:
    server = policy_server(max_request_bytes=4096)
    client = _client(redis_url)
    g = _big_graph()
    for rid in ("r1", "r2"):  # each time the full graph, refused: never a RunRef, never unknown_graph
        with pytest.raises(PlacementUnavailable, match="bad_request.*exceeds the limit of 4096"):
            client.place(_request(rid, run=g.run_key, task="task-0000"), {g.run_key: g})
    # counted once its reply is written, just after the client can read it: wait for the count
    deadline = time.monotonic() + 5
    while server.metrics.requests.labels(outcome="bad_request")._value.get() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.metrics.requests.labels(outcome="bad_request")._value.get() == 2
    assert server.metrics.requests.labels(outcome="unknown_graph")._value.get() == 0


def test_a_request_over_the_limit_is_not_sent(redis_url: str,
                                              policy_server: Callable[..., PolicyServer]) -> None:
    server = policy_server()
    client = _client(redis_url, max_request_bytes=4096)
    g = _big_graph()
    with pytest.raises(PlacementUnavailable, match="exceeds the policy servers' limit of 4096; not sent"):
        client.place(_request("r1", run=g.run_key, task="task-0000"), {g.run_key: g})
    assert redis.Redis.from_url(redis_url).xlen(Keys("t").requests) == 0
    assert server.handled == 0


def test_no_server_fails_fast_with_the_reason(redis_url: str) -> None:
    client = _client(redis_url, timeout_ms=2000)
    start = time.monotonic()
    with pytest.raises(PlacementUnavailable, match="no policy server"):
        client.place(_request("r1"), {"d/r1": _graph()})
    assert time.monotonic() - start < 0.5, "no heartbeat: no need to wait for the deadline"


def test_stale_heartbeat_counts_as_dead(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.hset(Keys("t").heartbeat, "ghost", '{"ts": %f}' % (time.time() - 120))
    with pytest.raises(PlacementUnavailable, match="freshest heartbeat"):
        _client(redis_url, stale_after_s=15).place(_request("r1"), {"d/r1": _graph()})


def test_a_heartbeat_dated_far_ahead_is_not_a_live_server(redis_url: str) -> None:
    """Found by review: {"ts": 1e300} read as live for ever (a negative age)."""
    r = redis.Redis.from_url(redis_url)
    r.hset(Keys("t").heartbeat, "ghost", '{"ts": 1e300}')
    with pytest.raises(PlacementUnavailable, match="no live policy server"):
        _client(redis_url, stale_after_s=15).place(_request("r1"), {"d/r1": _graph()})


def test_silent_server_times_out_within_the_deadline(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.hset(Keys("t").heartbeat, "mute", str(time.time()))  # alive on paper, never answers
    client = _client(redis_url, timeout_ms=150)
    start = time.monotonic()
    with pytest.raises(PlacementUnavailable, match="no reply within 150 ms"):
        client.place(_request("r1"), {"d/r1": _graph()})
    assert 0.14 <= time.monotonic() - start < 0.4


def test_dead_redis_backs_off() -> None:
    client = PlacementClient(f"redis://127.0.0.1:{free_port()}/0", timeout_ms=100, backoff_max_s=5)
    with pytest.raises(PlacementUnavailable, match="redis error"):
        client.place(_request("r1"), {"d/r1": _graph()})
    start = time.monotonic()
    with pytest.raises(PlacementUnavailable, match="retrying in"):
        client.place(_request("r2"), {"d/r1": _graph()})
    assert time.monotonic() - start < 0.01, "during back-off the client does not touch Redis"


def test_a_hung_redis_holds_the_scheduler_little_past_the_deadline() -> None:
    """A Redis that accepts connections and never answers (was: 0.7 s for a 0.2 s deadline, at
    every try after each back-off)."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        client = PlacementClient(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_ms=200)
        start = time.monotonic()
        with pytest.raises(PlacementUnavailable, match="redis error"):
            client.place(_request("r1"), {"d/r1": _graph()})
        assert time.monotonic() - start < 0.55, "was >= 0.7 s (the socket timeout alone)"
    finally:
        stop.set()
        thread.join(2)
        for conn in held:
            conn.close()
        listener.close()


def test_runs_over_the_limit_together_are_sent_over_heartbeats(redis_url: str,
                                                                policy_server: Callable[..., PolicyServer]) -> None:
    """Two new runs whose graphs fit the limit one at a time: the first request places the
    tasks of one (the other's get no decision: offered again at the next heartbeat), the next
    sends that one by reference and the other in full. was: the whole batch refused, at every
    heartbeat while the runs shared batches."""
    from policy.schema import dumps

    policy_server()
    a, b = _big_graph(run="d/a", n=30), _big_graph(run="d/b", n=30)
    one = len(dumps(PlacementRequest("x", (ReadyTask("d/a", "task-0000"),), POOLS, runs=(a,))))
    client = _client(redis_url, max_request_bytes=one + 400)
    request = PlacementRequest("r1", (ReadyTask("d/a", "task-0000"), ReadyTask("d/b", "task-0000")), POOLS)
    first = client.place(request, {"d/a": a, "d/b": b})
    assert len(first.decisions) == 1
    placed = first.decisions[0].run_key
    second = client.place(replace(request, request_id="r2"), {"d/a": a, "d/b": b})
    assert sorted(d.run_key for d in second.decisions) == ["d/a", "d/b"], "the other run's graph, now it fits"
    assert placed in {"d/a", "d/b"}


def test_a_run_whose_graph_alone_is_over_the_limit_is_placed_by_the_fallback_at_once(
        redis_url: str, policy_server: Callable[..., PolicyServer]) -> None:
    """was: beside any run that fits, its tasks got no decision at every heartbeat (its graph can
    never be sent), which the executor takes for the policy holding them: each waited max_wait_s"""
    from policy.schema import dumps

    policy_server()
    small, giant = _big_graph(run="d/small", n=5), _big_graph(run="d/giant", n=300)
    one = len(dumps(PlacementRequest("x", (ReadyTask("d/small", "task-0000"),), POOLS, runs=(small,))))
    client = _client(redis_url, max_request_bytes=one + 400)
    request = PlacementRequest("r1", (ReadyTask("d/small", "task-0000"), ReadyTask("d/giant", "task-0000")), POOLS)
    reply = client.place(request, {"d/small": small, "d/giant": giant})
    by_run = {d.run_key: d for d in reply.decisions}
    assert sorted(by_run) == ["d/giant", "d/small"] and not by_run["d/small"].fallback
    assert by_run["d/giant"].fallback and "over the policy servers' request limit" in by_run["d/giant"].reason


def test_no_blpop_once_the_deadline_has_passed(redis_url: str) -> None:
    """Found by review: when the DEL+XADD used up the deadline, ``_round_trip`` still blocked in a
    BLPOP (``timeout=max(remaining, 0.001)``): one more round trip of a slow Redis, up to the
    socket timeout, holding the scheduler loop for a reply that could not count as on time."""
    r = redis.Redis.from_url(redis_url)
    r.hset(Keys("t").heartbeat, "mute", str(time.time()))
    now = [1000.0]
    client = PlacementClient(redis_url, prefix="t", timeout_ms=200, clock=lambda: now[0])
    client._live_checked_at, client._live_reason = now[0], None  # liveness known: no read now
    real_pipeline = client._redis.pipeline

    def slow_pipeline(*a: object, **kw: object) -> redis.client.Pipeline:
        pipe = real_pipeline(*a, **kw)  # type: ignore[arg-type]
        real_execute = pipe.execute

        def execute(*ea: object, **ekw: object) -> list[object]:
            out = real_execute(*ea, **ekw)  # type: ignore[arg-type]
            now[0] += 0.5  # the DEL+XADD took longer than the whole deadline
            return out

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    blpops: list[float] = []
    real_blpop = client._redis.blpop

    def blpop(keys: object, timeout: float = 0) -> object:
        blpops.append(timeout)
        return real_blpop(keys, timeout=timeout)  # type: ignore[arg-type]

    client._redis.pipeline = slow_pipeline  # type: ignore[method-assign]
    client._redis.blpop = blpop  # type: ignore[method-assign]
    with pytest.raises(PlacementUnavailable):
        client.place(_request("r1"), {"d/r1": _graph()})
    assert blpops == [], f"BLPOP issued (timeout {blpops}) after the deadline had passed"


@pytest.mark.parametrize("runs", [1, 1_100])
def test_more_ready_tasks_or_runs_than_a_request_takes_are_sent_over_heartbeats(
        redis_url: str, policy_server: Callable[..., PolicyServer], runs: int) -> None:
    """4,200 ready tasks (of one run, or of 1,100 runs): the first request carries the first
    4,096 tasks of at most 1,024 runs, in the executor's order; the others get no decision now
    (offered again at the next heartbeat). was: the server refused the whole request (its limits,
    policy.schema), and every task was placed by the fallback at every heartbeat."""
    from policy.schema import MAX_READY_PER_REQUEST, MAX_RUNS_PER_REQUEST

    policy_server()
    n = 4_200
    per_run = -(-n // runs)
    graphs = {f"d/r{k}": RunGraph(f"d/r{k}", tuple(TaskNode(f"t{i}") for i in range(per_run)), ())
              for k in range(runs)}
    ready = tuple(ReadyTask(f"d/r{j // per_run}", f"t{j % per_run}") for j in range(n))
    reply = _client(redis_url, timeout_ms=20_000).place(PlacementRequest("r1", ready, POOLS), graphs)
    assert reply.ok and not any(d.fallback for d in reply.decisions), reply.error
    sent = [(d.run_key, d.task_id) for d in reply.decisions]
    expected = [t.key for t in ready if int(t.run_key[3:]) < MAX_RUNS_PER_REQUEST][:MAX_READY_PER_REQUEST]
    assert sorted(sent) == sorted(expected)
