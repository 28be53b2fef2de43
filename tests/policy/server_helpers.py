"""Request builders and a bare client for the server tests (the executor's side of the wire)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis

from policy.bench import DEFAULT_CATALOGUE
from policy.catalogue import load_catalogue
from policy.schema import PlacementReply, PlacementRequest, ReadyTask, RunEntry, RunGraph, TaskNode, dumps
from policy.transport import PAYLOAD_FIELD, Keys

KEYS = Keys("t")
CATALOGUE = load_catalogue(DEFAULT_CATALOGUE)


def chain(run_key: str, n: int = 5) -> RunGraph:
    tasks = tuple(TaskNode(task_id=f"t{i}", duration_s=10.0 * (i + 1)) for i in range(n))
    return RunGraph(run_key=run_key, tasks=tasks, edges=tuple((i, i + 1) for i in range(n - 1)))


def request(runs: list[RunEntry], ready: list[tuple[str, str]], *, deadline_ms: float = 2000.0,
            created_at: float | None = None, request_id: str | None = None) -> PlacementRequest:
    return PlacementRequest(
        request_id=request_id or uuid.uuid4().hex,
        ready=tuple(ReadyTask(rk, tid) for rk, tid in ready),
        pools=CATALOGUE.states(),
        runs=tuple(runs),
        created_at=time.time() if created_at is None else created_at,
        deadline_ms=deadline_ms,
    )


def send_raw(r: redis.Redis, payload: bytes | str, keys: Keys = KEYS) -> None:
    r.xadd(keys.requests, {PAYLOAD_FIELD: payload})


def send(r: redis.Redis, req: PlacementRequest, keys: Keys = KEYS) -> None:
    send_raw(r, dumps(req), keys)


def wait_reply(r: redis.Redis, request_id: str, timeout_s: float = 5.0,
               keys: Keys = KEYS) -> PlacementReply | None:
    got: Any = r.blpop([keys.reply(request_id)], timeout=timeout_s)
    if got is None:
        return None
    return PlacementReply.from_json(json.loads(got[1]))


def ask(r: redis.Redis, req: PlacementRequest, timeout_s: float = 5.0,
        keys: Keys = KEYS) -> PlacementReply | None:
    send(r, req, keys)
    return wait_reply(r, req.request_id, timeout_s, keys)
