"""A rollout planner: the slow search reference (and a possible teacher for the learned policy).

At each decision point it takes the base rule's decisions (``srpt+eft`` by default), then, for the
``branch`` most urgent ready tasks in turn, tries every alternative for that task (each feasible
pool, or waiting), simulates each alternative forward on a :meth:`~trainer.simulator.Simulator.fork`
of the real simulator under the base rule for ``horizon_s`` simulated seconds, and keeps the one
with the smallest jobs-in-system integral at the horizon (the mean-JCT objective). One-step
lookahead policy improvement over the base rule (Bertsekas' rollout), so it is at least as good as
the base rule on the sampled futures. Decisions are still made through the ``Placer`` call; the
search needs the simulator, so it cannot run in production (``bind`` is how it gets it).
"""

from __future__ import annotations

import copy
from typing import Mapping

from policy.catalogue import Catalogue
from policy.graph import view
from policy.placement import feasible
from policy.schema import Decision, PlacementRequest, RunGraph
from trainer.baselines.rules import ListScheduler
from trainer.simulator import Simulator


class RolloutPlanner:
    name = "rollout"
    version = "baseline-1"

    def __init__(self, catalogue: Catalogue | None = None, *, seed: int = 0, base: str = "srpt+eft",
                 horizon_s: float = 600.0, branch: int = 1) -> None:
        order, _, placement = base.partition("+")
        self.base = ListScheduler(order, placement, catalogue)
        self.horizon_s = horizon_s
        self.branch = branch
        self.sim: Simulator | None = None

    def bind(self, simulator: Simulator) -> None:
        self.sim = simulator

    def _score(self, decisions: list[Decision], base: ListScheduler) -> float:
        assert self.sim is not None
        sim = self.sim.fork()
        planner = copy.deepcopy(base)
        end = sim.now + self.horizon_s
        request = sim.step(decisions)
        while request is not None and sim.now < end:
            request = sim.step(planner.place(request, sim.graphs))
        if sim.now > end:  # the last step ran past the horizon: the integral as it was there (found by
            return sim.area_until(end)  # review: the area past it was kept, windows of unequal length)
        return sim.jobs_in_system_area + sim.jobs_in_system * (end - sim.now)

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        decisions = self.base.place(request, graphs)
        if self.sim is None:
            return decisions
        by_task = {(d.run_key, d.task_id): d for d in decisions}
        # the most urgent ready tasks: those the base rule sent first, then the ones it held back
        urgent = [(d.run_key, d.task_id) for d in decisions]
        urgent += [r.key for r in request.ready if r.key not in by_task]
        pools = {p.name: p for p in request.pools}
        for key in urgent[: self.branch]:
            graph = graphs[key[0]]
            g = view(graph)
            task = graph.tasks[g.index[key[1]]]
            options: list[Decision | None] = [None]
            options += [Decision(key[0], key[1], p.name, p.vm_class, reason="rollout")
                        for p in feasible(task, request.pools)]
            best: tuple[float, Decision | None] | None = None
            for opt in options:
                trial = dict(by_task)
                if opt is None:
                    trial.pop(key, None)
                else:
                    trial[key] = opt
                if not trial and not any(p.busy or p.queued for p in pools.values()):
                    continue  # waiting with nothing running would stall the cluster
                score = self._score(list(trial.values()), self.base)
                if best is None or score < best[0] - 1e-9:
                    best = (score, opt)
            if best is not None:
                if best[1] is None:
                    by_task.pop(key, None)
                else:
                    by_task[key] = best[1]
        # the base rule's ledger holds its own choices; it is reconciled with the pool counts at
        # the next request, which is all a ledger can know anyway
        return list(by_task.values())
