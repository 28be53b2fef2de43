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
