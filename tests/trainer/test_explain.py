"""``drl-trainer explain`` on a tiny stream with a freshly saved checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from policy.checkpoint import save_checkpoint
from policy.model import ModelConfig, PlacementGNN
from trainer.explain import add_arguments, run


def test_explain_prints_evidence_and_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    save_checkpoint(PlacementGNN(ModelConfig(hidden=8, layers=2)), tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    png = tmp_path / "dag.png"
    args = parser.parse_args(["--checkpoint", str(tmp_path / "ckpt"), "--workflows", "mlpipeline",
                              "--dag-runs", "3", "--request", "2", "--png", str(png)])
    assert run(args) == 0
    out = capsys.readouterr().out
    assert "reason: " in out
    assert "pair features (chosen minus runner-up" in out
    assert "DAG nodes that drove it" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("ensemble", [False, True])
def test_the_margin_is_over_a_pool_the_step_offered(tmp_path: Path, ensemble: bool) -> None:
    """The explained margin is the chosen pool's logit over the runner-up's among the pools the
    decoding step offered (a busy pool that ``reserve_busy`` blocked there is not the runner-up),
    so it is log(p_chosen / p_runner) of the step's probabilities; for an ensemble checkpoint
    (``drl-trainer ensemble``) the same, over its members' mean logits."""
    import math

    from policy.checkpoint import load_checkpoint, save_ensemble
    from policy.gnn import GNNPlacer, attribute
    from policy.registry import DEFAULT_CHECKPOINT
    from trainer.explain import find_decision

    default = load_checkpoint(DEFAULT_CHECKPOINT)  # its first model, trained with reserve_busy, alone
    ckpt = tmp_path / "single"
    save_checkpoint(default.model, ckpt, training=default.manifest["training"])
    if ensemble:
        torch.manual_seed(1)
        save_checkpoint(PlacementGNN(ModelConfig()), tmp_path / "other", training={"reserve_busy": True})
        save_ensemble([load_checkpoint(ckpt), load_checkpoint(tmp_path / "other")], tmp_path / "ens")
        ckpt = tmp_path / "ens"
    placer = GNNPlacer.from_checkpoint(ckpt)
    assert placer.reserve_busy and len(placer.models) == 1 + ensemble
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    checked = 0
    for request in range(0, 40, 4):
        args = parser.parse_args(["--checkpoint", str(ckpt), "--request", str(request)])
        _, dec, row = find_decision(args, placer)
        att = attribute(placer.models, dec, row)
        assert att.runner_up is not None and dec.probs[row, att.runner_up] > 0
        p = dec.probs[row]
        assert att.margin == pytest.approx(math.log(p[att.chosen] / p[att.runner_up]), abs=1e-3)
        checked += 1
    assert checked == 10
