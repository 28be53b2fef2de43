"""An ensemble as one wider network (policy.model.fuse_models) and the placer that runs it."""

from __future__ import annotations

import pytest
import torch
from gnn_helpers import GPU_CATALOGUE, big_request, mixed_requests
from test_gnn import _same

import policy.gnn as gnn_mod
from policy.catalogue import load_catalogue
from policy.features import featurize
from policy.gnn import GNNPlacer
from policy.model import ModelConfig, PlacementGNN, collate, fuse_models


def _members() -> list[PlacementGNN]:
    """Three unlike members: widths 32 / 16 / 8, 3 / 2 / 0 rounds, a row bias on one, feature
    schemas 4 / 6 / 3 (an older one reads fewer ready columns)."""
    torch.manual_seed(11)
    a = PlacementGNN(ModelConfig(hidden=32, layers=3), schema_version=4)
    b = PlacementGNN(ModelConfig(hidden=16, layers=2, row_bias=True))
    c = PlacementGNN(ModelConfig(hidden=8, layers=0), schema_version=3)
    with torch.no_grad():
        b.row_k.fill_(-2.5)
    return [a, b, c]


def _requests() -> list:
    items = [(r, g) for r, g in mixed_requests() if r.ready]
    return items + [big_request(n, ready=16, seed=s) for s, n in enumerate((60, 300))]


def _stop(model: PlacementGNN, fb) -> torch.Tensor:  # type: ignore[no-untyped-def]
    bt = collate([fb])
    h, s = model.encode_graph(bt.x, bt.edge_index, bt.node_run, bt.num_runs)
    a = model.task_part(h[bt.ready_node], s[bt.ready_run], bt.ready_x)
    _, g = model.encode_pools(bt.pool_x)
    return model.stop_logits(a.mean(dim=0, keepdim=True), g)


def test_a_fused_model_scores_as_the_mean_of_its_members() -> None:
    """Pair logits, masks, value and the stop logit of the fused model are the members' mean (to
    float32 rounding), members of unlike width, depth, row bias and feature schema alike."""
    members = _members()
    fused = fuse_models(members)
    assert fused.config == ModelConfig(hidden=56, layers=3, row_bias=True)
    with torch.no_grad():
        assert float(fused.row_k) == pytest.approx(-2.5 / 3)
        for req, graphs in _requests():
            fb = featurize(req, graphs)
            bt = collate([fb])
            logits, value = fused(bt)
            each = [m(bt) for m in members]
            assert torch.allclose(logits, torch.stack([x for x, _ in each]).mean(dim=0), atol=1e-5, rtol=1e-5)
            assert torch.allclose(value, torch.stack([v for _, v in each]).mean(dim=0), atol=1e-5, rtol=1e-5)
            assert torch.allclose(_stop(fused, fb), torch.stack([_stop(m, fb) for m in members]).mean(dim=0),
                                  atol=1e-5, rtol=1e-5)


def test_one_model_fused_is_that_model() -> None:
    """``fuse_models([m])`` has ``m``'s weights, bit for bit."""
    model = _members()[1]
    fused = fuse_models([model])
    assert fused.config == model.config and fused.schema_version == model.schema_version
    mine, theirs = fused.state_dict(), model.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(ValueError, match="no models"):
        fuse_models([])


def test_an_ensemble_encodes_a_run_once_not_once_a_member(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold request to a two-member ensemble runs one graph encoding (of the fused model),
    where each member ran its own (the default checkpoint's forward took twice one member's)."""
    members = _members()
    placer = GNNPlacer(members[0]).with_members([("b", members[1]), ("c", members[2])])
    calls: list[int] = []
    real = PlacementGNN.encode_graph

    def counted(self: PlacementGNN, *args: object) -> object:
        calls.append(self.config.hidden)
        return real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(PlacementGNN, "encode_graph", counted)
    req, graphs = big_request(200, ready=16, seed=3)
    assert placer.place(req, graphs)
    assert calls == [56]


def test_an_ensemble_decides_alike_whatever_it_placed_before() -> None:
    """``with_members`` on a placer that has placed alone, or ``clear_cache`` after a member's
    weights changed: the decisions are a fresh ensemble's (the embeddings cached alone were the
    first model's only; a changed member is fused again)."""
    members = _members()
    items = _requests()
    used = GNNPlacer(members[0])
    for req, graphs in items:
        used.place(req, graphs)
    used.with_members([("b", members[1])])
    fresh = GNNPlacer(members[0]).with_members([("b", members[1])])
    _same([used.place(r, g) for r, g in items], [fresh.place(r, g) for r, g in items])
    with torch.no_grad():
        for p in members[1].parameters():
            p.mul_(-1.5)
    used.clear_cache()
    changed = GNNPlacer(members[0]).with_members([("b", members[1])])
    _same([used.place(r, g) for r, g in items], [changed.place(r, g) for r, g in items])
    assert [fresh.place(r, g) for r, g in items] != [changed.place(r, g) for r, g in items]


def _pair() -> tuple[PlacementGNN, PlacementGNN]:
    torch.manual_seed(3)
    return PlacementGNN(ModelConfig(hidden=16, layers=2)), PlacementGNN(ModelConfig(hidden=8, layers=1))


def test_fusing_an_ensemble_leaves_the_global_torch_rng_alone() -> None:
    """``fuse_models`` builds its result with ``PlacementGNN(...)``, whose default initialisation
    draws from torch's global generator, only to overwrite every weight with ``load_state_dict``.
    So ``GNNPlacer.with_members`` and every ``clear_cache()`` of an ensemble now move the caller's
    seeded torch RNG stream (the old code built no model there and drew nothing). The codebase keeps
    the global RNG as it was elsewhere (``policy.inputs.untrained_at_init`` uses ``fork_rng``).
    Found by reading fuse_models and checking: seed, fuse, draw gives another draw than seed, draw.
    Fix: build the fused model under ``torch.random.fork_rng(devices=[])`` (or on the meta device
    and ``load_state_dict(..., assign=True)``), so nothing random is drawn."""
    a, b = _pair()
    torch.manual_seed(5)
    want = torch.rand(4)

    torch.manual_seed(5)
    fuse_models([a, b])
    assert torch.equal(torch.rand(4), want), "fuse_models drew from the global torch RNG"

    placer = GNNPlacer(a, step_kernel="numpy")
    torch.manual_seed(5)
    placer.with_members([("b", b)])
    assert torch.equal(torch.rand(4), want), "with_members drew from the global torch RNG"

    torch.manual_seed(5)
    placer.clear_cache()
    assert torch.equal(torch.rand(4), want), "clear_cache drew from the global torch RNG"


def test_bench_cold_place_times_the_first_request_not_a_refusion(monkeypatch: pytest.MonkeyPatch) -> None:
    """``policy.bench_model``'s ``place_cold_ms`` is documented as ``place`` "with the embedding cache
    cleared (first request of a run)", and it clears it with ``placer.clear_cache()``. Since the
    change, ``clear_cache`` of an ensemble also rebuilds the fused model (``fuse_models``: a new
    ``sum(H)`` model, block-diagonal copies, ``numpy_weights``), which a server never does for a new
    run. Measured on the packaged default (two 32-wide members, 200 tasks, 16 ready, 2 threads):
    place_cold_ms 12.2 ms, 3.9 ms with only the two caches cleared, so the figure is ~3x what a
    first request costs. Found by reading bench_model's ``cold()`` against the new clear_cache
    and timing both; asserted here by counting fuse_models calls during one bench row.
    Fix: let ``cold()`` forget the run's embeddings and pool parts only (e.g. a
    ``GNNPlacer.forget_embeddings()`` that clears ``_embed`` / ``_pools``), keeping
    ``clear_cache`` (refuse) for changed weights."""
    from policy.bench_model import _bench_one

    a, b = _pair()
    placer = GNNPlacer(a, step_kernel="numpy").with_members([("b", b)])
    calls: list[int] = []
    real = gnn_mod.fuse_models

    def counted(models: list[PlacementGNN]) -> PlacementGNN:
        calls.append(len(models))
        return real(models)

    monkeypatch.setattr(gnn_mod, "fuse_models", counted)
    pools = load_catalogue(GPU_CATALOGUE).states()
    row = _bench_one(placer, pools, 40, 4, 3)
    assert float(row["place_cold_ms"]) > 0  # type: ignore[arg-type]
    assert calls == [], f"the cold figure re-fused the ensemble {len(calls)} time(s): it times fuse_models too"
