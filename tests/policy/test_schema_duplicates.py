"""The wire schema and the featuriser on inputs that passed validation and then crashed a decoder
or gave wrong tensors (policy/schema.py, policy/features.py; found by review): each is refused with
a SchemaError / bad_request or handled as if sent once."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from policy.config import ServerConfig
from policy.errors import SchemaError
from policy.features import READY_FEATURES, TASK_FEATURES, featurize
from policy.schema import (
    Decision,
    PlacementReply,
    PlacementRequest,
    PoolState,
    ReadyTask,
    RunGraph,
    RunProgress,
    TaskNode,
    dumps,
    loads_json,
)
from policy.server import PolicyServer

POOLS = (PoolState("small", "s", slots=2, cpus=4, memory_gb=16),
         PoolState("big", "b", slots=2, cpus=16, memory_gb=64))


def _graph(edges: tuple[tuple[int, int], ...] = ((0, 1), (0, 2))) -> RunGraph:
    return RunGraph("d/r1", (TaskNode("a", duration_s=10.0), TaskNode("b", duration_s=5.0),
                             TaskNode("c", duration_s=1.0)), edges)


def _request_json(**over: Any) -> dict[str, Any]:
    req = PlacementRequest("req-1", (ReadyTask("d/r1", "a"),), POOLS, runs=(_graph(),),
                           progress=(RunProgress("d/r1"),))
    obj = json.loads(dumps(req))
    obj.update(over)
    return obj


# --- replies: the executor's side decodes them; anything but a SchemaError escapes the client ----
# (airflow_drl_executor/client.py catches only SchemaError around PlacementReply.from_json, and
# DRLExecutor._decide only PlacementUnavailable: an AttributeError / OverflowError here escapes the
# scheduler loop instead of falling back to the heuristic)


@pytest.mark.parametrize("decision", [["x"], "x", None, 3])
def test_a_reply_whose_decision_is_not_an_object_is_a_schema_error(decision: Any) -> None:
    obj = {"schema_version": 1, "request_id": "r", "decisions": [decision]}
    with pytest.raises(SchemaError, match=r"decisions\[0\]"):
        PlacementReply.from_json(obj)


def test_a_reply_score_past_a_floats_range_is_a_schema_error() -> None:
    raw = (b'{"schema_version":1,"request_id":"r","decisions":[{"run_key":"d/r1","task_id":"a",'
           b'"pool":"small","vm_class":"s","score":1' + b"0" * 400 + b"}]}")
    obj = loads_json(raw, max_bytes=1 << 20)  # valid JSON: an integer of 401 digits
    try:
        reply = PlacementReply.from_json(obj)
    except SchemaError:
        return  # refused as malformed: fine
    # or read as some finite score: also fine; an OverflowError is not
    assert all(isinstance(d, Decision) for d in reply.decisions)


# --- requests: duplicates that pass validation --------------------------------------------------


def test_a_duplicated_ready_task_is_refused_or_placed_once() -> None:
    """The same (run_key, task_id) twice in ``ready`` passed validation, and the server answered
    two decisions for one task instance (the fuzz test's invariant: a good reply places each
    ready task at most once)."""
    obj = _request_json()
    obj["ready"].append(dict(obj["ready"][0]))
    server = PolicyServer(ServerConfig(placer="eft", device="cpu", catalogue=None))
    [job] = server.handle([(b"1-0", {b"payload": json.dumps(obj).encode()})])
    reply = job.reply
    assert reply is not None
    if reply.ok:
        keys = [(d.run_key, d.task_id) for d in reply.decisions]
        assert len(keys) == len(set(keys)), f"one task instance placed twice: {keys}"
    else:
        assert reply.error_code == "bad_request", reply


@pytest.mark.parametrize("field", ["finished", "running"])
def test_duplicated_progress_ids_do_not_count_twice(field: str) -> None:
    """``progress.finished`` / ``running`` listing a task twice passed validation, and the
    featuriser counted it twice: ``run_done_frac`` 5/3 and ``run_work_left_frac`` < 0 for a
    3-task run (fractions outside [0, 1] no training sample had)."""
    once = _request_json(progress=[{"run_key": "d/r1", field: ["b", "c"]}])
    twice = _request_json(progress=[{"run_key": "d/r1", field: ["b", "b", "b", "c", "c"]}])
    ref = PlacementRequest.from_json(once)
    try:
        req = PlacementRequest.from_json(twice)
        fb = featurize(req, req.graphs())
    except SchemaError:
        return  # refused: fine
    expected = featurize(ref, ref.graphs()).ready_x
    for name in ("run_done_frac", "run_running_frac", "run_work_left_frac"):
        col = READY_FEATURES.index(name)
        assert 0.0 <= fb.ready_x[0, col] <= 1.0, (name, fb.ready_x[0, col])
    np.testing.assert_array_equal(fb.ready_x, expected)


def test_a_duplicated_edge_is_refused_or_featurised_as_one() -> None:
    """The same dependency twice passed validation and doubled the child's ``log_parents`` and
    the parent's ``log_children`` (and the GNN's message along it), for a graph the same as the
    one without the repeat."""
    obj = _request_json()
    run = obj["runs"][0]
    run.pop("digest")
    run["edges"].append([0, 1])
    try:
        req = PlacementRequest.from_json(obj)
        fb = featurize(req, req.graphs())
    except SchemaError:
        return  # refused: fine
    ref = PlacementRequest.from_json(_request_json())
    x, x_ref = fb.runs[0].x, featurize(ref, ref.graphs()).runs[0].x
    for name in ("log_parents", "log_children"):
        col = TASK_FEATURES.index(name)
        np.testing.assert_array_equal(x[:, col], x_ref[:, col], err_msg=name)


def test_a_reply_fallback_must_be_a_boolean() -> None:
    """``bool("false")`` is True: a decision saying ``"fallback": "false"`` read as a fallback."""
    obj = {"schema_version": 1, "request_id": "r", "decisions": [
        {"run_key": "d/r1", "task_id": "a", "pool": "small", "vm_class": "s", "fallback": "false"}]}
    with pytest.raises(SchemaError, match=r"decisions\[0\]\.fallback"):
        PlacementReply.from_json(obj)


@pytest.mark.parametrize("part", ["pools", "runs"])
def test_a_pool_or_run_listed_twice_is_refused(part: str) -> None:
    obj = _request_json()
    obj[part].append(dict(obj[part][0]))
    with pytest.raises(SchemaError, match=f"request.{part}: .* listed twice"):
        PlacementRequest.from_json(obj)
