"""Feature schema 3: the pair wait from what a placer's ledger knows (PoolState.free_at,
max_slots, boot_s), and the simulator reporting it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gnn_helpers import GPU_CATALOGUE

from policy.catalogue import load_catalogue
from policy.errors import SchemaError
from policy.features import PairStatic, pad_free_in, pair_static, wait_terms, wait_terms_reference
from policy.schema import PoolState, TaskNode


def _pool(**kw: object) -> PoolState:
    base = dict(name="p", vm_class="v", slots=2, cpus=4, memory_gb=8)
    return PoolState(**{**base, **kw})  # type: ignore[arg-type]


def test_wait_is_when_the_queued_for_slot_frees() -> None:
    """Two slots busy until t=100 and t=160 (now 40): the next task waits 60 s, the one after
    120 s, then (nothing more reported) one more run time per slot; a free slot waits 0."""
    task = TaskNode("t", duration_s=30.0)
    pool = _pool(busy=2, free_at=(160.0, 100.0))
    ps = pair_static([task], [pool], now=40.0)
    waits = []
    for placed in range(4):
        now_free, free, alpha, beta, cap = wait_terms(ps, ps.base_backlog + placed)
        waits.append(float(np.where(now_free, 0.0, np.minimum(alpha + beta * 30.0, cap))[0]))
    assert waits == [60.0, 120.0, 120.0 + 15.0, 120.0 + 30.0]
    idle = pair_static([task], [_pool(busy=1, free_at=(100.0,))], now=40.0)
    assert wait_terms(idle, idle.base_backlog)[0][0]  # one of two slots free


def test_a_pool_that_can_grow_waits_at_most_a_boot() -> None:
    task = TaskNode("t", duration_s=1000.0)
    ps = pair_static([task], [_pool(busy=2, free_at=(900.0, 950.0), max_slots=3, boot_s=45.0)], now=0.0)
    now_free, free, alpha, beta, cap = wait_terms(ps, ps.base_backlog)
    assert not now_free[0] and free[0] and cap[0] == 45.0
    # once the queue covers the growth (one more slot), it waits for the running tasks again
    now_free, free, alpha, beta, cap = wait_terms(ps, ps.base_backlog + 1)
    assert not free[0] and cap[0] == np.inf and alpha[0] == 950.0


def test_vectorised_wait_terms_match_the_reference() -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):
        p = int(rng.integers(1, 5))
        slots = rng.integers(0, 5, p).astype(float)
        base = rng.integers(0, 8, p).astype(float)
        free_in = tuple(np.sort(rng.random(rng.integers(0, 6)) * 100) for _ in range(p))
        pad, n = pad_free_in(free_in)
        ps = PairStatic(speed=None, affinity=None, run_s=None, cost=None, mask=None, pinned=None,  # type: ignore[arg-type]
                        slots=slots, base_backlog=base, best_run=None, best_cost=None, ref=None,  # type: ignore[arg-type]
                        free_in=free_in, max_slots=slots + rng.integers(0, 4, p), boot_s=rng.random(p) * 60,
                        queued=np.minimum(base, rng.integers(0, 4, p)).astype(float), free_pad=pad, free_n=n)
        if rng.random() < 0.5:  # schema 7: a pool with no slot waits at least its boot
            ps = replace(ps, floor=np.where(slots == 0, ps.boot_s, 0.0))
        backlog = base + rng.integers(0, 10, (6, p))
        got = wait_terms(ps, backlog)
        for i in range(6):
            # the batched [6, P] path and the one-backlog [P] path (the placer's steps) alike
            for a, one, b in zip(got, wait_terms(ps, backlog[i]), wait_terms_reference(ps, backlog[i]), strict=True):
                assert np.array_equal(a[i], b) and np.array_equal(one, b)


def test_wire_round_trip_and_validation() -> None:
    pool = _pool(busy=2, max_slots=6, boot_s=30.0, free_at=(5.0, 3.0))
    back = PoolState.from_json(pool.to_json())
    assert back.free_at == (3.0, 5.0) and back.max_slots == 6 and back.boot_s == 30.0
    assert PoolState.from_json({k: v for k, v in _pool().to_json().items()
                                if k not in ("free_at", "max_slots", "boot_s")}) == _pool()
    with pytest.raises(SchemaError, match="free_at"):
        PoolState.from_json({**pool.to_json(), "free_at": ["soon"]})
    with pytest.raises(SchemaError, match="free_at"):
        PoolState.from_json({**pool.to_json(), "free_at": [1.0] * 10_000})


def test_simulator_reports_expected_finish_times() -> None:
    from trainer.simulator import SimConfig, Simulator
    from trainer.train import Args, make_stream, settings_from

    cat = load_catalogue(GPU_CATALOGUE)
    args = Args()
    jobs = make_stream(settings_from("mlpipeline", 1)[0], cat, 6, 3, args)
    seen = []

    class Spy:
        name, version = "spy", "0"

        def __init__(self) -> None:
            from trainer.baselines import make_placer
            self.inner = make_placer("srpt+eft", cat)

        def place(self, request, graphs):  # type: ignore[no-untyped-def]
            seen.append(request)
            return self.inner.place(request, graphs)

    Simulator(cat, jobs, Spy(), seed=3, config=SimConfig(duration_noise=0.3)).run()
    busy = [p for r in seen for p in r.pools if p.busy]
    assert busy
    for p in busy:  # running and queued tries (not those still in dispatch), ascending
        assert p.busy <= len(p.free_at) <= p.busy + p.queued
        assert list(p.free_at) == sorted(p.free_at)
    spec = {s.name: s for s in cat.pools}
    for p in busy:
        s = spec[p.name]
        hi = (s.max_workers if s.max_workers is not None else s.workers) * s.slots_per_worker
        assert p.max_slots == (hi if hi > p.slots else None) and p.boot_s == s.boot_delay_s


@pytest.mark.parametrize("dialect", ["numpy", "torch"])
def test_a_pool_with_no_worker_waits_for_a_boot_not_a_run_time(dialect: str) -> None:
    """An elastic pool scaled to zero starts nothing before a worker boots: a 2 s task waits the
    90 s boot there, not min(its run time, the boot) (a run time per task ahead per slot, read
    with one slot for none, was what the features said: "est. wait 2s" on a pool with no VM). One
    whose room to grow is taken waits at least the boot too. The batched decoder's copy agrees."""
    import torch

    from policy import batch_decoder as bd
    from policy.features import pair_dynamic

    task = TaskNode("t", duration_s=2.0)
    other = _pool(name="q", slots=4)  # a free pool: the finish ratios need a reference
    for queued, top, least in ((0, 2, 90.0), (2, 2, 90.0), (0, 0, 90.0)):
        cold = _pool(slots=0, queued=queued, max_slots=top, boot_s=90.0)
        ps = pair_static([task], [cold, other], now=0.0)
        d = pair_dynamic(ps, np.array([0]), np.zeros(2))
        wait = float(np.expm1(d[0, 0, 0] * 8.0))  # column 0: log1p(wait) / 8
        assert wait == pytest.approx(least, rel=1e-5) if top and not queued else wait >= least - 1e-3, (queued, top)
        xp = bd._NUMPY if dialect == "numpy" else bd._torch_ops(torch.device("cpu"))
        conv = (lambda a: a) if dialect == "numpy" else torch.as_tensor
        pad, n = pad_free_in(ps.free_in)
        pools = tuple(conv(np.asarray(a)[None]) for a in (ps.slots, ps.top, ps.queued, ps.base_backlog,
                                                            ps.boot_s, pad, n, ps.floor))
        got = bd._pair_dynamic(xp, conv(ps.run_s[None]), conv(ps.ref[None]), pools, pools[3], row_axis=True)
        assert np.array_equal(np.asarray(got)[0], d), (queued, top)
        # schema 6 and older (what every checkpoint before schema 7 was trained on): one busy slot
        old = pair_dynamic(pair_static([task], [cold, other], now=0.0, boot_floor=False), np.array([0]), np.zeros(2))
        assert float(np.expm1(old[0, 0, 0] * 8.0)) < 10.0


def test_a_placer_reads_the_boot_floor_only_from_schema_7() -> None:
    """The committed default (schema 4) decides on the features it was trained on; a model of this
    code's schema gets the floor."""
    from policy.features import BOOT_FLOOR_SCHEMA, FEATURE_SCHEMA_VERSION
    from policy.gnn import GNNPlacer
    from policy.model import PlacementGNN, upgraded
    from policy.registry import DEFAULT_CHECKPOINT

    assert FEATURE_SCHEMA_VERSION >= BOOT_FLOOR_SCHEMA == 7
    assert not GNNPlacer(PlacementGNN(schema_version=6), version="old").boot_floor
    assert GNNPlacer(PlacementGNN(), version="new").boot_floor
    assert not GNNPlacer.from_checkpoint(DEFAULT_CHECKPOINT).boot_floor  # the default's members: schema 4
    # a fine-tune of an older checkpoint trains this code's schema, floor included
    assert GNNPlacer(upgraded(PlacementGNN(schema_version=4)), version="tuned").boot_floor
