"""The server's batch path against a real redis-server: one ``place_many`` per micro-batch (issue 5)."""

from __future__ import annotations

import time
from typing import Mapping, Sequence

import pytest
import redis
import torch
from gnn_helpers import random_dag
from server_helpers import KEYS, ask, chain, request, send, send_raw, wait_reply

from policy.arbiter import Arbiter
from policy.gnn import GNNPlacer
from policy.model import ModelConfig, PlacementGNN
from policy.schema import Decision, PlacementRequest, RunGraph

pytestmark = pytest.mark.integration


class RecordingPlacer(GNNPlacer):
    """The GNN placer, recording batch sizes and failing on requests whose id starts with boom."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(PlacementGNN(ModelConfig()))
        self.batches: list[int] = []

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        if request.request_id.startswith("boom"):
            raise RuntimeError("boom")
        return super().place(request, graphs)

    def place_many(self, requests: Sequence[PlacementRequest],
                   graphs: Sequence[Mapping[str, RunGraph]]) -> list[list[Decision]]:
        self.batches.append(len(requests))
        if any(r.request_id.startswith("boom") for r in requests):
            raise RuntimeError("boom in the batch")
        return super().place_many(requests, graphs)


def _queue(r: redis.Redis, n: int, boom: bool = False) -> list[PlacementRequest]:
    """``n`` requests of different sizes, queued before any server reads them."""
    reqs = []
    for i in range(n):
        g = random_dag(20 + 30 * i, seed=i, run_key=f"dag/batch-{i}") if i % 3 else chain(f"dag/chain-{i}")
        ready = [(g.run_key, t.task_id) for t in g.tasks[: 1 + i % 6]]
        rid = f"boom-{i}" if boom and i == 2 else None
        reqs.append(request([g], ready, request_id=rid, deadline_ms=30_000))
        send(r, reqs[-1])
    return reqs


def _expected(req: PlacementRequest) -> list[tuple[str, str, str]]:
    ref = RecordingPlacer()
    graphs = {g.run_key: g for g in req.runs if isinstance(g, RunGraph)}
    return [(d.task_id, d.pool, d.reason) for d in Arbiter().decide(ref, req, graphs)]


def test_a_micro_batch_is_decided_in_one_call_as_one_by_one(start_server, rclient: redis.Redis) -> None:
    reqs = _queue(rclient, 12)
    send_raw(rclient, '{"request_id": "bad-1", "ready": "not a list"}')  # an error reply, no harm
    late = request([chain("dag/late")], [("dag/late", "t0")], deadline_ms=100)
    send(rclient, late)
    time.sleep(0.2)  # 100 ms pass on Redis's clock before any replica reads it: dropped
    placer = RecordingPlacer()
    start_server(placer=placer)
    for req in reqs:
        reply = wait_reply(rclient, req.request_id)
        assert reply is not None and reply.ok, reply
        assert reply.policy == "drl"
        assert [(d.task_id, d.pool, d.reason) for d in reply.decisions] == _expected(req)
    bad = wait_reply(rclient, "bad-1")
    assert bad is not None and bad.error_code == "bad_request"
    assert wait_reply(rclient, late.request_id, timeout_s=0.3) is None
    assert max(placer.batches) == len(reqs)  # the whole queue in one call
    assert rclient.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_a_failing_request_costs_only_its_own_decisions(start_server, rclient: redis.Redis) -> None:
    reqs = _queue(rclient, 6, boom=True)
    placer = RecordingPlacer()
    start_server(placer=placer)
    for req in reqs:
        reply = wait_reply(rclient, req.request_id)
        assert reply is not None and reply.ok, reply
        if req.request_id.startswith("boom"):  # the fallback decided, and says why
            assert len(reply.decisions) == len(req.ready)
            assert all("drl failed (RuntimeError: boom)" in d.reason for d in reply.decisions)
        else:
            assert [(d.task_id, d.pool, d.reason) for d in reply.decisions] == _expected(req)
    assert placer.batches[0] == len(reqs)


def test_batch_wait_waits_milliseconds_not_a_redis_tick(start_server, rclient: redis.Redis) -> None:
    """``batch_wait_ms`` polls: a blocked read would time out on Redis's cron tick (~100 ms at
    the default hz 10), not after the few milliseconds asked for."""
    from policy.placement import EarliestFinishPlacer

    start_server(placer=EarliestFinishPlacer(), batch_wait_ms=5)
    g = chain("dag/wait")
    assert (reply := ask(rclient, request([g], [(g.run_key, "t0")]))) is not None and reply.ok  # warm
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        reply = ask(rclient, request([g], [(g.run_key, "t0")]))
        took.append(time.perf_counter() - t0)
        assert reply is not None and reply.ok
    assert sorted(took)[2] < 0.05, took  # median; ~100 ms each with BLOCK 5
