"""Property tests: no policy beats the lower bounds; tasks are conserved under failures/outages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _checks import check_conservation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.catalogue import Catalogue, load_catalogue, parse_catalogue
from policy.graph import view
from policy.schema import RunGraph, TaskNode
from trainer.baselines import BASELINES, make_placer
from trainer.bounds import (
    critical_path_lb,
    makespan_lb,
    pooled_work_s,
    stream_lb,
    total_speed,
    window_lb,
)
from trainer.makespan import single_dag_rows
from trainer.metrics import Bounds
from trainer.simulator import Job, Outage, Simulator
from trainer.wfformat import load_wfformat
from trainer.workloads import ArrivalSpec, make_jobs

CATS = {n: load_catalogue(f"policy/catalogues/{n}.yaml") for n in ("speeds-1-2-4", "gpu-affinity")}
KINDS = ("default", "gpu_train", "inference")
TRACES = Path(__file__).resolve().parents[3] / "shared" / "workflows" / "wfinstances"


@st.composite
def dags(draw, key: str = "g"):
    n = draw(st.integers(1, 12))
    tasks = tuple(
        TaskNode(f"t{i}", duration_s=draw(st.floats(1.0, 300.0)), kind=draw(st.sampled_from(KINDS)),
                 memory_gb=draw(st.sampled_from((1.0, 8.0, 32.0))))
        for i in range(n)
    )
    parents = [draw(st.sets(st.integers(0, c - 1), max_size=3)) for c in range(1, n)]
    edges = tuple(sorted({(p, c) for c, ps in enumerate(parents, start=1) for p in ps}))
    return RunGraph(key, tasks, edges)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graphs=st.lists(dags(), min_size=1, max_size=5),
    gaps=st.lists(st.floats(0.0, 200.0), min_size=5, max_size=5),
    cat=st.sampled_from(sorted(CATS)),
    policy=st.sampled_from(BASELINES),
)
def test_no_policy_beats_the_lower_bounds(graphs, gaps, cat, policy):
    catalogue = CATS[cat]
    jobs = []
    t = 0.0
    for k, g in enumerate(graphs):
        t += gaps[k]
        jobs.append(Job(RunGraph(f"r{k}", g.tasks, g.edges), t))
    result = Simulator(catalogue, jobs, make_placer(policy, catalogue, 0), seed=0).run()
    bounds = Bounds(jobs, catalogue)
    for j in result.jobs:
        assert j.jct_s >= bounds.cp[j.run_key] * (1 - 1e-9) - 1e-6
    mean_jct = np.mean([j.jct_s for j in result.jobs])
    assert mean_jct >= bounds.stream_mean_jct * (1 - 1e-9) - 1e-6
    check_conservation(jobs, result, catalogue)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graphs=st.lists(dags(), min_size=1, max_size=4),
    policy=st.sampled_from(BASELINES),
    failure=st.floats(0.0, 0.3),
    outage=st.tuples(st.sampled_from(("cpu-small", "cpu-large", "gpu")), st.floats(0, 300),
                     st.floats(1, 600)),
)
def test_conservation_under_failures_and_outages(graphs, policy, failure, outage):
    catalogue = CATS["gpu-affinity"]
    jobs = [Job(RunGraph(f"r{k}", g.tasks, g.edges), 20.0 * k) for k, g in enumerate(graphs)]
    pool, start, length = outage
    sim = Simulator(catalogue, jobs, make_placer(policy, catalogue, 1), seed=3, duration_noise=0.3,
                    failure_rate=failure, outages=(Outage(pool, start, start + length),))
    check_conservation(jobs, sim.run(), catalogue)


def test_stream_bound_single_machine_srpt():
    # one machine of speed 1, two jobs of work 10 and 2 at t=0: SRPT finishes them at 2 and 12
    assert stream_lb([0.0, 0.0], [10.0, 2.0], [0.0, 0.0], 1.0) == 14.0
    # the critical-path count dominates when jobs are long and narrow
    assert stream_lb([0.0], [1.0], [50.0], 100.0) == 50.0


def test_critical_path_uses_fastest_feasible_pool():
    cat = CATS["gpu-affinity"]
    tasks = (TaskNode("a", 120.0, kind="gpu_train"), TaskNode("b", 60.0, memory_gb=100.0))
    g = RunGraph("x", tasks, ((0, 1),))
    # a: gpu 1.5 x 8 = 12 -> 10 s; b: only large-cpu (128 GB) holds it, speed 2 -> 30 s
    assert critical_path_lb(g, cat) == 40.0


def test_workload_load_is_offered_work_over_capacity():
    cat = CATS["speeds-1-2-4"]
    rng = np.random.default_rng(0)
    g = RunGraph("x", (TaskNode("a", 100.0),), ())
    jobs = make_jobs([g], cat, 4000, rng, ArrivalSpec(load=0.5))
    rate = len(jobs) / jobs[-1].arrival_s
    assert abs(rate * 100.0 / 24.0 - 0.5) < 0.03


# --- the single-DAG makespan bound ---------------------------------------------------------------


@st.composite
def catalogues(draw, max_slots: int = 6):
    """1-3 pools of heterogeneous speeds, some with an affinity and little memory."""
    n = draw(st.integers(1, 3))
    vms, pools, slots = {}, {}, 0
    for k in range(n):
        workers = draw(st.integers(1, 2))
        per = draw(st.integers(1, 2))
        if slots + workers * per > max_slots:
            workers, per = 1, 1
        slots += workers * per
        vms[f"vm{k}"] = {"cpus": 4, "memory_gb": 64 if k == 0 else draw(st.sampled_from((8, 64))),
                         "speed": draw(st.sampled_from((0.5, 1.0, 1.5, 2.0, 4.0))),
                         "affinity": draw(st.sampled_from(({}, {"gpu_train": 8.0}, {"inference": 0.5})))}
        pools[f"p{k}"] = {"vm_class": f"vm{k}", "workers": workers, "slots_per_worker": per}
    return parse_catalogue({"vm_classes": vms, "pools": pools})


@st.composite
def shaped_dags(draw, catalogue: Catalogue, max_tasks: int = 12):
    """A chain, a fork-join or a random DAG; some tasks need memory, some are pinned to a pool."""
    shape = draw(st.sampled_from(("chain", "forkjoin", "random")))
    n = draw(st.integers(1, max_tasks))
    names = catalogue.names
    tasks = []
    for i in range(n):
        memory = draw(st.sampled_from((1.0, 1.0, 32.0)))
        pin = draw(st.sampled_from((None, None, None, *names)))
        if pin is not None and catalogue.pool(pin).vm_class.memory_gb < memory:
            pin = None
        tasks.append(TaskNode(f"t{i}", duration_s=draw(st.sampled_from((0.0, 1.0, 5.0, 30.0, 100.0, 250.0))),
                              kind=draw(st.sampled_from(KINDS)), memory_gb=memory, pool=pin))
    if shape == "chain":
        edges = {(i, i + 1) for i in range(n - 1)}
    elif shape == "forkjoin":
        edges = {(0, i) for i in range(1, n - 1)} | {(i, n - 1) for i in range(1, n - 1)} if n > 2 else set()
    else:
        edges = {(p, c) for c in range(1, n) for p in draw(st.sets(st.integers(0, c - 1), max_size=3))}
    return RunGraph("g", tuple(tasks), tuple(sorted(edges)))


def optimum(graph: RunGraph, catalogue: Catalogue) -> float:
    """The least makespan of any non-preemptive schedule, by exhaustive search (tiny graphs only).

    Every schedule is matched or beaten by placing its tasks in order of start time, each on its
    slot as early as parents and slot allow; so searching over orders and slots finds the optimum.
    """
    g = view(graph)
    slots = [p for p in catalogue.pools for _ in range(p.workers * p.slots_per_worker)]
    ok = [[s for s, p in enumerate(slots) if p.state().fits(t)] for t in graph.tasks]
    time = [[t.duration_s / slots[s].state().speed_for(t.kind) for s in range(len(slots))]
            for t in graph.tasks]
    best = [float("inf")]

    def search(done: dict[int, float], free: list[float], span: float) -> None:
        if span >= best[0]:
            return
        if len(done) == len(graph.tasks):
            best[0] = span
            return
        for v in range(len(graph.tasks)):
            if v in done or any(p not in done for p in g.parents[v]):
                continue
            ready = max((done[p] for p in g.parents[v]), default=0.0)
            for s in ok[v]:
                end = max(ready, free[s]) + time[v][s]
                was = free[s]
                free[s] = end
                done[v] = end
                search(done, free, max(span, end))
                del done[v]
                free[s] = was

    search({}, [0.0] * len(slots), 0.0)
    return best[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_makespan_bound_is_below_the_exact_optimum(data):
    catalogue = data.draw(catalogues(max_slots=3))
    graph = data.draw(shaped_dags(catalogue, max_tasks=5))
    assert makespan_lb(graph, catalogue) <= optimum(graph, catalogue) * (1 + 1e-9) + 1e-9


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), policy=st.sampled_from(BASELINES))
def test_no_policy_beats_the_makespan_bound(data, policy):
    catalogue = data.draw(st.one_of(st.sampled_from(list(CATS.values())), catalogues()))
    graph = data.draw(shaped_dags(catalogue))
    lb = makespan_lb(graph, catalogue)
    old = max(critical_path_lb(graph, catalogue), pooled_work_s(graph, catalogue) / total_speed(catalogue))
    assert lb >= old * (1 - 1e-12)
    result = Simulator(catalogue, [Job(graph, 0.0)], make_placer(policy, catalogue, 0), seed=0).run()
    assert result.makespan_s >= lb * (1 - 1e-9) - 1e-9


@pytest.mark.skipif(not TRACES.is_dir(), reason="the shared WfInstances are not checked out here")
def test_no_policy_beats_the_makespan_bound_on_the_real_traces():
    cat = CATS["speeds-1-2-4"]
    rows = single_dag_rows([load_wfformat(f) for f in sorted(TRACES.glob("*.json"))], cat, BASELINES)
    assert len(rows) == 19
    for r in rows:
        assert r["best_over_lb"] >= 1 - 1e-9, r["workflow"]


@pytest.mark.skipif(not TRACES.is_dir(), reason="the shared WfInstances are not checked out here")
def test_makespan_bound_of_the_helloworld_fork_join():
    # root 100.187, eight middle tasks (107.353 ... 102.475, 828.697 in all), join 99.82, on
    # speeds 1/2/4 with 8/4/2 slots. Head of the middle: 100.187 / 4; tail: 99.82 / 4. Middle
    # stage: each task is over 99.82 work, so inside 99.82 s none can run on a speed-1 slot; the
    # six others do at most 16 units per second: 828.697 / 16 = 51.79 s (the critical path
    # assumes 107.353 / 4 = 26.8 s). Optimum ~102.4 s (4 tasks on the two speed-4 slots, 4 on
    # the speed-2 ones); the critical-path bound was 76.8 s.
    cat = CATS["speeds-1-2-4"]
    g = load_wfformat(TRACES / "helloworld-forkjoin-10-chameleon.json")
    expected = 100.187 / 4 + 828.697 / 16 + 99.82 / 4
    assert abs(makespan_lb(g, cat) - expected) < 1e-9
    assert abs(critical_path_lb(g, cat) - (100.187 + 107.353 + 99.82) / 4) < 1e-9


def test_makespan_bound_of_equal_independent_tasks_is_exact():
    # 40 tasks of 1 s on speeds 1/2/4 x 8/4/2: within t < 2 s a slot of speed e runs floor(e t)
    # < 2e tasks, 34 in all at most; at 2 s, 48. The work bound says 40 / 24 = 1.67 s.
    cat = CATS["speeds-1-2-4"]
    g = RunGraph("x", tuple(TaskNode(f"t{i}", 1.0) for i in range(40)), ())
    assert makespan_lb(g, cat) == 2.0
    assert Simulator(cat, [Job(g, 0.0)], make_placer("heft", cat), seed=0).run().makespan_s == 2.0


def test_window_bound_cases():
    zeros = np.zeros(2)
    # two tasks of work 10 on speeds 4 and 1: both on the fast slot (5 s) beats one on each (10 s)
    assert window_lb(zeros, zeros, np.array([10.0, 10.0]), np.array([4.0, 1.0])) == 5.0
    # works 1, 4, 4 on two slots of speed 1: one slot runs two of them, at least 1 + 4 (the
    # work bound says 9 / 2)
    assert window_lb(np.zeros(3), np.zeros(3), np.array([1.0, 4.0, 4.0]), np.ones(2)) == 5.0
    # a chain of 5 equals its critical path; heads and tails add up along it
    cat = CATS["speeds-1-2-4"]
    g = RunGraph("c", tuple(TaskNode(f"t{i}", 8.0) for i in range(5)), tuple((i, i + 1) for i in range(4)))
    assert makespan_lb(g, cat) == critical_path_lb(g, cat) == 10.0
