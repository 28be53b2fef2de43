"""The policy server's batch loop, deadlines and heartbeat (found by review; each test failed on the
code before its fix, for the bug its docstring names)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any, Mapping

import numpy as np
import pytest
import redis
from server_helpers import KEYS, chain, request, send, send_raw

from policy.config import ServerConfig
from policy.placement import EarliestFinishPlacer
from policy.schema import Decision, PlacementReply, PlacementRequest, RunGraph, dumps
from policy.server import PolicyServer

pytestmark = pytest.mark.integration


def _server(redis_url: str, placer: Any = None, **overrides: Any) -> PolicyServer:
    base = ServerConfig(redis_url=redis_url, prefix=KEYS.prefix, consumer="me", block_ms=50,
                        heartbeat_s=0.2, claim_interval_s=0.1, reconnect_base_s=0.05,
                        reconnect_max_s=0.4)
    return PolicyServer(replace(base, **overrides), placer=placer or EarliestFinishPlacer())


def _reply(r: redis.Redis, request_id: str) -> PlacementReply | None:
    raw: Any = r.lpop(KEYS.reply(request_id))
    return None if raw is None else PlacementReply.from_json(json.loads(raw))


class NumpyScorePlacer(EarliestFinishPlacer):
    """EFT, but for requests whose id starts with "np" the scores are numpy float32 (what a
    placer computing its scores in float32 arrays returns)."""

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        out = super().place(request, graphs)
        if request.request_id.startswith("np"):
            out = [replace(d, score=np.float32(d.score)) for d in out]
        return out


def test_one_reply_that_cannot_be_encoded_does_not_drop_its_batch_mates(
        redis_url: str, rclient: redis.Redis) -> None:
    """policy/server.py step(): every reply of the batch is encoded inside ``_reply`` and any
    non-Redis exception there acknowledges and deletes the WHOLE batch unanswered. One request
    whose decisions cannot be encoded (a placer's numpy score: json.dumps raises TypeError) costs
    every request read with it its reply. Fix: encode each reply on its own before the script
    call, turning a failure into that request's ``internal`` error reply."""
    server = _server(redis_url, placer=NumpyScorePlacer())
    server._connect()
    try:
        good = request([chain("good")], [("good", "t0")], request_id="good-1", deadline_ms=30_000)
        bad = request([chain("bad")], [("bad", "t0")], request_id="np-1", deadline_ms=30_000)
        send(rclient, bad)
        send(rclient, good)
        assert server.step() == 2  # one batch of both
        reply = _reply(rclient, "good-1")
        assert reply is not None and reply.ok, "a batch-mate of an unencodable reply was dropped unanswered"
    finally:
        server._goodbye()


def test_a_negative_deadline_is_a_bad_request_not_a_silent_drop(redis_url: str, rclient: redis.Redis) -> None:
    """policy/server.py _decode/_is_late: ``deadline_ms`` is checked against the clock before the
    request is validated, so a negative one (the schema refuses it: ``_num`` lo=0) makes the
    request "late" and it is dropped without any reply, where bad input gets a ``bad_request``
    reply. Fix: only a finite ``deadline_ms >= 0`` counts as a deadline in ``_is_late``; any
    other value falls through to the schema, which refuses it."""
    server = _server(redis_url)
    server._connect()
    try:
        doc = json.loads(dumps(request([chain("neg")], [("neg", "t0")], request_id="neg-1")))
        doc["deadline_ms"] = -1000
        send_raw(rclient, json.dumps(doc))
        assert server.step() == 1
        reply = _reply(rclient, "neg-1")
        assert reply is not None and reply.error_code == "bad_request", reply
    finally:
        server._goodbye()


def test_an_idle_replica_blocks_no_longer_than_its_heartbeat_interval(
        redis_url: str, rclient: redis.Redis) -> None:
    """policy/server.py step(): an idle read blocks ``min(block_ms, time to the next claim)``, but
    not until the next heartbeat, which is written only between reads. With block_ms=5000,
    claim_interval_s=5, heartbeat_s=0.2 (each valid) a live idle replica writes a heartbeat every
    5 s while everyone (executors; ``_claim``: 3 x heartbeat_s) takes it for dead after 0.6 s.
    Fix: bound the block by the time to ``_next_heartbeat`` as well."""
    server = _server(redis_url, block_ms=5000, claim_interval_s=5.0, heartbeat_s=0.2)
    server._connect()
    blocks: list[int | None] = []

    def read(r: Any, count: int, block_ms: int | None) -> list[Any]:
        blocks.append(block_ms)
        return []
    server._read = read  # type: ignore[method-assign]
    try:
        server.step()
        assert blocks and blocks[0] is not None
        assert blocks[0] <= server.config.heartbeat_s * 1000, blocks
    finally:
        server._goodbye()


def test_stop_ends_the_batch_wait_instead_of_spinning_on_redis(
        redis_url: str, rclient: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """policy/server.py step(), the ``batch_wait_ms`` loop: once stop() is set, ``_stop.wait``
    returns at once, so the loop polls Redis without pause until ``batch_wait_ms`` has passed
    (valid up to a day) instead of finishing the batch in hand. Fix: break out of the wait when
    ``self._stop`` is set. (A fake monotonic clock: 1 ms per call.)"""
    server = _server(redis_url, batch_wait_ms=1000)
    server._connect()
    real_read = server._read
    polls: list[int | None] = []

    def read(r: Any, count: int, block_ms: int | None) -> list[Any]:
        polls.append(block_ms)
        return real_read(r, count, block_ms)
    server._read = read  # type: ignore[method-assign]
    fake = [time.monotonic()]

    def monotonic() -> float:
        fake[0] += 0.001
        return fake[0]
    try:
        send(rclient, request([chain("s")], [("s", "t0")], request_id="s-1", deadline_ms=60_000))
        server.stop()
        monkeypatch.setattr("policy.server.time.monotonic", monotonic)
        assert server.step() == 1
        monkeypatch.undo()
        assert len(polls) <= 3, f"{len(polls)} reads of Redis after stop() while waiting for the batch to fill"
    finally:
        monkeypatch.undo()
        server._goodbye()
