"""The Gymnasium environment: registered, steps to the end with masked random actions."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

import trainer.gym_env  # noqa: F401  (registers the id)
from trainer.gym_env import ENV_ID


def test_registered_env_runs_an_episode():
    env = gym.make(ENV_ID, dag_runs=4, workflows="mlpipeline").unwrapped
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    rng = np.random.default_rng(0)
    total, steps, done = 0.0, 0, False
    while not done:
        mask = info["action_mask"]
        action = int(rng.choice(np.flatnonzero(mask)))
        obs, reward, done, _, info = env.step(action)
        total += reward
        steps += 1
        assert steps < 10_000
    result = env.sim.result()
    assert len(result.jobs) == 4
    # the return is minus the sum of JCTs (in reward_scale units)
    assert np.isclose(-total * env.reward_scale, sum(j.jct_s for j in result.jobs), rtol=1e-6)
