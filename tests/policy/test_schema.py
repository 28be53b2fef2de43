from __future__ import annotations

import json
from dataclasses import replace

import pytest

from policy.errors import SchemaError
from policy.schema import (
    SCHEMA_VERSION,
    Decision,
    PlacementReply,
    PlacementRequest,
    PoolState,
    ReadyTask,
    RunGraph,
    RunProgress,
    RunRef,
    TaskNode,
    dumps,
    loads_json,
)


def _graph() -> RunGraph:
    tasks = (TaskNode("a", duration_s=10), TaskNode("b", gpus=1, kind="gpu_train"), TaskNode("c", pool="big"))
    return RunGraph(run_key="dag/run1", tasks=tasks, edges=((0, 1), (0, 2)))


def _request() -> PlacementRequest:
    g = _graph()
    return PlacementRequest(
        request_id="r1",
        ready=(ReadyTask("dag/run1", "a"),),
        pools=(PoolState("small", "s", slots=2, cpus=4, memory_gb=16),
               PoolState("gpu", "g", slots=1, cpus=8, memory_gb=64, gpus=1, affinity={"gpu_train": 8.0})),
        runs=(g, RunRef("dag/run0", "0123456789abcdef")),
        progress=(RunProgress("dag/run1", finished=("x",), running=("a",), age_s=3.0),),
        created_at=1.0,
        deadline_ms=100.0,
    )


def test_request_round_trips_through_json() -> None:
    req = _request()
    back = PlacementRequest.from_json(loads_json(dumps(req), max_bytes=1 << 20))
    assert back == req
    assert back.graphs()["dag/run1"].digest == req.runs[0].digest  # type: ignore[union-attr]


def test_held_time_travels_and_is_not_part_of_the_task_s_identity() -> None:
    req = replace(_request(), ready=(ReadyTask("dag/run1", "a", held_s=12.5),))
    back = PlacementRequest.from_json(loads_json(dumps(req), max_bytes=1 << 20))
    assert back.ready[0].held_s == 12.5
    assert "held_s" not in ReadyTask("dag/run1", "a").to_json(), "an unheld task's JSON is as before"
    assert ReadyTask("dag/run1", "a", held_s=3.0) == ReadyTask("dag/run1", "a")
    assert hash(ReadyTask("dag/run1", "a", held_s=3.0)) == hash(ReadyTask("dag/run1", "a"))


def test_reply_round_trips_and_reports_errors() -> None:
    reply = PlacementReply("r1", (Decision("dag/run1", "a", "small", "s", -3.0, "why"),), "eft", "1")
    assert PlacementReply.from_json(json.loads(dumps(reply))) == reply
    err = PlacementReply("r2", error_code="unknown_graph", error="dag/run0")
    back = PlacementReply.from_json(json.loads(dumps(err)))
    assert not back.ok and back.error_code == "unknown_graph"


def test_digest_depends_on_content_only() -> None:
    a, b = _graph(), _graph()
    assert a.digest == b.digest and len(a.digest) == 16
    changed = RunGraph(run_key="dag/run1", tasks=a.tasks, edges=((0, 1),))
    assert changed.digest != a.digest


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda o: o.update(schema_version=99), "schema_version"),
        (lambda o: o.pop("request_id"), "request_id"),
        (lambda o: o["ready"][0].update(task_id=""), "ready[0].task_id"),
        (lambda o: o["ready"][0].update(held_s=-1.0), "ready[0].held_s"),
        (lambda o: o["pools"][0].update(slots=-1), "slots"),
        (lambda o: o["pools"][0].update(cpus="many"), "cpus"),
        (lambda o: o["runs"][0]["tasks"][0].update(duration_s=float("nan")), "duration_s"),
        (lambda o: o["runs"][0].update(edges=[[0, 7]]), "bad edge"),
        (lambda o: o["runs"][0].update(digest="0000"), "digest"),
        (lambda o: o["pools"][1].update(affinity={"gpu_train": -1}), "affinity"),
    ],
)
def test_malformed_requests_name_the_field(mutate, field: str) -> None:
    obj = json.loads(dumps(_request()))
    mutate(obj)
    with pytest.raises(SchemaError, match=field.replace("[", r"\[").replace("]", r"\]")):
        PlacementRequest.from_json(obj)


def test_loads_json_refuses_oversized_and_non_objects() -> None:
    with pytest.raises(SchemaError, match="exceeds"):
        loads_json(b"{}" * 10, max_bytes=5)
    with pytest.raises(SchemaError, match="not JSON"):
        loads_json(b"{nope", max_bytes=100)
    with pytest.raises(SchemaError, match="JSON object"):
        loads_json(b"[1]", max_bytes=100)
    # strict UTF-8, a BOM taken as json.loads(bytes) took it; a str holding a raw lone surrogate refused
    assert loads_json(b'\xef\xbb\xbf{"a": 1}', max_bytes=100) == {"a": 1}
    with pytest.raises(SchemaError, match="not JSON"):
        loads_json(b'{"a": "\xed\xa0\x80"}', max_bytes=100)
    with pytest.raises(SchemaError, match="surrogate"):
        loads_json('{"a": "\ud800"}', max_bytes=100)
    assert loads_json('{"a": "\u00e9t\u00e9"}', max_bytes=100) == {"a": "été"}


def test_pool_constraints_and_affinity() -> None:
    gpu = PoolState("gpu", "g", slots=1, cpus=8, memory_gb=64, gpus=1, speed=1.5, affinity={"gpu_train": 8.0})
    small = PoolState("small", "s", slots=2, cpus=4, memory_gb=16)
    trainer = TaskNode("t", gpus=1, kind="gpu_train")
    assert gpu.fits(trainer) and not small.fits(trainer)
    assert gpu.speed_for("gpu_train") == 12.0 and gpu.speed_for("default") == 1.5
    assert not small.fits(TaskNode("p", pool="gpu"))
    assert SCHEMA_VERSION == 1


def test_fast_digest_writes_the_reference_bytes() -> None:
    """graph_digest writes the canonical JSON itself: it must hash the same bytes as the
    definition (json.dumps with sorted keys) for any content, or executors and servers of
    different versions would disagree on every RunRef."""
    import random

    from policy.schema import graph_digest, graph_digest_reference

    rng = random.Random(0)
    texts = ["t", "a\u00e9\"b\\c", "line\nbreak", "\u4e2d\u6587", "tab\there", "emoji \U0001f600", "x" * 300]
    numbers = [0.0, 1.0, 1e-7, 2.5, 123456789.123, 1e22, 3.0000000000000004, 7, 0.1 + 0.2]
    for case in range(300):
        n = rng.randint(1, 12)
        tasks = tuple(
            TaskNode(task_id=f"{rng.choice(texts)}-{i}", duration_s=rng.choice(numbers),
                     cpus=rng.choice(numbers), memory_gb=rng.choice(numbers), gpus=rng.choice(numbers),
                     priority=rng.choice(numbers), kind=rng.choice(texts),
                     pool=rng.choice([None, "gpu", rng.choice(texts)]))
            for i in range(n))
        edges = tuple((rng.randrange(i), i) for i in range(1, n) if rng.random() < 0.7)
        assert graph_digest(tasks, edges) == graph_digest_reference(tasks, edges), case
    odd = (TaskNode(task_id="inf", duration_s=float("inf")), TaskNode(task_id="nan", cpus=float("nan")))
    assert graph_digest(odd, ()) == graph_digest_reference(odd, ())


def test_fast_task_parsing_accepts_and_refuses_as_the_checks_do() -> None:
    """TaskNode.from_json's fast path (every number a float) gives what the checked path gives,
    and anything else goes the checked way: defaults for absent fields, ints, errors."""
    full = {"task_id": "a", "duration_s": 5.0, "cpus": 2.0, "memory_gb": 4.0, "gpus": 1.0,
            "priority": 3.0, "kind": "gpu_train", "pool": "gpu"}
    assert TaskNode.from_json(full) == TaskNode("a", 5.0, 2.0, 4.0, 1.0, 3.0, "gpu_train", "gpu")
    assert TaskNode.from_json({"task_id": "b"}) == TaskNode("b")
    assert TaskNode.from_json({"task_id": "c", "duration_s": 10, "pool": None}) == TaskNode("c", duration_s=10.0)
    for bad, match in (({**full, "cpus": -1.0}, "cpus"), ({**full, "gpus": float("nan")}, "gpus"),
                       ({**full, "kind": ""}, "kind"), ({**full, "pool": 3}, "pool"),
                       ({**full, "task_id": ""}, "task_id"), ({**full, "priority": True}, "priority")):
        with pytest.raises(SchemaError, match=match):
            TaskNode.from_json(bad)
