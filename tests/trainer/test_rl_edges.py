"""The policy-gradient phase (``trainer/rl.py``), its evaluation and selection and the Gymnasium
environment (``trainer/gym_env.py``) at their edges.

Each test failed on the code before its fix, for the reason its docstring gives."""

from __future__ import annotations

import math
import types
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from test_rl import _one_thread  # noqa: F401 - an autouse fixture

import trainer.gym_env  # noqa: F401  (registers the id)
import trainer.rl as rl_mod
from policy.catalogue import load_catalogue
from policy.model import ModelConfig, PlacementGNN
from trainer.gym_env import ENV_ID, POOL_FEATURES
from trainer.rl import Reference, Rollout, eval_score, interval_rewards, reinforce
from trainer.simulator import JobRecord
from trainer.train import Args, Setting, settings_from


def _row(sla: float) -> dict[str, float]:
    return {"mean_jct_s": 100.0, "p95_jct_s": 200.0, "sla_violation_rate": sla, "cost": 1.0}


def test_eval_score_survives_a_teacher_with_no_sla_violations() -> None:
    """``eval_score`` divides ``drl / teacher`` by ``max(teacher, 1e-9)`` (``trainer/rl.py``,
    ``eval_score``): with ``--objective sla_violation_rate`` a teacher with no late run on an
    evaluation stream is common (``srpt+eft`` on Monte Carlo, 20 runs: rate 0.0), and then a
    policy that ties it at 0 gets ratio 0, ``log 0 = -inf``, and the geometric mean over *all*
    settings is 0 -- the best possible score however bad the other settings are, so selection
    (docs/policy.md, "Evaluation and selection": the lowest geometric mean of drl / teacher is
    kept) keeps it for good; a policy with one late run gets ratio ~1e8 instead. A tie must
    count as 1 (or the ratio be floored), so that here, a tie on one setting and 5 x the
    teacher on the other, the score is finite and above 1 (sqrt(5) with a tie as 1)."""
    args = Args(objective="sla_violation_rate")
    settings = [Setting("a", [], "srpt+eft"), Setting("b", [], "srpt+eft")]
    reference = {"a": {"srpt+eft": _row(0.0)}, "b": {"srpt+eft": _row(0.1)}}
    res = {"a": {"drl": _row(0.0)}, "b": {"drl": _row(0.5)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        score, ratios = eval_score(settings, args, res, reference)
    assert math.isfinite(score) and score > 1.0, (score, ratios)
    assert ratios["b"] == pytest.approx(5.0)


def _job(key: str, arrival: float, finish: float) -> JobRecord:
    return JobRecord(key, arrival, finish, 1)


@pytest.mark.parametrize("objective", ["p95_jct", "sla_violation_rate"])
def test_a_run_finishing_at_a_decision_is_charged_to_the_interval_it_finished_in(objective: str) -> None:
    """A run that completes exactly at decision time ``t_1`` completed during ``[t_0, t_1]``: the
    simulator handles the completion event before it asks for the decision at ``t_1`` (which
    sees the run gone, and so cannot have influenced it). ``interval_rewards`` charges its
    per-run penalty with ``searchsorted(t, finish, side="right") - 1`` (``trainer/rl.py``,
    ``interval_rewards``), i.e. to the decision made *after* it finished: an off-by-one
    inconsistent with the same function's JCT reward (the run's area ends in interval 0) and
    its cost reward (billing of the events at ``t_1`` is in ``costs[1] - costs[0]``, interval
    0). Expected: the penalty in interval 0 (the module docstring: "a per-run penalty at its
    completion", in the interval "between decision i and the next one")."""
    jobs = [_job("a", 0.0, 10.0)]
    ro = Rollout([], np.array([0.0, 10.0, 20.0]), np.zeros(3), 30.0, 0.0, jobs)
    ref = Reference(sum_jct=10.0, tail_q=4.0, tail_sum=1.0, late_sum=1.0, cost=1.0)
    jct = interval_rewards(ro, "mean_jct", 0.0, ref, {"a": 5.0})
    assert jct == pytest.approx([-1.0, 0.0, 0.0])  # the run's whole area is before t_1
    r = interval_rewards(ro, objective, 0.0, ref, {"a": 5.0})
    pen = 6.0 if objective == "p95_jct" else 2.0  # JCT 10 - q 4; 1 + 5 s late / 5 s allowed
    assert r == pytest.approx([-pen, 0.0, 0.0])


def test_a_time_limit_stop_still_evaluates_the_last_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """``reinforce`` evaluates every ``rl_eval_every`` iterations *or at the last one*
    (``done == args.rl_iters``) and finally loads the best evaluated weights
    (``trainer/rl.py``, the loop's end). When ``--rl-time-limit-s`` stops the loop early, the
    weights of the iterations since the last evaluation are never evaluated and are thrown
    away: with the default ``rl_eval_every`` 5 and a limit reached after 2 iterations, the
    model comes back as it started, its PPO training silently lost. Expected: the stop is the
    last iteration, so the weights then are evaluated (a second ``eval/rl_score`` record, as
    after a run that reaches ``rl_iters``) and may be kept."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(rl_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    args = Args(workflows="mlpipeline", heldout="", threads=1, seed=2, rl_iters=4, rl_rollouts=2,
                rl_runs_start=3, rl_runs_end=3, rl_size_start=1.0, rl_eval_every=3, rl_time_limit_s=100.0,
                rl_batch_requests=32, eval_runs=4, eval_streams=1)
    settings = settings_from("mlpipeline", seed=1)
    settings[0].teacher = "srpt+eft"
    catalogue = load_catalogue(args.pools)
    torch.manual_seed(2)
    model = PlacementGNN(ModelConfig(hidden=8, layers=1))
    rows: list[dict[str, Any]] = []

    def record(step: int, **kv: float) -> None:
        rows.append(kv)
        if kv.get("charts/iter") == 1:  # the time limit is reached during the second iteration
            clock.now = 1e6

    out = reinforce(model, settings, catalogue, args, record)
    assert out["rl_iters_done"] == 2
    scored = [r for r in rows if "eval/rl_score" in r]
    assert len(scored) == 2, f"{len(scored)} evaluation(s): the weights after the stop were never evaluated"


def test_gym_observation_shows_the_tasks_already_placed_in_the_request() -> None:
    """``PlacementEnv`` places one ready task per step and sends the request's decisions only
    after its last task (``trainer/gym_env.py``, ``step``), but ``_obs`` reads the pools'
    ``busy``, ``queued`` and ``free slots`` from the request's snapshot, never counting the
    decisions already made in it. After the agent sends a task to pool ``k``, the next task
    sees pool ``k`` exactly as before, so two different states (a slot taken or not) give the
    same observation: the environment is not Markov in its own observation, and an agent
    cannot learn not to pile a batch onto one free slot (the repository's decoders count a
    batch's earlier placements: ``policy.gnn``'s ``placed``, EFT's backlog). Expected: pool
    ``k``'s state columns change once a task of the request is sent there."""
    env = gym.make(ENV_ID, dag_runs=4, workflows="mlpipeline").unwrapped
    obs, info = env.reset(seed=0)
    steps = 0
    while len(env._todo) < 2:  # walk to a request with at least two ready tasks
        obs, _, done, _, info = env.step(int(np.flatnonzero(info["action_mask"][:-1])[0]))
        steps += 1
        assert not done and steps < 1000
    k = int(np.flatnonzero(info["action_mask"][:-1])[0])
    request = env._request
    before = obs[k * POOL_FEATURES:k * POOL_FEATURES + 5].copy()  # up, slots, busy, queued, free
    obs, _, _, _, info = env.step(k)
    assert env._request is request  # still the same request: its second task
    after = obs[k * POOL_FEATURES:k * POOL_FEATURES + 5]
    assert not np.array_equal(before, after), (before, after)
