"""``scripts/cost_frontier.py``: its boot-aware rule (srpt+eft at lam = 0, cheaper when lam is large)
and the learned policy under a premium gate."""

from __future__ import annotations

import runpy
from pathlib import Path

from policy.catalogue import load_catalogue
from trainer.baselines import make_placer
from trainer.bench import setting_jobs
from trainer.simulator import SimConfig, Simulator

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "cost_frontier.py"))
CATALOGUE = load_catalogue(ROOT / "policy" / "catalogues" / "gpu-affinity.yaml")


def _run(placer, seed: int = 3):  # type: ignore[no-untyped-def]
    jobs = setting_jobs("mlpipeline", 0, seed, CATALOGUE, 10, 0.85)
    sim = Simulator(CATALOGUE, jobs, placer, seed=seed, config=SimConfig(duration_noise=0.3))
    return sim.run()


def test_boot_aware_at_zero_weight_is_srpt_eft() -> None:
    ours, theirs = _run(SCRIPT["BootAware"](CATALOGUE, 0.0)), _run(make_placer("srpt+eft", CATALOGUE, 3))
    assert [(t.task_id, t.pool) for t in ours.tasks] == [(t.task_id, t.pool) for t in theirs.tasks]
    assert ours.cost == theirs.cost


def test_a_large_weight_buys_cost_with_time() -> None:
    blind, frugal = _run(SCRIPT["BootAware"](CATALOGUE, 0.0)), _run(SCRIPT["BootAware"](CATALOGUE, 1e5))
    jct = [sum(j.jct_s for j in r.jobs) / len(r.jobs) for r in (blind, frugal)]
    assert frugal.cost < 0.9 * blind.cost
    assert jct[1] > jct[0]
    expensive = {"cpu-large", "gpu"}
    assert (sum(t.pool in expensive for t in frugal.tasks) < sum(t.pool in expensive for t in blind.tasks))


def test_the_cp_gate_makes_the_learned_policy_spend_less_on_premium_pools() -> None:
    """``cp_gate`` 3 (``scripts/cost_frontier.py --checkpoints DIR@3``): the default checkpoint
    sends CPU work to the premium GPU pool only for critical-path tasks, so an ETL stream (CPU
    work only) runs fewer tasks there and costs less than without the gate (s41: 6.29 vs 5.45
    dollars; e2: 6.31 vs 5.41)."""
    def run(gate: float, scope: str = "off-cp"):  # type: ignore[no-untyped-def]
        jobs = setting_jobs("etl", 0, 3, CATALOGUE, 10, 0.85)
        placer = make_placer("drl", CATALOGUE, 3, cp_gate=gate, cp_gate_scope=scope)
        return Simulator(CATALOGUE, jobs, placer, seed=3, config=SimConfig(duration_noise=0.3)).run()

    plain, gated, every = run(0.0), run(3.0), run(3.0, "all")
    assert sum(t.pool == "gpu" for t in gated.tasks) < 0.5 * sum(t.pool == "gpu" for t in plain.tasks)
    assert gated.cost < 0.95 * plain.cost
    # the gate for every task (``DIR@3/all``): CPU work on the GPU only where the GPU is not
    # premium for it (the 32 GB merges do not fit cpu-small, and per unit of work the GPU costs
    # 1.8 x cpu-large, under the gate's 3), and less spent still
    assert all("merge" in t.task_id for t in every.tasks if t.pool == "gpu")
    assert sum(t.pool == "gpu" for t in every.tasks) < sum(t.pool == "gpu" for t in gated.tasks)
    assert every.cost < gated.cost


def test_a_checkpoint_keeps_its_gate_unless_told_otherwise(tmp_path: Path) -> None:
    """``make_placer`` (and so ``--checkpoints DIR``) decodes a checkpoint with the gate and scope
    it was trained with; ``DIR@R/scope`` overrides them."""
    from policy.checkpoint import load_checkpoint, save_checkpoint

    model = load_checkpoint(ROOT / "policy" / "checkpoints" / "default").model
    save_checkpoint(model, tmp_path / "every", training={"cp_gate": 3.0, "cp_gate_scope": "all"})
    placer = make_placer("drl", CATALOGUE, 0, checkpoint=tmp_path / "every")
    assert (placer.cp_gate, placer.cp_gate_scope) == (3.0, "all")  # type: ignore[attr-defined]
    placer = make_placer("drl", CATALOGUE, 0, checkpoint=tmp_path / "every", cp_gate=2.0, cp_gate_scope="off-cp")
    assert (placer.cp_gate, placer.cp_gate_scope) == (2.0, "off-cp")  # type: ignore[attr-defined]
