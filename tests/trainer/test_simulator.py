"""The simulator: conservation, dependencies, capacity, determinism, failures and outages."""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import pytest
from _checks import check_conservation

from policy.catalogue import load_catalogue
from policy.placement import EarliestFinishPlacer
from policy.schema import Decision, PlacementRequest, RunGraph, TaskNode
from trainer.simulator import Job, Outage, SimulationError, Simulator, Slowdown
from trainer.workloads import ArrivalSpec, make_jobs, seed_dataset

CATALOGUES = "policy/catalogues"


def _chain(key: str, n: int = 3, d: float = 10.0) -> RunGraph:
    tasks = tuple(TaskNode(f"t{i}", duration_s=d) for i in range(n))
    return RunGraph(key, tasks, tuple((i, i + 1) for i in range(n - 1)))


def test_chain_on_one_pool_runs_back_to_back():
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    r = Simulator(cat, [Job(_chain("a"), 5.0)], EarliestFinishPlacer(), seed=0).run()
    assert r.jobs[0].finish_s == pytest.approx(5.0 + 30.0 / 4.0)
    assert {t.pool for t in r.tasks} == {"speed-4"}


def test_same_seed_same_result_and_conservation():
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    rng = np.random.default_rng(3)
    tpl = seed_dataset("mlpipeline", rng)[:6] + seed_dataset("etl", rng)[:6]
    jobs = make_jobs(tpl, cat, 40, rng, ArrivalSpec(load=0.9))
    a = Simulator(cat, jobs, EarliestFinishPlacer(), seed=5, duration_noise=0.3).run()
    b = Simulator(cat, jobs, EarliestFinishPlacer(), seed=5, duration_noise=0.3).run()
    assert [j.finish_s for j in a.jobs] == [j.finish_s for j in b.jobs]
    check_conservation(jobs, a, cat)
    assert a.cost > 0 and 0 < max(a.utilization.values()) <= 1.0


def test_failures_outages_and_slowdowns_conserve_tasks():
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    rng = np.random.default_rng(4)
    tpl = seed_dataset("montecarlo", rng)[:8]
    jobs = make_jobs(tpl, cat, 30, rng, ArrivalSpec(load=0.8))
    r = Simulator(
        cat, jobs, EarliestFinishPlacer(), seed=2, duration_noise=0.3, failure_rate=0.1,
        dispatch_latency_s=0.5,
        outages=(Outage("cpu-large", 100.0, 900.0), Outage("gpu", 50.0, 400.0)),
        slowdowns=(Slowdown("cpu-small", 0.0, 2000.0, 0.5),),
    ).run()
    assert r.failed_tries > 0
    check_conservation(jobs, r, cat)
    for t in r.tasks:
        if t.pool == "cpu-large":
            assert not (100.0 < t.start_s < 900.0)


class _Lazy:
    """Places only the oldest ready task each time: exercises deferral (late binding)."""

    name = "lazy"
    version = "test"

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        free = [p for p in request.pools if p.up and p.free_slots > 0]
        if not free:
            return []
        r = request.ready[0]
        return [Decision(r.run_key, r.task_id, free[0].name, free[0].vm_class)]


def test_partial_decisions_defer_tasks():
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    jobs = [Job(_chain(f"r{i}", 2), float(i)) for i in range(5)]
    r = Simulator(cat, jobs, _Lazy(), seed=0).run()
    check_conservation(jobs, r, cat)


class _Never:
    name = "never"
    version = "test"

    def place(self, request, graphs):
        return []


def test_deadlock_is_reported():
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    with pytest.raises(SimulationError, match="never"):
        Simulator(cat, [Job(_chain("a"), 0.0)], _Never(), seed=0).run()


def test_max_wait_bounds_holds_as_the_executor_does():
    # A placer that never places: each task of the chain is held max_wait_s, then the executor's
    # fallback (earliest finish: the speed-4 pool, 10 s / 4) places it.
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    jobs = [Job(_chain("a"), 0.0)]
    r = Simulator(cat, jobs, _Never(), seed=0, max_wait_s=7.0).run()
    assert r.jobs[0].finish_s == pytest.approx(3 * (7.0 + 2.5))
    assert r.wait_fallbacks == 3 and r.decisions == 3
    assert {t.pool for t in r.tasks} == {"speed-4"}
    check_conservation(jobs, r, cat)


def test_max_wait_leaves_a_placer_that_places_in_time_alone():
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    jobs = [Job(_chain(f"r{i}", 2), float(i)) for i in range(5)]
    free = Simulator(cat, jobs, _Lazy(), seed=0).run()
    bounded = Simulator(cat, jobs, _Lazy(), seed=0, max_wait_s=1e6).run()
    assert bounded.wait_fallbacks == 0
    assert [j.finish_s for j in bounded.jobs] == [j.finish_s for j in free.jobs]
    at_once = [Job(_chain(f"r{i}", 2), 0.0) for i in range(5)]  # 5 ready, one placed per request
    tight = Simulator(cat, at_once, _Lazy(), seed=0, max_wait_s=0.0).run()
    assert tight.wait_fallbacks >= 4
    check_conservation(at_once, tight, cat)
    with pytest.raises(ValueError, match="max_wait_s"):
        Simulator(cat, jobs, _Lazy(), seed=0, max_wait_s=-1.0)


class _WhenFree:
    """Places the oldest ready tasks on the pools' free slots, one a slot; holds the rest while
    every pool is full (what a late-binding rule does on a saturated cluster)."""

    name = "when-free"
    version = "test"

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        slots = [p for p in request.pools if p.up for _ in range(p.free_slots)]
        ready = request.ready[:len(slots)]
        return [Decision(r.run_key, r.task_id, p.name, p.vm_class) for r, p in zip(ready, slots[:len(ready)], strict=True)]


def test_max_wait_counts_only_time_a_pool_had_a_free_slot():
    # 40 runs of one 100 s task at once on 14 slots: 26 tasks are held while every slot is busy,
    # 100-300 s each. max_wait_s counts none of that (the placer never holds a task while a slot
    # is free): no task is placed by the fallback, the run order stays the placer's. The bound
    # on the whole time held (max_hold_s; = max_wait_s is the single bound of earlier versions)
    # places every task held that long.
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    jobs = [Job(_chain(f"r{i:02d}", 1, 100.0), 0.0) for i in range(40)]
    free = Simulator(cat, jobs, _WhenFree(), seed=0).run()
    waited = Simulator(cat, jobs, _WhenFree(), seed=0, max_wait_s=7.0).run()
    assert waited.wait_fallbacks == 0
    assert [j.finish_s for j in waited.jobs] == [j.finish_s for j in free.jobs]
    single = Simulator(cat, jobs, _WhenFree(), seed=0, max_wait_s=7.0, max_hold_s=7.0).run()
    assert single.wait_fallbacks == 26  # every task not started at 0 reached 7 s held
    held = Simulator(cat, jobs, _WhenFree(), seed=0, max_wait_s=7.0, max_hold_s=60.0).run()
    # by 60 s 22 tasks have started (speed-4: 25 s a task on 2 slots, 6; speed-2: 50 s on 4, 8;
    # speed-1: 100 s on 8, 8): the other 18 reach the bound still held
    assert held.wait_fallbacks == 18
    for r in (single, held):
        check_conservation(jobs, r, cat)
    with pytest.raises(ValueError, match="max_hold_s"):
        Simulator(cat, jobs, _WhenFree(), seed=0, max_hold_s=math.inf)


class _Recorder(_Lazy):
    """_Lazy, remembering what each request said of each task (``held_s``) and when."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str, float]] = []

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        self.seen += [(request.created_at, f"{r.run_key}/{r.task_id}", r.held_s) for r in request.ready]
        return super().place(request, graphs)


@pytest.mark.parametrize("max_wait_s", [None, 1e6])
def test_requests_say_how_long_each_task_has_been_held(max_wait_s):
    # 5 single-task runs ready at once, one placed per request: the others are offered again,
    # each time with the seconds since they were first left without a decision
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    jobs = [Job(_chain(f"r{i}", 1), 0.0) for i in range(5)]
    rec = _Recorder()
    Simulator(cat, jobs, rec, seed=0, max_wait_s=max_wait_s).run()
    first: dict[str, float] = {}
    for t, key, held in rec.seen:
        first.setdefault(key, t)
        assert held == pytest.approx(t - first[key])
    assert max(h for _, _, h in rec.seen) > 0, "some task was held and said so"
    assert all(h == 0.0 for t, _, h in rec.seen if t == 0.0), "offered for the first time: not held"


def test_step_api_matches_run():
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    jobs = [Job(_chain(f"r{i}", 4), 3.0 * i) for i in range(6)]
    placer = EarliestFinishPlacer()
    sim = Simulator(cat, jobs, seed=1, duration_noise=0.2)
    req = sim.reset()
    while req is not None:
        assert {r.run_key for r in req.ready} <= set(sim.graphs)
        req = sim.step(placer.place(req, sim.graphs))
    stepped = sim.result()
    ran = Simulator(cat, jobs, placer, seed=1, duration_noise=0.2).run()
    assert [j.finish_s for j in stepped.jobs] == [j.finish_s for j in ran.jobs]


def test_elastic_pool_scales_up_and_down():
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    wide = RunGraph("w", tuple(TaskNode(f"t{i}", duration_s=200.0) for i in range(40)), ())
    jobs = [Job(wide, 0.0), Job(_chain("late", 1, 1.0), 5000.0)]
    sim = Simulator(cat, jobs, EarliestFinishPlacer(), seed=0)
    r = sim.run()
    check_conservation(jobs, r, cat)
    small = next(p for p in sim.pools if p.name == "cpu-small")
    assert small.workers == small.min_workers  # scaled back down while idle
    assert max(t.end_s for t in r.tasks if t.run_key == "w") < 40 * 200.0 / 14


class _ToPool:
    name = "to-pool"

    def __init__(self, pool: str) -> None:
        self.pool = pool

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        vm = {p.name: p.vm_class for p in request.pools}[self.pool]
        return [Decision(t.run_key, t.task_id, self.pool, vm) for t in request.ready]


@pytest.mark.parametrize("rule, worker_s", [("sustained", 111 + 111 + 111), ("window", 111 + 205 + 111)])
def test_scale_in_rules(rule: str, worker_s: float) -> None:
    """Two workers boot for a 1 s and a 95 s task (ready at 10 s; idle from 11 s and 105 s), a
    third task comes at 300 s; scale-in after 100 s. "sustained": the pool has had surplus since
    11 s, so at 111 s both go, the second idle for 6 s; "window": one goes at 111 s, the other at
    205 s, each after 100 s of surplus (found by review: the docstring said "window")."""
    from policy.catalogue import parse_catalogue

    cat = parse_catalogue({
        "vm_classes": {"v": {"cpus": 4, "memory_gb": 16, "speed": 1.0, "price_per_hour": 3600.0}},  # $1 a second
        "pools": {"e": {"vm_class": "v", "workers": 0, "min_workers": 0, "max_workers": 3, "boot_delay_s": 10,
                        "idle_scale_down_s": 100, "billing_s": 1}}})
    jobs = [Job(_chain("a", 1, 1.0), 0.0), Job(_chain("b", 1, 95.0), 0.0), Job(_chain("c", 1, 1.0), 300.0)]
    sim = Simulator(cat, jobs, _ToPool("e"), seed=0, scale_in=rule)
    r = sim.run()
    assert r.cost == pytest.approx(worker_s)
    assert sim.pools[0].workers == 0
    with pytest.raises(ValueError, match="scale_in must be one of sustained, window, got 'hpa'"):
        Simulator(cat, jobs, _ToPool("e"), scale_in="hpa")


def test_window_scale_in_on_a_busy_cluster_conserves_and_scales_back() -> None:
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    rng = np.random.default_rng(3)
    tpl = seed_dataset("mlpipeline", rng)[:6] + seed_dataset("etl", rng)[:6]
    jobs = [*make_jobs(tpl, cat, 40, rng, ArrivalSpec(load=0.9)), Job(_chain("late", 1, 1.0), 1e5)]
    sim = Simulator(cat, jobs, EarliestFinishPlacer(), seed=5, duration_noise=0.3, scale_in="window")
    r = sim.run()
    check_conservation(jobs, r, cat)
    assert all(p.workers <= max(p.min_workers, 1) for p in sim.pools), "idle for hours: back to the floor"
    sustained = Simulator(cat, jobs, EarliestFinishPlacer(), seed=5, duration_noise=0.3).run()
    assert r.cost > sustained.cost, "workers are kept longer"


@pytest.mark.parametrize("config, message", [
    ({"outages": (Outage("gpu", 10.0, 100.0), Outage("gpu", 50.0, 200.0))}, "outages of 'gpu' overlap"),
    ({"slowdowns": (Slowdown("gpu", 0.0, 10.0, 1.5),)}, "0 < factor <= 1"),
])
def test_overlapping_outages_and_speed_ups_are_refused(config: dict, message: str) -> None:
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    with pytest.raises(ValueError, match=message):
        Simulator(cat, [Job(_chain("a"), 0.0)], EarliestFinishPlacer(), **config)
    Simulator(cat, [Job(_chain("a"), 0.0)], EarliestFinishPlacer(),  # back to back is fine
              outages=(Outage("gpu", 10.0, 50.0), Outage("gpu", 50.0, 60.0), Outage("cpu-small", 20.0, 30.0)))


def test_bad_jobs_rejected():
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    with pytest.raises(SimulationError, match="share run_key"):
        Simulator(cat, [Job(_chain("a"), 0.0), Job(_chain("a"), 1.0)], EarliestFinishPlacer())
    with pytest.raises(SimulationError, match="nope"):
        Simulator(cat, [Job(_chain("a"), 0.0)], EarliestFinishPlacer(), outages=(Outage("nope", 0, 1),))
