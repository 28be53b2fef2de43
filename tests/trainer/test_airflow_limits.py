"""The simulator under Airflow's concurrency limits (``SimConfig.max_active_tasks`` / ``pool_slots``
/ ``parallelism``): the scheduler hands the executor only what they allow, in Airflow's order."""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import numpy as np
import pytest
from _checks import check_conservation

from policy.catalogue import load_catalogue
from policy.graph import view
from policy.placement import EarliestFinishPlacer
from policy.schema import Decision, PlacementRequest, RunGraph, TaskNode
from trainer.simulator import Job, SimConfig, Simulator, downstream_weights
from trainer.workloads import ArrivalSpec, make_jobs, seed_dataset

CATALOGUES = "policy/catalogues"


def _graph(key: str, n: int, edges: tuple[tuple[int, int], ...] = (), d: float = 10.0) -> RunGraph:
    return RunGraph(key, tuple(TaskNode(f"t{i}", duration_s=d) for i in range(n)), edges)


class _Watch:
    """EFT, remembering each request's ready tasks and each run's tasks handed over (ready in
    the request or dispatched and not finished), and how many tasks were sent and not finished."""

    name = "watch"
    version = "test"

    def __init__(self) -> None:
        self.eft = EarliestFinishPlacer()
        self.ready: list[list[str]] = []
        self.per_run: list[int] = []
        self.total: list[int] = []
        self.sent: list[int] = []

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        self.ready.append([f"{t.run_key}/{t.task_id}" for t in request.ready])
        counts: dict[str, int] = defaultdict(int)
        for t in request.ready:
            counts[t.run_key] += 1
        for p in request.progress:
            counts[p.run_key] += len(p.running)
        self.per_run.append(max(counts.values()))
        self.total.append(sum(counts.values()))
        self.sent.append(sum(p.busy + p.queued for p in request.pools))
        return self.eft.place(request, graphs)


def test_downstream_weights_count_each_descendant_once():
    # a -> b, a -> c, b -> d, c -> d: Airflow's weight_rule "downstream" with weights 1
    g = view(_graph("r", 5, ((0, 1), (0, 2), (1, 3), (2, 3))))
    assert downstream_weights(g) == [4, 2, 2, 1, 1]


def test_max_active_tasks_caps_what_each_run_hands_the_executor():
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    jobs = [Job(_graph("a", 12), 0.0), Job(_graph("b", 12), 1.0)]  # fan-outs of 12 independent tasks
    watch = _Watch()
    r = Simulator(cat, jobs, watch, seed=0, max_active_tasks=3).run()
    check_conservation(jobs, r, cat)
    assert max(watch.per_run) == 3, "a run never has more than 3 tasks handed over, and reaches 3"
    free = _Watch()
    Simulator(cat, jobs, free, seed=0).run()
    assert max(free.per_run) == 12, "without the limit the placer sees the whole fan-out"


def test_pool_slots_cap_all_runs_together():
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    jobs = [Job(_graph(f"r{i}", 6), float(i)) for i in range(4)]
    watch = _Watch()
    r = Simulator(cat, jobs, watch, seed=0, pool_slots=5).run()
    check_conservation(jobs, r, cat)
    assert max(watch.total) == 5


def test_the_scheduler_hands_over_by_priority_weight_then_oldest_run():
    # each run: a root with three children (weight 4) and three lone tasks (weight 1); one task
    # handed over at a time: the first run's root, then the *second* run's root (weight 4 beats
    # the first run's children and lone tasks, weight 1), then the first run's weight-1 tasks
    cat = load_catalogue(f"{CATALOGUES}/speeds-1-2-4.yaml")
    edges = ((0, 1), (0, 2), (0, 3))
    jobs = [Job(_graph("a", 7, edges), 0.0), Job(_graph("b", 7, edges), 0.5)]
    watch = _Watch()
    Simulator(cat, jobs, watch, seed=0, pool_slots=1).run()
    order = [ready[0] for ready in watch.ready]
    assert all(len(ready) == 1 for ready in watch.ready)
    assert order[:3] == ["a/t0", "b/t0", "a/t1"], order


def test_parallelism_caps_tasks_sent_but_not_tasks_held():
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    jobs = [Job(_graph("a", 10), 0.0)]
    watch = _Watch()
    r = Simulator(cat, jobs, watch, seed=0, parallelism=2, autoscale=False).run()
    check_conservation(jobs, r, cat)
    assert max(len(ready) for ready in watch.ready) == 10, "held tasks are still offered"
    tries = [(t.start_s, t.end_s) for t in r.tasks]
    assert max(sum(1 for s, e in tries if s <= t0 < e) for t0, _ in tries) == 2, \
        "at most 2 sent and not finished (the pools have 14 slots)"


def test_failed_tries_wait_for_the_scheduler_again_and_every_task_finishes():
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    rng = np.random.default_rng(7)
    jobs = make_jobs(seed_dataset("montecarlo", rng)[:6], cat, 20, rng, ArrivalSpec(load=0.9))
    watch = _Watch()
    r = Simulator(cat, jobs, watch, seed=3, duration_noise=0.3, failure_rate=0.1,
                  max_active_tasks=4, pool_slots=10, parallelism=12).run()
    assert r.failed_tries > 0
    check_conservation(jobs, r, cat)
    assert max(watch.per_run) <= 4 and max(watch.total) <= 10 and max(watch.sent) <= 12


def test_limits_slow_a_wide_fan_out_and_are_deterministic():
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    rng = np.random.default_rng(5)
    jobs = make_jobs(seed_dataset("montecarlo", rng)[:6], cat, 20, rng, ArrivalSpec(load=0.9))
    free = Simulator(cat, jobs, EarliestFinishPlacer(), seed=1, duration_noise=0.3).run()
    limited = [Simulator(cat, jobs, EarliestFinishPlacer(), seed=1, duration_noise=0.3, max_active_tasks=2).run()
               for _ in range(2)]
    assert [j.finish_s for j in limited[0].jobs] == [j.finish_s for j in limited[1].jobs]
    mean = [sum(j.jct_s for j in res.jobs) / len(res.jobs) for res in (free, limited[0])]
    assert mean[1] > mean[0], "two tasks of a run at a time: runs take longer than with the whole fan-out"


@pytest.mark.parametrize("field", ["max_active_tasks", "pool_slots", "parallelism"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_bad_limits_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SimConfig(**{field: value})
