"""Property tests: no policy beats the lower bounds; tasks are conserved under failures/outages."""

from __future__ import annotations

import numpy as np
from _checks import check_conservation
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.catalogue import load_catalogue
from policy.schema import RunGraph, TaskNode
from trainer.baselines import BASELINES, make_placer
from trainer.bounds import critical_path_lb, stream_lb
from trainer.metrics import Bounds
from trainer.simulator import Job, Outage, Simulator
from trainer.workloads import ArrivalSpec, make_jobs

CATS = {n: load_catalogue(f"policy/catalogues/{n}.yaml") for n in ("speeds-1-2-4", "gpu-affinity")}
KINDS = ("default", "gpu_train", "inference")


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
