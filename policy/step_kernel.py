"""The one-request greedy decode compiled to machine code with numba (issue 5's CPU latency).

:meth:`policy.gnn.GNNPlacer._decode_features` decides a request in steps; each step is ~40
numpy calls on arrays of a few hundred numbers, so a step costs what the calls cost (a few
microseconds each), not what the arithmetic does. :func:`greedy_steps` runs the same steps in
one compiled call: the same quantities (the head's first layer from the precomputed static part
``pre`` plus the dynamic columns times ``c_dyn``, the late-binding mask, the stop guard and stop
head, the greedy choice over the surviving (row, pool) pairs against stop, near-ties to the row
first in decode order as :func:`policy.model.greedy_choice`) and the same
state updates as :class:`policy.features.PairDynamics` (a placement on pool ``j`` copies in
column ``j`` at its new backlog from the table and retakes every row's finish ratio). A pair's
head output is kept between steps and recomputed only when its columns changed (the placed
pool's, and a row's other pools when its earliest finish moved).

Precision: float32 where numpy computes in float32, float64 where it does, but the sums of the
two matrix products run in a fixed order, where numpy's BLAS blocks and vectorises them, so a
logit can differ in its last float32 bits (~1e-6, as the batched decoder's,
:mod:`policy.batch_decoder`): a decision can differ only between pairs whose scores tie to within
that. The tests decide hundreds of requests both ways and compare the decisions and evidence.

It serves the greedy path without a recorded trajectory (the placer's, the server's, the
benchmarks'); training (``record=True``) and sampling (``temperature > 0``) keep the numpy steps,
as do requests whose backlog table is too large to build (:data:`policy.features.TABLE_CELLS`).
Without numba (it is in the ``policy`` extra; a GPU host's image may lack it) :data:`AVAILABLE`
is False and the numpy steps serve every request.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)

try:
    import numba
except ImportError:  # pragma: no cover - exercised only where numba is not installed
    numba = None  # type: ignore[assignment]

#: whether the compiled steps can be used here
AVAILABLE = numba is not None


def _greedy_steps(pre: np.ndarray, c_dyn: np.ndarray, w: np.ndarray, w_b: np.ndarray, table: np.ndarray,
                  finish: np.ndarray, free_table: np.ndarray, cur: np.ndarray, fin: np.ndarray, free: np.ndarray,
                  ref: np.ndarray, fit: np.ndarray, blocked: np.ndarray, order: np.ndarray, a: np.ndarray,
                  g: np.ndarray, s0_w: np.ndarray, s0_b: np.ndarray, s2_w: np.ndarray, s2_b: np.ndarray,
                  top: np.ndarray, reserve_busy: bool, allow_wait: bool, busy_anywhere: bool, log_ratio: float,
                  neg_inf: float, tie: float) -> tuple[Any, ...]:
    """The greedy steps of one request (shapes: ``n`` ready rows, ``P`` pools, ``H`` hidden).

    ``pre [n, P, H]`` f32: the head's first layer without the dynamic columns; ``c_dyn [5, H]``,
    ``w [H]``, ``w_b [1]`` the head's; ``table [T, n, P, 5]`` f32, ``finish [T, n, P]`` f64 and
    ``free_table [T, P]`` bool: :class:`policy.features.PairDynamics`' table of every reachable
    backlog (index: tasks placed on the pool); ``cur [n, P, 5]`` / ``fin [n, P]`` / ``free [P]``
    its current state, updated in place; ``ref`` / ``fit`` / ``blocked [n, P]`` bool; ``order
    [n]`` the rows in decode order; ``a [n, H]``, ``g [H]`` and ``s0_w [2H, H2]``, ``s0_b``,
    ``s2_w [H2]``, ``s2_b [1]`` the stop head's inputs and weights; ``top [P]`` the most slots per pool;
    ``tie`` :data:`policy.model.TIE_TOLERANCE`.

    Returns ``(actions [n], sent [n], n_sent, reserved [n], n_reserved, d_kept [n, P, 5],
    z_kept [n, P, H], logits_kept [n, P], held [n], n_held, held_logits [n, P])``: the pool of
    each chosen row (-1 held), the rows sent and reserved in step order, each chosen row's
    dynamic columns, hidden layer and logits at its step, and the rows a stop held with their
    logits at that step (rows indexed by row, not by step).
    """
    n, num_pools, hidden = pre.shape
    num_dyn = c_dyn.shape[0]
    h2 = s0_b.shape[0]
    rows = order.copy()
    nrows = n
    placed = np.zeros(num_pools, dtype=np.int64)
    actions = np.full(n, -1, dtype=np.int64)
    sent = np.empty(n, dtype=np.int64)
    reserved = np.empty(n, dtype=np.int64)
    n_sent = 0
    n_reserved = 0
    d_kept = np.zeros((n, num_pools, num_dyn), dtype=np.float32)
    z_kept = np.zeros((n, num_pools, hidden), dtype=np.float32)
    logits_kept = np.zeros((n, num_pools), dtype=np.float64)
    held = np.empty(n, dtype=np.int64)
    n_held = 0
    held_logits = np.zeros((n, num_pools), dtype=np.float64)
    z = np.empty((n, num_pools, hidden), dtype=np.float32)
    raw = np.empty((n, num_pools), dtype=np.float64)  # each pair's head output, before the masks
    dirty = np.ones((n, num_pools), dtype=np.bool_)  # its columns changed since raw was computed
    logits = np.empty((n, num_pools), dtype=np.float64)
    a_sum = np.empty(hidden, dtype=np.float32)
    stop_in = np.empty(2 * hidden, dtype=np.float32)
    while nrows > 0:
        # the logits of every surviving pair, the guard and their first maximum
        free_near = False
        any_nan = False  # a NaN logit: numpy's max is NaN then, so stop never wins (gnn's error follows)
        best_logit = -math.inf
        best_k = 0
        best_p = 0
        for k in range(nrows):
            r = rows[k]
            late_best = math.inf  # the row's earliest finish ratio on a free feasible pool
            for p in range(num_pools):
                if fit[r, p] and cur[r, p, 3] > 0.5:
                    if cur[r, p, 2] < late_best:
                        late_best = cur[r, p, 2]
                    if cur[r, p, 2] <= log_ratio:
                        free_near = True
            for p in range(num_pools):
                if dirty[r, p]:  # a pair whose columns did not change keeps its head output
                    acc = np.float32(0.0)
                    for h in range(hidden):
                        dc = np.float32(0.0)
                        for c in range(num_dyn):
                            dc += cur[r, p, c] * c_dyn[c, h]
                        v = pre[r, p, h] + dc
                        if v < 0:
                            v = np.float32(0.0)
                        z[r, p, h] = v
                        acc += v * w[h]
                    raw[r, p] = float(acc + w_b[0])
                    dirty[r, p] = False
                lg = raw[r, p]
                if blocked[r, p]:
                    lg = neg_inf
                if reserve_busy and not cur[r, p, 3] > 0.5 and cur[r, p, 2] >= late_best:
                    lg = neg_inf
                logits[r, p] = lg
                if lg != lg:
                    any_nan = True
                if lg > best_logit or (k == 0 and p == 0):
                    best_logit = lg
                    best_k = k
                    best_p = p
        # near-ties go to the row first in decode order, on its first best pool (policy.model.greedy_choice)
        for k in range(nrows):
            r = rows[k]
            row_best = logits[r, 0]
            for p in range(1, num_pools):
                if logits[r, p] > row_best:
                    row_best = logits[r, p]
            if row_best >= best_logit - tie:
                best_k = k
                for p in range(num_pools):  # its first pool within the tolerance of its best
                    if logits[r, p] >= row_best - tie:
                        best_p = p
                        break
                break
        any_free = False
        for p in range(num_pools):
            if free[p]:
                any_free = True
        stop = neg_inf
        if allow_wait and (busy_anywhere or n_sent > 0) and not (any_free and free_near):
            for h in range(hidden):
                a_sum[h] = np.float32(0.0)
            for k in range(nrows):
                for h in range(hidden):
                    a_sum[h] += a[rows[k], h]
            for h in range(hidden):
                stop_in[h] = a_sum[h] / np.float32(nrows)
                stop_in[hidden + h] = g[h]
            out = np.float32(0.0)
            for j in range(h2):
                acc = np.float32(0.0)
                for i in range(2 * hidden):
                    acc += stop_in[i] * s0_w[i, j]
                v = acc + s0_b[j]
                if v > 0:
                    out += v * s2_w[j]
            stop = float(out + s2_b[0])
        # found by review: the running maximum skipped NaN logits, so stop held every row of a request
        # whose scores were NaN (no decision, no error, no fallback) where numpy raised for the fallback
        if stop > best_logit and not any_nan:  # stop: hold every remaining row
            for k in range(nrows):
                r = rows[k]
                held[n_held] = r
                n_held += 1
                for p in range(num_pools):
                    held_logits[r, p] = logits[r, p]
            break
        r = rows[best_k]
        pool = best_p
        actions[r] = pool
        if reserve_busy and not free[pool] and top[pool] > 0:  # policy.features.reserves
            reserved[n_reserved] = r
            n_reserved += 1
        else:
            sent[n_sent] = r
            n_sent += 1
        d_kept[r] = cur[r]
        z_kept[r] = z[r]
        logits_kept[r] = logits[r]
        # PairDynamics.place(pool)
        placed[pool] += 1
        at = placed[pool]
        free[pool] = free_table[at, pool]
        for i in range(n):
            fin[i, pool] = finish[at, i, pool]
            for c in range(num_dyn):
                cur[i, pool, c] = table[at, i, pool, c]
            dirty[i, pool] = True
            best = math.inf
            for p in range(num_pools):
                if ref[i, p] and fin[i, p] < best:
                    best = fin[i, p]
            best = max(best, 1e-6)
            for p in range(num_pools):
                ratio = np.float32(min(math.log(max(fin[i, p], 1e-6) / best), 3.0))
                if ratio != cur[i, p, 2]:  # the row's earliest finish moved: its other pools too
                    cur[i, p, 2] = ratio
                    dirty[i, p] = True
        for k in range(best_k, nrows - 1):
            rows[k] = rows[k + 1]
        nrows -= 1
    return (actions, sent, n_sent, reserved, n_reserved, d_kept, z_kept, logits_kept, held, n_held, held_logits)


greedy_steps: Callable[..., tuple[Any, ...]] = (
    numba.njit(cache=True, nogil=True)(_greedy_steps) if numba is not None else _greedy_steps)


_warm = False


def warm_up() -> bool:
    """Compile (or load from numba's cache) :func:`greedy_steps` now rather than on the first
    request, once per process; True if the compiled steps are available."""
    global _warm
    if not AVAILABLE:
        return False
    if _warm:
        return True
    t0 = time.perf_counter()
    n, p, h = 2, 2, 2
    f32, f64 = np.float32, np.float64
    greedy_steps(np.zeros((n, p, h), f32), np.zeros((5, h), f32), np.zeros(h, f32), np.zeros(1, f32),
                 np.zeros((n + 1, n, p, 5), f32), np.ones((n + 1, n, p), f64), np.ones((n + 1, p), np.bool_),
                 np.zeros((n, p, 5), f32), np.ones((n, p), f64), np.ones(p, np.bool_), np.ones((n, p), np.bool_),
                 np.ones((n, p), np.bool_), np.zeros((n, p), np.bool_), np.arange(n, dtype=np.int64),
                 np.zeros((n, h), f32), np.zeros(h, f32), np.zeros((2 * h, h), f32), np.zeros(h, f32), np.zeros(h, f32),
                 np.zeros(1, f32), np.ones(p, f64), True, True, True, math.inf, -1e9, 1e-4)
    _warm = True
    log.info("compiled decode steps ready in %.2f s (numba %s)", time.perf_counter() - t0, numba.__version__)
    return True
