"""Baselines: every one is a Placer that completes a workload; HEFT against the bound on real DAGs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _checks import check_conservation

from policy.catalogue import load_catalogue
from policy.placement import Placer
from trainer.baselines import BASELINES, expand, make_placer
from trainer.makespan import medians, single_dag_rows
from trainer.simulator import Simulator
from trainer.wfformat import load_wfformat
from trainer.workloads import ArrivalSpec, make_jobs, seed_dataset

TRACES = Path(__file__).resolve().parents[3] / "shared" / "workflows" / "wfinstances"


@pytest.fixture(scope="module")
def workload():
    cat = load_catalogue("policy/catalogues/gpu-affinity.yaml")
    rng = np.random.default_rng(7)
    tpl = seed_dataset("mlpipeline", rng)[::4] + seed_dataset("etl", rng)[::4]
    return cat, make_jobs(tpl, cat, 25, rng, ArrivalSpec(load=0.9))


@pytest.mark.parametrize("name", BASELINES)
def test_every_baseline_is_a_placer_and_completes(name, workload):
    cat, jobs = workload
    placer = make_placer(name, cat, 0)
    assert isinstance(placer, Placer)
    result = Simulator(cat, jobs, placer, seed=1, duration_noise=0.3).run()
    check_conservation(jobs, result, cat)
    assert result.refused_decisions == 0


def test_expand_and_unknown_names():
    names = expand("baselines,srpt+eft")
    assert names == list(BASELINES)
    assert "heft" in names and "srpt+eft" in names
    with pytest.raises(ValueError, match="unknown"):
        make_placer("nope")
    with pytest.raises(ValueError, match="job order"):
        make_placer("lifo+eft")


def test_earliest_finish_beats_fastest_free_on_mean_jct(workload):
    # the observation: placement matters as much as order
    cat, jobs = workload
    jct = {}
    for name in ("srpt+ff", "srpt+eft"):
        r = Simulator(cat, jobs, make_placer(name, cat), seed=1, duration_noise=0.3).run()
        jct[name] = np.mean([j.jct_s for j in r.jobs])
    assert jct["srpt+eft"] < jct["srpt+ff"]


@pytest.mark.skipif(not TRACES.is_dir(), reason="the shared WfInstances are not checked out here")
def test_insertion_heft_on_single_real_dags_is_close_to_the_bound():
    """Issue 3's independent figure: single DAGs of the shared WfInstances on speeds 1/2/4 with
    8/4/2 workers, insertion HEFT at a median makespan / lower bound of at most 1.05.

    Bound: :func:`trainer.bounds.makespan_lb` (heads, tails and non-preemptive stage bounds);
    measured median 1.033, worst 1.181 (montage-dss-075d; see docs/bench.md).
    """
    cat = load_catalogue("policy/catalogues/speeds-1-2-4.yaml")
    graphs = [load_wfformat(f) for f in sorted(TRACES.glob("*.json"))]
    assert len(graphs) == 19
    rows = single_dag_rows(graphs, cat, ["heft"])
    for r in rows:
        assert r["makespan_lb_s"] >= r["critical_path_lb_s"]
        assert r["heft_over_lb"] >= 1 - 1e-9
    assert medians(rows, ["heft"])["heft"] <= 1.05


def test_rollout_planner_searches_on_forks():
    cat = load_catalogue("policy/catalogues/gpu-affinity.yaml")
    rng = np.random.default_rng(1)
    jobs = make_jobs(seed_dataset("mlpipeline", rng)[:2], cat, 2, rng, ArrivalSpec(load=0.9))
    placer = make_placer("rollout", cat)
    result = Simulator(cat, jobs, placer, seed=2, duration_noise=0.3).run()
    check_conservation(jobs, result, cat)


def test_cost_cp_keeps_premium_pools_for_the_critical_path():
    """``cost-cp``: a task with slack never takes a pool priced > 3x the cheapest per unit of its
    work; the critical-path task may (and ``srpt+eft`` sends both there)."""
    from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode

    small = PoolState("small", "s", slots=2, cpus=4, memory_gb=16, speed=1.0, price_per_hour=0.17)
    gpu = PoolState("gpu", "g", slots=2, cpus=8, memory_gb=64, gpus=1, speed=1.5, price_per_hour=1.2)
    # a -> c is the critical path (10 + 100 s); b (20 s) has 90 s of slack
    tasks = (TaskNode("a", duration_s=10), TaskNode("b", duration_s=20), TaskNode("c", duration_s=100))
    g = RunGraph("d/r", tasks, ((0, 2),))
    req = PlacementRequest("q", (ReadyTask("d/r", "a"), ReadyTask("d/r", "b")), (small, gpu))

    def placed(name: str) -> dict[str, str]:
        return {d.task_id: d.pool for d in make_placer(name, None).place(req, {"d/r": g})}

    assert placed("srpt+eft") == {"a": "gpu", "b": "gpu"}
    assert placed("cost-cp") == {"a": "gpu", "b": "small"}
    # a pool priced within the ratio is no premium: both tasks stay on their fastest pool
    cheap_gpu = PoolState("gpu", "g", slots=2, cpus=8, memory_gb=64, gpus=1, speed=1.5, price_per_hour=0.5)
    req2 = PlacementRequest("q", req.ready, (small, cheap_gpu))
    got = {d.task_id: d.pool for d in make_placer("cost-cp", None).place(req2, {"d/r": g})}
    assert got == {"a": "gpu", "b": "gpu"}
    from trainer.baselines.rules import CriticalPathCost

    # allowed a premium pool's free slot, the task with slack takes it (no worker boots for it)
    got = {d.task_id: d.pool for d in CriticalPathCost(None, premium_free_slots=True).place(req, {"d/r": g})}
    assert got == {"a": "gpu", "b": "gpu"}
    # the gate for every task: the critical-path task stays off the premium pool too
    got = {d.task_id: d.pool for d in CriticalPathCost(None, every_task=True).place(req, {"d/r": g})}
    assert got == {"a": "small", "b": "small"}
    with pytest.raises(ValueError, match="ratio"):
        CriticalPathCost(None, ratio=0.5)


def test_cost_cp_variants_ride_near_and_slack():
    """The variants of ``cost-cp`` that ``scripts/cost_frontier.py --cp`` measures: a task with
    slack may *ride* a premium pool's free slot that a running task keeps billed past its finish
    (``ride``), count as critical within ``near`` x the critical path's rank, or take the premium
    pool when the cheap pools would finish it later by more than ``slack`` x its slack."""
    from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode
    from trainer.baselines.rules import CriticalPathCost

    small = PoolState("small", "s", slots=2, cpus=4, memory_gb=16, speed=1.0, price_per_hour=0.17)
    gpu = PoolState("gpu", "g", slots=2, cpus=8, memory_gb=64, gpus=1, speed=1.5, price_per_hour=1.2)
    # a -> c (60 + 100 s) is the critical path, and a goes to the GPU first (40 s there); b (20 s,
    # 13.3 s on the GPU) has 140 s of slack and would finish on the GPU before a does
    c = TaskNode("c", duration_s=100)
    g = RunGraph("d/r", (TaskNode("a", duration_s=60), TaskNode("b", duration_s=20), c), ((0, 2),))
    req = PlacementRequest("q", (ReadyTask("d/r", "a"), ReadyTask("d/r", "b")), (small, gpu))

    def placed(rule: CriticalPathCost, r: PlacementRequest = req) -> dict[str, str]:
        return {d.task_id: d.pool for d in rule.place(r, {"d/r": g})}

    assert placed(CriticalPathCost(None)) == {"a": "gpu", "b": "small"}
    assert placed(CriticalPathCost(None, ride=1.0)) == {"a": "gpu", "b": "gpu"}
    # a ride that would outlast the task keeping the worker billed is no ride
    long_b = RunGraph("d/r", (TaskNode("a", duration_s=60), TaskNode("b", duration_s=90), c), ((0, 2),))
    got = {d.task_id: d.pool for d in CriticalPathCost(None, ride=1.0).place(req, {"d/r": long_b})}
    assert got == {"a": "gpu", "b": "small"}
    # b's rank is 0.125 x the critical path's: critical within near = 0.1, not within 0.5
    assert placed(CriticalPathCost(None, near=0.1)) == {"a": "gpu", "b": "gpu"}
    assert placed(CriticalPathCost(None, near=0.5)) == {"a": "gpu", "b": "small"}
    # the small pool finishes b 6.7 s later than the GPU: more than 0.04 x its 140 s of slack, less than 0.05 x
    assert placed(CriticalPathCost(None, slack=0.04)) == {"a": "gpu", "b": "gpu"}
    assert placed(CriticalPathCost(None, slack=0.05)) == {"a": "gpu", "b": "small"}


def test_cost_cp_second_tier_and_no_boot_for_tasks_with_slack():
    """``cost-cp``'s ``soft`` tier (a pool within ``ratio`` but over ``soft`` x the cheapest is
    for a task with slack only when the cheapest would finish it later by more than ``slack`` x
    its slack) and ``noboot`` (a task with slack makes no pool grow unless the boot finishes it
    earlier by more than ``noboot`` x its slack: it waits for a busy slot instead)."""
    from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode
    from trainer.baselines.ledger import PoolLimits
    from trainer.baselines.rules import CriticalPathCost

    # d/r: a -> c (60 + 100 s) is the critical path; b (20 s) has 140 s of slack. e/r: x (200 s)
    # is sent first and keeps the small pool's one slot busy until t = 200.
    g = RunGraph("d/r", (TaskNode("a", duration_s=60), TaskNode("b", duration_s=20),
                         TaskNode("c", duration_s=100)), ((0, 2),))
    e = RunGraph("e/r", (TaskNode("x", duration_s=200),), ())
    graphs = {"d/r": g, "e/r": e}

    def small(busy: int) -> PoolState:
        return PoolState("small", "s", slots=1, cpus=4, memory_gb=16, speed=1.0, price_per_hour=0.17, busy=busy)

    large = PoolState("large", "l", slots=2, cpus=16, memory_gb=128, speed=2.0, price_per_hour=0.90)

    def where_b(rule: CriticalPathCost, pools: tuple[PoolState, ...]) -> tuple[str, bool]:
        rule.place(PlacementRequest("q1", (ReadyTask("e/r", "x"),), (small(0),)), graphs)
        rule.place(PlacementRequest("q2", (ReadyTask("d/r", "a"), ReadyTask("d/r", "b")), pools), graphs)
        return next((pool, sent) for _, t, pool, sent in rule.trace if t == "b")

    # a takes a large slot (30 s); for b the small pool finishes 210 s later than the large
    # pool's other slot (220 against 10 s): more than 1 x its slack, less than 2 x
    both = (small(1), large)
    assert where_b(CriticalPathCost(None), both) == ("large", True)
    assert where_b(CriticalPathCost(None, soft=2.0, slack=1.0), both) == ("large", True)
    assert where_b(CriticalPathCost(None, soft=2.0, slack=2.0), both) == ("small", False)
    # the small pool alone, elastic (45 s boot): a's send boots a worker; a second boot would
    # finish b at 65 s instead of 220 s, 155 s sooner: more than 1 x its slack, less than 1.2 x
    for noboot, sent in ((None, True), (1.0, True), (1.2, False)):
        rule = CriticalPathCost(None, noboot=noboot)
        rule.ledger.limits = {"small": PoolLimits(max_slots=4, boot_delay_s=45.0)}
        assert where_b(rule, (small(1),)) == ("small", sent), noboot
