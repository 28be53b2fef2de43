from __future__ import annotations

from dataclasses import replace

import pytest

from policy.errors import SchemaError
from policy.graph import view
from policy.placement import EarliestFinishPlacer, Placer
from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode

SMALL = PoolState("small", "s", slots=4, cpus=4, memory_gb=16, speed=1.0)
LARGE = PoolState("large", "l", slots=2, cpus=16, memory_gb=128, speed=2.0)
GPU = PoolState("gpu", "g", slots=1, cpus=8, memory_gb=64, gpus=1, speed=1.5, affinity={"gpu_train": 8.0})


def _place(tasks: tuple[TaskNode, ...], pools=(SMALL, LARGE, GPU), edges=()) -> dict[str, str]:
    g = RunGraph("d/r", tasks, tuple(edges))
    req = PlacementRequest("q", tuple(ReadyTask("d/r", t.task_id) for t in tasks), tuple(pools))
    return {d.task_id: d.pool for d in EarliestFinishPlacer().place(req, {"d/r": g})}


def test_is_a_placer() -> None:
    assert isinstance(EarliestFinishPlacer(), Placer)


def test_prefers_fastest_free_pool_and_spreads_a_batch() -> None:
    placed = _place(tuple(TaskNode(f"t{i}", duration_s=10) for i in range(4)))
    # Two free slots at speed 2 (5 s), then the GPU box's CPUs (6.7 s); the fourth task waits for
    # a speed-2 slot (2.5 s + 5 s) rather than run on the small VM (10 s).
    assert sorted(placed.values()) == ["gpu", "large", "large", "large"]


def test_affinity_sends_training_to_the_gpu() -> None:
    assert _place((TaskNode("train", duration_s=100, kind="gpu_train", gpus=1),)) == {"train": "gpu"}
    assert _place((TaskNode("train", duration_s=100, kind="gpu_train"),)) == {"train": "gpu"}


def test_hard_constraints_and_pins_win() -> None:
    assert _place((TaskNode("big", memory_gb=100),)) == {"big": "large"}
    assert _place((TaskNode("pinned", pool="small"),)) == {"pinned": "small"}
    down_large = PoolState("large", "l", slots=2, cpus=16, memory_gb=128, speed=2.0, up=False)
    assert _place((TaskNode("x"),), pools=(SMALL, down_large)) == {"x": "small"}


def test_infeasible_task_gets_largest_pool_and_says_so() -> None:
    g = RunGraph("d/r", (TaskNode("huge", memory_gb=1000),), ())
    req = PlacementRequest("q", (ReadyTask("d/r", "huge"),), (SMALL, LARGE))
    (d,) = EarliestFinishPlacer().place(req, {"d/r": g})
    assert d.pool == "large" and "no pool fits" in d.reason


@pytest.mark.parametrize("pin, says", [
    ("small", "pinned to small, which cannot hold cpus=8 mem=1GB gpus=0: placed off its pin"),
    ("nowhere", "pinned to nowhere, which is not one of the pools: placed off its pin"),
])
def test_a_pin_that_cannot_be_honoured_is_named_in_the_reason(pin: str, says: str) -> None:
    """was: 'no pool fits cpus=8 ...' while the pool it went to fits, and the GNN said the same"""
    from gnn_helpers import ROOT

    from policy.gnn import GNNPlacer

    g = RunGraph("d/r", (TaskNode("t", cpus=8, pool=pin),), ())
    req = PlacementRequest("q", (ReadyTask("d/r", "t"),), (SMALL, LARGE, GPU))
    for placer in (EarliestFinishPlacer(), GNNPlacer.from_checkpoint(ROOT / "policy" / "checkpoints" / "default")):
        (d,) = placer.place(req, {"d/r": g})
        assert d.pool in ("large", "gpu") and d.reason.endswith(says) and "no pool fits" not in d.reason, d.reason


def test_the_gnn_says_a_chosen_pool_is_down() -> None:
    """was: 'only usable pool ...' for a GPU task queued on a GPU pool that is down, as if it ran"""
    from gnn_helpers import ROOT

    from policy.gnn import GNNPlacer

    down_gpu = PoolState("gpu", "g", slots=1, cpus=8, memory_gb=64, gpus=1, speed=1.5, up=False)
    g = RunGraph("d/r", (TaskNode("train", gpus=1, kind="gpu_train"),), ())
    req = PlacementRequest("q", (ReadyTask("d/r", "train"),), (SMALL, LARGE, down_gpu))
    (d,) = GNNPlacer.from_checkpoint(ROOT / "policy" / "checkpoints" / "default").place(req, {"d/r": g})
    assert d.pool == "gpu" and d.reason.endswith("gpu is down, the only pool that may run it: queued for its workers")


def test_critical_path_first() -> None:
    # a -> c (long tail); b alone. One fast slot: a (longer remaining path) gets it.
    tasks = (TaskNode("a", duration_s=1), TaskNode("b", duration_s=5), TaskNode("c", duration_s=50))
    g = RunGraph("d/r", tasks, ((0, 2),))
    fast = PoolState("fast", "f", slots=1, cpus=4, memory_gb=16, speed=4.0)
    slow = PoolState("slow", "s", slots=1, cpus=4, memory_gb=16, speed=1.0)
    req = PlacementRequest("q", (ReadyTask("d/r", "b"), ReadyTask("d/r", "a")), (fast, slow))
    placed = {d.task_id: d.pool for d in EarliestFinishPlacer().place(req, {"d/r": g})}
    assert placed["a"] == "fast"
    assert view(g).critical_path_s == 51.0


def test_cycle_is_a_schema_error() -> None:
    g = RunGraph("d/r", (TaskNode("a"), TaskNode("b")), ((0, 1), (1, 0)))
    with pytest.raises(SchemaError, match="cycle"):
        view(g)


def test_a_task_whose_only_usable_pools_are_down_queues_there_and_says_so() -> None:
    """A pool marked down (no live worker) is avoided while another may run the task; a task that
    only it may run (a GPU task, a pin) is queued there to wait, not sent where it cannot run."""
    down_gpu = PoolState("gpu", "g", slots=1, cpus=8, memory_gb=64, gpus=1, speed=1.5, up=False)
    tasks = (TaskNode("train", duration_s=100, kind="gpu_train", gpus=1),
             TaskNode("prep", duration_s=100, kind="gpu_train"),
             TaskNode("pinned", pool="gpu"))
    g = RunGraph("d/r", tasks, ())
    req = PlacementRequest("q", tuple(ReadyTask("d/r", t.task_id) for t in tasks), (SMALL, LARGE, down_gpu))
    placed = {d.task_id: d for d in EarliestFinishPlacer().place(req, {"d/r": g})}
    assert placed["prep"].pool == "large", "the affinity pool is down: the best live one"
    for tid in ("train", "pinned"):
        assert placed[tid].pool == "gpu", tid
        assert "gpu is down, the only pool that may run it" in placed[tid].reason
    assert "no pool fits" not in placed["train"].reason


def _one(task: TaskNode, pools: tuple[PoolState, ...]):
    g = RunGraph("d/r", (task,), ())
    req = PlacementRequest("q", (ReadyTask("d/r", task.task_id),), pools)
    (d,) = EarliestFinishPlacer().place(req, {"d/r": g})
    return d


def test_a_pool_scaled_to_zero_waits_for_a_boot_not_a_run_time() -> None:
    # found by review: a pool with no worker was scored as one busy slot, its wait the task's own
    # run time (100 s here) whatever its boot delay, so the fallback sent a long task to a busy
    # pool rather than boot a worker in 10 s
    busy = PoolState("busy", "b", slots=1, cpus=4, memory_gb=16, busy=1)
    elastic = PoolState("elastic", "e", slots=0, cpus=4, memory_gb=16, max_slots=2, boot_s=10.0)
    d = _one(TaskNode("t", duration_s=100), (busy, elastic))
    assert d.pool == "elastic" and d.score == pytest.approx(-110.0)
    assert "wait 10.0s (a worker's boot)" in d.reason
    # and a boot slower than the busy pool's queue loses to it
    slow = replace(elastic, boot_s=500.0)
    d = _one(TaskNode("t", duration_s=100), (busy, slow))
    assert d.pool == "busy" and d.score == pytest.approx(-200.0)


def test_a_pool_with_no_worker_that_cannot_grow_is_taken_only_when_nothing_else_may_run_the_task() -> None:
    # before: scored as one busy slot, it won over a pool with a queue of two per slot
    stuck = PoolState("stuck", "s", slots=0, cpus=4, memory_gb=16, speed=2.0)
    queued = PoolState("queued", "q", slots=1, cpus=4, memory_gb=16, busy=1, queued=1)
    assert _one(TaskNode("t", duration_s=100), (stuck, queued)).pool == "queued"
    d = _one(TaskNode("t", duration_s=100, pool="stuck"), (stuck, queued))
    assert d.pool == "stuck" and "no worker and it cannot grow" in d.reason and d.score == pytest.approx(-50.0)


def test_a_pool_that_has_used_its_room_to_grow_waits_for_its_slots() -> None:
    # one busy slot and room for one more: the first of a batch of three waits for a boot; the
    # room is then spent and the next two queue, a run time per task ahead of them
    pool = PoolState("p", "p", slots=1, cpus=4, memory_gb=16, busy=1, max_slots=2, boot_s=5.0)
    tasks = tuple(TaskNode(f"t{i}", duration_s=100) for i in range(3))
    g = RunGraph("d/r", tasks, ())
    req = PlacementRequest("q", tuple(ReadyTask("d/r", t.task_id) for t in tasks), (pool,))
    waits = sorted(-d.score - 100 for d in EarliestFinishPlacer().place(req, {"d/r": g}))
    assert waits == pytest.approx([5.0, 200.0, 300.0])


def test_a_busy_pool_waits_until_its_expected_finish_not_a_run_time_of_the_task() -> None:
    # version 2 read no free_at: the busy pool, its one task ending in 10 s, looked one run time
    # (100 s) away, and the task went to the pool at half speed (200 s) rather than wait 10 s
    now = 1_000.0
    fast = PoolState("fast", "f", slots=1, cpus=4, memory_gb=16, speed=2.0, busy=1, free_at=(now + 10,))
    slow = PoolState("slow", "s", slots=1, cpus=4, memory_gb=16, speed=1.0)
    g = RunGraph("d/r", (TaskNode("t", duration_s=200),), ())
    req = PlacementRequest("q", (ReadyTask("d/r", "t"),), (fast, slow), created_at=now)
    (d,) = EarliestFinishPlacer().place(req, {"d/r": g})
    assert d.pool == "fast" and d.score == pytest.approx(-110.0) and "wait 10.0s" in d.reason
    # past the known finishes, a run time per slot more: the second of a batch waits 10 s + 100 s
    tasks = (TaskNode("a", duration_s=200), TaskNode("b", duration_s=200))
    g = RunGraph("d/r", tasks, ())
    req = PlacementRequest("q", tuple(ReadyTask("d/r", t.task_id) for t in tasks), (fast,), created_at=now)
    assert sorted(-d.score for d in EarliestFinishPlacer().place(req, {"d/r": g})) == pytest.approx([110.0, 210.0])
    # an expected finish already past counts as a slot free now
    late = replace(fast, free_at=(now - 5,))
    req = PlacementRequest("q", (ReadyTask("d/r", "a"),), (late,), created_at=now)
    assert EarliestFinishPlacer().place(req, {"d/r": g})[0].score == pytest.approx(-100.0)
