"""Inputs a model never learned from are cut off at load (policy/inputs.py)."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gnn_helpers import ROOT, big_request

from policy.checkpoint import load_checkpoint, save_checkpoint
from policy.errors import CheckpointError
from policy.gnn import GNNPlacer
from policy.inputs import cut_inputs, input_layers, unchanged_inputs, untrained_at_init, untrained_inputs_of
from policy.model import ModelConfig, PlacementGNN
from policy.schema import PlacementRequest

DEFAULT = ROOT / "policy" / "checkpoints" / "default"
NEVER_IN_THE_LAB = ["task.gpus", "task.pinned", "ready.retry", "pool.failure_rate", "pair.pinned_here"]


def _retried(request: PlacementRequest, which: int | None = None) -> PlacementRequest:
    ready = tuple(replace(t, try_number=2) if which is None or i == which else t for i, t in enumerate(request.ready))
    return replace(request, ready=ready)


def _decide(placer: GNNPlacer, request: PlacementRequest, graphs: dict) -> list[tuple[str, str, float]]:
    return [(d.task_id, d.pool, round(d.score, 6)) for d in placer.place(request, graphs)]


def test_the_default_checkpoint_reads_a_retried_task_as_the_fresh_one_it_was_trained_on() -> None:
    """was: ready.retry's weights at their random start: one retried task among fresh ones had its
    own decision changed in 10-20% of requests"""
    ckpt = load_checkpoint(DEFAULT)
    for model in (ckpt.model, *(m for _, m in ckpt.members)):
        assert list(model.untrained_inputs) == NEVER_IN_THE_LAB
        layer, names = input_layers(model)["ready"]
        assert torch.count_nonzero(layer.weight[:, list(names).index("retry")]) == 0
    placer = GNNPlacer.from_checkpoint(DEFAULT)
    for seed in range(4):
        request, graphs = big_request(200, 16, seed=seed)
        fresh = _decide(placer, request, graphs)
        assert _decide(placer, _retried(request), graphs) == fresh
        assert _decide(placer, _retried(request, which=seed), graphs) == fresh


def test_cutting_changes_nothing_where_the_inputs_were_as_in_training(tmp_path: Path) -> None:
    """A model whose retry weights are random (as a checkpoint without the record, trained from
    scratch, has them): the same decisions once cut on fresh tasks, the fresh ones on retried."""
    torch.manual_seed(7)
    model = PlacementGNN(ModelConfig(hidden=16, layers=1))
    with torch.no_grad():  # "training" moved every column but the five
        for name, (layer, names) in input_layers(model).items():
            keep = [j for j, n in enumerate(names) if f"{name}.{n}" not in NEVER_IN_THE_LAB]
            layer.weight[:, keep] += 0.1
    assert untrained_at_init(model, 7) == NEVER_IN_THE_LAB
    uncut = GNNPlacer(copy.deepcopy(model), seed=0)
    request, graphs = big_request(60, 8, seed=1)
    before = _decide(uncut, request, graphs)
    assert any(_decide(uncut, _retried(request, which=k), graphs) != before for k in range(8)), "the bug"
    save_checkpoint(model, tmp_path / "ck", training={"seed": 7})
    cut = GNNPlacer.from_checkpoint(tmp_path / "ck")
    assert list(cut.model.untrained_inputs) == NEVER_IN_THE_LAB, "found from the seed's initialisation"
    assert _decide(cut, request, graphs) == before
    assert all(_decide(cut, _retried(request, which=k), graphs) == before for k in range(8))


def test_the_record_decides_and_a_fine_tuned_model_is_not_guessed_at(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = PlacementGNN(ModelConfig(hidden=8, layers=1))
    assert untrained_inputs_of(model, {"untrained_inputs": ["ready.retry"]}) == ["ready.retry"]
    assert untrained_inputs_of(model, {"seed": 3, "init": "some/checkpoint"}) == [], "not from the seed's init"
    assert untrained_inputs_of(model, {"seed": 3, "finetune": {}}) == []
    assert len(untrained_inputs_of(model, {"seed": 3})) == sum(len(n) for _, n in input_layers(model).values())
    assert untrained_inputs_of(model, None) == []
    with pytest.raises(CheckpointError, match="must be a list of column names, got 'ready.retry'"):
        untrained_inputs_of(model, {"untrained_inputs": "ready.retry"})
    with pytest.raises(CheckpointError, match=r"does not read: \['ready.nope'\]"):
        cut_inputs(model, ["ready.nope"])
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.ready_in.weight[:, 0] += 1.0
    assert "ready.run_done_frac" not in unchanged_inputs(other, model)
