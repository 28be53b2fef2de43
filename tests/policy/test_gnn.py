"""The GNN placer on hand-made requests (policy/gnn.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gnn_helpers import big_request, diamond_request

from policy.checkpoint import save_checkpoint
from policy.features import featurize
from policy.gnn import GNNPlacer, attribute
from policy.model import ModelConfig, PlacementGNN, collate
from policy.placement import Placer


def _placer(**kw: object) -> GNNPlacer:
    torch.manual_seed(0)
    return GNNPlacer(PlacementGNN(ModelConfig()), **kw)  # type: ignore[arg-type]


def test_is_a_placer_with_one_decision_per_ready_task() -> None:
    placer = _placer()
    assert isinstance(placer, Placer)
    req, graphs = diamond_request()
    decisions = placer.place(req, graphs)
    assert sorted(d.task_id for d in decisions) == ["b", "c"]
    by_task = {d.task_id: d for d in decisions}
    assert by_task["c"].pool == "gpu"  # the only pool that fits a GPU task
    assert by_task["c"].vm_class == "gpu-a10"
    for d in decisions:
        assert d.reason.startswith(d.pool)
        assert 0.0 < d.score <= 1.0


def test_decoded_features_equal_teacher_forced_features() -> None:
    """What the placer saw while decoding is what featurize(assigned=choices) rebuilds, so
    training on recorded decisions sees the same inputs."""
    placer = _placer()
    req, graphs = big_request(60, 12)
    dec = placer.decode(req, graphs)
    forced = featurize(req, graphs, assigned=dec.actions.tolist())
    np.testing.assert_array_equal(dec.batch.pair_x, forced.pair_x)
    logits, _ = placer.model(collate([forced]))
    lp = torch.log_softmax(logits, -1).gather(1, torch.from_numpy(dec.actions)[:, None])[:, 0]
    np.testing.assert_allclose(lp.detach().numpy(), dec.logp, rtol=1e-4, atol=1e-4)
    assert (dec.actions == logits.argmax(1).numpy()).all()


def test_sampling_is_seeded() -> None:
    req, graphs = big_request(60, 12)
    a = _placer(temperature=1.0, seed=7).decode(req, graphs).actions
    b = _placer(temperature=1.0, seed=7).decode(req, graphs).actions
    assert (a == b).all()


def test_from_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_checkpoint(PlacementGNN(ModelConfig(hidden=16)), tmp_path)
    placer = GNNPlacer.from_checkpoint(tmp_path, device="cpu")
    assert placer.name == "drl" and placer.version.startswith("gnn-")
    req, graphs = diamond_request()
    assert len(placer.place(req, graphs)) == 2


def test_attribution_covers_the_run() -> None:
    placer = _placer()
    req, graphs = diamond_request()
    dec = placer.decode(req, graphs)
    att = attribute(placer.model, dec, row=0)
    assert att.nodes is not None and att.nodes.shape == (4,)
    assert att.chosen == int(dec.actions[0])
    assert set(att.pair) and att.task_features
    # the margin decomposes (ReLU network, no bias terms in the pair part): finite, same sign
    assert np.isfinite(att.margin)


def test_bad_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        _placer(temperature=-1.0)
