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
argmax's "first maximum" breaks ties exactly as ``numpy.argmax`` over the surviving rows does.
Matrix products and sums of different shapes may still round differently in the last float32
bit (the scores differ by ~1e-6): decisions could differ only between choices that tie to within
that, and on a GPU, whose kernels round differently from the CPU's, by the same margin.

Host <-> device traffic: one upload of everything the requests need (packed into one float64
buffer off the CPU; float32, bool and int64 survive the round trip exactly) and one download of
the results; nothing in between.

Shapes (``S`` requests, ``R`` the most ready rows, ``P`` the most pools, ``H`` hidden,
``F = F_PAIR``; slot ``k`` of request ``s`` is its ``k``-th row in decode order)::

    a          [S, R, H]     task part of the first head layer, per row slot
    b          [S, P, H]     pool part;  g [S, H] cluster summary
    static_x   [S, R, P, F]  pair features with the dynamic columns zeroed
    run_s      [S, R, P]     float64;  ref, keep [S, R, P] bool;  slots, base [S, P] float64
    result     actions [S, R] (pool or -1), step [S, R] (dispatch position or -1),
               probs [S, R, P] float64, dyn [S, R, P, 5], contrib [S, R, P, F]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from policy.features import DYNAMIC_PAIR_COLUMNS, F_PAIR, FeatureBatch, pair_rows
from policy.model import NEG_INF, PlacementGNN

_LOG = 8.0  # the scale of policy.features' log columns
_CHECK_EVERY = 4  # off the CPU: steps between checks whether every request is done
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
) -> list[Decided]:
    """Greedy decoding of every request of ``fbs`` (each with >= 1 ready row and >= 1 pool).

    ``h_table [N, H]`` / ``s_table [U, H]`` hold the task embeddings and run summaries of every
    run involved (on the model's device); ``node_idx`` / ``run_idx`` ``[sum R_s]`` index them for
    the ready rows of all requests, concatenated in request order.
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
    slots = np.ones((S, P), dtype=np.float64)
    zero_slots = np.zeros((S, P), dtype=bool)
    base = np.zeros((S, P), dtype=np.float64)
    row_valid = np.zeros((S, R), dtype=bool)
    slot_row = np.zeros((S, R), dtype=np.int64)
    busy = np.zeros(S, dtype=bool)
    pool_x = np.zeros((S, P, fbs[0].pool_x.shape[1]), dtype=np.float32)
    pool_valid = np.zeros((S, P), dtype=bool)
    x_alls: list[tuple[np.ndarray, np.ndarray]] = []
    off = 0
    for s, fb in enumerate(fbs):
        n, p, o = num[s], npools[s], fb.order
        x_all, m_all = pair_rows(fb.pairs, np.arange(n), np.zeros(p))  # [n, p, F]
        x_alls.append((x_all, m_all))
        st = x_all[o].copy()
        st[..., dyn] = 0.0
        sx[s, :n, :p] = st
        run_s[s, :n, :p] = fb.pairs.run_s[o]
        ref[s, :n, :p] = fb.pairs.ref[o]
        keep[s, :n, :p] = (m_all | ~m_all.any(axis=1, keepdims=True))[o]
        slots[s, :p] = fb.pairs.slots
        zero_slots[s, :p] = fb.pairs.slots == 0
        base[s, :p] = fb.pairs.base_backlog
        row_valid[s, :n] = True
        slot_row[s, :n] = off + o
        busy[s] = any(q.busy + q.queued > 0 for q in fb.pools)
        pool_x[s, :p] = fb.pool_x
        pool_valid[s, :p] = True
        off += n
    ready_x = np.concatenate([fb.ready_x for fb in fbs])
    (t_sx, t_run, t_ref, t_keep, t_slots, t_zero, t_base, t_valid, t_slot_row, t_busy, t_pool_x,
     t_pool_valid, t_ready_x, t_node, t_run_idx) = upload(
        [sx, run_s, ref, keep, slots, zero_slots, base, row_valid, slot_row, busy, pool_x, pool_valid,
         ready_x, node_idx, run_idx], device)

    # --- one model call per phase: task parts of all rows, pool parts of all requests ----------
    a_rows = model.task_part(h_table[t_node], s_table[t_run_idx], t_ready_x)  # [sum R, H]
    a = a_rows[t_slot_row]  # [S, R, H]
    hidden = a.shape[-1]
    b = torch.zeros((S, P, hidden), device=device)
    g = torch.zeros((S, hidden), device=device)
    for p in sorted(set(npools)):  # requests with the same number of pools share one call
        idx = [s for s in range(S) if npools[s] == p]
        sel: slice | Tensor = slice(None) if len(idx) == S else torch.tensor(idx, device=device)
        q, g_p = model.encode_pools(t_pool_x[sel, :p])
        b[sel, :p] = model.pool_part(q, g_p)
        g[sel] = g_p
    c_t = model.head_pair.weight.T  # [F, H]
    c_dyn = c_t[dyn]  # [5, H]
    w = model.head_out.weight[0]
    w_b = model.head_out.bias
    s0, s2 = model.stop[0], model.stop[2]
    assert isinstance(s0, torch.nn.Linear) and isinstance(s2, torch.nn.Linear)
    # written out as matmul + bias (not addmm) to round as the one-request decoder's numpy does
    s0_w, s0_b, s2_w, s2_b = s0.weight.T, s0.bias, s2.weight[0], s2.bias[0]
    pre = a[:, :, None, :] + b[:, None] + t_sx @ c_t  # [S, R, P, H]

    # --- the steps: only what the choice needs; the evidence for the reasons comes after -------
    arange = torch.arange(S, device=device)
    placed = torch.zeros((S, P), dtype=torch.float64, device=device)
    remaining = t_valid.clone()
    active = remaining.any(dim=1)
    actions = torch.full((S, R), -1, dtype=torch.int64, device=device)
    hist_placed = torch.zeros((R, S, P), dtype=torch.float64, device=device)  # before each step
    hist_k = torch.zeros((R, S), dtype=torch.int64, device=device)
    hist_go = torch.zeros((R, S), dtype=torch.bool, device=device)
    slots_b, zero_b = t_slots[:, None, :], t_zero[:, None, :]
    blocked = ~t_keep
    absent = ~(t_valid[:, :, None] & t_pool_valid[:, None, :])
    stop_col = R * P
    steps = 0
    for t in range(R):
        steps = t + 1
        hist_placed[t] = placed
        d = _pair_dynamic(t_run, t_ref, slots_b, zero_b, (t_base + placed)[:, None, :])
        z = torch.relu(pre + d @ c_dyn)  # [S, R, P, H]
        logits = (z @ w + w_b).to(torch.float64).masked_fill(blocked, NEG_INF)  # [S, R, P]
        logits = logits.masked_fill(absent | ~remaining[:, :, None], -torch.inf)
        stop_ok = ((placed.sum(dim=1) > 0) | t_busy) & allow_wait
        count = remaining.sum(dim=1, keepdim=True).clamp_min(1)
        a_mean = (a * remaining[:, :, None]).sum(dim=1) / count  # [S, H]
        stop_hidden = torch.relu(torch.cat([a_mean, g], dim=-1) @ s0_w + s0_b)
        stop = torch.where(stop_ok, (stop_hidden @ s2_w + s2_b).to(torch.float64), NEG_INF)  # [S]
        choice = torch.cat([logits.reshape(S, stop_col), stop[:, None]], dim=1).argmax(dim=1)
        go = active & (choice < stop_col)
        k = torch.div(choice, P, rounding_mode="floor").clamp_max(R - 1)
        pool = choice % P
        hist_k[t], hist_go[t] = k, go
        actions[arange, k] = torch.where(go, pool, actions[arange, k])
        placed[arange, pool] += go.to(torch.float64)
        remaining[arange, k] &= ~go
        active = go & remaining.any(dim=1)
        # Stop early once every request is done: free on a CPU; on a device the check waits for
        # the queue, so it is made every few steps (trained policies often hold most rows).
        if (device.type == "cpu" or t % _CHECK_EVERY == _CHECK_EVERY - 1) and not bool(active.any()):
            break

    # --- evidence of each placed row at its step (one pass; same formulas as in the steps) ------
    m = steps * S
    es = arange.repeat(steps)  # [M] request of each (step, request) entry
    ek = hist_k[:steps].reshape(m)
    d = _pair_dynamic(t_run[es, ek], t_ref[es, ek], t_slots[es], t_zero[es],
                      t_base[es] + hist_placed[:steps].reshape(m, P))  # [M, P, 5]
    z = torch.relu(pre[es, ek] + d @ c_dyn)  # [M, P, H]
    row_logits = (z @ w + w_b).to(torch.float64).masked_fill(blocked[es, ek], NEG_INF)
    row_logits = row_logits.masked_fill(absent[es, ek], -torch.inf)
    e = torch.exp(row_logits - row_logits.amax(dim=1, keepdim=True))
    probs = e / e.sum(dim=1, keepdim=True)  # [M, P]
    x = t_sx[es, ek].clone()
    x[..., dyn] = d
    contrib = ((z > 0) * w) @ c_t.T * x  # d logit[p] / d x[p] times x: [M, P, F]

    actions_h, k_h, go_h, probs_h, dyn_h, contrib_h = download(
        [actions, hist_k[:steps], hist_go[:steps], probs, d, contrib])
    out: list[Decided] = []
    for s, fb in enumerate(fbs):
        n, p, o = num[s], npools[s], fb.order
        x_all, m_all = x_alls[s]
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


def _pair_dynamic(run_s: Tensor, ref: Tensor, slots: Tensor, zero: Tensor, backlog: Tensor) -> Tensor:
    """``[..., P, 5]`` float32: :func:`policy.features.pair_dynamic` over the last axis (pools)
    in the same float64 operations, given ``backlog`` (busy + queued + placed) per pool."""
    free = backlog < slots
    per_slot = slots.clamp_min(1.0)
    wait = torch.where(free, 0.0, (backlog - slots + 1) / per_slot * run_s)
    wait = torch.where(zero, wait + run_s, wait)
    finish = wait + run_s
    best = torch.where(ref, finish, torch.inf).amin(dim=-1, keepdim=True).clamp_min(1e-6)
    return torch.stack([
        torch.log1p(wait) / _LOG,
        torch.log1p(finish) / _LOG,
        torch.log(finish.clamp_min(1e-6) / best).clamp_max(3.0),
        free.to(torch.float64).expand_as(wait),
        (backlog / per_slot).clamp_max(10.0).expand_as(wait),
    ], dim=-1).to(torch.float32)
