"""The rollout reference planner scores each alternative by the jobs-in-system integral at its horizon
(found by review: a step past the horizon kept the area beyond it)."""

from __future__ import annotations

import pytest

from policy.catalogue import parse_catalogue
from policy.schema import Decision, RunGraph, TaskNode
from trainer.baselines.rollout import RolloutPlanner
from trainer.simulator import Job, Simulator


def test_rollout_scores_the_jobs_in_system_integral_at_the_horizon() -> None:
    """The rollout planner must compare alternatives by the jobs-in-system integral *at the
    horizon* (trainer/baselines/rollout.py module docstring: "simulates each alternative forward
    ... for ``horizon_s`` simulated seconds, and keeps the one with the smallest jobs-in-system
    integral at the horizon"; docs/bench.md: "horizon 600 s"). ``_score`` pads the integral up to
    the horizon when the fork stops early, but when the fork's last step runs past the horizon
    (the next decision point, or the end of the workload, lies beyond it) the area past the
    horizon is kept, so alternatives are compared over different windows.

    One run of one 100 s task on one speed-1 slot, horizon 10 s: one job is in the system for the
    whole horizon, so the integral at the horizon is 10 job-seconds; the score is 100 (the whole
    run, 90 s past the horizon).
    """
    cat = parse_catalogue({"vm_classes": {"vm": {"cpus": 4, "memory_gb": 16, "speed": 1.0}},
                           "pools": {"p": {"vm_class": "vm", "workers": 1, "slots_per_worker": 1}}})
    graph = RunGraph("j/0", (TaskNode("a", duration_s=100.0),), ())
    planner = RolloutPlanner(cat, horizon_s=10.0)
    sim = Simulator(cat, [Job(graph, 0.0)], planner, seed=0)
    planner.bind(sim)
    request = sim.reset()
    assert request is not None and request.created_at == 0.0
    score = planner._score([Decision("j/0", "a", "p", "vm")], planner.base)
    assert score == 10.0


def test_the_area_until_now_is_the_jobs_in_system_integral() -> None:
    """``Simulator.area_until`` (what the rollout's score reads at the horizon) agrees with the
    integral the simulator keeps, at every decision point of a seeded stream."""
    import numpy as np

    from policy.catalogue import load_catalogue
    from policy.placement import EarliestFinishPlacer
    from trainer.workloads import load_templates, make_jobs

    cat = load_catalogue("policy/catalogues/gpu-affinity.yaml")
    jobs = make_jobs(load_templates("mlpipeline", np.random.default_rng(2)), cat, 12, np.random.default_rng(3))
    sim = Simulator(cat, jobs, EarliestFinishPlacer(), seed=3)
    request, seen = sim.reset(), 0
    while request is not None:
        assert sim.area_until(sim.now) == pytest.approx(sim.jobs_in_system_area, rel=1e-9, abs=1e-6)
        assert sim.area_until(sim.now / 2) <= sim.jobs_in_system_area
        request = sim.step(EarliestFinishPlacer().place(request, sim.graphs))
        seen += 1
    assert seen > 10
