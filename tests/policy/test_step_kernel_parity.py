"""The compiled decode steps (policy/step_kernel.py) decide as the numpy steps where the two once
differed (found by review, 2026-12-06): a free pool at exactly ``hold_ratio`` x a task's best
finish, and NaN scores, which must end in the fallback, not in a stop that holds every task."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from policy import step_kernel
from policy.arbiter import Arbiter
from policy.errors import ModelOutputError
from policy.gnn import GNNPlacer
from policy.model import ModelConfig, PlacementGNN
from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode

pytestmark = pytest.mark.skipif(not step_kernel.AVAILABLE, reason="numba is not installed (the policy extra)")

KERNELS = ("compiled", "numpy")


def _eager_to_stop(seed: int = 0) -> PlacementGNN:
    """An untrained model whose stop logit beats every pair wherever stop is allowed: what it
    decides shows where each decoder's guard allows stop."""
    torch.manual_seed(seed)
    model = PlacementGNN(ModelConfig(hidden=16))
    out = model.stop[2]
    assert isinstance(out, torch.nn.Linear)
    with torch.no_grad():
        out.bias.fill_(1e3)
    return model


def _two_pools(ratio: Fraction, duration: float = 60.0) -> tuple[PlacementRequest, dict[str, RunGraph]]:
    """One ready task; pool ``fast`` (``ratio`` x the speed) is busy but its slot frees now, so the
    task's best finish is there (``duration / ratio``); pool ``slow`` is free and finishes it in
    ``duration``: exactly ``ratio`` x its best."""
    run = RunGraph("dag/hold", (TaskNode("a", duration_s=duration),), ())
    pools = (PoolState("fast", "c-fast", slots=1, cpus=8, memory_gb=32, speed=float(ratio), busy=1, free_at=(0.0,)),
             PoolState("slow", "c-slow", slots=1, cpus=8, memory_gb=32, speed=1.0))
    return PlacementRequest("req-hold", (ReadyTask(run.run_key, "a"),), pools, runs=(run,)), {run.run_key: run}


@pytest.mark.parametrize("hold_ratio", [2.0, 3.0, 4.0])
def test_compiled_steps_refuse_stop_at_exactly_hold_ratio_as_numpy_does(hold_ratio: float) -> None:
    """A task whose free feasible pool finishes at exactly ``hold_ratio`` x its best (busy) pool
    must not be held ("refused while ... within this factor"): the numpy steps (and the batched
    numpy/torch steps) compare the float32 finish-ratio column with log(hold_ratio) in float32
    (NumPy/torch treat the Python float as a weak scalar), so log(2) <= log(2) and stop is refused.
    The compiled kernel (policy/step_kernel.py: ``cur[r, p, 2] <= log_ratio``) compares the
    float32 column widened to float64 against the float64 log: float32(log 2) = 0.69314718246 >
    0.69314718056, so the free pool is "not within" and stop is allowed. Consequence: with
    ``hold_ratio`` set (ServerConfig.hold_ratio) and the default ``step_kernel=auto``, the server
    holds a task on an idle pool that the numpy decoder (and the documented guard) would start,
    a different decision from the same inputs depending on whether numba is installed; the
    batched compiled path (place_many) inherits it."""
    req, graphs = _two_pools(Fraction(hold_ratio))
    model = _eager_to_stop()
    got: dict[str, object] = {}
    for kernel in KERNELS:
        placer = GNNPlacer(model, hold_ratio=hold_ratio, step_kernel=kernel, explain=False)
        got[kernel] = [(d.task_id, d.pool) for d in placer.place(req, graphs)]
        got[kernel + "/many"] = [[(d.task_id, d.pool) for d in x]
                                 for x in placer.place_many([req, req], [graphs, graphs])]
    assert got["numpy"] == [("a", "slow")]  # the guard: a free pool within hold_ratio, so no stop
    assert got["compiled"] == got["numpy"], got
    assert got["compiled/many"] == got["numpy/many"] == [got["numpy"]] * 2, got


def test_compiled_and_numpy_steps_agree_for_any_hold_ratio_met_exactly() -> None:
    """Property (seeded): for 40 random speed ratios r = p/q (small integers, as catalogues'
    speeds are) and ``hold_ratio = r``, a task whose free pool finishes at exactly r x its best
    is decided alike by both kernels. They part wherever the float32 finish-ratio column rounds
    above the float64 log(r) (30 of these 40; 2, 3, 4, 7/4, 4/3 among them): the compiled guard
    compares in float64 what the numpy guard compares in float32 (see the test above). The
    uncompiled ``step_kernel._greedy_steps`` decides as numpy: it is numba's widening."""
    rng = np.random.default_rng(7)
    model = _eager_to_stop()
    placers = {k: GNNPlacer(model, hold_ratio=1.0, step_kernel=k, explain=False) for k in KERNELS}
    parted = []
    for _ in range(40):
        r = Fraction(int(rng.integers(2, 13)), int(rng.integers(1, 5)))
        if r <= 1:
            r = 1 / r
        for p in placers.values():
            p.hold_ratio = float(r)
        req, graphs = _two_pools(r, duration=float(120 * r.numerator))
        got = {k: [(d.task_id, d.pool) for d in p.place(req, graphs)] for k, p in placers.items()}
        if got["compiled"] != got["numpy"]:
            parted.append((str(r), got))
    assert not parted, f"{len(parted)} of 40 ratios decided differently: {parted[:5]}"


def test_compiled_steps_do_not_hide_nan_scores_behind_stop() -> None:
    """A schema-valid but absurd request (a 1e306 s task on a pool of speed 1e-5: its run time
    overflows to inf and its pair features to NaN) gives that row NaN logits. The numpy steps
    propagate the NaN (``logits.max()`` is NaN, so stop never wins) and the placer refuses with
    ModelOutputError, which the arbiter answers with the fallback's decisions for every task.
    The compiled kernel skips NaN in its running maximum (``lg > best_logit`` is False for NaN),
    so the stop head beats the finite logits and both tasks, the healthy one included, are
    silently held: no error, no fallback, no decision, request after request. Consequence: the
    two kernels answer the same request differently (fallback placements vs. nothing), and with
    the compiled one a NaN model output is never reported."""
    run = RunGraph("dag/nan", (TaskNode("a", duration_s=30.0, priority=2.0), TaskNode("big", duration_s=1e306),
                               TaskNode("after", duration_s=1e306)), ((0, 2),))
    pools = (PoolState("p", "v-slow", slots=1, cpus=4, memory_gb=8, busy=1, speed=1e-5),
             PoolState("q", "v", slots=1, cpus=4, memory_gb=8, busy=1))
    req = PlacementRequest("req-nan", tuple(ReadyTask(run.run_key, t) for t in ("a", "big")), pools, runs=(run,))
    graphs = {run.run_key: run}
    model = _eager_to_stop()
    outcome: dict[str, object] = {}
    with np.errstate(all="ignore"):
        for kernel in KERNELS:
            placer = GNNPlacer(model, step_kernel=kernel, explain=False)
            try:
                outcome[kernel] = [(d.task_id, d.pool) for d in placer.place(req, graphs)]
            except ModelOutputError:
                outcome[kernel] = "ModelOutputError"
            replies = Arbiter().decide(placer, req, graphs)
            outcome[kernel + "/arbiter"] = sorted(d.task_id for d in replies)
    assert outcome["numpy"] == "ModelOutputError"
    assert outcome["numpy/arbiter"] == ["a", "big"]  # the fallback places both
    assert outcome["compiled"] == outcome["numpy"], outcome
    assert outcome["compiled/arbiter"] == outcome["numpy/arbiter"], outcome


def test_finish_ratio_equal_to_log_hold_ratio_is_within_in_numpy() -> None:
    """Guard for the tests above (passes): the numpy/torch comparison the decoders use is in
    float32, so a finish ratio of exactly ``hold_ratio`` counts as within it there, while the
    same comparison widened to float64, as the compiled kernel makes it, does not."""
    col = np.array([np.float32(math.log(2.0))], dtype=np.float32)
    assert bool((col <= math.log(2.0))[0])
    assert bool((torch.from_numpy(col) <= math.log(2.0))[0])
    assert not float(col[0]) <= math.log(2.0)
