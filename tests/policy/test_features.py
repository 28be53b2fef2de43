"""Featurizer shapes and values on tiny hand-made requests (policy/features.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gnn_helpers import big_request, diamond_request, mixed_requests, random_dag

from policy.errors import SchemaError
from policy.features import (
    CP_GATE_SCOPES,
    F_PAIR,
    F_POOL,
    F_READY,
    F_TASK,
    PAIR_FEATURES,
    READY_FEATURES,
    TABLE_CELLS,
    TASK_FEATURES,
    PairDynamics,
    featurize,
    kind_bucket,
    pair_dynamic,
    pair_features,
    reserves,
    wait_terms,
)
from policy.graph import view
from policy.schema import PlacementRequest, ReadyTask, RunProgress


def test_shapes_on_the_diamond() -> None:
    req, graphs = diamond_request()
    fb = featurize(req, graphs)
    assert len(fb.runs) == 1
    rf = fb.runs[0]
    assert rf.x.shape == (4, F_TASK) and rf.x.dtype == np.float32
    # edges are (child, parent): messages flow from children up to parents
    assert rf.edge_index.shape == (2, 4)
    assert {tuple(e) for e in rf.edge_index.T.tolist()} == {(1, 0), (2, 0), (3, 1), (3, 2)}
    assert fb.ready_node.tolist() == [1, 2]
    assert fb.ready_run.tolist() == [0, 0]
    assert fb.ready_x.shape == (2, F_READY)
    assert fb.pool_x.shape == (3, F_POOL)
    assert fb.pair_x.shape == (2, 3, F_PAIR)
    assert fb.mask.shape == (2, 3)


def test_critical_path_and_order() -> None:
    req, graphs = diamond_request()
    fb = featurize(req, graphs)
    x = fb.runs[0].x
    on_cp = x[:, TASK_FEATURES.index("on_critical_path")]
    assert on_cp.tolist() == [1.0, 0.0, 1.0, 1.0]  # a -> c -> d is the critical path
    assert fb.order.tolist() == [1, 0]  # c (longer rank) decoded first
    assert x[2, len(TASK_FEATURES) - 8 + kind_bucket("gpu_train")] == 1.0


def test_mask_is_the_hard_constraints() -> None:
    req, graphs = diamond_request()
    fb = featurize(req, graphs)
    names = [p.name for p in fb.pools]
    # c needs a GPU: only the gpu pool fits; b fits everywhere
    assert fb.mask[1].tolist() == [n == "gpu" for n in names]
    assert fb.mask[0].all()


def test_a_down_pool_is_masked_unless_nothing_else_may_run_the_task() -> None:
    req, graphs = diamond_request()
    names = [p.name for p in req.pools]
    down = replace(req, pools=tuple(replace(p, up=p.name != "gpu") for p in req.pools))
    fb = featurize(down, graphs)
    # b may run elsewhere: the down gpu pool is masked; c needs a GPU: it keeps the gpu pool
    assert fb.mask[0].tolist() == [n != "gpu" for n in names]
    assert fb.mask[1].tolist() == [n == "gpu" for n in names]


def test_teacher_forcing_adds_backlog() -> None:
    req, graphs = diamond_request(busy_gpu=1)  # one of two GPU slots busy
    gpu = [p.name for p in req.pools].index("gpu")
    free = PAIR_FEATURES.index("has_free_slot")
    alone = featurize(req, graphs)
    assert alone.pair_x[0, gpu, free] == 1.0
    forced = featurize(req, graphs, assigned=[gpu, gpu])  # c (decoded first) took the last slot
    assert forced.pair_x[1, gpu, free] == 1.0
    assert forced.pair_x[0, gpu, free] == 0.0
    assert forced.pair_x[0, gpu, PAIR_FEATURES.index("log_wait_s")] > 0


def test_late_binding_reserves_a_booting_pool_scaled_to_zero() -> None:
    """An elastic pool scaled to zero whose room to grow is taken (its VMs are booting) is busy
    like any other: a task given it reserves a slot and waits for the boot. A pool that can never
    have a slot (its most slots are zero) gets the task, so reservations never wait forever."""
    req, graphs = diamond_request()
    gpu = [p.name for p in req.pools].index("gpu")
    for top, queued, reserved in ((2, 2, True), (2, 0, False), (0, 0, False)):
        pools = list(req.pools)
        pools[gpu] = replace(pools[gpu], slots=0, busy=0, queued=queued, max_slots=top, boot_s=90.0)
        ps = featurize(replace(req, pools=tuple(pools)), graphs).pairs
        _, free, *_ = wait_terms(ps, ps.base_backlog)
        assert ps.top[gpu] == top
        assert bool(reserves(free, ps.top)[gpu]) is reserved, (top, queued)


def test_pair_features_affinity() -> None:
    req, graphs = diamond_request()
    c = graphs["dag/diamond"].tasks[2]
    x, mask = pair_features(c, req.pools, np.zeros(3))
    gpu = [p.name for p in req.pools].index("gpu")
    assert x[gpu, PAIR_FEATURES.index("log_affinity")] == pytest.approx(np.log(8.0))
    assert x[gpu, PAIR_FEATURES.index("run_ratio")] == pytest.approx(0.0)


def test_unknown_task_is_a_schema_error() -> None:
    req, graphs = diamond_request()
    bad = type(req)(req.request_id, ready=(type(req.ready[0])("dag/diamond", "zzz"),), pools=req.pools)
    with pytest.raises(SchemaError, match="zzz"):
        featurize(bad, graphs)
    with pytest.raises(SchemaError, match="no graph"):
        featurize(req, {})


def test_big_request_shapes_and_finite() -> None:
    req, graphs = big_request(200, 16)
    fb = featurize(req, graphs)
    assert fb.runs[0].x.shape == (200, F_TASK)
    assert fb.pair_x.shape == (16, 3, F_PAIR)
    for arr in (fb.runs[0].x, fb.ready_x, fb.pool_x, fb.pair_x):
        assert np.isfinite(arr).all()


@pytest.mark.parametrize("tabulated", [False, True])
def test_pair_dynamics_equals_pair_dynamic_bit_for_bit(tabulated: bool) -> None:
    """The decoder's incremental pair columns are pair_dynamic's, exactly, after any sequence
    of placements (busy pools, a pool down, a pool scaled to zero slots, pinned and infeasible
    tasks), step by step and from the table of every reachable backlog."""
    rng = np.random.default_rng(3)
    requests = mixed_requests()
    req, graphs = requests[4]
    zero = (replace(req.pools[0], slots=0, busy=0, queued=0), *req.pools[1:])
    requests.append((replace(req, request_id="req-zero-slots", pools=zero), graphs))
    checked = tables = 0
    for req, graphs in requests:
        fb = featurize(req, graphs, pairs=False)
        if not (fb.num_ready and fb.num_pools):
            continue
        dyn = PairDynamics(fb.pairs, steps=fb.num_ready if tabulated else None)
        assert (dyn._table is not None) == (tabulated and (fb.num_ready + 1) * fb.num_ready * fb.num_pools
                                            <= TABLE_CELLS)
        tables += dyn._table is not None
        placed = np.zeros(fb.num_pools)
        rows = fb.order.copy()
        while len(rows):
            got, want = dyn(rows), pair_dynamic(fb.pairs, rows, placed)
            assert got.dtype == want.dtype and np.array_equal(got, want)
            # the free-slot column the stop guard reads, cached per step, follows each placement
            assert np.array_equal(dyn.free, wait_terms(fb.pairs, fb.pairs.base_backlog + placed)[1])
            pool = int(rng.integers(fb.num_pools))
            placed[pool] += 1
            dyn.place(pool)
            rows = np.delete(rows, int(rng.integers(len(rows))))
            checked += 1
    assert checked > 100
    assert (tables >= 5) if tabulated else (tables == 0)


def test_featurize_order_is_decode_order() -> None:
    """featurize's vectorised order (and pair_static's per-shape lookups) agree with the plain
    definitions on requests of 4-1,000 tasks with pins, a task no pool holds and a pool down."""
    from policy.features import decode_order, pair_static

    for req, graphs in mixed_requests():
        fb = featurize(req, graphs)
        np.testing.assert_array_equal(fb.order, decode_order(req, graphs))
        ps = pair_static(fb.tasks, req.pools)
        want_mask = [[p.up and p.fits(t) for p in req.pools] for t in fb.tasks]
        want_aff = [[p.affinity.get(t.kind, 1.0) for p in req.pools] for t in fb.tasks]
        assert ps.mask.tolist() == want_mask
        assert ps.affinity.tolist() == want_aff


def test_run_work_left_ratio_ranks_the_runs_of_a_request_on_any_time_scale() -> None:
    """SRPT's key relative to the request's other runs: 0 for the run with the least work left,
    log of the ratio for the others; the same whether the jobs take seconds or hours."""
    col = READY_FEATURES.index("run_work_left_ratio")

    def ratios(scale: float) -> np.ndarray:
        runs = []
        for k, n in enumerate((40, 120)):
            g = random_dag(n, k, run_key=f"dag/r{k}")
            runs.append(replace(g, tasks=tuple(replace(t, duration_s=t.duration_s * scale) for t in g.tasks)))
        req = PlacementRequest(
            "req-two", ready=(ReadyTask(runs[1].run_key, "t0"), ReadyTask(runs[0].run_key, "t0")),
            pools=diamond_request()[0].pools, runs=tuple(runs),
            progress=tuple(RunProgress(g.run_key) for g in runs),
        )
        return featurize(req, {g.run_key: g for g in runs}, pairs=False).ready_x[:, col]

    small, large = ratios(0.01), ratios(100.0)
    assert small[1] == 0.0 and large[1] == 0.0  # the 40-task run has less work left
    assert 0.5 < large[0] <= 3.0
    assert small[0] > 0.0 and large[0] == pytest.approx(small[0], abs=0.05)


def test_rank_over_remaining_cp_marks_the_run_s_critical_path() -> None:
    """Schema 5: a ready task's upward rank over the longest upward rank among its run's ready
    tasks in the request and its running ones (what is left of the run's critical path, as
    ``rcp`` and ``cost-cp`` read it): 1 for the task on it, less for the others, and below 1 for
    every ready task once a running task has the longest rank."""
    col = READY_FEATURES.index("rank_over_remaining_cp")
    g = random_dag(60, 5, run_key="dag/cp")
    rank = view(g).rank
    ready = [5, 9, 17, 30]
    by_rank = sorted(range(60), key=lambda i: -rank[i])
    top_running = next(i for i in by_rank if i not in ready)

    def column(running: tuple[str, ...]) -> np.ndarray:
        req = PlacementRequest("req-cp", ready=tuple(ReadyTask(g.run_key, f"t{i}") for i in ready),
                               pools=diamond_request()[0].pools, runs=(g,),
                               progress=(RunProgress(g.run_key, running=running),))
        return featurize(req, {g.run_key: g}, pairs=False).ready_x[:, col]

    alone = column(())
    best = max(rank[i] for i in ready)
    assert alone.tolist() == pytest.approx([rank[i] / best for i in ready])
    assert alone.max() == 1.0 and (alone < 1.0).sum() == len(ready) - 1
    assert rank[top_running] > best  # the graph's longest rank is not among the ready tasks
    behind = column((f"t{top_running}",))
    assert behind.tolist() == pytest.approx([rank[i] / rank[top_running] for i in ready])
    assert behind.max() < 1.0


def test_held_time_columns_say_how_long_each_task_has_waited() -> None:
    """Schema 6: ``ReadyTask.held_s`` (the executor's and the simulator's hold time) as log
    seconds and as a multiple of the task's expected duration (clipped), 0 when not held."""
    g = random_dag(30, 3, run_key="dag/held")
    held = {2: 0.0, 7: 5.0, 11: 600.0}
    req = PlacementRequest("req-held", ready=tuple(ReadyTask(g.run_key, f"t{i}", held_s=h) for i, h in held.items()),
                           pools=diamond_request()[0].pools, runs=(g,))
    x = featurize(req, {g.run_key: g}, pairs=False).ready_x
    log_held, over = (x[:, READY_FEATURES.index(c)] for c in ("log_held_s", "held_over_duration"))
    assert log_held.tolist() == pytest.approx([np.log1p(h) / 8 for h in held.values()], rel=1e-6)
    dur = [g.tasks[i].duration_s for i in held]
    assert over.tolist() == pytest.approx([min(np.log1p(h / d), 3.0) for h, d in zip(held.values(), dur, strict=True)], rel=1e-6)
    assert over[0] == 0.0 and 0.0 < over[1] <= over[2]
    unheld = replace(req, ready=tuple(replace(r, held_s=0.0) for r in req.ready))
    y = featurize(unheld, {g.run_key: g}, pairs=False).ready_x
    assert not y[:, -2:].any() and np.array_equal(np.delete(x, [-2, -1], 1), np.delete(y, [-2, -1], 1))


def test_cp_gate_masks_premium_pools_off_the_critical_path() -> None:
    """``cp_gate`` (``cost-cp``'s rule as a hard constraint): a ready task off its run's remaining
    critical path loses the feasible pools whose price per unit of its work is more than the gate
    x its cheapest feasible pool's; a task on the path, a task with one feasible pool, and every
    task without the gate keep the plain mask; no feasible task is left without a pool. The
    expected mask is computed here from the catalogue's prices and speeds, not from features."""
    g = random_dag(120, 2, run_key="dag/gate")
    rank = view(g).rank
    ready = list(range(0, 42, 3))  # CPU tasks and every 7th a GPU one (random_dag)
    pools = big_request()[0].pools
    top_running = max((i for i in range(120) if i not in ready), key=lambda i: rank[i])

    def masks(running: tuple[str, ...], gate: float, scope: str = "off-cp") -> np.ndarray:
        req = PlacementRequest("req-gate", ready=tuple(ReadyTask(g.run_key, f"t{i}") for i in ready), pools=pools,
                               runs=(g,), progress=(RunProgress(g.run_key, running=running),))
        return featurize(req, {g.run_key: g}, cp_gate=gate, cp_gate_scope=scope).pairs.mask

    for running in ((), (f"t{top_running}",)):
        plain = masks(running, 0.0)
        crit = max([rank[i] for i in ready] + [rank[top_running]] * bool(running))
        for gate in (2.0, 3.0):
            for scope in CP_GATE_SCOPES:
                gated = masks(running, gate, scope)
                want = plain.copy()
                for r, i in enumerate(ready):
                    task = g.tasks[i]
                    per_work = np.array([p.price_per_hour / p.speed_for(task.kind) for p in pools])
                    cheapest = per_work[plain[r]].min()
                    if rank[i] < crit or scope == "all":
                        want[r] &= ~(per_work > gate * cheapest * (1 + 1e-9))
                assert (gated == want).all()
                assert (gated.any(axis=1) == plain.any(axis=1)).all()
        gpu = [p.name for p in pools].index("gpu")
        gpu_per_work = {i: pools[gpu].price_per_hour / pools[gpu].speed_for(g.tasks[i].kind) for i in ready}
        small = next(p for p in pools if p.name == "cpu-small")
        cpu_rows = [r for r, i in enumerate(ready)
                    if plain[r].sum() > 1 and gpu_per_work[i] > 3.0 * small.price_per_hour / small.speed_for(g.tasks[i].kind)]
        assert cpu_rows and plain[cpu_rows, gpu].all()  # the test can fail: CPU work may take the GPU ...
        gated = masks(running, 3.0)
        off = [r for r in cpu_rows if rank[ready[r]] < crit]
        assert off and not gated[off, gpu].any()  # ... but not off the critical path at gate 3
        on = [r for r in cpu_rows if rank[ready[r]] >= crit]
        assert gated[on, gpu].all()
        assert not masks(running, 3.0, "all")[cpu_rows, gpu].any()  # scope all: on the path neither
    with pytest.raises(ValueError, match="cp_gate"):
        masks((), 0.5)
    with pytest.raises(ValueError, match="cp_gate_scope"):
        masks((), 3.0, "critical")
