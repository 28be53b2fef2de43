"""The placement GNN: scores every (ready task, pool) pair of a request in one forward pass.

Architecture (Decima, Mao et al. SIGCOMM 2019, adapted to heterogeneous pools as in READYS,
Grinsztajn et al. 2021):

1. **Task encoder** over each run's DAG: ``h0 = relu(W x)``, then ``layers`` rounds of
   GraphSAGE message passing from children to parents with a residual,
   ``h_{k+1} = h_k + relu(SAGE(h_k))``, so a task's embedding summarises the work below it.
   Embeddings depend only on the run's static graph, so a placer caches them per run digest
   (:meth:`PlacementGNN.encode_graph`); this is what keeps 1,000+-task runs cheap.
   A run summary is the mean of its task embeddings.
2. **Pool encoder**: an MLP per pool; the cluster summary ``g`` is the mean over pools.
3. **Pair head**: ``logit[r, p] = w . relu(a_r + b_p + C pair_rp) + b`` with
   ``a_r = A [h_r, s_run(r), ready_r]`` and ``b_p = B [q_p, g]`` (the first layer of an MLP over
   the concatenation, split so the ``[R, P]`` broadcast is cheap), masked to ``-inf`` where the
   pool is down or the task does not fit (hard constraints come after the policy, never learned).
   Optionally (:attr:`ModelConfig.row_bias`) ``+ k * run_work_left_ratio_r`` on every pool of
   row ``r``: a learned weight on SRPT's key that the run order cannot route around; decoders
   read it as one more hidden unit of the head (:meth:`PlacementGNN.head_weights`).
4. **Stop head**: ``stop = MLP([mean of a_r over the rows still unplaced, g])``: "hold the
   remaining ready tasks for a better moment" (late binding: they are offered again at the next
   decision point, as the list-scheduling baselines do when they wait for a busy faster pool).
5. **Decoding** (Decima's one-node-at-a-time, over pairs): a batch is decided in steps; each
   step is a softmax over every (unplaced row, feasible pool) pair *and* stop; the chosen task is
   sent, the pair features of the others are recomputed with its backlog, until stop or none
   is left. So the model learns both *which task goes first* (the order across runs, e.g. SRPT)
   and *where* it goes. :meth:`PlacementGNN.step_forward` scores recorded steps in one batch.
6. **Value head** (for PPO/A2C): per request, ``v = MLP([mean_r a_r, g])``.

Shapes (``N`` task nodes, ``E`` edges, ``U`` runs, ``R`` ready rows, ``S`` requests in a
collated batch, ``P`` pools, ``H`` hidden)::

    BatchTensors.x            [N, F_TASK]
    BatchTensors.edge_index   [2, E]       (child, parent)
    BatchTensors.node_run     [N]          run of each node, 0..U-1
    BatchTensors.ready_node   [R]          node index of each ready row
    BatchTensors.ready_run    [R]
    BatchTensors.ready_sample [R]          request of each ready row, 0..S-1
    BatchTensors.ready_x      [R, F_READY]
    BatchTensors.pool_x       [S, P, F_POOL]
    BatchTensors.pair_x       [R, P, F_PAIR]
    BatchTensors.mask         [R, P]       bool
    PlacementGNN(...) ->  logits [R, P], value [S]      (first step, no stop column)
    PlacementGNN.step_forward(StepTensors) -> StepScores: log p(chosen) [K], entropy [K],
        value [S], log p(chosen pool) [K]
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch_geometric.nn import SAGEConv
from torch_geometric.utils import scatter

from policy.errors import CheckpointError
from policy.features import (
    DYNAMIC_PAIR_COLUMNS,
    F_PAIR,
    F_POOL,
    F_TASK,
    FEATURE_SCHEMA_VERSION,
    READY_COLUMNS,
    READY_FEATURES,
    FeatureBatch,
    guard_fit,
    late_blocked,
    pair_rows,
)

NEG_INF = -1e9

#: Greedy decoding's ties: the (row, pool) pairs whose logit is within this of the step's
#: maximum count as tied, and the tie goes to the row first in decode order (longest remaining
#: critical path, then the higher priority, then request order, which the executor makes
#: Airflow's priority order; :func:`policy.features.decode_order`), on that row's best pool.
#: Without it the logits of two identical ready tasks, which differ by float32 rounding only,
#: decided which took a contended slot: the one with the
#: higher Airflow priority was chosen first in 50 of 198 requests, with it in 198
#: (``scripts/priority_probe.py``, its second line; found by review, 2026-12-06). A gap of 1e-4
#: is a probability ratio of 1.0001: no preference a model could have learnt. (Decoders whose
#: sums round differently may still part where a gap sits within rounding of the tolerance
#: itself, as they could at an exact tie before.)
TIE_TOLERANCE = 1e-4


def greedy_choice(logits: np.ndarray) -> int:
    """The flat index (``row * P + pool``) greedy decoding takes among ``logits [r, P]`` (rows in
    decode order; see :data:`TIE_TOLERANCE`): the first row whose best logit is within the
    tolerance of the maximum, and that row's first pool within the tolerance of its best (found by
    review: two identical pools, their logits apart in the last bits by how the pool encoder was
    batched, went one way alone and the other in a micro-batch)."""
    best = logits.max(axis=1)
    k = int(np.argmax(best >= best.max() - TIE_TOLERANCE))
    return k * logits.shape[1] + int(np.argmax(logits[k] >= best[k] - TIE_TOLERANCE))


#: The row bias's column: SRPT's key, 0 for the run with the least work left, at most 3.
ROW_BIAS_COLUMN = READY_FEATURES.index("run_work_left_ratio")
#: The bias folds exactly into one extra hidden unit of the head, ``relu(ratio)`` (= ``ratio``,
#: never negative) with output weight ``k``, which every decoding path reads as it reads the
#: others (:meth:`PlacementGNN.task_side`, :meth:`PlacementGNN.head_weights`); the rows of the
#: run with the least work left (ratio 0) get exactly nothing added. ``k`` is used clamped to
#: ``[-ROW_BIAS_MAX, ROW_BIAS_MAX]``: the trained logits of a row differ by ~10 across the rows
#: of a request, so ``k`` needs room, and ``|k * ratio| <= 768`` keeps a row's float32 logit
#: within ~6e-5 of exact (under :data:`TIE_TOLERANCE`), whichever order a decoder sums it in.
#: (Before d8879c7, 2026-12-07, the unit was ``relu(128 + k * ratio)``, its offset taken off the output
#: bias, which capped ``k`` at 32: every row's logit passed through 128, and a larger offset
#: rounded past the tolerance.)
ROW_BIAS_MAX = 256.0


@dataclass(frozen=True)
class ModelConfig:
    """Size of the model; recorded in every checkpoint manifest."""

    #: width of every embedding
    hidden: int = 32
    #: rounds of child -> parent message passing
    layers: int = 3
    #: a learned weight ``k`` on SRPT's key, ``run_work_left_ratio``, added to every pair logit of
    #: its row (:meth:`PlacementGNN.row_bias`): a direct path the run order cannot route around
    row_bias: bool = False

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.layers < 0:
            raise CheckpointError(f"model config: bad hidden={self.hidden!r} / layers={self.layers!r}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.row_bias:  # the manifests written before it existed stay as they were
            del out["row_bias"]
        return out

    @classmethod
    def from_json(cls, obj: Any) -> ModelConfig:
        if not isinstance(obj, dict) or not {"hidden", "layers"} <= set(obj) <= {"hidden", "layers", "row_bias"}:
            raise CheckpointError(f"model config: expected {{hidden, layers[, row_bias]}}, got {obj!r}")
        if not isinstance(obj.get("row_bias", False), bool):
            raise CheckpointError(f"model config: row_bias must be true or false, got {obj['row_bias']!r}")
        try:
            return cls(hidden=int(obj["hidden"]), layers=int(obj["layers"]), row_bias=obj.get("row_bias", False))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"model config: {obj!r}: {exc}") from exc


@dataclass
class BatchTensors:
    """One or more featurized requests as tensors (see the module docstring for shapes)."""

    x: Tensor
    edge_index: Tensor
    node_run: Tensor
    num_runs: int
    ready_node: Tensor
    ready_run: Tensor
    ready_sample: Tensor
    ready_x: Tensor
    pool_x: Tensor
    pair_x: Tensor
    mask: Tensor

    @property
    def num_samples(self) -> int:
        return int(self.pool_x.shape[0])

    def to(self, device: str | torch.device) -> BatchTensors:
        moved: dict[str, Any] = {
            k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()
        }
        return BatchTensors(**moved)


def collate(batches: Sequence[FeatureBatch], device: str | torch.device = "cpu") -> BatchTensors:
    """Stack featurized requests (all with the same number of pools) into one :class:`BatchTensors`."""
    if not batches:
        raise ValueError("collate: no feature batches")
    num_pools = batches[0].num_pools
    xs, eis, node_run, rn, rr, rs, rx, px, pair, mask = [], [], [], [], [], [], [], [], [], []
    node_off = 0
    run_off = 0
    for s, fb in enumerate(batches):
        if fb.num_pools != num_pools:
            raise ValueError(f"collate: request {s} has {fb.num_pools} pools, expected {num_pools}")
        offs = []
        for u, rf in enumerate(fb.runs):
            offs.append(node_off)
            xs.append(rf.x)
            eis.append(rf.edge_index + node_off)
            node_run.append(np.full(rf.num_nodes, run_off + u, dtype=np.int64))
            node_off += rf.num_nodes
        rn.append(np.asarray(offs, dtype=np.int64)[fb.ready_run] + fb.ready_node if fb.num_ready else
                  np.zeros(0, dtype=np.int64))
        rr.append(fb.ready_run + run_off)
        rs.append(np.full(fb.num_ready, s, dtype=np.int64))
        rx.append(fb.ready_x)
        px.append(fb.pool_x)
        pair.append(fb.pair_x)
        mask.append(fb.mask)
        run_off += len(fb.runs)

    def t(a: list[np.ndarray], dtype: torch.dtype, axis: int = 0) -> Tensor:
        return torch.from_numpy(np.concatenate(a, axis=axis)).to(device=device, dtype=dtype)

    return BatchTensors(
        x=t(xs, torch.float32),
        edge_index=t(eis, torch.long, axis=1),
        node_run=t(node_run, torch.long),
        num_runs=run_off,
        ready_node=t(rn, torch.long),
        ready_run=t(rr, torch.long),
        ready_sample=t(rs, torch.long),
        ready_x=t(rx, torch.float32),
        pool_x=torch.from_numpy(np.stack(px)).to(device=device, dtype=torch.float32),
        pair_x=t(pair, torch.float32),
        mask=t(mask, torch.bool),
    )


@dataclass(frozen=True)
class Step:
    """One decoding step of a request: the tasks already sent per pool in this batch
    (``placed [P]``), the rows still unplaced (``rows``) and the choice made: ``(row, pool)``, or
    ``None`` for "stop". ``late``: decoded with ``reserve_busy``, whose choices leave out
    :func:`~policy.features.late_blocked` pairs."""

    placed: np.ndarray
    rows: np.ndarray
    action: tuple[int, int] | None
    stop_ok: bool = True
    late: bool = False
    #: the decoder's premium ratio (:func:`~policy.features.guard_fit`; 0 = off)
    premium: float = 0.0


@dataclass
class StepTensors:
    """Decoding steps of collated requests (``K`` steps, ``M`` (row, pool) entries, ``Q``
    (step, remaining row) pairs)::

        step_sample [K]  request of each step     entry_step [M], entry_row [M], entry_pool [M]
        target      [K]  entry index, -1 = stop   entry_x    [M, F_PAIR]
        stop_ok     [K]  bool                     rem_step [Q], rem_row [Q]
    """

    bt: BatchTensors
    step_sample: Tensor
    target: Tensor
    stop_ok: Tensor
    entry_step: Tensor
    entry_row: Tensor
    entry_pool: Tensor
    entry_x: Tensor
    rem_step: Tensor
    rem_row: Tensor


class StepScores(NamedTuple):
    """:meth:`PlacementGNN.step_forward` over ``K`` recorded steps of ``S`` requests."""

    #: ``[K]`` log-probability of each step's recorded choice
    logp: Tensor
    #: ``[K]`` entropy of each step's distribution
    entropy: Tensor
    #: ``[S]`` value of each request
    value: Tensor
    #: ``[K]`` log-probability of the recorded choice's pool, whichever task goes there (the
    #: marginal over the step's rows; "stop" is its own choice): the decision that sets cost
    logp_pool: Tensor


def segment_logsumexp(x: Tensor, index: Tensor, size: int) -> Tensor:
    """``[size]``: the log-sum-exp of ``x`` per segment ``index`` (stable: shifted by each
    segment's maximum; an empty segment gives ``-inf``)."""
    peak = scatter(x, index, dim=0, dim_size=size, reduce="max")
    return torch.log(scatter(torch.exp(x - peak[index]), index, dim=0, dim_size=size, reduce="sum")) + peak


def step_entries(fb: FeatureBatch, step: Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows [m], pools [m], x [m, F_PAIR])``: the (remaining row, pool) choices of one step,
    row-major; a row with no feasible pool keeps every pool (it must still go somewhere). A
    ``late`` step leaves out the busy pools its decoder blocks, except its own choice (a
    teacher's reservation is learned even where the features rank another pool first)."""
    x, mask = pair_rows(fb.pairs, step.rows, step.placed)
    keep = mask | ~mask.any(axis=1, keepdims=True)
    if step.late:
        blocked = late_blocked(x[..., DYNAMIC_PAIR_COLUMNS], guard_fit(fb.pairs, step.rows, mask, step.premium))
        if step.action is not None:
            blocked[step.rows == step.action[0], step.action[1]] = False
        keep &= ~blocked
    r_idx, p_idx = np.nonzero(keep)
    return step.rows[r_idx], p_idx, x[r_idx, p_idx]


def collate_steps(samples: Sequence[tuple[FeatureBatch, Sequence[Step]]],
                  device: str | torch.device = "cpu") -> StepTensors:
    """Stack requests and their decoding steps for :meth:`PlacementGNN.step_forward`."""
    bt = collate([fb for fb, _ in samples], device)
    ss, tg, ok, es, er, ep, ex, rs, rr = [], [], [], [], [], [], [], [], []
    row_off = 0
    k = 0
    m = 0
    for s, (fb, steps) in enumerate(samples):
        for step in steps:
            rows, pools, x = step_entries(fb, step)
            target = -1
            if step.action is not None:
                hit = np.nonzero((rows == step.action[0]) & (pools == step.action[1]))[0]
                if len(hit) != 1:
                    raise ValueError(f"step action {step.action} is not a choice of its step")
                target = m + int(hit[0])
            ss.append(s)
            tg.append(target)
            ok.append(step.stop_ok)
            es.append(np.full(len(rows), k, dtype=np.int64))
            er.append(rows + row_off)
            ep.append(pools)
            ex.append(x)
            rs.append(np.full(len(step.rows), k, dtype=np.int64))
            rr.append(step.rows + row_off)
            k += 1
            m += len(rows)
        row_off += fb.num_ready

    def t(a: list[np.ndarray], dtype: torch.dtype) -> Tensor:
        return torch.from_numpy(np.concatenate(a)).to(device=device, dtype=dtype)

    return StepTensors(
        bt=bt,
        step_sample=torch.tensor(ss, dtype=torch.long, device=device),
        target=torch.tensor(tg, dtype=torch.long, device=device),
        stop_ok=torch.tensor(ok, dtype=torch.bool, device=device),
        entry_step=t(es, torch.long),
        entry_row=t(er, torch.long),
        entry_pool=t(ep, torch.long),
        entry_x=t(ex, torch.float32),
        rem_step=t(rs, torch.long),
        rem_row=t(rr, torch.long),
    )


def upgraded(model: PlacementGNN) -> PlacementGNN:
    """``model`` reading this code's feature schema: the same weights, and zero weights for the
    ready columns its schema lacks, so its outputs on the same features are unchanged until
    training moves them (``drl-trainer train --init`` of an older checkpoint; the nightly
    fine-tune). From schema 6 to 7 the features themselves change where a pool has no worker (its
    wait counts the boot, :attr:`policy.features.PairStatic.floor`): the upgraded model's placer
    reads them as a schema-7 model does. ``model`` itself if already current."""
    if model.schema_version == FEATURE_SCHEMA_VERSION:
        return model
    new = PlacementGNN(model.config)
    state = model.state_dict()
    w = state["ready_in.weight"]
    state["ready_in.weight"] = torch.cat([w, w.new_zeros(w.shape[0], new.ready_in.in_features - w.shape[1])], 1)
    new.load_state_dict(state)
    new.untrained_inputs = model.untrained_inputs  # still never learned: their weights came along as 0
    return new.to(w.device)


class PlacementGNN(nn.Module):
    """Scores (ready task, pool) pairs; see the module docstring for the maths and shapes."""

    def __init__(self, config: ModelConfig | None = None, schema_version: int = FEATURE_SCHEMA_VERSION) -> None:
        super().__init__()
        self.config = config or ModelConfig()
        if schema_version not in READY_COLUMNS:
            raise CheckpointError(f"feature schema version {schema_version!r}: this code reads {sorted(READY_COLUMNS)}")
        #: the feature schema the model was built for; it reads that schema's ready columns
        self.schema_version = schema_version
        #: input columns cut off because training never moved their weights (policy/inputs.py)
        self.untrained_inputs: tuple[str, ...] = ()
        h = self.config.hidden
        self.task_in = nn.Linear(F_TASK, h)
        self.convs = nn.ModuleList([SAGEConv(h, h, aggr="max") for _ in range(self.config.layers)])
        self.pool_in = nn.Sequential(nn.Linear(F_POOL, h), nn.ReLU(), nn.Linear(h, h))
        self.ready_in = nn.Linear(READY_COLUMNS[schema_version], h)
        self.head_task = nn.Linear(3 * h, h)
        self.head_pool = nn.Linear(2 * h, h, bias=False)
        self.head_pair = nn.Linear(F_PAIR, h, bias=False)
        self.head_out = nn.Linear(h, 1)
        self.stop = nn.Sequential(nn.Linear(2 * h, h), nn.ReLU(), nn.Linear(h, 1))
        self.value = nn.Sequential(nn.Linear(2 * h, h), nn.ReLU(), nn.Linear(h, 1))
        if self.config.row_bias:
            if READY_COLUMNS[schema_version] <= ROW_BIAS_COLUMN:
                raise CheckpointError(f"a row bias reads run_work_left_ratio, which feature schema {schema_version}"
                                      " lacks")
            #: ``k`` of the row bias (:meth:`row_bias`); 0: the model starts without it (training
            #: may start it elsewhere, ``drl-trainer train --row-bias-init``)
            self.row_k = nn.Parameter(torch.zeros(1))

    # --- parts, usable separately so a placer can cache per-run embeddings ------------------

    def encode_graph(
        self, x: Tensor, edge_index: Tensor, node_run: Tensor, num_runs: int
    ) -> tuple[Tensor, Tensor]:
        """Task embeddings ``[N, H]`` and run summaries ``[U, H]``."""
        h = torch.relu(self.task_in(x))
        for conv in self.convs:
            h = h + torch.relu(conv(h, edge_index))
        summary = scatter(h, node_run, dim=0, dim_size=num_runs, reduce="mean")
        return h, summary

    def encode_pools(self, pool_x: Tensor) -> tuple[Tensor, Tensor]:
        """Pool embeddings ``[S, P, H]`` and cluster summaries ``[S, H]``."""
        q = self.pool_in(pool_x)
        return q, q.mean(dim=1)

    def task_part(self, h_ready: Tensor, s_ready: Tensor, ready_x: Tensor) -> Tensor:
        """``[R, H]``: the task side of the first head layer."""
        ready_x = ready_x[..., : self.ready_in.in_features]  # an older schema's leading columns
        return self.head_task(torch.cat([h_ready, s_ready, torch.relu(self.ready_in(ready_x))], dim=-1))

    def pool_part(self, q: Tensor, g: Tensor) -> Tensor:
        """``[S, P, H]``: the pool side of the first head layer."""
        return self.head_pool(torch.cat([q, g.unsqueeze(1).expand_as(q)], dim=-1))

    def row_bias(self, ready_x: Tensor) -> Tensor:
        """``[R]``: ``k * run_work_left_ratio`` of each ready row, added to every pair logit of
        the row (zeros without :attr:`ModelConfig.row_bias`). It moves which task goes first,
        never which pool a task goes to; ``k < 0`` prefers the run with the least work left."""
        if not self.config.row_bias:
            return ready_x.new_zeros(ready_x.shape[:-1])
        return self.row_weight()[0] * ready_x[..., ROW_BIAS_COLUMN]

    def row_weight(self) -> Tensor:
        """``[1]``: the row bias's ``k`` as used, clamped to ``+-ROW_BIAS_MAX`` (needs
        :attr:`ModelConfig.row_bias`)."""
        return self.row_k.clamp(-ROW_BIAS_MAX, ROW_BIAS_MAX)

    def pair_logits(self, a: Tensor, b: Tensor, pair_x: Tensor, mask: Tensor, bias: Tensor | None = None) -> Tensor:
        """``[R, P]`` masked logits from ``a [R, H]``, ``b [R, P, H]`` and ``pair_x [R, P, F_PAIR]``,
        plus ``bias [R]`` (:meth:`row_bias`) on every pool of a row.

        A row whose mask is all False (no pool fits) is left unmasked, so the caller can still
        choose (and say that nothing fits), as :class:`~policy.placement.EarliestFinishPlacer` does.
        """
        z = torch.relu(a.unsqueeze(1) + b + self.head_pair(pair_x))
        logits = self.head_out(z).squeeze(-1)
        if bias is not None:
            logits = logits + bias.unsqueeze(1)
        keep = mask | ~mask.any(dim=1, keepdim=True)
        return logits.masked_fill(~keep, NEG_INF)

    def head_arrays(self) -> tuple[np.ndarray, np.ndarray, float]:
        """``(C^T [F_PAIR, H], w [H], b)`` of the pair head as numpy, for a per-row decode loop
        that must not pay torch's per-call overhead 16 times a batch (see :mod:`policy.gnn`)."""
        return (
            self.head_pair.weight.detach().cpu().numpy().T.copy(),
            self.head_out.weight.detach().cpu().numpy()[0].copy(),
            float(self.head_out.bias.detach().cpu()[0]),
        )

    def stop_logits(self, a_mean: Tensor, g: Tensor) -> Tensor:
        """``[K]`` logits of "stop: hold the remaining tasks" from the mean task part of the rows
        still unplaced ``[K, H]`` and the cluster summary ``[K, H]``."""
        return self.stop(torch.cat([a_mean, g], dim=-1)).squeeze(-1)

    def with_row_bias(self, k: float) -> PlacementGNN:
        """This model with a row bias of weight ``k`` and its other weights unchanged (a prior on
        SRPT's run order for a model trained without one; ``drl-trainer ensemble --row-bias``)."""
        check_row_bias_weight(k)
        model = PlacementGNN(replace(self.config, row_bias=True), self.schema_version)
        state = self.state_dict()
        state["row_k"] = state["head_out.bias"].new_tensor([k])
        model.load_state_dict(state)
        # the inputs it never learned from stay so (was: dropped, so an ensemble written with --row-bias
        # recorded none and a fine-tune of it would not know them; found 2026-12-07)
        model.untrained_inputs = self.untrained_inputs
        return model.to(state["head_out.bias"].device).train(self.training)

    # --- the head as the decoders read it: the row bias folded into one more hidden unit -------

    def task_side(self, h_ready: Tensor, s_ready: Tensor, ready_x: Tensor) -> Tensor:
        """``[R, H']``: :meth:`task_part`, with the row bias's key ``run_work_left_ratio`` as one
        more unit (``H' = H + 1``; ``H`` without a row bias); :meth:`head_weights` gives it the
        weight ``k``."""
        a = self.task_part(h_ready, s_ready, ready_x)
        if not self.config.row_bias:
            return a
        return torch.cat([a, ready_x[..., ROW_BIAS_COLUMN].unsqueeze(-1).to(a.dtype)], dim=-1)

    def pool_side(self, q: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """``(b [S, P, H'], g [S, H'])``: :meth:`pool_part` and the cluster summary, zero on the
        row bias's unit."""
        b = self.pool_part(q, g)
        if not self.config.row_bias:
            return b, g
        return _unit(b), _unit(g)

    def head_weights(self) -> dict[str, Tensor]:
        """The pair head and the stop MLP over :meth:`task_side` / :meth:`pool_side`'s ``H'``
        units: ``c_t [F_PAIR, H']``, ``w [H']``, ``b [1]``, ``s0_w [2H', H]``, ``s0_b [H]``,
        ``s2_w [H]``, ``s2_b [1]``. The row bias's unit has no pair weights, output weight
        ``k`` (clamped) and no part in stop, so ``w . relu(a + b_p + C x) + b`` is
        :meth:`pair_logits` with the bias, exactly (the unit's input, the ratio, is never
        negative)."""
        s0, s2 = self.stop[0], self.stop[2]
        assert isinstance(s0, nn.Linear) and isinstance(s2, nn.Linear)
        c_t, w, s0_w = self.head_pair.weight.T, self.head_out.weight[0], s0.weight.T
        b: Tensor = self.head_out.bias
        if self.config.row_bias:
            h = self.config.hidden
            c_t = _unit(c_t)
            w = torch.cat([w, self.row_weight().to(w.dtype)])
            zero = s0_w.new_zeros(1, s0_w.shape[1])
            s0_w = torch.cat([s0_w[:h], zero, s0_w[h:], zero])
        return {"c_t": c_t, "w": w, "b": b, "s0_w": s0_w, "s0_b": s0.bias, "s2_w": s2.weight[0], "s2_b": s2.bias}

    def numpy_weights(self) -> dict[str, np.ndarray]:
        """:meth:`head_weights` as numpy, for the per-step decode loop (which must not pay
        torch's per-call overhead a dozen times a batch; see :mod:`policy.gnn`)."""
        return {k: v.detach().cpu().numpy().copy() for k, v in self.head_weights().items()}

    def step_forward(self, st: StepTensors, temperature: float = 1.0) -> StepScores:
        """Decoding steps of collated requests -> :class:`StepScores`.

        A step's choices are its entries (remaining row, pool) plus "stop"; the softmax runs
        over each step's own choices (a segment softmax). The pool marginal sums a step's
        probabilities per pool (a log-sum-exp per (step, pool) segment). ``temperature``: the
        distribution the decoder sampled from (logits / temperature; a refused stop stays
        impossible), so PPO's ratio compares the policy that acted.
        """
        if not temperature > 0 or not math.isfinite(temperature):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        bt = st.bt
        h, summary = self.encode_graph(bt.x, bt.edge_index, bt.node_run, bt.num_runs)
        q, g = self.encode_pools(bt.pool_x)
        a = self.task_part(h[bt.ready_node], summary[bt.ready_run], bt.ready_x)  # [R, H]
        b = self.pool_part(q, g)  # [S, P, H]
        sample_of_entry = st.step_sample[st.entry_step]
        z = torch.relu(a[st.entry_row] + b[sample_of_entry, st.entry_pool] + self.head_pair(st.entry_x))
        entry_logits = self.head_out(z).squeeze(-1) + self.row_bias(bt.ready_x)[st.entry_row]  # [M]
        k = st.step_sample.shape[0]
        a_mean = scatter(a[st.rem_row], st.rem_step, dim=0, dim_size=k, reduce="mean")
        stop_logits = self.stop_logits(a_mean, g[st.step_sample])  # [K]
        if temperature != 1.0:  # skipped at 1, the imitation path (x / 1.0 is x exactly either way)
            entry_logits, stop_logits = entry_logits / temperature, stop_logits / temperature
        stop_logits = stop_logits.masked_fill(~st.stop_ok, NEG_INF)
        logits = torch.cat([entry_logits, stop_logits])
        index = torch.cat([st.entry_step, torch.arange(k, device=logits.device)])
        logp = logits - segment_logsumexp(logits, index, k)[index]
        stop_pos = entry_logits.shape[0] + torch.arange(k, device=logits.device)
        target = torch.where(st.target >= 0, st.target, stop_pos)
        p = torch.exp(logp)
        entropy = -scatter(p * logp, index, dim=0, dim_size=k, reduce="sum")
        pooled = scatter(a, bt.ready_sample, dim=0, dim_size=bt.num_samples, reduce="mean")
        value = self.value(torch.cat([pooled, g], dim=-1)).squeeze(-1)
        n_pools = bt.pool_x.shape[1]
        seg = st.entry_step * n_pools + st.entry_pool  # (step, pool) of each entry
        seg_lse = segment_logsumexp(logp[: entry_logits.shape[0]], seg, k * n_pools)
        logp_target = logp[target]
        logp_pool = logp_target.clone()  # a stop is its own pool
        placed = st.target >= 0
        logp_pool[placed] = seg_lse[seg[st.target[placed]]]
        return StepScores(logp_target, entropy, value, logp_pool)

    # --- the whole thing ----------------------------------------------------------------------

    def forward(self, bt: BatchTensors) -> tuple[Tensor, Tensor]:
        """``(logits [R, P], value [S])`` for a collated batch: every row scored against the
        request's pools as featurized (the first decoding step, without the stop choice)."""
        h, summary = self.encode_graph(bt.x, bt.edge_index, bt.node_run, bt.num_runs)
        q, g = self.encode_pools(bt.pool_x)
        h_ready = h[bt.ready_node]
        s_ready = summary[bt.ready_run]
        a = self.task_part(h_ready, s_ready, bt.ready_x)
        b = self.pool_part(q, g)[bt.ready_sample]
        logits = self.pair_logits(a, b, bt.pair_x, bt.mask, self.row_bias(bt.ready_x))
        pooled = scatter(a, bt.ready_sample, dim=0, dim_size=bt.num_samples, reduce="mean")
        value = self.value(torch.cat([pooled, g], dim=-1)).squeeze(-1)
        return logits, value


def fuse_models(models: Sequence[PlacementGNN]) -> PlacementGNN:
    """One model whose pair and stop logits (and value) are the mean of ``models``' own, computed
    in one pass: an ensemble as one wider network (hidden ``sum(H_i)``, each member's units
    reading only its own). A layer read by every member (``task_in``, ``ready_in``, ``pool_in[0]``,
    ``head_pair``) stacks their rows; a layer inside a member (the SAGE convolutions, ``pool_in[2]``)
    is block-diagonal; a layer over a concatenation (``head_task`` over ``[h, s, ready]``, ``head_pool``
    over ``[q, g]``, the first layers of stop and value over ``[a_mean, g]``) takes each member's
    column block from the same group of the fused input; the output layers are the members' rows
    side by side over ``K``, their biases' mean. Elementwise steps (relu, the residual, SAGE's
    max aggregation, the run and cluster means) keep the blocks apart, so each member's units are
    exactly its own. A member with fewer layers gets zero convolutions (``h + relu(0) = h``), one
    of an older feature schema zero weights on the ready columns it does not read, and the row
    bias is the mean of the members' (clamped) ``k``, 0 for a member without one.

    The logits are the members' mean up to float32 rounding (a sum's order in the wider matmuls):
    :class:`~policy.gnn.GNNPlacer` decodes an ensemble with it, one forward instead of ``K``."""
    if not models:
        raise ValueError("fuse_models: no models")
    k = len(models)
    hs = [m.config.hidden for m in models]
    width = sum(hs)
    layers = max(m.config.layers for m in models)
    row_bias = any(m.config.row_bias for m in models)
    with torch.random.fork_rng(devices=[]):  # its initial weights are all replaced: draw nothing of the caller's
        fused = PlacementGNN(ModelConfig(hidden=width, layers=layers, row_bias=row_bias),
                             max(m.schema_version for m in models))
    states = [{n: t.detach().float().cpu() for n, t in m.state_dict().items()} for m in models]

    def stack(name: str) -> Tensor:  # rows of each member, columns padded to the widest input
        cols = max(s[name].shape[1] for s in states)
        return torch.cat([nn.functional.pad(s[name], (0, cols - s[name].shape[1])) for s in states])

    def diag(name: str) -> Tensor:  # a member's own units only (zeros for a layer it lacks)
        return torch.block_diag(*(s.get(name, torch.zeros(h, h)) for s, h in zip(states, hs, strict=True)))

    def grouped(name: str, groups: int) -> Tensor:  # [member blocks of group 0 | ... of group g-1]
        out = torch.zeros(width, groups * width)
        r = 0
        for s, h in zip(states, hs, strict=True):
            for grp in range(groups):
                c = grp * width + r
                out[r:r + h, c:c + h] = s[name][:, grp * h:(grp + 1) * h]
            r += h
        return out

    def cat(name: str) -> Tensor:  # biases (zeros for a layer a member lacks)
        return torch.cat([s.get(name, torch.zeros(hi)) for s, hi in zip(states, hs, strict=True)])

    def out_row(name: str) -> Tensor:
        return torch.cat([s[name] for s in states], dim=1) / k

    def out_bias(name: str) -> Tensor:
        return torch.stack([s[name] for s in states]).mean(dim=0)

    new: dict[str, Tensor] = {
        "task_in.weight": stack("task_in.weight"), "task_in.bias": cat("task_in.bias"),
        "pool_in.0.weight": stack("pool_in.0.weight"), "pool_in.0.bias": cat("pool_in.0.bias"),
        "pool_in.2.weight": diag("pool_in.2.weight"), "pool_in.2.bias": cat("pool_in.2.bias"),
        "ready_in.weight": stack("ready_in.weight"), "ready_in.bias": cat("ready_in.bias"),
        "head_task.weight": grouped("head_task.weight", 3), "head_task.bias": cat("head_task.bias"),
        "head_pool.weight": grouped("head_pool.weight", 2),
        "head_pair.weight": stack("head_pair.weight"),
        "head_out.weight": out_row("head_out.weight"), "head_out.bias": out_bias("head_out.bias"),
    }
    for head in ("stop", "value"):
        new[f"{head}.0.weight"] = grouped(f"{head}.0.weight", 2)
        new[f"{head}.0.bias"] = cat(f"{head}.0.bias")
        new[f"{head}.2.weight"] = out_row(f"{head}.2.weight")
        new[f"{head}.2.bias"] = out_bias(f"{head}.2.bias")
    for i in range(layers):
        new[f"convs.{i}.lin_l.weight"] = diag(f"convs.{i}.lin_l.weight")
        new[f"convs.{i}.lin_l.bias"] = cat(f"convs.{i}.lin_l.bias")
        new[f"convs.{i}.lin_r.weight"] = diag(f"convs.{i}.lin_r.weight")
    if row_bias:
        new["row_k"] = torch.stack([m.row_weight().detach().float().cpu()
                                    if m.config.row_bias else torch.zeros(1) for m in models]).mean(dim=0)
    fused.load_state_dict(new)
    fused.untrained_inputs = tuple(n for n in models[0].untrained_inputs
                                   if all(n in m.untrained_inputs for m in models))
    return fused.to(next(models[0].parameters()).device).eval()


def check_row_bias_weight(k: float) -> None:
    """Refuse a row bias's weight that is not finite or outside ``+-ROW_BIAS_MAX`` (where the
    clamp, and so the fold into one hidden unit, would change it)."""
    if not math.isfinite(k) or abs(k) > ROW_BIAS_MAX:
        raise ValueError(f"a row bias's weight must be within +-{ROW_BIAS_MAX:g}, got {k!r}")


def _unit(t: Tensor) -> Tensor:
    """``t`` with the row bias's hidden unit appended on its last axis, zero."""
    return torch.cat([t, t.new_zeros(t.shape[:-1] + (1,))], dim=-1)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
