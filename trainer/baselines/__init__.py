"""The baselines: every one a :class:`~policy.placement.Placer`, built by name.

``make_placer(name, catalogue, seed)`` builds one; :data:`BASELINES` lists every name (the
``baselines`` keyword of ``drl-trainer bench``). List-scheduling names are ``ORDER+PLACEMENT``
(see :mod:`trainer.baselines.rules`). ``eft`` is the shipped :class:`~policy.placement.EarliestFinishPlacer`
(the executor's own fallback); ``rollout`` is the slow search reference.
"""

from __future__ import annotations

from pathlib import Path

from policy.catalogue import Catalogue
from policy.placement import EarliestFinishPlacer, Placer
from trainer.baselines.planners import Cpop, Heft
from trainer.baselines.rules import (
    ORDERS,
    PLACEMENTS,
    CostAware,
    CriticalPathCost,
    Fifo,
    ListScheduler,
    MinMin,
    RandomPlacer,
    RoundRobin,
    StaticQueue,
)

SIMPLE = ("random", "round-robin", "static", "fifo", "eft", "heft", "cpop", "min-min", "cost-aware", "cost-cp")
LIST_RULES = tuple(f"{o}+{p}" for o in ORDERS for p in PLACEMENTS)
#: every baseline except the slow rollout planner, in table order
BASELINES = SIMPLE + LIST_RULES
SLOW = ("rollout",)


#: The learned policy's name in ``--policies`` (not a baseline: never a reference).
LEARNED = "drl"


def make_placer(name: str, catalogue: Catalogue | None = None, seed: int = 0,
                checkpoint: str | Path | None = None, hold_ratio: float | None = None,
                reserve_busy: bool | None = None, cp_gate: float | None = None,
                cp_gate_scope: str | None = None) -> Placer:
    """A fresh placer (placers keep per-simulation state: build one per simulation).

    ``drl`` is the GNN policy loaded from ``checkpoint`` (default: the committed default
    checkpoint; several folders joined by commas: their ensemble, :meth:`GNNPlacer.with_members`),
    greedy, on the CPU, with its stop guard at ``hold_ratio`` (default:
    :data:`policy.features.HOLD_RATIO`), decoding busy pools as the checkpoint was trained
    unless ``reserve_busy`` says otherwise, with the premium gate ``cp_gate`` over
    ``cp_gate_scope``'s tasks (:data:`policy.features.CP_GATE_SCOPES`; both default to the
    checkpoint's).
    """
    if name == LEARNED:
        from policy.gnn import GNNPlacer
        from policy.registry import DEFAULT_CHECKPOINT

        extra: dict[str, float | bool | str] = {} if hold_ratio is None else {"hold_ratio": hold_ratio}
        if reserve_busy is not None:
            extra["reserve_busy"] = reserve_busy
        if cp_gate is not None:
            extra["cp_gate"] = cp_gate
        if cp_gate_scope is not None:
            extra["cp_gate_scope"] = cp_gate_scope
        first, *others = str(checkpoint or DEFAULT_CHECKPOINT).split(",")
        placer = GNNPlacer.from_checkpoint(first, device="cpu", **extra)
        if others:  # an ensemble: the first checkpoint's decoder settings, every model's scores
            from policy.checkpoint import load_checkpoint

            loaded = [load_checkpoint(p) for p in others]  # (an ensemble among them: all its members)
            kept = [(m.version, m.model) for m in placer.members]
            placer.with_members(kept + [m for c in loaded for m in [(c.version, c.model), *c.members]])
        return placer
    if name == "random":
        return RandomPlacer(catalogue, seed)
    if name == "round-robin":
        return RoundRobin(catalogue)
    if name == "static":
        return StaticQueue(catalogue)
    if name == "fifo":
        return Fifo(catalogue)
    if name == "eft":
        return EarliestFinishPlacer()
    if name == "heft":
        return Heft(catalogue)
    if name == "cpop":
        return Cpop(catalogue)
    if name == "min-min":
        return MinMin(catalogue)
    if name == "cost-aware":
        return CostAware(catalogue)
    if name == "cost-cp":
        return CriticalPathCost(catalogue)
    if name == "rollout":
        from trainer.baselines.rollout import RolloutPlanner

        return RolloutPlanner(catalogue, seed=seed)
    if "+" in name:
        order, _, placement = name.partition("+")
        return ListScheduler(order, placement, catalogue)
    raise ValueError(f"unknown policy {name!r}; expected one of {BASELINES + SLOW}")


def expand(names: str) -> list[str]:
    """A comma list of policy names, with ``baselines`` expanded to :data:`BASELINES`."""
    out: list[str] = []
    for item in [s.strip() for s in names.split(",") if s.strip()]:
        for name in BASELINES if item == "baselines" else (item,):
            if name not in out:
                out.append(name)
    return out
