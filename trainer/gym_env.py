"""A Gymnasium environment over the simulator, registered as ``DRLPlacement-v0``.

One step places ONE ready task: the environment walks the ready tasks of each
:class:`~policy.schema.PlacementRequest` longest-remaining-critical-path first; action ``k < P``
sends the task to pool ``k`` (catalogue order), action ``P`` leaves it waiting (late binding,
offered again at the next decision point). When every task of the request has an action, the
decisions go to :meth:`Simulator.step`. Infeasible actions (pool down, task does not fit) count
as "wait"; ``info["action_mask"]`` marks the valid ones ("wait" is masked when nothing is running
or queued anywhere, so an episode cannot deadlock).

Observation (``float32``, shape ``(7 * P + 6,)``): per pool ``[up, slots, busy, queued, free
slots, effective speed for this task's kind, price per hour]``, then for the task ``[expected
duration / 100 s, upward rank / 100 s, cpus, memory GB, ready tasks / 100, runs / 10]``.

Reward: minus the increase of the jobs-in-system integral since the previous step, in units of
``reward_scale`` seconds, so the return is minus the sum of JCTs (Decima's objective for mean
JCT; Mao et al. 2019). ``info["request"]`` and ``info["graphs"]`` carry the raw request for
graph-based agents.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Mapping

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from policy.catalogue import Catalogue, load_catalogue
from policy.graph import view
from policy.placement import ordered_ready
from policy.schema import Decision, PlacementRequest, RunGraph
from trainer.simulator import Job, SimConfig, Simulator
from trainer.workloads import ArrivalSpec, load_templates, make_jobs

ENV_ID = "DRLPlacement-v0"
POOL_FEATURES = 7
TASK_FEATURES = 6


class PlacementEnv(gym.Env[np.ndarray, int]):
    """See the module docstring. ``jobs_fn(rng)`` draws an episode's jobs (default: seed families)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        catalogue: Catalogue | str | None = None,
        jobs_fn: Callable[[np.random.Generator], list[Job]] | None = None,
        *,
        dag_runs: int = 20,
        load: float = 0.85,
        workflows: str = "seed",
        config: SimConfig | None = None,
        reward_scale: float = 100.0,
    ) -> None:
        if catalogue is None or isinstance(catalogue, str):
            from trainer.bench import DEFAULT_POOLS

            catalogue = load_catalogue(catalogue or DEFAULT_POOLS)
        self.catalogue = catalogue
        self.config = config or SimConfig(duration_noise=0.3)
        self.reward_scale = reward_scale
        cat = catalogue
        self.jobs_fn = jobs_fn or (lambda rng: make_jobs(load_templates(workflows, rng), cat, dag_runs, rng,
                                                         ArrivalSpec(load=load)))
        self.n_pools = len(catalogue.pools)
        self.action_space = spaces.Discrete(self.n_pools + 1)
        self.observation_space = spaces.Box(-np.inf, np.inf, (POOL_FEATURES * self.n_pools + TASK_FEATURES,),
                                            np.float32)
        self.sim: Simulator | None = None
        self._request: PlacementRequest | None = None
        self._todo: list[Any] = []
        self._decisions: list[Decision] = []
        self._area = 0.0

    # -- gymnasium API ---------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        jobs = self.jobs_fn(self.np_random)
        sim_seed = int(self.np_random.integers(2**31))
        self.sim = Simulator(self.catalogue, jobs, seed=sim_seed, config=self.config)
        self._area = 0.0
        self._begin(self.sim.reset())
        return self._obs(), self._info()

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        assert self.sim is not None and self._request is not None, "call reset() first"
        ready, task, _ = self._todo.pop(0)
        if 0 <= action < self.n_pools:
            pool = self._request.pools[int(action)]
            if pool.up and pool.fits(task):
                self._decisions.append(Decision(ready.run_key, ready.task_id, pool.name, pool.vm_class))
        if not self._todo:
            self._begin(self.sim.step(self._decisions))
        area = self.sim.jobs_in_system_area
        reward = -(area - self._area) / self.reward_scale
        self._area = area
        done = self._request is None
        return self._obs(), float(reward), done, False, self._info()

    # -- helpers ----------------------------------------------------------------------------------

    def _begin(self, request: PlacementRequest | None) -> None:
        self._request = request
        self._decisions = []
        self._todo = ordered_ready(request, self.graphs) if request is not None else []

    @property
    def graphs(self) -> Mapping[str, RunGraph]:
        assert self.sim is not None
        return self.sim.graphs

    def action_mask(self) -> np.ndarray:
        mask = np.zeros(self.n_pools + 1, dtype=bool)
        if self._request is None or not self._todo:
            mask[-1] = True
            return mask
        task = self._todo[0][1]
        for k, p in enumerate(self._request.pools):
            mask[k] = p.up and p.fits(task)
        placed = len(self._decisions) > 0
        mask[-1] = placed or any(p.busy or p.queued for p in self._request.pools) or not mask[:-1].any()
        return mask

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.observation_space.shape, dtype=np.float32)  # type: ignore[arg-type]
        if self._request is None or not self._todo:
            return obs
        ready, task, g = self._todo[0]
        # the request's tasks placed so far take the pools' free slots, then queue (found by
        # review: unseen until the request was sent, two states gave one observation)
        sent = Counter(d.pool for d in self._decisions)
        for k, p in enumerate(self._request.pools):
            n = sent.get(p.name, 0)
            starts = min(n, p.free_slots)
            obs[k * POOL_FEATURES:(k + 1) * POOL_FEATURES] = (
                float(p.up), p.slots, p.busy + starts, p.queued + n - starts, p.free_slots - starts,
                p.speed_for(task.kind), p.price_per_hour,
            )
        base = POOL_FEATURES * self.n_pools
        rank = view(g.graph).rank[g.index[ready.task_id]]
        obs[base:] = (task.duration_s / 100.0, rank / 100.0, task.cpus, task.memory_gb,
                      len(self._request.ready) / 100.0, len(self._request.runs) / 10.0)
        return obs

    def _info(self) -> dict[str, Any]:
        return {"action_mask": self.action_mask(), "request": self._request,
                "graphs": self.graphs if self.sim is not None else {}}


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="trainer.gym_env:PlacementEnv")
