"""The placement heuristics (policy/placement.py, trainer/baselines) on inputs at their edges: found
by review, each failed on the code before its fix."""

from __future__ import annotations

from policy.placement import EarliestFinishPlacer
from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode
from trainer.baselines import make_placer
from trainer.baselines.rules import CostAware


def _request(graph: RunGraph, pools: tuple[PoolState, ...], ready: tuple[str, ...] | None = None) -> PlacementRequest:
    ids = ready if ready is not None else tuple(t.task_id for t in graph.tasks)
    return PlacementRequest("q", tuple(ReadyTask(graph.run_key, t) for t in ids), pools)


def test_eft_zero_duration_tasks_do_not_queue_behind_a_backlog_while_a_pool_is_free() -> None:
    """EFT's queue wait is ``backlog / slots x run_s`` of the *new* task: for a task of 0 s (a
    valid duration, e.g. a ``duration_s: 0`` hint) every pool scores finish 0, the tie goes to the
    cheapest pool, and the whole batch is queued behind 50 tasks on a full pool while another
    pool has four idle slots (the batch's own earlier decisions do not count either)."""
    busy = PoolState("busy", "c", slots=1, cpus=4, memory_gb=16, price_per_hour=0.1, busy=1, queued=50)
    idle = PoolState("idle", "f", slots=4, cpus=4, memory_gb=16, price_per_hour=1.0)
    g = RunGraph("d/r", tuple(TaskNode(f"t{i}", duration_s=0.0) for i in range(4)), ())
    placed = {d.task_id: d.pool for d in EarliestFinishPlacer().place(_request(g, (busy, idle)), {"d/r": g})}
    assert placed == {f"t{i}": "idle" for i in range(4)}, placed


def test_cost_aware_takes_the_cheaper_pool_with_huge_prices() -> None:
    """``cost-aware`` ranks pools by ``run_time x price_per_hour``: with valid, finite but huge
    prices both products overflow to inf, the tie goes to the earlier finish and the rule takes a
    pool 17x the price for a 10% speed-up (not the cheapest within its slack)."""
    cheap = PoolState("cheap", "a", slots=1, cpus=4, memory_gb=16, speed=1.0, price_per_hour=1e307)
    dear = PoolState("dear", "b", slots=1, cpus=4, memory_gb=16, speed=1.1, price_per_hour=1.7e308)
    g = RunGraph("d/r", (TaskNode("t", duration_s=100.0),), ())
    (d,) = CostAware(None).place(_request(g, (cheap, dear)), {"d/r": g})
    assert d.pool == "cheap", d


def test_cpop_critical_path_pool_is_not_the_cheapest_when_no_pool_holds_the_whole_path() -> None:
    """CPOP's critical-path pool is "the one pool that runs the critical path fastest"; when no
    pool can hold every critical-path task, every pool's key is inf and the choice falls to the
    lowest price: the slowest pool. Here a (CPU, fits anywhere) -> b (16 CPUs) -> c (a GPU) is
    the critical path; a is planned on the speed-1 pool (100 s) instead of the speed-4 one (25 s)
    that also runs b, and the run's planned makespan is 225 s instead of HEFT's 150 s."""
    small = PoolState("small", "s", slots=2, cpus=4, memory_gb=16, speed=1.0, price_per_hour=0.1)
    large = PoolState("large", "l", slots=2, cpus=16, memory_gb=128, speed=4.0, price_per_hour=0.9)
    gpu = PoolState("gpu", "g", slots=2, cpus=8, memory_gb=64, gpus=1, speed=1.0, price_per_hour=1.2)
    tasks = (TaskNode("a", duration_s=100), TaskNode("b", duration_s=100, cpus=16),
             TaskNode("c", duration_s=100, gpus=1))
    g = RunGraph("d/r", tasks, ((0, 1), (1, 2)))
    placer = make_placer("cpop")
    (d,) = placer.place(_request(g, (small, large, gpu), ready=("a",)), {"d/r": g})
    assert d.pool == "large", (d, placer.plans)


def test_reason_for_a_pin_to_an_unknown_pool_says_when_no_pool_fits_the_task() -> None:
    """A task pinned to a pool the catalogue lacks that also fits no pool's resources is placed on
    "the largest" pool, which cannot hold it; the reason only says "pinned to nowhere, which is
    not one of the pools: placed off its pin", as if the pin were the only problem (the same task
    unpinned, or pinned to a pool that exists, is told "no pool fits ...")."""
    small = PoolState("small", "s", slots=4, cpus=4, memory_gb=16)
    large = PoolState("large", "l", slots=2, cpus=16, memory_gb=128, speed=2.0)
    g = RunGraph("d/r", (TaskNode("huge", memory_gb=1000, pool="nowhere"),), ())
    (d,) = EarliestFinishPlacer().place(_request(g, (small, large)), {"d/r": g})
    assert "no pool fits cpus=1 mem=1000GB gpus=0" in d.reason, d.reason


def test_eft_choice_for_a_task_no_pool_fits_does_not_depend_on_pool_order() -> None:
    """For a task no pool can hold, EFT takes ``max`` over (cpus, memory, gpus): between two
    equally large live pools the first listed wins, whatever their load, speed or price (the main
    path breaks ties by finish, price and name). Listed one way the task queues behind 100 tasks
    on a slow pool, listed the other way it runs at once on an idle fast twin."""
    jammed = PoolState("jammed", "x", slots=1, cpus=8, memory_gb=32, speed=1.0, busy=1, queued=100)
    idle = PoolState("idle", "x", slots=4, cpus=8, memory_gb=32, speed=2.0)
    g = RunGraph("d/r", (TaskNode("big", memory_gb=500),), ())
    got = set()
    for pools in ((jammed, idle), (idle, jammed)):
        (d,) = EarliestFinishPlacer().place(_request(g, pools), {"d/r": g})
        got.add(d.pool)
    assert got == {"idle"}, got
