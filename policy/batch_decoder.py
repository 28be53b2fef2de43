"""Greedy step decoding of several requests in one set of tensor operations (issue 5).

:meth:`policy.gnn.GNNPlacer.decode` decides one request in steps (Decima's one node at a time,
:mod:`policy.model` point 5): each step scores every (unplaced ready task, feasible pool) pair and
"stop", takes the argmax, and recomputes the backlog-dependent pair columns. This module runs the
same steps for ``S`` requests at once on the model's device: each step picks one pair, or stop,
*per request still active*; a request that stopped, or has placed every row, takes no further
part (its later steps are masked, not skipped, so a CUDA device never waits for the host).

Identity with the one-request decoder (tested in ``tests/policy/test_gnn.py``): the same
quantities in the same order and precision (pair columns in float64 cast to float32, the head in
float32, logits in float64), and each request's rows laid out in its decode order, so that the
greedy choice's near-ties (:func:`policy.model.greedy_choice`) break exactly as over the surviving rows.
Matrix products and sums of different shapes may still round differently in the last float32
bit (the scores differ by ~1e-6): decisions could differ only between choices that tie to within
that, and on a GPU, whose kernels round differently from the CPU's, by the same margin.

The model's parts (task, pool and static pair terms) are computed in torch on the device. The
steps then run on numpy arrays on the host for batches of up to :data:`_NUMPY_ROWS` row slots on
a CPU and :data:`_NUMPY_ROWS_OFF_CPU` off it (a numpy operation on small arrays costs a fraction
of torch's dispatch, let alone a kernel launch), and on torch tensors on the device for larger
ones; one function, :func:`_steps`, written in the dialect both share, serves both, and the
tests run both on a CPU. Where numba is installed (and the placer asks for it) each request's
steps instead run in one call of the compiled kernel (:mod:`policy.step_kernel`), after the same
batched model parts: faster than either from 8 requests of 16 ready rows up (docs/server.md).

Host <-> device traffic: one upload of everything the requests need (packed into one float64
buffer off the CPU; float32, bool and int64 survive the round trip exactly), then either one
download of the model's parts (numpy steps) or, with torch steps, one download of the results
and in between only a one-byte "all done?" check every few steps.

Shapes (``S`` requests, ``R`` the most ready rows, ``P`` the most pools, ``H`` hidden,
``F = F_PAIR``; slot ``k`` of request ``s`` is its ``k``-th row in decode order)::

    a          [S, R, H]     task part of the first head layer, per row slot
    b          [S, P, H]     pool part;  g [S, H] cluster summary
    static_x   [S, R, P, F]  pair features with the dynamic columns zeroed
    run_s      [S, R, P]     float64;  ref, keep [S, R, P] bool;  slots, base [S, P] float64
    steps      actions [S, R] (pool or -1); per step t and request s (entry t * S + s): the
               row slot chosen k [T, S] and whether it was placed go [T, S]; the placed rows'
               probs [T*S, P] float64, dynamic pair columns [T*S, P, 5], contrib [T*S, P, F]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from policy import step_kernel
from policy.features import (
    DYNAMIC_PAIR_COLUMNS,
    F_PAIR,
    HOLD_RATIO,
    PREMIUM_RATIO,
    RESERVE_BUSY,
    FeatureBatch,
    PairDynamics,
    check_hold_ratio,
    guard_fit,
    late_blocked,
    pair_rows,
    pool_free_within,
    reserves,
)
from policy.model import NEG_INF, TIE_TOLERANCE, PlacementGNN

_LOG = 8.0  # the scale of policy.features' log columns
_CHECK_EVERY = 4  # off the CPU: steps between checks whether every request is done
#: on a CPU, batches up to this many row slots (S x R) step on numpy, larger ones on torch, whose
#: kernels win once the arrays are large (one core, 200 tasks, 16 ready: 8 requests 7.5 ms a batch
#: with numpy steps vs 9.4 ms with torch; 256 requests 315 ms vs 156 ms; docs/server.md)
_NUMPY_ROWS = 1024
#: off the CPU, batches up to this many row slots step on numpy too, after one download of the
#: model's parts: a step on a GPU is a few dozen kernel launches and their Python dispatch, which
#: cost more than the small arrays' arithmetic on the host (H200, 200 tasks, 16 ready: 8 requests
#: 21.8 ms a batch with torch steps on the device vs 6.5 ms on one CPU core with numpy steps)
_NUMPY_ROWS_OFF_CPU = 4096
_DTYPES: dict[np.dtype[Any], torch.dtype] = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
           np.dtype(np.bool_): torch.bool, np.dtype(np.int64): torch.int64}
_NP_DTYPES: dict[torch.dtype, np.dtype[Any]] = {v: k for k, v in _DTYPES.items()}


@dataclass
class Decided:
    """One request's greedy decoding, rows in request order (as :class:`policy.gnn.Decoded`).

    ``order`` lists the placed rows in dispatch order; ``pair_x[r]`` holds row ``r``'s pair
    features at the step it was placed (rows held by stop keep zeros).
    """

    actions: np.ndarray  # [n] pool or -1
    order: list[int]
    probs: np.ndarray  # [n, p]
    pair_x: np.ndarray  # [n, p, F_PAIR]
    mask: np.ndarray  # [n, p]
    contrib: np.ndarray  # [n, p, F_PAIR]


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> list[Tensor]:
    """The arrays as tensors on ``device``: zero-copy on the CPU, one packed copy elsewhere."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    flat = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays]))
    parts = flat.to(device).split([int(a.size) for a in arrays])
    return [t.view(a.shape).to(_DTYPES[a.dtype]) for t, a in zip(parts, arrays, strict=True)]


def download(tensors: Sequence[Tensor]) -> list[np.ndarray]:
    """The tensors as numpy arrays: one packed copy off a device, none on the CPU."""
    if all(t.device.type == "cpu" for t in tensors):
        return [t.numpy() for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    out, off = [], 0
    for t in tensors:
        n = t.numel()
        out.append(flat[off : off + n].reshape(tuple(t.shape)).astype(_NP_DTYPES[t.dtype]))
        off += n
    return out


class NotBatched(ValueError):
    """These requests cannot be decoded together: decode them one by one."""


@torch.inference_mode()
def decode_greedy(
    model: PlacementGNN,
    fbs: Sequence[FeatureBatch],
    h_table: Tensor,
    s_table: Tensor,
    node_idx: np.ndarray,
    run_idx: np.ndarray,
    *,
    allow_wait: bool = True,
    hold_ratio: float = HOLD_RATIO,
    reserve_busy: bool = RESERVE_BUSY,
    premium_ratio: float = PREMIUM_RATIO,
    backend: str | None = None,
    weights: dict[str, np.ndarray] | None = None,
) -> list[Decided]:
    """Greedy decoding of every request of ``fbs`` (each with >= 1 ready row and >= 1 pool).

    An ensemble is decoded as its fused model (:func:`policy.model.fuse_models`), one model.

    ``h_table [N, H]`` / ``s_table [U, H]`` hold the task embeddings and run summaries of every
    run involved (on the model's device); ``node_idx`` / ``run_idx`` ``[sum R_s]`` index them for
    the ready rows of all requests, concatenated in request order. ``reserve_busy``: a row
    given a pool with no free slot reserves it and is not sent (:data:`policy.features.RESERVE_BUSY`);
    ``premium_ratio``: the guards leave out premium pools (:func:`policy.features.guard_fit`).
    ``backend`` forces the
    steps onto ``"numpy"`` or ``"torch"`` arrays, or ``"compiled"``: each request's steps in one
    call of :func:`policy.step_kernel.greedy_steps` after the batched model parts (needs
    ``weights``, :meth:`policy.model.PlacementGNN.numpy_weights`, and numba). Default: compiled
    when ``weights`` are given and every request's backlog table fits
    (:data:`policy.features.TABLE_CELLS`), else numpy up to a batch size (see the module
    docstring) and torch above it.
    """
    device = h_table.device
    num = [fb.num_ready for fb in fbs]
    npools = [fb.num_pools for fb in fbs]
    S, R, P = len(fbs), max(num), max(npools)
    dyn = list(DYNAMIC_PAIR_COLUMNS)
    sx = np.zeros((S, R, P, F_PAIR), dtype=np.float32)
    run_s = np.zeros((S, R, P), dtype=np.float64)
    ref = np.zeros((S, R, P), dtype=bool)
    keep = np.zeros((S, R, P), dtype=bool)
    fit = np.zeros((S, R, P), dtype=bool)
    slots = np.ones((S, P), dtype=np.float64)
    top = np.ones((S, P), dtype=np.float64)
    queued = np.zeros((S, P), dtype=np.float64)
    boot = np.zeros((S, P), dtype=np.float64)
    kmax = max(fb.pairs.free_pad.shape[1] if fb.pairs.free_pad is not None else 1 for fb in fbs)
    pad = np.zeros((S, P, kmax), dtype=np.float64)
    nfree = np.zeros((S, P), dtype=np.int64)
    floor = np.zeros((S, P), dtype=np.float64)  # PairStatic.floor (0: none)
    base = np.zeros((S, P), dtype=np.float64)
    row_valid = np.zeros((S, R), dtype=bool)
    slot_row = np.zeros((S, R), dtype=np.int64)
    busy = np.zeros(S, dtype=bool)
    pool_x = np.zeros((S, P, fbs[0].pool_x.shape[1]), dtype=np.float32)
    pool_valid = np.zeros((S, P), dtype=bool)
    x_alls: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # features, mask, guards' pools
    tables: list[tuple[np.ndarray, ...] | None] = []  # the compiled steps' backlog tables
    compiled = backend == "compiled" or (backend is None and weights is not None)
    off = 0
    for s, fb in enumerate(fbs):
        n, p, o = num[s], npools[s], fb.order
        dynamics = PairDynamics(fb.pairs, steps=n if compiled else None)
        every = np.arange(n)
        x_all, m_all = pair_rows(fb.pairs, every, dynamics.placed, dynamics(every))  # [n, p, F]
        guard = guard_fit(fb.pairs, every, m_all, premium_ratio)  # the pools the guards count
        x_alls.append((x_all, m_all, guard))
        tables.append(dynamics.table())
        st = x_all[o].copy()
        st[..., dyn] = 0.0
        sx[s, :n, :p] = st
        run_s[s, :n, :p] = fb.pairs.run_s[o]
        ref[s, :n, :p] = fb.pairs.ref[o]
        keep[s, :n, :p] = (m_all | ~m_all.any(axis=1, keepdims=True))[o]
        fit[s, :n, :p] = guard[o]
        slots[s, :p] = fb.pairs.slots
        ps = fb.pairs
        top[s, :p] = ps.top
        queued[s, :p] = ps.queued if ps.queued is not None else 0.0
        boot[s, :p] = ps.boot_s if ps.boot_s is not None else 0.0
        floor[s, :p] = ps.floor if ps.floor is not None else 0.0
        if ps.free_pad is not None and ps.free_n is not None:
            k = ps.free_pad.shape[1]
            pad[s, :p, :k] = ps.free_pad
            pad[s, :p, k:] = ps.free_pad[:, -1:]
            nfree[s, :p] = ps.free_n
        base[s, :p] = ps.base_backlog
        row_valid[s, :n] = True
        slot_row[s, :n] = off + o
        busy[s] = any(q.busy + q.queued > 0 for q in fb.pools)
        pool_x[s, :p] = fb.pool_x
        pool_valid[s, :p] = True
        off += n
    ready_x = np.concatenate([fb.ready_x for fb in fbs])
    (t_sx, t_run, t_ref, t_keep, t_fit, t_slots, t_top, t_queued, t_boot, t_pad, t_nfree, t_floor, t_base,
     t_valid, t_slot_row, t_busy, t_pool_x, t_pool_valid, t_ready_x, t_node, t_run_idx) = upload(
        [sx, run_s, ref, keep, fit, slots, top, queued, boot, pad, nfree, floor, base, row_valid, slot_row, busy,
         pool_x, pool_valid, ready_x, node_idx, run_idx], device)

    # --- one model call per phase: task parts of all rows, pool parts of all requests ----------
    a = model.task_side(h_table[t_node], s_table[t_run_idx], t_ready_x)[t_slot_row]  # [S, R, H]
    hidden = a.shape[-1]
    b = torch.zeros((S, P, hidden), device=device)
    g = torch.zeros((S, hidden), device=device)
    for p in sorted(set(npools)):  # requests with the same number of pools share one call
        idx = [s for s in range(S) if npools[s] == p]
        sel: slice | Tensor = slice(None) if len(idx) == S else torch.tensor(idx, device=device)
        b[sel, :p], g[sel] = model.pool_side(*model.encode_pools(t_pool_x[sel, :p]))
    head = model.head_weights()
    c_t = head["c_t"]  # [F, H]
    c_dyn = c_t[dyn]  # [5, H]
    w, w_b = head["w"], head["b"]
    # written out as matmul + bias (not addmm) to round as the one-request decoder's numpy does
    s0_w, s0_b, s2_w, s2_b = head["s0_w"], head["s0_b"], head["s2_w"], head["s2_b"][0]
    pre = a[:, :, None, :] + b[:, None] + t_sx @ c_t  # [S, R, P, H]

    if compiled:
        if weights is None:
            raise ValueError("backend='compiled' needs the model's numpy weights")
        if all(t is not None for t in tables) or backend == "compiled":
            pre_h, a_h, g_h = download([pre, a, g])
            return [_compiled(fb, tab, pre_h[s], a_h[s], g_h[s], x_alls[s], weights, allow_wait=allow_wait,
                              hold_ratio=check_hold_ratio(hold_ratio), reserve_busy=reserve_busy)
                    for s, (fb, tab) in enumerate(zip(fbs, tables, strict=True))]

    # Small batches step on host numpy (a few microseconds per operation, where torch's dispatch,
    # let alone a kernel launch, costs several times that), larger ones on the device's tensors.
    on_cpu = device.type == "cpu"
    use_numpy = backend == "numpy" or (backend is None and S * R <= (_NUMPY_ROWS if on_cpu else _NUMPY_ROWS_OFF_CPU))
    xp = _NUMPY if use_numpy else _torch_ops(device)
    model_arrays: list[Any]
    state: list[Any]
    if use_numpy:
        model_arrays = download([pre, a, g, c_t, c_dyn, w, w_b, s0_w, s0_b, s2_w, s2_b])
        state = [sx, run_s, ref, keep, fit, (slots, top, queued, base, boot, pad, nfree, floor), row_valid, busy,
                 pool_valid]
    else:
        model_arrays = [pre, a, g, c_t, c_dyn, w, w_b, s0_w, s0_b, s2_w, s2_b]
        state = [t_sx, t_run, t_ref, t_keep, t_fit, (t_slots, t_top, t_queued, t_base, t_boot, t_pad, t_nfree, t_floor),
                 t_valid, t_busy, t_pool_valid]
    # padded slots and finished requests compute inf and NaN that are masked, never chosen
    with np.errstate(divide="ignore", invalid="ignore"):
        found = _steps(xp, *model_arrays, *state, allow_wait=allow_wait, hold_ratio=check_hold_ratio(hold_ratio),
                       reserve_busy=reserve_busy, sync_every=1 if on_cpu or use_numpy else _CHECK_EVERY)
    actions_h, k_h, go_h, probs_h, dyn_h, contrib_h = found if use_numpy else download(found)
    out: list[Decided] = []
    for s, fb in enumerate(fbs):
        n, p, o = num[s], npools[s], fb.order
        x_all, m_all, _ = x_alls[s]
        act = np.full(n, -1, dtype=np.int64)
        act[o] = actions_h[s, :n]
        ts = np.nonzero(go_h[:, s])[0]  # the steps that placed a row, in dispatch order
        entry = ts * S + s
        rows = o[k_h[ts, s]]
        pr = np.zeros((n, p), dtype=np.float64)
        pr[rows] = probs_h[entry, :p]
        cb = np.zeros((n, p, F_PAIR), dtype=np.float32)
        cb[rows] = contrib_h[entry, :p]
        px = np.zeros((n, p, F_PAIR), dtype=np.float32)
        px[rows] = x_all[rows]
        for j, r in zip(entry, rows, strict=True):
            px[r][:, dyn] = dyn_h[j, :p]
        mk = np.zeros((n, p), dtype=bool)
        mk[rows] = m_all[rows]
        out.append(Decided(act, [int(r) for r in rows], pr, px, mk, cb))
    return out


def _compiled(fb: FeatureBatch, tab: tuple[np.ndarray, ...] | None, pre: np.ndarray, a: np.ndarray, g: np.ndarray,
              found: tuple[np.ndarray, np.ndarray, np.ndarray], weights: dict[str, np.ndarray], *,
              allow_wait: bool, hold_ratio: float, reserve_busy: bool) -> Decided:
    """One request's steps compiled (:mod:`policy.step_kernel`) from the batch's model parts:
    ``pre [R, P, H]``, ``a [R, H]`` (row slots in decode order), ``g [H]``; ``tab`` its
    :meth:`policy.features.PairDynamics.table`, ``found`` its pair features and mask at an empty
    backlog and the pools its guards count. The evidence of the rows sent, as the batched steps give it."""
    if tab is None:
        raise ValueError(f"request of {fb.num_ready} ready rows x {fb.num_pools} pools: too large for the "
                         f"compiled steps' backlog table")
    n, p, o = fb.num_ready, fb.num_pools, fb.order
    x_all, m_all, guard = found
    pre_rows = np.empty((n, p, pre.shape[-1]), dtype=np.float32)
    pre_rows[o] = pre[:n, :p]
    a_rows = np.empty((n, a.shape[-1]), dtype=np.float32)
    a_rows[o] = a[:n]
    actions, sent, n_sent, resv, n_resv, d_kept, z_kept, logits_kept, *_ = compiled_steps(
        fb, tab, pre_rows, a_rows, g, m_all, guard, weights, allow_wait=allow_wait, hold_ratio=hold_ratio,
        reserve_busy=reserve_busy)
    rows = sent[:n_sent]
    act = actions.copy()
    act[resv[:n_resv]] = -1
    pr = np.zeros((n, p), dtype=np.float64)
    px = np.zeros((n, p, F_PAIR), dtype=np.float32)
    cb = np.zeros((n, p, F_PAIR), dtype=np.float32)
    pr[rows], px[rows], cb[rows] = row_evidence(rows, logits_kept, d_kept, z_kept, x_all, weights)
    mk = np.zeros((n, p), dtype=bool)
    mk[rows] = m_all[rows]
    return Decided(act, [int(r) for r in rows], pr, px, mk, cb)


def compiled_steps(fb: FeatureBatch, tab: tuple[np.ndarray, ...], pre: np.ndarray, a: np.ndarray, g: np.ndarray,
                   fit: np.ndarray, guard: np.ndarray, weights: dict[str, np.ndarray], *, allow_wait: bool,
                   hold_ratio: float, reserve_busy: bool) -> tuple[Any, ...]:
    """:func:`policy.step_kernel.greedy_steps` of one request (its outputs): ``tab`` its
    :meth:`~policy.features.PairDynamics.table`, ``pre [n, P, H]`` / ``a [n, H]`` the head's static
    part and task part by row, ``g [H]`` the cluster summary, ``fit [n, P]`` the feasible pairs and
    ``guard`` those the guards count (:func:`~policy.features.guard_fit`),
    ``weights`` :meth:`policy.model.PlacementGNN.numpy_weights` (the one-request decoder of
    :mod:`policy.gnn` and the batched one share this call)."""
    table, finish, free_table, cur, fin, free_now = tab
    keep = fit | ~fit.any(axis=1, keepdims=True)  # rows no pool can hold keep every pool
    return step_kernel.greedy_steps(
        pre, np.ascontiguousarray(weights["c_t"][list(DYNAMIC_PAIR_COLUMNS)]), weights["w"], weights["b"], table,
        finish, free_table, cur, fin, free_now, fb.pairs.ref, guard, ~keep, fb.order, a,
        np.ascontiguousarray(g, dtype=np.float32), weights["s0_w"], weights["s0_b"], weights["s2_w"],
        weights["s2_b"], fb.pairs.top, reserve_busy, allow_wait, any(q.busy + q.queued > 0 for q in fb.pools),
        # log(hold_ratio) rounded to float32 as numpy compares it with the float32 column (found by
        # review: the kernel compared in float64, so a free pool at exactly hold_ratio x a task's
        # best finish was "near" for numpy and not for the kernel, which then held the task)
        float(np.float32(math.log(hold_ratio))), NEG_INF, TIE_TOLERANCE)


def row_evidence(rows: np.ndarray, logits: np.ndarray, d: np.ndarray, z: np.ndarray, x_all: np.ndarray,
                 weights: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The evidence of the chosen ``rows`` from what each one's step kept (``logits [n, P]``,
    dynamic columns ``d [n, P, 5]``, hidden layer ``z [n, P, H]``; indexed by row) and the
    features at an empty backlog ``x_all``: ``(probs [r, P], pair features [r, P, F], gradient x
    input [r, P, F])``. d logit[p] / d x[p] = C^T (w * 1[z[p] > 0]): exact, and nearly free."""
    x = x_all[rows]
    x[..., list(DYNAMIC_PAIR_COLUMNS)] = d[rows]
    contrib = ((z[rows] > 0) * weights["w"]) @ np.ascontiguousarray(weights["c_t"].T) * x
    return softmax_rows(logits[rows]), x, contrib


def softmax_rows(x: np.ndarray) -> np.ndarray:
    """Softmax of each row of ``x [r, P]``."""
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class _Ops:
    """The array operations whose spelling differs between numpy and torch (the rest of
    :func:`_steps` is written in their common dialect: ``where``, ``clip``, ``log1p``, ``@``...)."""

    mod: Any  # numpy or torch
    f32: Any
    f64: Any
    i64: Any
    cast: Callable[[Any, Any], Any]
    min_last: Callable[[Any], Any]  # min over the last axis, kept
    max_last: Callable[[Any], Any]
    zeros: Callable[[tuple[int, ...], Any], Any]
    tile: Callable[[Any, int], Any]
    copy: Callable[[Any], Any]
    take_last: Callable[[Any, Any], Any]  # x[..., idx[...]] along the last axis


_NUMPY = _Ops(
    mod=np, f32=np.float32, f64=np.float64, i64=np.int64,
    cast=lambda x, t: x.astype(t),
    min_last=lambda x: x.min(axis=-1, keepdims=True),
    max_last=lambda x: x.max(axis=-1, keepdims=True),
    zeros=lambda shape, t: np.zeros(shape, dtype=t),
    tile=np.tile,
    copy=np.copy,
    take_last=lambda x, i: np.take_along_axis(x, i[..., None], -1)[..., 0],
)


def _torch_ops(device: torch.device) -> _Ops:
    return _Ops(
        mod=torch, f32=torch.float32, f64=torch.float64, i64=torch.int64,
        cast=lambda x, t: x.to(t),
        min_last=lambda x: x.amin(dim=-1, keepdim=True),
        max_last=lambda x: x.amax(dim=-1, keepdim=True),
        zeros=lambda shape, t: torch.zeros(shape, dtype=t, device=device),
        tile=lambda x, n: x.repeat(n),
        copy=torch.clone,
        take_last=lambda x, i: torch.gather(x, -1, i.unsqueeze(-1)).squeeze(-1),
    )


def _steps(xp: _Ops, pre: Any, a: Any, g: Any, c_t: Any, c_dyn: Any, w: Any, w_b: Any, s0_w: Any,
           s0_b: Any, s2_w: Any, s2_b: Any, sx: Any, run_s: Any, ref: Any, keep: Any, fit: Any,
           pools: tuple[Any, ...], valid: Any, busy: Any, pool_valid: Any, *, allow_wait: bool,
           hold_ratio: float, reserve_busy: bool, sync_every: int) -> list[Any]:
    """The greedy steps and the evidence of each placed row (shapes in the module docstring).

    Returns ``[actions [S, R], k [T, S], go [T, S], probs [T*S, P], dyn [T*S, P, 5],
    contrib [T*S, P, F]]``: for step ``t`` and request ``s`` (entry ``t * S + s``), the row slot
    ``k`` it chose and whether it sent it (``go``; False for stop, a request already done, or a
    row that reserved a busy pool with ``reserve_busy``: its choice still adds to the backlog).
    """
    m = xp.mod
    S, R, P = run_s.shape
    dyn = list(DYNAMIC_PAIR_COLUMNS)
    arange = m.arange(S)
    if xp is not _NUMPY:
        arange = arange.to(run_s.device)
    placed = xp.zeros((S, P), xp.f64)
    remaining = xp.copy(valid)
    active = remaining.any(1)
    actions = xp.zeros((S, R), xp.i64) - 1
    hist_placed = xp.zeros((R, S, P), xp.f64)  # placed before each step
    hist_k = xp.zeros((R, S), xp.i64)
    hist_go = xp.zeros((R, S), m.bool_ if xp is _NUMPY else m.bool)
    base = pools[3]
    blocked = ~keep
    absent = ~(valid[:, :, None] & pool_valid[:, None, :])
    stop_col = R * P
    steps = 0
    for t in range(R):
        steps = t + 1
        hist_placed[t] = placed
        d = _pair_dynamic(xp, run_s, ref, pools, base + placed, row_axis=True)
        z = m.clip(pre + d @ c_dyn, 0, None)  # relu: [S, R, P, H]
        logits = m.where(blocked, NEG_INF, xp.cast(z @ w + w_b, xp.f64))  # [S, R, P]
        logits = m.where(absent | ~remaining[:, :, None], -math.inf, logits)
        if reserve_busy:
            logits = m.where(late_blocked(d, fit, m.where, xp.min_last), NEG_INF, logits)
        free_near = pool_free_within(d, fit & remaining[:, :, None], hold_ratio)
        stop_ok = ((placed.sum(1) > 0) | busy) & allow_wait & ~free_near
        count = xp.cast(m.clip(remaining.sum(1)[:, None], 1, None), xp.f32)
        a_mean = (a * remaining[:, :, None]).sum(1) / count  # [S, H]
        stop_hidden = m.clip(m.concatenate([a_mean, g], -1) @ s0_w + s0_b, 0, None)
        stop = m.where(stop_ok, xp.cast(stop_hidden @ s2_w + s2_b, xp.f64), NEG_INF)  # [S]
        # stop only when greater than every pair; else the first row (decode order) whose best
        # pair is within TIE_TOLERANCE of the maximum, on its first best pool (policy.model.greedy_choice)
        row_best = xp.max_last(logits)[..., 0]  # [S, R]
        top_logit = xp.max_last(row_best)  # [S, 1]
        k = xp.cast(row_best >= top_logit - TIE_TOLERANCE, xp.i64).argmax(1)
        row = logits[arange, k]  # [S, P]: the chosen row's first pool within the tolerance of its best
        first = xp.cast(row >= xp.max_last(row) - TIE_TOLERANCE, xp.i64).argmax(1)
        choice = m.where(stop > top_logit[:, 0], stop_col, k * P + first)
        take = active & (choice < stop_col)  # a row was chosen: sent, or reserving its pool
        k = m.clip(choice // P, None, R - 1)
        pool = choice % P
        go = take
        if reserve_busy:
            go = take & ~reserves(d[arange, k, pool, 3] > 0.5, pools[1][arange, pool])
        hist_k[t], hist_go[t] = k, go
        actions[arange, k] = m.where(go, pool, actions[arange, k])
        placed[arange, pool] += xp.cast(take, xp.f64)
        remaining[arange, k] &= ~take
        active = take & remaining.any(1)
        # Stop once every request is done; off the CPU the check waits for the device's queue,
        # so it is made every few steps (trained policies often hold most rows).
        if t % sync_every == sync_every - 1 and not bool(active.any()):
            break

    # evidence of each placed row at its step: one pass, the same formulas as in the steps
    es = xp.tile(arange, steps)  # [M] request of each (step, request) entry
    ek = hist_k[:steps].reshape(steps * S)
    d = _pair_dynamic(xp, run_s[es, ek], ref[es, ek], tuple(a[es] for a in pools),
                      base[es] + hist_placed[:steps].reshape(steps * S, P), row_axis=False)  # [M, P, 5]
    z = m.clip(pre[es, ek] + d @ c_dyn, 0, None)  # [M, P, H]
    row_logits = m.where(blocked[es, ek], NEG_INF, xp.cast(z @ w + w_b, xp.f64))
    if reserve_busy:
        row_logits = m.where(late_blocked(d, fit[es, ek], m.where, xp.min_last), NEG_INF, row_logits)
    row_logits = m.where(absent[es, ek], -math.inf, row_logits)
    e = m.exp(row_logits - xp.max_last(row_logits))
    probs = e / e.sum(-1)[:, None]  # [M, P]
    x = sx[es, ek]  # advanced indexing: a copy
    x[..., dyn] = d
    contrib = ((z > 0) * w) @ c_t.T * x  # d logit[p] / d x[p] times x: [M, P, F]
    return [actions, hist_k[:steps], hist_go[:steps], probs, d, contrib]


def _pair_dynamic(xp: _Ops, run_s: Any, ref: Any, pools: tuple[Any, ...], backlog: Any, *,
                  row_axis: bool) -> Any:
    """``[..., P, 5]`` float32: :func:`policy.features.pair_dynamic` over the last axis (pools)
    in the same float64 operations. ``pools`` = ``(slots, top, queued, base, boot [X, P], pad
    [X, P, K], nfree, floor [X, P])`` and ``backlog [X, P]`` (busy + queued + placed) per pool; with
    ``row_axis`` ``run_s``/``ref`` are ``[X, R, P]`` (a pool term is broadcast over the rows),
    else ``[X, P]``. The wait is :func:`policy.features.wait_terms`'."""
    m = xp.mod
    slots, top, queued, base, boot, pad, nfree, floor = pools
    now_free = backlog < slots
    grow = ~now_free & (top > slots) & (queued + (backlog - base) < top - slots)
    free = now_free | grow
    cap = m.where(grow, boot, math.inf)
    k = xp.cast(m.clip(backlog - slots, 0.0, None), xp.i64)
    alpha = m.where(now_free, 0.0, m.maximum(xp.take_last(pad, m.clip(k, None, pad.shape[-1] - 1)), floor))
    beta = m.where(now_free | (k < nfree), 0.0, (k - nfree + 1) / m.clip(slots, 1.0, None))
    load = m.clip(backlog / m.clip(slots, 1.0, None), None, 10.0)
    if row_axis:
        now_free, free, alpha, beta, cap, load = (x[:, None, :] for x in (now_free, free, alpha, beta, cap, load))
    wait = m.where(now_free, 0.0, m.minimum(alpha + beta * run_s, cap))
    finish = wait + run_s
    best = m.clip(xp.min_last(m.where(ref, finish, math.inf)), 1e-6, None)
    return xp.cast(m.stack([
        m.log1p(wait) / _LOG,
        m.log1p(finish) / _LOG,
        m.clip(m.log(m.clip(finish, 1e-6, None) / best), None, 3.0),
        m.broadcast_to(xp.cast(free, xp.f64), wait.shape),
        m.broadcast_to(load, wait.shape),
    ], -1), xp.f32)
