"""The GNN placement policy as a :class:`~policy.placement.Placer`, with per-decision evidence.

Stable API (the policy server and the lab load the model only through this)::

    from policy.gnn import GNNPlacer
    placer = GNNPlacer.from_checkpoint("policy/checkpoints/default", device="cpu")
    decisions = placer.place(request, graphs)      # Decisions in dispatch order, with reasons
    placer.name, placer.version                    # "drl", "gnn-<sha256 prefix of the weights>"

How a batch is decided
    The task embeddings of each run are computed once per ``(run_key, digest)`` and cached (they
    depend only on the graph, see :mod:`policy.model`); the pools are encoded once per request.
    The batch is then decoded in steps (:mod:`policy.model`, point 5): each step scores every
    (unplaced ready task, feasible pool) pair and "stop"; the chosen task is sent and the pair
    features of the others are recomputed with its backlog (two tasks do not both take the one
    free GPU slot). The choice is the argmax (``temperature=0``, production) or a sample at
    ``temperature`` (training). Infeasible pools are masked, never learned. On "stop" the
    remaining tasks get no decision and stay ready (late binding; the simulator offers them
    again at the next decision point). ``allow_wait=False`` forbids stop: every task is placed.
    Stop is also refused while nothing runs or is queued anywhere and nothing was placed yet,
    so a batch always makes progress, and while some remaining task has a feasible pool with a
    free slot (``hold_ratio``, :data:`~policy.features.HOLD_RATIO`: by default any such
    pool; ``1``: only its earliest-finish one). Holding is then only "do not queue behind busy
    pools": trained models were seen to hold hundreds of tasks on idle capacity (on 1,000-task
    DAGs, and one training seed in three on 200-task ones; docs/policy.md).
    The greedy steps of a lone request run compiled (:mod:`policy.step_kernel`, numba; the same
    decisions, ``step_kernel``) where numba is installed; training's recorded and sampled steps,
    and requests too large for the backlog table, run on numpy arrays.
    With ``reserve_busy`` (a checkpoint trained with ``drl-trainer train --reserve-busy 1``
    decodes so; :data:`~policy.features.RESERVE_BUSY`), a task given a pool with no free slot
    and no room to grow is not sent: it reserves that pool's next slot for the rest of the batch
    (later steps see the backlog) and stays ready, as ``srpt+eft`` holds a task for its ledger's
    reserved slot; only choices that start now (or boot a worker) are dispatched. Such a decoder
    offers a busy pool to a task only where its estimated finish beats every free feasible pool
    of the task (:func:`~policy.features.late_blocked`; training's choices leave out the same).
    With ``premium_ratio`` (``--premium-ratio``, recorded in the checkpoint;
    :data:`~policy.features.PREMIUM_RATIO`), neither guard counts a pool priced more than that
    factor x the task's cheapest feasible pool per unit of its work: holding a task, or reserving
    a busy cheap pool, while only a premium pool is free becomes a legal step (``cost-cp``'s).
    With ``cp_gate`` (``drl-policy serve --cp-gate``, or recorded by ``drl-trainer train
    --cp-gate``; :data:`~policy.features.CP_GATE`) such premium pools are masked outright for the
    tasks off their run's remaining critical path (``cost-cp``'s rule as a hard constraint,
    :func:`~policy.features.gate_premium`), or for every task with ``cp_gate_scope="all"``; a
    decision's reason names the pools it gated.

Ensembles
    :meth:`GNNPlacer.with_members` (or a checkpoint written by ``drl-trainer ensemble``) averages
    several models' logits at every step: their fused model (:func:`~policy.model.fuse_models`,
    one wider network whose logits are the members' mean), run and decoded as one model, under
    the first model's settings: one forward pass for the ensemble, not one a member.

The reason string
    :func:`attribute` is the attribution machinery shared with ``drl-trainer explain``:
    gradient x input of the margin between the chosen pool's logit and the runner-up's, over
    the pair features (what made this pool better than the next) and over the task nodes of the
    run (which DAG nodes drove the decision). The placer uses the cheap part (pair features, one
    batched backward pass through the head) to write e.g.
    ``gpu (gpu-a10) p=0.97 over cpu-large p=0.02: est. run 15s vs 60s, affinity x8 vs x1``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from policy import step_kernel as step_kernel_mod
from policy.batch_decoder import NotBatched, compiled_steps, decode_greedy, row_evidence, softmax_rows, upload
from policy.checkpoint import Checkpoint, load_checkpoint
from policy.config import STEP_KERNELS
from policy.errors import ModelOutputError
from policy.features import (
    BOOT_FLOOR_SCHEMA,
    CP_GATE,
    CP_GATE_SCOPE,
    DYNAMIC_PAIR_COLUMNS,
    HOLD_RATIO,
    PAIR_FEATURES,
    PREMIUM_RATIO,
    RESERVE_BUSY,
    TASK_FEATURES,
    FeatureBatch,
    PairDynamics,
    RunFeatures,
    check_gate_scope,
    check_hold_ratio,
    check_premium_ratio,
    featurize,
    guard_fit,
    late_blocked,
    pair_rows,
    pool_free_within,
    reserves,
)
from policy.lru import LRU
from policy.model import NEG_INF, PlacementGNN, Step, fuse_models, greedy_choice
from policy.placement import down_note, unfit
from policy.schema import Decision, PlacementRequest, RunGraph

log = logging.getLogger(__name__)

_EMBED_CACHE_SIZE = 512
_POOL_CACHE_SIZE = 256


@dataclass
class Decoded:
    """One decoded batch.

    ``actions[r]`` is the pool index of ready row ``r``, or -1 when it was held (stop chosen
    before it) or reserved a busy pool's next slot (late binding: its step's action names the
    pool; not sent); ``steps`` the decoding steps (what :func:`policy.model.collate_steps` needs to
    score them again in training); ``logp`` the summed log-probability of the steps at
    temperature 1; ``probs[r]`` the softmax over row ``r``'s pools at the step it was decided
    (or held); ``pair_contrib[r]`` gradient x input of each of row ``r``'s pool logits w.r.t. its
    own pair features at that step. ``batch.pair_x[r]`` holds the pair features of row ``r`` at
    that step. ``order`` (when set) is the dispatch order, for a decoding that kept no steps.
    """

    batch: FeatureBatch
    actions: np.ndarray
    steps: list[Step]
    logp: float
    probs: np.ndarray
    pair_contrib: np.ndarray
    order: list[int] | None = None

    @property
    def placed_order(self) -> list[int]:
        """Rows in the order they were sent (the dispatch order)."""
        if self.order is not None:
            return self.order
        return [st.action[0] for st in self.steps if st.action is not None]


class GNNPlacer:
    """Places ready tasks with a :class:`~policy.model.PlacementGNN` (see the module docstring)."""

    name = "drl"

    def __init__(
        self,
        model: PlacementGNN,
        *,
        version: str = "gnn-untrained",
        manifest: Mapping[str, Any] | None = None,
        device: str = "cpu",
        temperature: float = 0.0,
        seed: int = 0,
        allow_wait: bool = True,
        hold_ratio: float = HOLD_RATIO,
        reserve_busy: bool = RESERVE_BUSY,
        premium_ratio: float = PREMIUM_RATIO,
        cp_gate: float = CP_GATE,
        cp_gate_scope: str = CP_GATE_SCOPE,
        explain: bool = True,
        step_kernel: str = "auto",
    ) -> None:
        if temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        self.model = model.to(device).eval()
        self.version = version
        self.manifest = dict(manifest or {})
        self.device = torch.device(device)
        self.temperature = temperature
        self.allow_wait = allow_wait
        self.hold_ratio = check_hold_ratio(hold_ratio)
        self.reserve_busy = bool(reserve_busy)
        self.premium_ratio = check_premium_ratio(premium_ratio)
        self.cp_gate = check_premium_ratio(cp_gate, "cp_gate")
        self.cp_gate_scope = check_gate_scope(cp_gate_scope)
        self.explain = explain
        self.rng = np.random.default_rng(seed)
        self._embed: LRU[tuple[str, str], tuple[Tensor, Tensor]] = LRU(_EMBED_CACHE_SIZE)
        self._pools: LRU[bytes, tuple[np.ndarray, np.ndarray]] = LRU(_POOL_CACHE_SIZE)
        #: the network the placer runs: its model, or its ensemble's fused model (:meth:`with_members`)
        self.net = self.model
        self._weights = self.net.numpy_weights()
        #: arrays of place_many's batched steps: None (numpy on a CPU, torch tensors on a GPU),
        #: "numpy" or "torch" (tests run the GPU's code on the CPU with "torch")
        self.batch_backend: str | None = None
        #: the one-request greedy steps: "auto" (compiled, :mod:`policy.step_kernel`, where numba
        #: is installed; numpy otherwise), "compiled" or "numpy"
        self.step_kernel = step_kernel_choice(step_kernel)
        if self.step_kernel == "compiled":
            step_kernel_mod.warm_up()  # compiled (or loaded from numba's cache) once per process
        #: further models whose scores are averaged with this one's at every step (an ensemble,
        #: :meth:`with_members`); their decoder settings are this placer's
        self.members: list[GNNPlacer] = []

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "cpu", **kwargs: Any) -> GNNPlacer:
        """Load a verified checkpoint directory (raises :class:`~policy.errors.CheckpointError`)."""
        if device == "cuda" and not torch.cuda.is_available():
            log.warning("CUDA requested but not available; the GNN policy runs on the CPU")
            device = "cpu"
        ckpt: Checkpoint = load_checkpoint(path, device=device)
        kwargs.setdefault("reserve_busy", reserve_busy_of(ckpt.manifest))
        kwargs.setdefault("premium_ratio", premium_ratio_of(ckpt.manifest))
        kwargs.setdefault("cp_gate", cp_gate_of(ckpt.manifest))
        kwargs.setdefault("cp_gate_scope", cp_gate_scope_of(ckpt.manifest))
        placer = cls(ckpt.model, version=ckpt.version, manifest=ckpt.manifest, device=device, **kwargs)
        if ckpt.members:  # an ensemble checkpoint: its own version names it
            placer.with_members(ckpt.members).version = ckpt.version
        return placer

    @property
    def models(self) -> list[PlacementGNN]:
        """This placer's model and its ensemble members' (:meth:`with_members`)."""
        return [self.model] + [m.model for m in self.members]

    def with_members(self, members: Sequence[tuple[str, PlacementGNN]]) -> GNNPlacer:
        """This placer as an ensemble: at every step the logits of each (task, pool) pair and of
        stop are the mean over this model and ``members``' models (``(version, model)`` pairs, as
        :attr:`policy.checkpoint.Checkpoint.members` lists them; a product of their distributions),
        read on the same features and under this placer's guards, masks and gates. It runs their
        fused model (:attr:`net`, :func:`~policy.model.fuse_models`): one forward for all members,
        decoded by every path (one request, compiled or numpy; :meth:`place_many`'s batches) as one
        wider model, the reasons' evidence the members' mean. Returns ``self``."""
        self.members = [GNNPlacer(m, version=v, device=str(self.device), explain=False, step_kernel="numpy")
                        for v, m in members]
        self.version = "+".join([self.version, *(v for v, _ in members)])
        self.clear_cache()  # embeddings cached so far are the first model's alone
        return self

    def clear_cache(self) -> None:
        """Forget cached run embeddings and weights (call after changing the model's weights, or
        a member's: an ensemble is fused again)."""
        self.clear_embeddings()
        self.net = fuse_models(self.models) if self.members else self.model  # on the model's device, in eval mode
        self._weights = self.net.numpy_weights()

    def clear_embeddings(self) -> None:
        """Forget cached run embeddings and pool parts, not the weights: what a run's first
        request meets (``python -m policy.bench_model``'s cold figure)."""
        self._embed.clear()
        self._pools.clear()

    def forget_run(self, key: tuple[str, str]) -> None:
        """Drop the cached embeddings of run ``(run_key, digest)`` (its graph left the server's cache;
        an ensemble's are its fused model's, found by review: its members kept theirs once)."""
        self._embed.discard(key)

    # --- decoding ------------------------------------------------------------------------------

    def _run_embeddings(self, fb: FeatureBatch) -> tuple[Tensor, Tensor]:
        """Embeddings of the ready tasks ``[R, H]`` and of their runs ``[R, H]``."""
        h_rows: list[Tensor] = []
        s_rows: list[Tensor] = []
        for rf in fb.runs:
            key = (rf.run_key, rf.digest)
            hit = self._embed.get(key)
            if hit is None:
                x = torch.from_numpy(rf.x).to(self.device)
                ei = torch.from_numpy(rf.edge_index).to(self.device)
                node_run = torch.zeros(rf.num_nodes, dtype=torch.long, device=self.device)
                h, s = self.net.encode_graph(x, ei, node_run, 1)
                hit = self._embed.put(key, (h, s[0]))
            h_rows.append(hit[0])
            s_rows.append(hit[1])
        rn = torch.from_numpy(fb.ready_node).to(self.device)
        rr = torch.from_numpy(fb.ready_run).to(self.device)
        if len(fb.runs) == 1:
            return h_rows[0][rn], s_rows[0].unsqueeze(0).expand(len(rn), -1)
        offs = np.cumsum([0] + [rf.num_nodes for rf in fb.runs[:-1]])
        h_all = torch.cat(h_rows)
        s_all = torch.stack(s_rows)
        return h_all[torch.from_numpy(offs[fb.ready_run] + fb.ready_node).to(self.device)], s_all[rr]

    def _head_parts(self, fb: FeatureBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(a [R, H], g [H], b [P, H])``: the task and pool sides of the first head layer and
        the cluster summary for ``fb``'s ready tasks, of :attr:`net` (an ensemble's fused model)."""
        h_ready, s_ready = self._run_embeddings(fb)
        ready_x = torch.from_numpy(fb.ready_x).to(self.device)
        b_np, g_np = self._pool_parts(fb.pool_x)
        return self.net.task_side(h_ready, s_ready, ready_x).cpu().numpy(), g_np, b_np

    def _pool_parts(self, pool_x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(b [P, H], g [H])``: the pool side of the head and the cluster summary, cached by the
        pool features (a catalogue's pools repeat their load states from request to request)."""
        key = pool_x.tobytes() + repr(pool_x.shape).encode()
        hit = self._pools.get(key)
        if hit is not None:
            return hit
        b, g = self.net.pool_side(*self.net.encode_pools(torch.from_numpy(pool_x).to(self.device).unsqueeze(0)))
        return self._pools.put(key, (b[0].cpu().numpy(), g[0].cpu().numpy()))

    def features(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> FeatureBatch:
        """``request``'s features as this placer decodes them (pairs filled while decoding, its
        premium gate and scope applied; training's teacher steps are read against the same)."""
        return featurize(request, graphs, pairs=False, cp_gate=self.cp_gate, cp_gate_scope=self.cp_gate_scope,
                         boot_floor=self.boot_floor)

    @property
    def boot_floor(self) -> bool:
        """Whether this placer's network reads schema 7's wait on a pool with no worker (a boot at
        least, :attr:`policy.features.PairStatic.floor`); older checkpoints read it as trained."""
        return self.net.schema_version >= BOOT_FLOOR_SCHEMA

    @torch.no_grad()
    def decode(
        self, request: PlacementRequest, graphs: Mapping[str, RunGraph], *, temperature: float | None = None
    ) -> Decoded:
        """Decide the ready tasks of ``request`` step by step (see the module docstring)."""
        temp = self.temperature if temperature is None else temperature
        return self._decode_features(self.features(request, graphs), temp, record=True)

    @torch.no_grad()
    def _decode_features(self, fb: FeatureBatch, temp: float, *, record: bool = False) -> Decoded:
        """:meth:`decode` of a featurized request; the steps and ``Decoded.logp`` (what training
        needs) are kept only with ``record=True``, the placer's path goes without them."""
        num_pools = fb.num_pools
        n = fb.num_ready
        actions = np.full(n, -1, dtype=np.int64)
        probs = np.zeros((n, num_pools), dtype=np.float64)
        contrib = np.zeros((n, num_pools, len(PAIR_FEATURES)), dtype=np.float32)
        steps: list[Step] = []
        if n == 0:
            return Decoded(fb, actions, steps, 0.0, probs, contrib)
        a_np, g_np, b_np = self._head_parts(fb)  # [R, H], [H], [P, H]
        wt = self._weights
        busy_anywhere = any(p.busy + p.queued > 0 for p in fb.pools)
        rows = fb.order.copy()
        order: list[int] = []
        reserved: list[int] = []
        total_logp = 0.0
        # The static pair columns and their share of the first head layer are computed once; a
        # step only recomputes the few columns that depend on the backlog placed so far.
        dyn = np.array(DYNAMIC_PAIR_COLUMNS)
        dynamics = PairDynamics(fb.pairs, steps=n)  # the backlog placed so far (dynamics.placed) and its waits
        every = np.arange(n)
        x_all, m_all = pair_rows(fb.pairs, every, dynamics.placed, dynamics(every))  # [R, P, F]
        c_t = wt["c_t"]
        c_dyn = c_t[dyn]  # [5, H]
        w, w_b = wt["w"], wt["b"]
        static_x = x_all.copy()
        static_x[..., dyn] = 0.0
        pre = a_np[:, None, :] + b_np[None] + static_x @ c_t  # [R, P, H]
        keep_all = m_all | ~m_all.any(axis=1, keepdims=True)
        g_all = guard_fit(fb.pairs, every, m_all, self.premium_ratio)  # the pools the guards count
        blocked = None if keep_all.all() else ~keep_all  # rows x pools masked to NEG_INF
        # One step costs a few dozen numpy calls on arrays of a few hundred numbers, so calls are
        # what is saved: the stop head only when stop is allowed, the log-probability only when
        # recorded, the argmax over pairs compared with stop directly, and the evidence of the
        # placed rows (probabilities, features, gradient x input) computed for all of them after
        # the steps from what each step kept of its chosen row.
        tab = dynamics.table() if temp == 0 and not record and self.step_kernel == "compiled" else None
        if tab is not None:  # the same steps in one compiled call
            (actions, sent, n_sent, resv, n_resv, d_kept, z_kept, logits_kept, held, n_held,
             held_logits) = compiled_steps(fb, tab, pre, a_np, g_np, m_all, g_all, wt, allow_wait=self.allow_wait,
                                           hold_ratio=self.hold_ratio, reserve_busy=self.reserve_busy)
            order, reserved = [int(r) for r in sent[:n_sent]], [int(r) for r in resv[:n_resv]]
            rows = held[:n_held]  # what a stop held (the loop below is skipped)
            if n_held:  # the evidence of held rows, as a stop in the loop below keeps it
                probs[rows] = softmax_rows(held_logits[rows])
                x = x_all[rows]
                x[..., dyn] = tab[3][rows]  # the current columns, which the kernel updated in place
                fb.pair_x[rows], fb.mask[rows] = x, m_all[rows]
        else:
            d_kept = np.zeros((n, num_pools, len(dyn)), dtype=np.float32)
            z_kept = np.zeros((n, num_pools, c_t.shape[1]), dtype=np.float32)
            logits_kept = np.zeros((n, num_pools), dtype=np.float64)
        while tab is None and len(rows):
            d = dynamics(rows)  # [r, P, 5]: pair_dynamic(fb.pairs, rows, dynamics.placed)
            z = np.maximum(pre[rows] + d @ c_dyn, 0.0)  # [r, P, H]
            logits = (z @ w + w_b).astype(np.float64)
            if blocked is not None:
                logits[blocked[rows]] = NEG_INF
            fit = g_all[rows]
            if self.reserve_busy:
                logits[late_blocked(d, fit)] = NEG_INF
            free = dynamics.free
            stop_ok = bool(self.allow_wait and (busy_anywhere or order)
                           and not (free.any() and pool_free_within(d, fit, self.hold_ratio)))
            if stop_ok:
                hidden = np.maximum(np.concatenate([a_np[rows].mean(axis=0), g_np]) @ wt["s0_w"] + wt["s0_b"], 0.0)
                stop = float(hidden @ wt["s2_w"] + wt["s2_b"][0])
            else:
                stop = NEG_INF
            stop_col = logits.size
            if temp > 0:
                flat = np.append(logits.ravel(), stop)
                # a masked pair or a refused stop stays impossible at any temperature (found by
                # review: NEG_INF / 1e9 is -1, and a GPU task was sampled onto a CPU pool)
                zt = np.where(flat <= NEG_INF, -np.inf, flat / temp)
                p = np.exp(zt - np.max(zt))
                if not np.isfinite(p).all() or not p.sum() > 0:  # as greedy decoding says it
                    raise ModelOutputError(f"the model's scores are not finite for {len(rows)} ready task(s) "
                                           "at this sampling step")
                choice = int(self.rng.choice(len(flat), p=p / p.sum()))
            else:
                # stop only when greater than every pair; else the greedy pair, near-ties to the
                # row first in decode order (policy.model.TIE_TOLERANCE)
                choice = stop_col if stop > logits.max() else greedy_choice(logits)
            if record:
                flat = np.append(logits.ravel(), stop)
                total_logp += float(flat[choice] - _logsumexp(flat))
            if choice == stop_col:  # stop: hold every remaining row
                if record:
                    steps.append(Step(dynamics.placed.copy(), rows.copy(), None, stop_ok, self.reserve_busy,
                                      self.premium_ratio))
                probs[rows] = softmax_rows(logits)
                x = x_all[rows]
                x[..., dyn] = d
                fb.pair_x[rows], fb.mask[rows] = x, m_all[rows]
                break
            k, pool = divmod(choice, num_pools)
            r = int(rows[k])
            if record:
                steps.append(Step(dynamics.placed.copy(), rows.copy(), (r, pool), stop_ok, self.reserve_busy,
                                  self.premium_ratio))
            actions[r] = pool
            if self.reserve_busy and reserves(free[pool], fb.pairs.top[pool]):
                reserved.append(r)  # late binding: it holds its slot in this batch but is not sent
            else:
                order.append(r)
            d_kept[r], z_kept[r], logits_kept[r] = d[k], z[k], logits[k]
            dynamics.place(pool)
            rows = np.concatenate((rows[:k], rows[k + 1:]))
        if order or reserved:
            done = np.array(order + reserved)
            probs[done], x, contrib[done] = row_evidence(done, logits_kept, d_kept, z_kept, x_all, wt)
            fb.pair_x[done], fb.mask[done] = x, m_all[done]
        actions[reserved] = -1
        return Decoded(fb, actions, steps, total_logp, probs, contrib, order)

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        """Decisions in dispatch order; tasks the policy holds (stop) get none and stay ready."""
        dec = self._decode_features(self.features(request, graphs), self.temperature)
        return self._decisions(dec, dec.placed_order)

    def place_many(
        self, requests: Sequence[PlacementRequest], graphs: Sequence[Mapping[str, RunGraph]]
    ) -> list[list[Decision]]:
        """:meth:`place` for each request of a micro-batch, with one model call per phase.

        The graphs of runs not in the embedding cache are encoded in one forward (a disjoint
        union), the pools and task parts of all requests in one more, and the greedy steps of all
        requests together (:mod:`policy.batch_decoder`). The decisions are those of :meth:`place`
        for each request. A lone request (or ``temperature > 0``, whose samples follow
        :meth:`place`'s generator) takes the one-request path, which is faster for one. An
        ensemble is batched as its fused model, as one model is.
        """
        if len(requests) != len(graphs):
            raise ValueError(f"place_many: {len(requests)} requests but {len(graphs)} graph maps")
        fbs = [self.features(r, g) for r, g in zip(requests, graphs, strict=True)]
        batched = [i for i, fb in enumerate(fbs) if fb.num_ready and fb.num_pools]
        if self.temperature > 0 or len(batched) < 2:
            return [self._decisions(dec, dec.placed_order)
                    for dec in (self._decode_features(fb, self.temperature) for fb in fbs)]
        out: list[list[Decision]] = [[] for _ in fbs]
        for i, fb in enumerate(fbs):
            if not (fb.num_ready and fb.num_pools):  # nothing to decide: the one-request path says so
                dec = self._decode_features(fb, 0.0)
                out[i] = self._decisions(dec, dec.placed_order)
        group = [fbs[i] for i in batched]
        h_table, s_table, node_idx, run_idx = self._embeddings_many(group)
        try:
            decided = decode_greedy(self.net, group, h_table, s_table, node_idx, run_idx,
                                    allow_wait=self.allow_wait, hold_ratio=self.hold_ratio,
                                    reserve_busy=self.reserve_busy, premium_ratio=self.premium_ratio,
                                    backend=self.batch_backend,
                                    weights=self._weights if self.step_kernel == "compiled" else None)
        except NotBatched:
            return [self._decisions(dec, dec.placed_order)
                    for dec in (self._decode_features(fb, self.temperature) for fb in fbs)]
        for i, fb, d in zip(batched, group, decided, strict=True):
            fb.pair_x, fb.mask = d.pair_x, d.mask
            out[i] = self._decisions(Decoded(fb, d.actions, [], 0.0, d.probs, d.contrib), d.order)
        return out

    @torch.no_grad()
    def _embeddings_many(self, fbs: Sequence[FeatureBatch]) -> tuple[Tensor, Tensor, np.ndarray, np.ndarray]:
        """``(h_table [N, H], s_table [U, H], node_idx, run_idx)`` for the ready rows of ``fbs``
        (concatenated in request order): cached run embeddings, and the runs not cached encoded
        in one forward over their disjoint union."""
        tables: dict[tuple[str, str], int] = {}
        hs: list[Tensor | None] = []
        ss: list[Tensor | None] = []
        new: list[tuple[int, RunFeatures]] = []
        for fb in fbs:
            for rf in fb.runs:
                key = (rf.run_key, rf.digest)
                if key in tables:
                    continue
                tables[key] = len(hs)
                hit = self._embed.get(key)
                if hit is None:
                    new.append((len(hs), rf))
                    hs.append(None)
                    ss.append(None)
                else:
                    hs.append(hit[0])
                    ss.append(hit[1])
        if new:
            sizes = [rf.num_nodes for _, rf in new]
            offs = np.cumsum([0] + sizes[:-1])
            x = np.concatenate([rf.x for _, rf in new])
            ei = np.concatenate([rf.edge_index + o for (_, rf), o in zip(new, offs, strict=True)], axis=1)
            node_run = np.repeat(np.arange(len(new), dtype=np.int64), sizes)
            tx, tei, tnr = upload([x, ei, node_run], self.device)
            h, summary = self.net.encode_graph(tx, tei, tnr, len(new))
            for (pos, rf), h_run, s_run in zip(new, h.split(sizes), summary, strict=True):
                if len(new) > 1:
                    # its own storage (found by review: a slice of the batch's tensor kept every
                    # run encoded with it alive, a dropped 3,000-task run for a cached 3-task one)
                    h_run, s_run = h_run.clone(), s_run.clone()
                hs[pos], ss[pos] = h_run, s_run
                self._embed.put((rf.run_key, rf.digest), (h_run, s_run))
        h_list = [t for t in hs if t is not None]
        s_list = [t for t in ss if t is not None]
        node_off = np.cumsum([0] + [int(t.shape[0]) for t in h_list[:-1]])
        node_idx = np.concatenate([node_off[[tables[(fb.runs[u].run_key, fb.runs[u].digest)] for u in
                                             fb.ready_run]] + fb.ready_node for fb in fbs])
        run_idx = np.concatenate([np.array([tables[(fb.runs[u].run_key, fb.runs[u].digest)]
                                            for u in fb.ready_run], dtype=np.int64) for fb in fbs])
        return torch.cat(h_list), torch.stack(s_list), node_idx.astype(np.int64), run_idx

    def _decisions(self, dec: Decoded, order: Sequence[int]) -> list[Decision]:
        fb = dec.batch
        rows = np.asarray(order, dtype=np.int64)
        reasons = explain_rows(dec, rows) if self.explain else [""] * len(rows)
        chosen = dec.probs[rows, dec.actions[rows]]
        if not np.isfinite(chosen).all():  # argmax over NaN picks a pool at random: refuse instead
            raise ModelOutputError(f"the model's probabilities are not finite for {len(rows)} ready task(s) "
                                   "(an input far outside the training range?)")
        choices = dec.actions[rows].tolist()
        scores = chosen.tolist()
        fits = np.asarray(fb.mask[rows].any(axis=1)).tolist()
        gated = fb.pairs.gated
        out: list[Decision] = []
        for i, choice, score, reason, fit in zip(order, choices, scores, reasons, fits, strict=True):
            pool = fb.pools[choice]
            if not fit:
                reason += f"; {unfit(fb.tasks[i], fb.pools)}"
            elif not pool.up:
                reason += f"; {down_note(pool)}"
            if gated is not None and gated[i].any():
                names = ",".join(p.name for p, g in zip(fb.pools, gated[i], strict=True) if g)
                who = "every task" if self.cp_gate_scope == "all" else "off the critical path"
                reason += f"; {who}: premium {names} gated (cp_gate {self.cp_gate:g})"
            ready = fb.ready[i]
            out.append(
                Decision(
                    run_key=ready.run_key,
                    task_id=ready.task_id,
                    pool=pool.name,
                    vm_class=pool.vm_class,
                    score=score,
                    reason=reason,
                )
            )
        return out


def step_kernel_choice(choice: str) -> str:
    """``"compiled"`` or ``"numpy"``: the one-request steps for ``choice`` (``"auto"``: compiled
    where numba is installed); ``ValueError`` for another name, or "compiled" without numba."""
    if choice not in STEP_KERNELS:
        raise ValueError(f"step_kernel must be one of {STEP_KERNELS}, got {choice!r}")
    if choice == "compiled" and not step_kernel_mod.AVAILABLE:
        raise ValueError("step_kernel='compiled' needs numba (pip install numba, in the policy extra)")
    if choice == "auto":
        return "compiled" if step_kernel_mod.AVAILABLE else "numpy"
    return choice


def _trained(manifest: Mapping[str, Any], key: str, default: Any) -> Any:
    """``training.<key>`` of a checkpoint's manifest (``default`` for checkpoints that predate the
    option)."""
    return (manifest.get("training") or {}).get(key, default)


def _trained_ratio(manifest: Mapping[str, Any], key: str, default: float) -> float:
    """``training.<key>`` of a checkpoint's manifest, checked as a premium ratio."""
    return check_premium_ratio(float(_trained(manifest, key, default)), key)


def premium_ratio_of(manifest: Mapping[str, Any]) -> float:
    """The premium ratio of a checkpoint's decoder guards (``training.premium_ratio`` in its
    manifest, :data:`~policy.features.PREMIUM_RATIO`: 0, off, for checkpoints that predate it)."""
    return _trained_ratio(manifest, "premium_ratio", PREMIUM_RATIO)


def cp_gate_of(manifest: Mapping[str, Any]) -> float:
    """The premium gate a checkpoint was trained with (``training.cp_gate`` in its manifest,
    :data:`~policy.features.CP_GATE`: 0, off, for checkpoints that predate it)."""
    return _trained_ratio(manifest, "cp_gate", CP_GATE)


def cp_gate_scope_of(manifest: Mapping[str, Any]) -> str:
    """The tasks a checkpoint's premium gate was trained to apply to (``training.cp_gate_scope``,
    ``off-cp`` for checkpoints that predate it; :data:`~policy.features.CP_GATE_SCOPES`)."""
    return check_gate_scope(str(_trained(manifest, "cp_gate_scope", CP_GATE_SCOPE)))


def reserve_busy_of(manifest: Mapping[str, Any]) -> bool:
    """How a checkpoint decodes busy pools: as it was trained (``training.reserve_busy`` in its
    manifest; checkpoints from before the option send every chosen task)."""
    return bool(_trained(manifest, "reserve_busy", RESERVE_BUSY))


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + math.log(float(np.exp(x - m).sum()))


# --- attribution ---------------------------------------------------------------------------------


@dataclass
class Attribution:
    """Evidence for one decision (row ``row`` of a decoded batch).

    ``pair`` maps each pair feature to its contribution to ``logit[chosen] - logit[runner_up]``
    (gradient x input, chosen minus runner-up); ``nodes`` (only from :func:`attribute` with
    ``nodes=True``) is ``|gradient x input|`` summed over features, per task node of the run,
    and ``task_features`` the same summed over nodes, per task feature.
    """

    row: int
    chosen: int
    runner_up: int | None
    margin: float
    pair: dict[str, float]
    nodes: np.ndarray | None = None
    task_features: dict[str, float] | None = None


def attribute(model: PlacementGNN | Sequence[PlacementGNN], dec: Decoded, row: int,
              device: torch.device | str = "cpu") -> Attribution:
    """Full evidence for one decision: pair features and task nodes (used by ``explain``).

    Rows of one request share the task encoder, so node attributions for a row come from the
    gradient of that row's margin alone (one backward pass per call). ``model`` may be an
    ensemble's models (:attr:`GNNPlacer.models`): the margin is then that of their mean logits.
    """
    from policy.model import collate

    device = torch.device(device)
    fb = dec.batch
    bt = collate([fb], device)
    xs = bt.x.clone().requires_grad_(True)
    pair_x = bt.pair_x.clone().requires_grad_(True)
    models = [model] if isinstance(model, PlacementGNN) else list(model)

    def row_logits(m: PlacementGNN) -> Tensor:
        h, summary = m.encode_graph(xs, bt.edge_index, bt.node_run, bt.num_runs)
        q, g = m.encode_pools(bt.pool_x)
        a = m.task_part(h[bt.ready_node], summary[bt.ready_run], bt.ready_x)
        return m.pair_logits(a, m.pool_part(q, g)[bt.ready_sample], pair_x, bt.mask, m.row_bias(bt.ready_x))[row]

    with torch.enable_grad():
        logits = torch.stack([row_logits(m) for m in models]).mean(dim=0)
        chosen = int(dec.actions[row]) if dec.actions[row] >= 0 else int(np.argmax(dec.probs[row]))
        order = torch.argsort(logits, descending=True).tolist()
        # the runner-up among the pools the decoding step offered (a busy pool that
        # reserve_busy blocked there has probability 0; the one-shot logits do not know it)
        offered = [j for j in order if j != chosen and dec.probs[row, j] > 0]
        # else the best other pool the task fits; none when it fits no other (found by review: a
        # masked pool, its logit -1e9, made a "margin" of 1e9)
        runner = next(iter(offered or [j for j in order if j != chosen and bool(fb.mask[row, j])]), None)
        margin = logits[chosen] - (logits[runner] if runner is not None else 0.0)
        gx, gp = torch.autograd.grad(margin, [xs, pair_x])
    contrib = gp[row] * pair_x[row].detach()
    # the margin's gradient on the runner-up's features already carries its minus sign (found by
    # review: subtracted again, 10 of 13 features were shown with the runner-up's share flipped)
    pair = contrib[chosen] + (contrib[runner] if runner is not None else 0.0)
    node_imp = (gx * xs.detach()).abs().sum(dim=1).cpu().numpy()
    u = int(fb.ready_run[row])
    start = sum(rf.num_nodes for rf in fb.runs[:u])
    run_nodes = node_imp[start : start + fb.runs[u].num_nodes]
    per_feat = (gx * xs.detach()).abs()[start : start + fb.runs[u].num_nodes].sum(dim=0).cpu().numpy()
    return Attribution(
        row=row,
        chosen=chosen,
        runner_up=runner,
        margin=float(margin.detach()),
        pair={n: float(v) for n, v in zip(PAIR_FEATURES, pair.cpu().numpy(), strict=False)},
        nodes=run_nodes,
        task_features={n: float(v) for n, v in zip(TASK_FEATURES, per_feat, strict=False)},
    )


#: Human quantities behind the pair features (the inverse of their scaling), from a row's
#: ``pair_x[row, pool]`` as a list.
_RAW = {
    "run_s": lambda x: _expm1(x[2] * 8.0),
    "wait_s": lambda x: _expm1(x[3] * 8.0),
    "affinity": lambda x: _expm1(x[1]) + 1.0,
    "speed": lambda x: _expm1(x[0]) + 1.0,
    "cost_c": lambda x: _expm1(x[7] * 4.0),
    "free": lambda x: x[9],
    "backlog": lambda x: x[10],
    "finish_s": lambda x: _expm1(x[4] * 8.0),
}


def _expm1(v: float) -> float:
    """``math.expm1``, inf past a float's range (found by review: a pool at speed 1.797e308, whose
    float32 log rounds up, raised OverflowError out of the reason: the request fell back)."""
    try:
        return math.expm1(v)
    except OverflowError:
        return math.inf


class _Raw:
    """:data:`_RAW` of one (row, pool), computed on demand: a reason names at most two."""

    __slots__ = ("x",)

    def __init__(self, x: list[float]) -> None:
        self.x = x

    def __getitem__(self, key: str) -> float:
        value: float = _RAW[key](self.x)
        return value


def _yes(flag: float) -> str:
    return "yes" if flag else "no"


#: The phrase of each reason, by what it speaks of, from the two pools' :class:`_Raw` quantities.
_PHRASES = {
    "speed": lambda c, r: f"speed {c['speed']:.3g} vs {r['speed']:.3g}",
    "affinity": lambda c, r: f"affinity x{c['affinity']:.3g} vs x{r['affinity']:.3g}",
    "run": lambda c, r: f"est. run {c['run_s']:.0f}s vs {r['run_s']:.0f}s",
    "wait": lambda c, r: f"est. wait {c['wait_s']:.0f}s vs {r['wait_s']:.0f}s",
    "finish": lambda c, r: f"est. finish {c['finish_s']:.0f}s vs {r['finish_s']:.0f}s",
    "cost": lambda c, r: f"cost {c['cost_c']:.2f}c vs {r['cost_c']:.2f}c",
    "free": lambda c, r: f"free slot {_yes(c['free'])} vs {_yes(r['free'])}",
    "backlog": lambda c, r: f"backlog/slot {c['backlog']:.2g} vs {r['backlog']:.2g}",
    "pinned": lambda c, r: "pinned by the DAG author",
    "feasible": lambda c, r: "only feasible pool",
}
#: The phrase each pair feature gives, by feature index: the log and the ratio of one estimate
#: give the same one, which a reason names once.
_PHRASE_OF = tuple({
    "log_eff_speed": "speed", "log_affinity": "affinity", "log_run_s": "run", "run_ratio": "run",
    "log_wait_s": "wait", "log_finish_s": "finish", "finish_ratio": "finish", "log_cost": "cost",
    "cost_ratio": "cost", "has_free_slot": "free", "backlog_per_slot": "backlog",
    "pinned_here": "pinned", "feasible": "feasible",
}[name] for name in PAIR_FEATURES)


def _evidence(diff: np.ndarray, x_chosen: np.ndarray, x_runner: np.ndarray, top: int = 2) -> list[list[str]]:
    """For each row of ``diff [k, F]`` (the pair attribution, chosen minus runner-up pool), the
    phrases (keys of :data:`_PHRASES`) a reason names: those of the ``top`` largest positive
    contributions, by size (pair feature order on a tie), each phrase once. A feature equal on
    both pools (``x_chosen [k, F]`` vs ``x_runner``) moved the margin only through the other
    features (the gradient differs, the input does not): it says nothing a reader can check
    (e.g. "only feasible pool" when both are feasible), so it is left out."""
    order = np.argsort(-np.abs(diff), axis=1, kind="stable")
    ok = np.take_along_axis((diff > 0) & (x_chosen != x_runner), order, axis=1)
    out: list[list[str]] = []
    for row, keep in zip(order.tolist(), ok.tolist(), strict=True):
        phrases: list[str] = []
        for f, good in zip(row, keep, strict=True):
            if good and _PHRASE_OF[f] not in phrases:
                phrases.append(_PHRASE_OF[f])
                if len(phrases) >= top:
                    break
        out.append(phrases)
    return out


def _describe(fb: FeatureBatch, row: int, chosen: int, runner: int | None, p_chosen: float, p_runner: float,
              x_chosen: list[float], x_runner: list[float], phrases: Iterable[str]) -> str:
    """A one-line reason for ready row ``row``: the chosen pool over the runner-up, and ``phrases``
    (from :func:`_evidence`) read off the two pools' pair features (as lists)."""
    pool = fb.pools[chosen]
    text = f"{pool.name} ({pool.vm_class}) p={p_chosen:.2f}"
    if runner is None or runner >= fb.num_pools:
        if fb.num_pools == 1:
            return text + ": only candidate"
        # no other pool the task fits or may use: what it asks for, which they do not offer
        return text + f": only usable pool for {fb.tasks[row].asks}"
    other = fb.pools[runner]
    text += f" over {other.name} p={p_runner:.2f}"
    c, r = _Raw(x_chosen), _Raw(x_runner)
    said = [_PHRASES[key](c, r) for key in phrases]
    if said:
        text += ": " + ", ".join(said)
    return text


def explain_row(dec: Decoded, i: int) -> str:
    """The reason string of row ``i`` of a decoded batch, from the pair attributions that
    :meth:`GNNPlacer.decode` computed (chosen pool minus the runner-up)."""
    return explain_rows(dec, np.array([i], dtype=np.int64))[0]


def explain_rows(dec: Decoded, rows: np.ndarray) -> list[str]:
    """:func:`explain_row` of each of ``rows``, with the array work done once for all of them
    (the runner-up of a row is the most probable other pool; on a tie, one the task may use
    (fits, not gated) before one it may not, then pool order; a row with no other pool it may
    use says so)."""
    fb = dec.batch
    if not len(rows):
        return []
    probs = dec.probs[rows]  # [k, P]
    actions = dec.actions[rows]
    held = actions < 0
    chosen = np.where(held, probs.argmax(axis=1), actions)
    k = np.arange(len(rows))
    x_chosen = fb.pair_x[rows, chosen]  # [k, F]
    if probs.shape[1] > 1:
        usable = fb.pairs.mask[rows]
        ranked = np.lexsort((~usable, -probs), axis=1)  # by probability, then usable first, then pool order
        runner = np.where(ranked[:, 0] == chosen, ranked[:, 1], ranked[:, 0])
        x_runner = fb.pair_x[rows, runner]
        diff = dec.pair_contrib[rows, chosen] - dec.pair_contrib[rows, runner]  # [k, F]
        evidence = _evidence(diff, x_chosen, x_runner)
        p_runner = probs[k, runner].tolist()
        xr: list[list[float]] = x_runner.tolist()
        # no other pool the task may use and none offered: the chosen one was the only candidate
        alone = ~usable[k, runner] & (probs[k, runner] <= 0)
        runners: list[int | None] = [None if a else int(r)
                                     for a, r in zip(alone.tolist(), runner.tolist(), strict=True)]
    else:
        evidence = [[] for _ in rows]
        p_runner = [0.0] * len(rows)
        xr = [[] for _ in rows]
        runners = [None] * len(rows)
    xc: list[list[float]] = x_chosen.tolist()
    out = []
    for j, (row, c, ru, feats) in enumerate(zip(rows.tolist(), chosen.tolist(), runners, evidence, strict=True)):
        text = _describe(fb, row, c, ru, float(probs[j, c]), p_runner[j], xc[j], xr[j], feats)
        out.append("held for a better moment; best now " + text if held[j] else text)
    return out
