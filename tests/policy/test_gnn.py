"""The GNN placer on hand-made requests (policy/gnn.py)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gnn_helpers import GPU_CATALOGUE, ROOT, big_request, diamond_request, mixed_requests

from policy import step_kernel
from policy.arbiter import BatchPlacer
from policy.catalogue import load_catalogue
from policy.checkpoint import load_checkpoint, save_checkpoint
from policy.errors import CheckpointError
from policy.features import featurize
from policy.gnn import GNNPlacer, attribute, step_kernel_choice
from policy.model import (
    ROW_BIAS_COLUMN,
    ROW_BIAS_MAX,
    TIE_TOLERANCE,
    ModelConfig,
    PlacementGNN,
    collate,
    collate_steps,
)
from policy.placement import Placer
from policy.schema import Decision, PlacementRequest, ReadyTask, RunGraph, TaskNode


def _placer(row_bias: bool = False, **kw: object) -> GNNPlacer:
    """An untrained placer; with ``row_bias`` a model whose row bias prefers the run with the
    least work left (``k = -2`` per unit of ``run_work_left_ratio``)."""
    torch.manual_seed(0)
    model = PlacementGNN(ModelConfig(row_bias=row_bias))
    if row_bias:
        with torch.no_grad():
            model.row_k.fill_(-2.0)
    return GNNPlacer(model, **kw)  # type: ignore[arg-type]


def _make(checkpoint: str | None, **kw: object) -> GNNPlacer:
    """A packaged checkpoint's placer, an untrained one (None) or one with a row bias ("row")."""
    if checkpoint in (None, "row"):
        return _placer(row_bias=checkpoint == "row", **kw)
    return GNNPlacer.from_checkpoint(ROOT / "policy" / "checkpoints" / checkpoint, **kw)  # type: ignore[arg-type]


def test_is_a_placer() -> None:
    placer = _placer(allow_wait=False)
    assert isinstance(placer, Placer)
    req, graphs = diamond_request()
    decisions = placer.place(req, graphs)
    assert sorted(d.task_id for d in decisions) == ["b", "c"]  # no stop allowed: all placed
    by_task = {d.task_id: d for d in decisions}
    assert by_task["c"].pool == "gpu"  # the only pool that fits a GPU task
    assert by_task["c"].vm_class == "gpu-a10"
    for d in decisions:
        assert d.reason.startswith(d.pool)
        assert 0.0 < d.score <= 1.0


def test_never_stops_while_nothing_runs() -> None:
    """With every pool idle the first step may not stop (the batch must make progress)."""
    placer = _placer(temperature=5.0, seed=3)
    req, graphs = diamond_request()
    for _ in range(20):
        dec = placer.decode(req, graphs)
        assert dec.steps[0].action is not None and not dec.steps[0].stop_ok


@pytest.mark.parametrize(("reserve_busy", "premium", "row_bias"),
                         [(False, 0.0, False), (True, 0.0, False), (True, 3.0, False), (True, 0.0, True)])
def test_recorded_steps_score_the_same_in_training(reserve_busy: bool, premium: float, row_bias: bool) -> None:
    """step_forward over the decoded steps gives back the decoder's log-probability, so
    training on recorded decisions sees exactly what the placer saw (with ``reserve_busy``, the
    busy pools it blocks are left out of training's choices too, with premium pools not
    counted when ``premium_ratio`` is set)."""
    from dataclasses import replace

    from policy.model import step_entries

    placer = _placer(row_bias, temperature=1.0, seed=1, reserve_busy=reserve_busy, premium_ratio=premium)
    left_out = 0
    for req, graphs in [big_request(60, 12), _cpu_busy_gpu_free(120, 24, 4),
                        *[(r, g) for r, g in mixed_requests() if r.ready]]:
        dec = placer.decode(req, graphs)
        logp = placer.model.step_forward(collate_steps([(dec.batch, dec.steps)])).logp
        assert float(logp.sum().detach()) == pytest.approx(dec.logp, rel=1e-4, abs=1e-4)
        placed = [st.action[0] for st in dec.steps if st.action is not None]
        assert [r for r in placed if dec.actions[r] >= 0] == dec.placed_order
        assert sorted(dec.placed_order) == sorted(np.nonzero(dec.actions >= 0)[0].tolist())
        if not reserve_busy:
            assert placed == dec.placed_order
        left_out += sum(len(step_entries(dec.batch, replace(st, late=False))[0]) - len(step_entries(dec.batch, st)[0])
                        for st in dec.steps)
    assert (left_out > 0) == reserve_busy


@pytest.mark.parametrize("row_bias", [False, True])
def test_first_step_logits_match_one_shot_forward(row_bias: bool) -> None:
    placer = _placer(row_bias, allow_wait=False)
    for req, graphs in [big_request(60, 12), *[(r, g) for r, g in mixed_requests() if len(r.runs) > 1]]:
        dec = placer.decode(req, graphs)
        first = dec.steps[0]
        fb = featurize(req, graphs)  # nothing placed yet: the first step's features
        logits, _ = placer.model(collate([fb]))
        r, p = first.action  # type: ignore[misc]
        assert logits.max().item() == pytest.approx(logits[r, p].item(), rel=1e-5)


def test_the_row_bias_orders_runs_by_work_left_and_folds_exactly() -> None:
    """A row bias (``ModelConfig.row_bias``) adds ``k * run_work_left_ratio`` to every pool of a
    row: the one-shot logits move by exactly that, the pools' order within a row does not, and
    the decoders, which read it as one more hidden unit of the head, give the same first step;
    with ``k`` strongly negative the first task sent is of the run with the least work left."""
    req, graphs = next((r, g) for r, g in mixed_requests() if len(r.runs) > 1)
    fb = featurize(req, graphs)
    ratio = fb.ready_x[:, ROW_BIAS_COLUMN]
    assert ratio.min() == 0 and ratio.max() > 0.5  # the runs differ in work left
    with_bias = _placer(True, allow_wait=False)
    plain = GNNPlacer(PlacementGNN(ModelConfig()), allow_wait=False)
    plain.model.load_state_dict({k: v for k, v in with_bias.model.state_dict().items() if k != "row_k"})
    bt = collate([fb])
    k = -2.0
    with torch.no_grad():
        shift = with_bias.model(bt)[0] - plain.model(bt)[0]
    keep = bt.mask | ~bt.mask.any(dim=1, keepdim=True)
    np.testing.assert_allclose(shift[keep].numpy(), np.broadcast_to(k * ratio[:, None], keep.shape)[keep.numpy()],
                               atol=1e-5)
    with torch.no_grad():
        with_bias.model.row_k.fill_(-300.0)  # clamped to -256: a strong preference for SRPT's run
    with_bias.clear_cache()
    first = with_bias._decode_features(with_bias.features(req, graphs), 0.0).placed_order[0]
    assert ratio[first] == 0
    with torch.no_grad():
        with_bias.model.row_k.fill_(20.0)  # and the other way round
    with_bias.clear_cache()
    assert ratio[with_bias._decode_features(with_bias.features(req, graphs), 0.0).placed_order[0]] > 0


def test_the_row_bias_folds_without_an_offset_up_to_its_largest_weight() -> None:
    """The decoders' head (:meth:`PlacementGNN.head_weights` over ``task_side`` / ``pool_side``)
    gives the one-shot logits with the row bias at its largest weight, -256, to float32
    rounding: the rows of the run with the least work left to 1e-5, as without a bias, and the
    others within :data:`TIE_TOLERANCE` though their bias is hundreds (before d8879c7, 2026-12-07, the unit
    was ``relu(128 + k * ratio)``, which capped ``k`` at 32: every row's logit passed through
    128, and an offset large enough for 256 rounded past the tolerance)."""
    req, graphs = next((r, g) for r, g in mixed_requests() if len(r.runs) > 1)
    fb = featurize(req, graphs)
    bt = collate([fb])
    ratio = bt.ready_x[:, ROW_BIAS_COLUMN]
    model = _placer(True, allow_wait=False).model.with_row_bias(-ROW_BIAS_MAX).eval()
    assert ROW_BIAS_MAX == 256
    with torch.no_grad():
        logits = model(bt)[0]
        h, summary = model.encode_graph(bt.x, bt.edge_index, bt.node_run, bt.num_runs)
        q, g = model.encode_pools(bt.pool_x)
        a = model.task_side(h[bt.ready_node], summary[bt.ready_run], bt.ready_x)
        b, _ = model.pool_side(q, g)
        w = model.head_weights()
        z = torch.relu(a.unsqueeze(1) + b[bt.ready_sample] + bt.pair_x @ w["c_t"])
        folded = z @ w["w"] + w["b"]
    keep = bt.mask.numpy()
    least = (ratio == 0).numpy()[:, None] & keep
    assert least.any() and (keep & ~least).any()
    assert float(logits.numpy()[keep & ~least].min()) < -100  # the bias is large where it applies
    np.testing.assert_allclose(folded.numpy()[least], logits.numpy()[least], atol=1e-5)
    np.testing.assert_allclose(folded.numpy()[keep], logits.numpy()[keep], atol=TIE_TOLERANCE)


def test_a_row_bias_needs_the_srpt_key_s_column() -> None:
    with pytest.raises(CheckpointError, match="run_work_left_ratio"):
        PlacementGNN(ModelConfig(row_bias=True), schema_version=3)


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
    assert 1 <= len(placer.place(req, graphs)) <= 2


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


@pytest.mark.parametrize("temperature", [0.25, 0.5, 3.0])
def test_training_scores_a_sampled_step_under_the_temperature_it_was_sampled_at(temperature: float) -> None:
    """PPO's log p_old and log p are the sampling distribution's (found by review: scored at
    temperature 1 whatever ``--rl-temperature`` sampled at, so the ratio weighted the samples of
    one distribution by another's probabilities). One ready task, nothing busy: the step's choices
    are its pools (stop refused), and its tempered log-probability follows from the decoder's own
    temperature-1 softmax ``probs``."""
    from trainer.rl import old_log_probs

    placer = _placer(temperature=temperature, seed=4)
    req, graphs = diamond_request()
    req = replace(req, ready=req.ready[:1])
    for _ in range(6):
        dec = placer.decode(req, graphs)
        assert len(dec.steps) == 1 and dec.steps[0].action is not None and not dec.steps[0].stop_ok
        row, pool = dec.steps[0].action[:2]
        p1 = dec.probs[row]
        allowed = p1 > 0
        tempered = np.log(p1[allowed]) / temperature
        expect = float(tempered[np.flatnonzero(allowed).tolist().index(pool)] - np.logaddexp.reduce(tempered))
        sample = (dec.batch, dec.steps)
        got = float(placer.model.step_forward(collate_steps([sample]), temperature).logp[0].detach())
        assert got == pytest.approx(expect, abs=1e-4)
        assert float(old_log_probs(placer.model, [sample], 8, temperature)[0][0]) == pytest.approx(expect, abs=1e-4)
        assert float(placer.model.step_forward(collate_steps([sample])).logp[0].detach()) == pytest.approx(
            float(np.log(p1[pool])), abs=1e-4)
    assert int(allowed.sum()) > 1  # a choice to score


def test_step_forward_refuses_a_temperature_that_is_not_positive() -> None:
    req, graphs = diamond_request()
    placer = _placer(temperature=1.0, seed=0)
    dec = placer.decode(req, graphs)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            placer.model.step_forward(collate_steps([(dec.batch, dec.steps)]), bad)


def _same(a: list[list[Decision]], b: list[list[Decision]]) -> None:
    """Same decisions in the same dispatch order with the same reasons; scores to float32 rounding."""
    assert [[(d.run_key, d.task_id, d.pool, d.vm_class, d.reason) for d in x] for x in a] == \
        [[(d.run_key, d.task_id, d.pool, d.vm_class, d.reason) for d in x] for x in b]
    assert [d.score for x in a for d in x] == pytest.approx([d.score for x in b for d in x], abs=1e-5)


#: the identity tests also run on a GPU where there is one (on a GPU host: python3 -m pytest
#: tests/policy/test_gnn.py -k place_many); CI has none
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["numpy", "torch"] + (["compiled"] if step_kernel.AVAILABLE else []))
@pytest.mark.parametrize("checkpoint", [None, "default", "row"])
@pytest.mark.parametrize(("allow_wait", "reserve_busy", "premium", "gate"),
                         [(True, False, 0.0, 0.0), (False, False, 0.0, 0.0), (True, True, 0.0, 0.0),
                          (True, True, 3.0, 0.0), (True, True, 3.0, 3.0)])
def test_place_many_decides_as_place(checkpoint: str | None, allow_wait: bool, reserve_busy: bool, premium: float,
                                     gate: float, backend: str, device: str) -> None:
    """The batched decoder gives each request of a micro-batch exactly place()'s decisions:
    requests of 4 to 1,000 tasks with 0 to 64 ready rows, holds (stop), pinned tasks, a task
    no pool can hold, a pool down, a request with fewer pools, two runs in one request, and
    (``reserve_busy``) tasks that reserve a busy pool instead of being sent, with guards that
    leave out premium pools (``premium_ratio``) or not, and with premium pools masked off the
    critical path (``cp_gate``). Its steps
    run on numpy arrays on the host (small batches), on torch tensors on the model's device, or
    request by request in the compiled steps (where numba is installed, the default): all are
    checked here, on the CPU and, where there is one, on a GPU (the model's parts
    computed there, the numpy steps after one download)."""
    def make() -> GNNPlacer:
        return _make(checkpoint, allow_wait=allow_wait, reserve_busy=reserve_busy, premium_ratio=premium, cp_gate=gate,
                     device=device)

    items = mixed_requests() + ([_cpu_busy_gpu_free(120, 24, 4)] if premium else [])
    requests, graphs = [r for r, _ in items], [g for _, g in items]
    one = make()
    single = [one.place(r, g) for r, g in items]
    many = make()
    many.batch_backend = backend
    assert isinstance(many, BatchPlacer)
    _same(many.place_many(requests, graphs), single)  # every run encoded in one forward
    _same(many.place_many(requests[::-1], graphs[::-1]), single[::-1])  # embeddings from the cache
    held = [len(r.ready) - len(d) for r, d in zip(requests, single, strict=True)]
    if allow_wait:
        assert any(0 < h < len(r.ready) for h, r in zip(held, requests, strict=True))  # stop mid-batch
    else:
        assert not any(held)
    assert any(not r.ready for r in requests)


@pytest.mark.skipif(not step_kernel.AVAILABLE, reason="numba is not installed (the policy extra installs it)")
@pytest.mark.parametrize("checkpoint", [None, "default", "row"])
@pytest.mark.parametrize(("allow_wait", "reserve_busy", "hold_ratio", "premium", "gate"),
                         [(True, False, math.inf, 0.0, 0.0), (False, False, math.inf, 0.0, 0.0),
                          (True, True, math.inf, 0.0, 0.0), (True, True, 1.0, 0.0, 0.0), (True, True, math.inf, 3.0, 0.0),
                          (True, False, math.inf, 3.0, 0.0), (True, True, math.inf, 3.0, 3.0)])
def test_compiled_steps_decide_as_numpy_steps(checkpoint: str | None, allow_wait: bool, reserve_busy: bool,
                                              hold_ratio: float, premium: float, gate: float) -> None:
    """The compiled one-request steps (policy/step_kernel.py) give the numpy steps' decisions,
    dispatch order, reasons and evidence (probabilities, pair features, contributions) on the
    mixed requests and on 60 random ones (1-40 ready rows of 30-400-task runs on busy and idle
    clusters); the float32 sums may round differently in the last bits, nothing more."""
    def make(kernel: str) -> GNNPlacer:
        return _make(checkpoint, allow_wait=allow_wait, reserve_busy=reserve_busy, hold_ratio=hold_ratio,
                     premium_ratio=premium, cp_gate=gate, step_kernel=kernel)

    fast, slow = make("compiled"), make("numpy")
    assert (fast.step_kernel, slow.step_kernel) == ("compiled", "numpy")
    rng = np.random.default_rng(3)
    items = mixed_requests()
    for s, (n, r) in enumerate(rng.integers([30, 1], [400, 41], (60, 2))):
        req, graphs = big_request(int(n), ready=int(r), seed=s)
        if s % 2:  # busy pools with a ledger's finish times, the first able to grow
            pools = tuple(replace(p, busy=p.slots, queued=int(rng.integers(0, 4)), boot_s=30.0,
                                  free_at=tuple(np.sort(rng.random(p.slots + 3) * 200.0).tolist()),
                                  max_slots=p.slots + 1 if j == 0 else None) for j, p in enumerate(req.pools))
            req = replace(req, pools=pools)
        items.append((req, graphs))
    held = placed = 0
    for req, graphs in items:
        a = fast._decode_features(featurize(req, graphs, pairs=False, cp_gate=gate), 0.0)
        b = slow._decode_features(featurize(req, graphs, pairs=False, cp_gate=gate), 0.0)
        assert a.actions.tolist() == b.actions.tolist() and a.placed_order == b.placed_order
        np.testing.assert_allclose(a.probs, b.probs, atol=1e-5)
        np.testing.assert_allclose(a.pair_contrib, b.pair_contrib, atol=1e-4)
        np.testing.assert_array_equal(a.batch.mask, b.batch.mask)
        np.testing.assert_allclose(a.batch.pair_x, b.batch.pair_x, atol=1e-6)
        _same([fast._decisions(a, a.placed_order)], [slow._decisions(b, b.placed_order)])
        held += int((a.actions < 0).sum())
        placed += len(a.placed_order)
    assert placed > 300
    if allow_wait:
        assert held  # stops happened: the held rows' evidence was compared too


def test_step_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` takes the compiled steps where numba is installed and the numpy ones where it is
    not; asking for ``compiled`` without numba, or for an unknown kernel, is a clear error."""
    assert step_kernel_choice("numpy") == "numpy"
    assert step_kernel_choice("auto") == ("compiled" if step_kernel.AVAILABLE else "numpy")
    with pytest.raises(ValueError, match="one of"):
        step_kernel_choice("fast")
    monkeypatch.setattr(step_kernel, "AVAILABLE", False)
    assert step_kernel_choice("auto") == "numpy"
    assert _placer().step_kernel == "numpy"
    with pytest.raises(ValueError, match="needs numba"):
        step_kernel_choice("compiled")


def test_place_many_on_one_request_and_with_sampling() -> None:
    """A lone request, and sampling at temperature > 0, take place()'s path: same draws."""
    items = mixed_requests()
    requests, graphs = [r for r, _ in items], [g for _, g in items]
    assert _placer().place_many(requests[2:3], graphs[2:3]) == [_placer().place(*items[2])]
    a = _placer(temperature=1.0, seed=5)
    b = _placer(temperature=1.0, seed=5)
    assert a.place_many(requests, graphs) == [b.place(r, g) for r, g in items]
    with pytest.raises(ValueError, match="graph maps"):
        a.place_many(requests, graphs[:-1])


@pytest.mark.parametrize("hold_ratio", [1.0, 2.0, math.inf])
@pytest.mark.parametrize("batched", [False, True])
def test_never_holds_a_task_that_a_free_pool_could_start(batched: bool, hold_ratio: float) -> None:
    """Stop is refused while a remaining task could start now on a free feasible pool finishing
    within ``hold_ratio`` x its earliest (1: its best pool; inf, the default: any): on a cluster
    with free slots everywhere, sampling at a high temperature (stop is often drawn when allowed)
    still places tasks until no such task remains, and every recorded stop step was allowed. The
    same guard holds in the batched decoder (greedy)."""
    from policy.features import pair_dynamic, pair_rows, pool_free_within

    req, graphs = big_request(200, ready=40, seed=2)
    pools = tuple(type(p)(**{**p.__dict__, "busy": min(1, p.slots)}) for p in req.pools)  # stop not refused for idleness
    req = type(req)(**{**req.__dict__, "pools": pools})
    placer = _placer(temperature=0.0 if batched else 5.0, seed=1, hold_ratio=hold_ratio)
    holds = 0
    for _ in range(1 if batched else 10):
        if batched:
            decisions = placer.place_many([req, req], [graphs, graphs])[0]
            _same([decisions], [placer.place(req, graphs)])
        dec = placer.decode(req, graphs)
        fb = featurize(req, graphs, pairs=False)
        placed = np.zeros(fb.num_pools)
        for d_pool in dec.placed_order:
            placed[dec.actions[d_pool]] += 1
        held = np.nonzero(dec.actions < 0)[0]
        holds += len(held)
        if len(held):
            d = pair_dynamic(fb.pairs, held, placed)
            _, fit = pair_rows(fb.pairs, held, placed)
            assert not pool_free_within(d, fit, hold_ratio)
            if math.isinf(hold_ratio):  # work-conserving: no held task has any free feasible pool
                assert not (fit & (d[..., 3] > 0.5)).any()
        for step in dec.steps:
            if step.action is None:
                assert step.stop_ok
    if hold_ratio == 1.0 and not batched:
        assert holds  # the rule of 1 leaves the sampled stop room to hold here: the test can fail


def _cpu_busy_gpu_free(n: int = 200, ready: int = 16, seed: int = 0) -> tuple[object, dict]:
    """A request whose CPU pools are full (no room to grow, tasks queued) while the GPU pool,
    premium for CPU work at ratio 3 (4.7 x the small pool's price per unit of it), is idle; the
    ready tasks are CPU work (``random_dag`` makes every 7th a GPU task)."""
    req, graphs = big_request(n, ready=ready, seed=seed)
    cpu = tuple(ReadyTask(req.ready[0].run_key, f"t{i}") for i in range(n) if i % 7)[:ready]
    pools = tuple(p if p.name == "gpu" else replace(p, busy=p.slots, queued=1, max_slots=p.slots,
                                                     free_at=tuple(20.0 + 10.0 * k for k in range(p.slots + 1)))
                  for p in req.pools)
    return replace(req, pools=pools, ready=cpu), graphs


@pytest.mark.parametrize("reserve_busy", [False, True])
def test_premium_pools_do_not_count_in_the_guards(reserve_busy: bool) -> None:
    """With ``premium_ratio`` the work-conserving stop and the late-binding rule leave out pools
    priced above that factor x a task's cheapest feasible pool per unit of its work: on a
    cluster whose CPU pools are full and whose GPU is idle, a sampled decoder holds CPU tasks
    (without the ratio it may not while the GPU has a slot), a held task never has a free
    non-premium feasible pool, and (``reserve_busy``) it may reserve a busy CPU pool that
    finishes after the GPU would, which the plain rule blocks; training's choices
    (``step_entries``) are the decoder's in both cases."""
    from policy.features import guard_fit, late_blocked, pair_dynamic, pair_rows
    from policy.model import step_entries

    req, graphs = _cpu_busy_gpu_free()
    fb = featurize(req, graphs, pairs=False)
    gpu = [p.name for p in fb.pools].index("gpu")
    every = np.arange(fb.num_ready)
    fit = pair_rows(fb.pairs, every, np.zeros(fb.num_pools))[1]
    premium = fit & ~guard_fit(fb.pairs, every, fit, 3.0)
    assert premium[:, gpu].all() and not premium[:, :gpu].any()  # the GPU is premium for CPU work
    counts = {}
    for ratio in (0.0, 3.0):
        placer = _placer(temperature=5.0, seed=1, reserve_busy=reserve_busy, premium_ratio=ratio)
        holds = extra = 0
        for _ in range(15):
            dec = placer.decode(req, graphs)
            for st in dec.steps:
                assert st.premium == ratio
                d = pair_dynamic(fb.pairs, st.rows, st.placed)
                f = pair_rows(fb.pairs, st.rows, st.placed)[1]
                g = guard_fit(fb.pairs, st.rows, f, ratio)
                if st.action is None:
                    assert st.stop_ok and not (g & (d[..., 3] > 0.5)).any()  # no free non-premium pool
                    holds += len(st.rows) if d[:, gpu, 3].max() > 0.5 else 0
                if reserve_busy:
                    rows, pools, _ = step_entries(fb, st)
                    at = {int(r): i for i, r in enumerate(st.rows)}
                    idx = [at[int(r)] for r in rows]
                    mask = late_blocked(d, g)
                    if st.action is not None:
                        mask[at[st.action[0]], st.action[1]] = False
                    assert not mask[idx, pools].any()
                    assert len(rows) == int((~mask & (f | ~f.any(axis=1, keepdims=True))).sum())
                    extra += int((late_blocked(d, f)[idx, pools]).sum())  # what the plain rule blocks
        counts[ratio] = (holds, extra)
    assert counts[0.0] == (0, 0)  # the GPU's free slot forbids holding (and reserving behind it)
    assert counts[3.0][0] > 0  # the test can fail: holds while the GPU is free
    if reserve_busy:
        assert counts[3.0][1] > 0


def test_premium_ratio_is_recorded_and_checked(tmp_path: Path) -> None:
    """``training.premium_ratio`` in a manifest sets the placer's guards (0, off, when absent); a
    ratio below 1, infinite or NaN is refused."""
    model = PlacementGNN(ModelConfig(hidden=8, layers=1))
    save_checkpoint(model, tmp_path / "cost", training={"premium_ratio": 3.0, "reserve_busy": 1})
    save_checkpoint(model, tmp_path / "plain", training={})
    assert GNNPlacer.from_checkpoint(tmp_path / "cost").premium_ratio == 3.0
    assert GNNPlacer.from_checkpoint(tmp_path / "cost", premium_ratio=0.0).premium_ratio == 0.0
    assert GNNPlacer.from_checkpoint(tmp_path / "plain").premium_ratio == 0.0
    for bad in (0.5, math.inf, math.nan, -1.0):
        with pytest.raises(ValueError, match="premium_ratio"):
            _placer(premium_ratio=bad)


def test_cp_gate_keeps_premium_pools_for_the_critical_path(tmp_path: Path) -> None:
    """With ``cp_gate`` a sampled decoder never sends a task off its run's critical path to a
    premium pool (the GPU for CPU work, on a cluster whose CPU pools are full and the GPU idle):
    they wait for the CPU pools instead, and the reasons of the ones sent say what was gated.
    Without the gate it does send them there (the test can fail).
    ``training.cp_gate`` in a manifest sets it (0, off, when absent); a bad gate is refused."""
    from policy.graph import view

    req, graphs = _cpu_busy_gpu_free(120, 24, 2)
    g = view(graphs[req.ready[0].run_key])
    crit = max(g.rank[g.index[r.task_id]] for r in req.ready)
    off_cp = {r.task_id for r in req.ready if g.rank[g.index[r.task_id]] < crit}
    sent: dict[float, int] = {}
    said: dict[float, int] = {}
    for gate in (0.0, 3.0):
        placer = _placer(temperature=3.0, seed=2, reserve_busy=True, cp_gate=gate)
        sent[gate] = said[gate] = 0
        for _ in range(10):
            for d in placer.place(req, graphs):
                sent[gate] += d.pool == "gpu" and d.task_id in off_cp
                assert "gated" not in d.reason or gate > 0 and d.task_id in off_cp
    assert sent[0.0] > 0 and sent[3.0] == 0
    # the gate for every task: the critical-path tasks no longer take the GPU either
    for scope, most in (("off-cp", None), ("all", 0)):
        placer = _placer(temperature=3.0, seed=2, reserve_busy=True, cp_gate=3.0, cp_gate_scope=scope)
        on_gpu = sum(d.pool == "gpu" and d.task_id not in off_cp for _ in range(10) for d in placer.place(req, graphs))
        assert on_gpu > 0 if most is None else on_gpu == most
    idle = replace(req, pools=big_request()[0].pools)  # every pool free: the off-path tasks are sent
    for gate in (0.0, 3.0):
        placer = _placer(temperature=3.0, seed=2, reserve_busy=True, cp_gate=gate)
        said[gate] = sum("premium gpu gated (cp_gate 3)" in d.reason for d in placer.place(idle, graphs))
    assert said[0.0] == 0 and said[3.0] > 0  # the reason says what the gate took out
    every = _placer(temperature=3.0, seed=2, reserve_busy=True, cp_gate=3.0, cp_gate_scope="all").place(idle, graphs)
    assert sum("every task: premium gpu gated (cp_gate 3)" in d.reason for d in every) >= said[3.0]
    assert not any("off the critical path" in d.reason for d in every)
    model = PlacementGNN(ModelConfig(hidden=8, layers=1))
    save_checkpoint(model, tmp_path / "gated", training={"cp_gate": 3.0})
    save_checkpoint(model, tmp_path / "plain", training={})
    assert GNNPlacer.from_checkpoint(tmp_path / "gated").cp_gate == 3.0
    assert GNNPlacer.from_checkpoint(tmp_path / "gated", cp_gate=0.0).cp_gate == 0.0
    assert GNNPlacer.from_checkpoint(tmp_path / "plain").cp_gate == 0.0
    save_checkpoint(model, tmp_path / "every", training={"cp_gate": 3.0, "cp_gate_scope": "all"})
    assert GNNPlacer.from_checkpoint(tmp_path / "every").cp_gate_scope == "all"
    assert GNNPlacer.from_checkpoint(tmp_path / "gated").cp_gate_scope == "off-cp"
    for bad in (0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="cp_gate"):
            _placer(cp_gate=bad)
    with pytest.raises(ValueError, match="cp_gate_scope"):
        _placer(cp_gate=3.0, cp_gate_scope="critical")


@pytest.mark.parametrize("allow_wait", [True, False])
def test_a_task_given_a_busy_pool_reserves_its_slot_and_waits(allow_wait: bool) -> None:
    """With ``reserve_busy`` a step that gives a task a pool with no free slot (and no room to
    grow) sends nothing: the task holds that slot for the rest of the batch (later steps see the
    backlog) and stays ready, as ``srpt+eft`` reserves its ledger's slot. Every other choice is
    sent, in step order. A busy pool is chosen only where it finishes before every free feasible
    pool of the task (``late_blocked``), and training sees the same choices (``step_entries``).
    Without it every chosen task is sent, busy pools included."""
    from policy.features import late_blocked, pair_dynamic, pair_rows
    from policy.model import step_entries

    reserved = sent_busy = blocked = 0
    for req, graphs in mixed_requests():
        if not req.ready:
            continue
        late = _placer(allow_wait=allow_wait, reserve_busy=True).decode(req, graphs)
        fb = featurize(req, graphs, pairs=False)
        expect = []
        for st in late.steps:
            assert st.late
            d = pair_dynamic(fb.pairs, st.rows, st.placed)
            mask = late_blocked(d, pair_rows(fb.pairs, st.rows, st.placed)[1])
            blocked += int(mask.sum())
            rows, pools, _ = step_entries(fb, st)
            at = {int(r): i for i, r in enumerate(st.rows)}
            assert not mask[[at[int(r)] for r in rows], pools].any()  # training's choices are the decoder's
            if st.action is None:
                continue
            r, pool = st.action
            assert not mask[at[r], pool]
            if d[at[r], pool, 3] > 0.5 or fb.pairs.top[pool] == 0:
                expect.append(r)
            else:
                reserved += 1
                assert late.actions[r] == -1
        assert late.placed_order == expect
        assert [d.task_id for d in _placer(allow_wait=allow_wait, reserve_busy=True).place(req, graphs)] == [
            fb.ready[r].task_id for r in expect]
        early = _placer(allow_wait=allow_wait).decode(req, graphs)
        for st in early.steps:
            assert not st.late
            if st.action is not None:
                r, pool = st.action
                sent_busy += int(pair_dynamic(fb.pairs, np.array([r]), st.placed)[0, pool, 3] < 0.5)
        assert sorted(early.placed_order) == sorted(st.action[0] for st in early.steps if st.action)
    assert reserved > 0 and blocked > 0
    if not allow_wait:
        assert sent_busy > 0


def test_checkpoints_decode_busy_pools_as_they_were_trained(tmp_path: Path) -> None:
    """``training.reserve_busy`` in a manifest sets the placer's default; an argument wins."""
    model = PlacementGNN(ModelConfig(hidden=8, layers=1))
    save_checkpoint(model, tmp_path / "late", training={"reserve_busy": 1})
    save_checkpoint(model, tmp_path / "early", training={})
    assert GNNPlacer.from_checkpoint(tmp_path / "late").reserve_busy
    assert not GNNPlacer.from_checkpoint(tmp_path / "late", reserve_busy=False).reserve_busy
    assert not GNNPlacer.from_checkpoint(tmp_path / "early").reserve_busy


def test_hold_ratio_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="hold_ratio must be >= 1"):
        _placer(hold_ratio=0.5)
    with pytest.raises(ValueError, match="hold_ratio must be >= 1"):
        _placer(hold_ratio=math.nan)


def test_reasons_name_only_features_that_differ_between_the_pools() -> None:
    """A reason compares the chosen pool with the runner-up on quantities that differ: never
    "only feasible pool" when the runner-up is feasible too, never "free slot yes vs yes"."""
    seen = 0
    for reserve in (False, True):  # a reserving decoding sends fewer tasks: check both
        placer = GNNPlacer.from_checkpoint(ROOT / "policy" / "checkpoints" / "default", reserve_busy=reserve)
        for req, graphs in mixed_requests():
            for d in placer.place(req, graphs):
                seen += 1
                assert "free slot yes vs yes" not in d.reason and "free slot no vs no" not in d.reason
                if "only feasible pool" in d.reason:
                    runner = d.reason.split(" over ")[1].split(" ")[0]
                    fb = featurize(req, graphs, pairs=False)
                    row = [(r.run_key, r.task_id) for r in req.ready].index((d.run_key, d.task_id))
                    names = [p.name for p in req.pools]
                    assert not fb.pairs.mask[row, names.index(runner)]
    assert seen > 40


def test_a_reason_compares_with_a_pool_the_task_may_use() -> None:
    """The runner-up a reason names is a pool the task fits (and is not gated from) whenever
    there is one, even at probability 0 (a pool the step did not offer, busy under late
    binding); a task that fits one pool only says so instead of naming a pool it cannot use."""
    seen = {"alone": 0, "runner": 0}  # (the rows no pool fits are offered every pool, and say so)
    for gate in (0.0, 3.0):
        placer = GNNPlacer.from_checkpoint(ROOT / "policy" / "checkpoints" / "default", cp_gate=gate,
                                           cp_gate_scope="all")
        for req, graphs in mixed_requests():
            fb = placer.features(req, graphs)
            usable = fb.pairs.mask
            names = [p.name for p in req.pools]
            rows = [(r.run_key, r.task_id) for r in req.ready]
            for d in placer.place(req, graphs):
                row = usable[rows.index((d.run_key, d.task_id))]
                if row.sum() == 1:  # and it says what the task asks for
                    t = fb.tasks[rows.index((d.run_key, d.task_id))]
                    assert d.reason.endswith(f": only usable pool for cpus={t.cpus:g} mem={t.memory_gb:g}GB "
                                            f"gpus={t.gpus:g}") and " over " not in d.reason, d.reason
                    seen["alone"] += 1
                elif row.any():
                    assert row[names.index(d.reason.split(" over ")[1].split(" ")[0])]
                    seen["runner"] += 1
    assert seen["alone"] > 0 and seen["runner"] > 20, seen


def _actions(placer: GNNPlacer, items: list) -> list[tuple[list[int], list[int]]]:
    out = []
    for req, graphs in items:
        dec = placer._decode_features(placer.features(req, graphs), 0.0)
        out.append((dec.actions.tolist(), dec.placed_order))
    return out


@pytest.mark.parametrize("kernel", ["numpy"] + (["compiled"] if step_kernel.AVAILABLE else []))
@pytest.mark.parametrize("reserve_busy", [False, True])
def test_an_ensemble_decides_on_its_members_mean_logits(reserve_busy: bool, kernel: str) -> None:
    """``with_members``: a model with itself decides as alone; two models decide alike in
    either order, unlike either alone; without stop, the first task sent and its pool are the
    argmax of the members' mean one-shot logits, and the stop logit is the mean of theirs;
    place_many decides each request as place. On the numpy and the compiled steps."""
    items = [(r, g) for r, g in mixed_requests() if r.ready]
    items += [big_request(int(n), ready=16, seed=s) for s, n in enumerate((60, 200, 400))]
    a = _placer(reserve_busy=reserve_busy, step_kernel=kernel)
    torch.manual_seed(7)
    b = GNNPlacer(PlacementGNN(ModelConfig(hidden=16, row_bias=True)), reserve_busy=reserve_busy, step_kernel=kernel)
    with torch.no_grad():
        b.model.row_k.fill_(-2.0)  # a member with a row bias: its unit stacks with the others
    b.clear_cache()

    def ens(x: GNNPlacer, y: GNNPlacer, **kw: object) -> GNNPlacer:
        return GNNPlacer(x.model, reserve_busy=reserve_busy, step_kernel=kernel,  # type: ignore[arg-type]
                         **kw).with_members([("y", y.model)])

    alone = _actions(a, items)
    assert _actions(ens(a, a), items) == alone
    both = _actions(ens(a, b), items)
    assert both == _actions(ens(b, a), items)
    assert both != alone and both != _actions(b, items)
    assert ens(a, b).version == "gnn-untrained+y"
    no_stop = GNNPlacer(a.model, allow_wait=False).with_members([("y", b.model)])  # sends its first choice
    differs = 0
    for req, graphs in items:
        fb = featurize(req, graphs)  # nothing placed yet: the first step's features
        la, lb = (m.model(collate([fb]))[0].detach().double() for m in (a, b))
        mean = (la + lb) / 2
        r, p = divmod(int(mean.argmax()), fb.num_pools)
        dec = no_stop._decode_features(no_stop.features(req, graphs), 0.0)
        assert (dec.placed_order[0], dec.actions[r]) == (r, p)
        differs += int(int(la.argmax()) != int(mean.argmax()) or int(lb.argmax()) != int(mean.argmax()))
        with torch.no_grad():
            am, g = (torch.from_numpy(x) for x in no_stop._head_parts(no_stop.features(req, graphs))[:2])
        h = a.model.config.hidden
        stop = float(torch.from_numpy(
            np.concatenate([am.mean(0).numpy(), g.numpy()]) @ no_stop._weights["s0_w"] + no_stop._weights["s0_b"]
        ).clamp(min=0) @ torch.from_numpy(no_stop._weights["s2_w"]) + float(no_stop._weights["s2_b"][0]))
        with torch.no_grad():
            each = [float(m.model.stop_logits(x.mean(0, keepdim=True), y.unsqueeze(0))) for m, x, y in
                    ((a, am[:, :h], g[:h]), (b, am[:, h:h + 16], g[h:h + 16]))]
        assert stop == pytest.approx(sum(each) / 2, abs=1e-5)
    assert differs
    single = [no_stop.place(r, g) for r, g in items]
    _same(no_stop.place_many([r for r, _ in items], [g for _, g in items]), single)
    # with stop, every request batched (compiled steps: the members' parts side by side), twice
    # (the second time the members' run embeddings come from their caches)
    pair, fresh = ens(a, b), ens(a, b)
    single = [fresh.place(r, g) for r, g in items]
    _same(pair.place_many([r for r, _ in items], [g for _, g in items]), single)
    _same(pair.place_many([r for r, _ in items][::-1], [g for _, g in items][::-1]), single[::-1])


@pytest.mark.parametrize("backend", ["numpy", "torch"] + (["compiled"] if step_kernel.AVAILABLE else []))
def test_every_decoder_gives_a_near_tie_to_the_row_first_in_decode_order(backend: str) -> None:
    """Two identical ready tasks on a checkpoint: their logits differ by float32 rounding only, and
    every greedy decoder (one request on numpy, compiled or recorded; a batch on
    numpy or torch) decides them in request order, which the executor makes Airflow's priority
    order (policy.model.TIE_TOLERANCE): the first listed is chosen first, and each request is
    decided as its mirror image. was: the rounding decided (scripts/priority_probe.py: the first
    listed chosen first in 50 of 198 requests)."""
    model = load_checkpoint(ROOT / "docs" / "exp-ledger" / "checkpoints" / "s41").model  # the default's first member
    placer = GNNPlacer(model, step_kernel="compiled" if backend == "compiled" else "numpy")
    placer.batch_backend = None if backend == "compiled" else backend
    pools = load_catalogue(GPU_CATALOGUE).states()
    rng = np.random.default_rng(0)
    requests, mirrored, graphs = [], [], []
    for trial in range(40):
        busy = (int(rng.integers(0, 9)), int(rng.integers(0, 5)), int(rng.integers(0, 3)))
        states = tuple(replace(p, busy=b) for p, b in zip(pools, busy, strict=True))
        duration = float(rng.uniform(5, 600))
        run = RunGraph(f"dag/{trial}", (TaskNode("a", duration_s=duration), TaskNode("b", duration_s=duration)), ())
        for listed, out in ((("a", "b"), requests), (("b", "a"), mirrored)):
            out.append(PlacementRequest(f"r{trial}", tuple(ReadyTask(run.run_key, t) for t in listed), states,
                                        runs=(run,)))
        graphs.append({run.run_key: run})
    want = [placer.place(r, g) for r, g in zip(requests, graphs, strict=True)]
    swap = {"a": "b", "b": "a"}
    _same([[replace(d, task_id=swap[d.task_id]) for d in x] for x in placer.place_many(mirrored, graphs)], want)
    _same(placer.place_many(requests, graphs), want)
    recorded = [placer.decode(r, g, temperature=0.0) for r, g in zip(requests, graphs, strict=True)]
    assert [[r.ready[i].task_id for i in d.placed_order] for r, d in zip(requests, recorded, strict=True)] == \
        [[d.task_id for d in x] for x in want]
    firsts = [d.steps[0].action[0] for d in recorded if d.steps and d.steps[0].action is not None]
    assert len(firsts) > 30 and set(firsts) == {0}, "the first listed is chosen first (sent or reserving)"
    assert sum(len({d.pool for d in x}) == 2 for x in want) >= 5  # the twins' pools differ: which got which mattered
