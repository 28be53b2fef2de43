"""The model and its decoding paths (policy/model.py, policy/gnn.py) on extreme-but-valid inputs and
settings: found by review, each failed on the code before its fix."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gnn_helpers import GPU_CATALOGUE, ROOT, diamond_request

from policy.catalogue import load_catalogue
from policy.checkpoint import load_checkpoint
from policy.errors import ModelOutputError
from policy.gnn import GNNPlacer
from policy.model import PlacementGNN
from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode


def _untrained(**kw: object) -> GNNPlacer:
    torch.manual_seed(0)
    return GNNPlacer(PlacementGNN(), **kw)  # type: ignore[arg-type]


def test_sampling_at_a_high_temperature_keeps_the_hard_constraints_and_the_stop_guard() -> None:
    """Sampling (policy/gnn.py ``_decode_features``, ``zt = flat / temp``) divides the masked
    pairs' NEG_INF (-1e9) and a refused stop's NEG_INF by the temperature: at ``temperature=1e9``
    (accepted: any finite value >= 0) they become -1 next to ~0 for the allowed choices, so the
    GPU task ``c`` is sampled onto CPU pools that cannot hold it and "stop" is sampled while
    nothing runs anywhere (nothing placed at all). Masks are hard constraints, "never learned",
    and stop is refused while nothing runs: neither may depend on the temperature."""
    req, graphs = diamond_request()  # every pool idle: stop is refused; c fits only "gpu"
    placer = _untrained(temperature=1e9, seed=0)
    off_gpu = nothing = 0
    for _ in range(60):
        decisions = placer.place(req, graphs)
        nothing += not decisions
        off_gpu += sum(d.task_id == "c" and d.pool != "gpu" for d in decisions)
    assert (off_gpu, nothing) == (0, 0)


def _nan_request() -> tuple[PlacementRequest, dict[str, RunGraph]]:
    """Schema-valid but absurd: a 1e306 s task on a pool of the least speed the schema allows
    (its run time overflows to inf, its pair features to NaN)."""
    run = RunGraph("dag/nan", (TaskNode("a", duration_s=30.0, priority=2.0), TaskNode("big", duration_s=1e306),
                               TaskNode("after", duration_s=1e306)), ((0, 2),))
    pools = (PoolState("p", "v-slow", slots=1, cpus=4, memory_gb=8, busy=1, speed=1e-3),
             PoolState("q", "v", slots=1, cpus=4, memory_gb=8, busy=1))
    return (PlacementRequest("req-nan", tuple(ReadyTask(run.run_key, t) for t in ("a", "big")), pools, runs=(run,)),
            {run.run_key: run})


def test_sampling_reports_non_finite_scores_as_a_model_output_error_like_greedy() -> None:
    """Greedy decoding of NaN scores raises ModelOutputError (``_decisions``: "the model's
    probabilities are not finite ..."); sampling the same request (temperature > 0, the
    training / exploration path) fails inside ``rng.choice`` with numpy's bare
    ``ValueError: Probabilities contain NaN`` (policy/gnn.py, ``_decode_features``): another
    exception type and message for the same bad input."""
    req, graphs = _nan_request()
    with np.errstate(all="ignore"):
        with pytest.raises(ModelOutputError):
            _untrained(step_kernel="numpy").place(req, graphs)
        with pytest.raises(ModelOutputError):
            _untrained(temperature=1.0, step_kernel="numpy").place(req, graphs)


def test_the_reason_of_a_pool_at_the_float_limit_does_not_overflow() -> None:
    """A pool of speed 1.7976931348623157e308 (finite, >= MIN_SPEED: valid) gives finite
    features and finite probabilities, so the policy decides; but the reason string reads the
    speed back as ``math.exp(x[0])`` of the float32 column (policy/gnn.py ``_RAW``), which rounds
    log(speed) up past 709.78, and ``math.exp`` raises OverflowError: the whole request fails
    ("drl failed (OverflowError: math range error)" and the fallback) for a formatting step.
    The same holds for ``expm1`` of the run / wait / finish / cost columns near the limit."""
    run = RunGraph("dag/fast", (TaskNode("a", duration_s=60.0),), ())
    pools = (PoolState("fast", "c-fast", slots=1, cpus=8, memory_gb=32, speed=1.7976931348623157e308),
             PoolState("slow", "c-slow", slots=1, cpus=8, memory_gb=32, speed=1.0))
    req = PlacementRequest("req-fast", (ReadyTask(run.run_key, "a"),), pools, runs=(run,))
    placer = GNNPlacer.from_checkpoint(ROOT / "policy" / "checkpoints" / "default", step_kernel="numpy")
    decisions = placer.place(req, {run.run_key: run})
    assert [d.task_id for d in decisions] == ["a"]
    assert decisions[0].reason.startswith(decisions[0].pool)


def test_identical_tasks_tie_to_request_order_whatever_the_scale_of_their_logits() -> None:
    """TIE_TOLERANCE (policy/model.py) is an absolute 1e-4, but the float32 rounding between two
    identical ready tasks' scores grows with the scores' magnitude: with a large (schema-valid)
    priority on both, their task parts already differ by ~4e-4, so the rounding, not request
    order, picks which goes first: the first listed went first in 31 of 60 requests (the
    documented rule, greedy_choice: near-ties go to the row first in decode order, here request
    order). Expected: every time (a tolerance relative to the scores' scale)."""
    model = load_checkpoint(ROOT / "docs" / "exp-ledger" / "checkpoints" / "s41").model
    placer = GNNPlacer(model, step_kernel="numpy", explain=False)
    pools = load_catalogue(GPU_CATALOGUE).states()
    rng = np.random.default_rng(0)
    firsts = []
    for trial in range(60):
        busy = (int(rng.integers(0, 9)), int(rng.integers(0, 5)), int(rng.integers(0, 3)))
        states = tuple(replace(p, busy=b) for p, b in zip(pools, busy, strict=True))
        duration = float(rng.uniform(5, 600))
        tasks = tuple(TaskNode(t, duration_s=duration, priority=1e300) for t in ("a", "b"))
        run = RunGraph(f"dag/{trial}", tasks, ())
        req = PlacementRequest(f"r{trial}", tuple(ReadyTask(run.run_key, t) for t in ("a", "b")), states, runs=(run,))
        decisions = placer.place(req, {run.run_key: run})
        if decisions:
            firsts.append(decisions[0].task_id)
    assert len(firsts) > 40
    assert firsts.count("a") == len(firsts), f"the first listed went first in {firsts.count('a')} of {len(firsts)}"
