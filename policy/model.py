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
3. **Pair head**: ``logit[r, p] = w . relu(A [h_r, s_run(r), ready_r] + B [q_p, g] + C pair_rp) + b``
   (the first layer of an MLP over the concatenation, split so the ``[R, P]`` broadcast is cheap),
   masked to ``-inf`` where the pool is down or the task does not fit (hard constraints come
   after the policy, never learned). With ``wait_choice`` an extra last column scores "hold the
   task for a better pool" from ``[h_r, s_run(r), ready_r, g]``.
4. **Value head** (for PPO/A2C): per request, ``v = MLP([mean_r a_r, g])``.

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
    PlacementGNN(...) ->  logits [R, P (+1 with wait_choice)], value [S]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch_geometric.nn import SAGEConv
from torch_geometric.utils import scatter

from policy.errors import CheckpointError
from policy.features import F_PAIR, F_POOL, F_READY, F_TASK, FeatureBatch

NEG_INF = -1e9


@dataclass(frozen=True)
class ModelConfig:
    """Size of the model; recorded in every checkpoint manifest."""

    #: width of every embedding
    hidden: int = 32
    #: rounds of child -> parent message passing
    layers: int = 3
    #: add a "wait for a better pool" column to the logits
    wait_choice: bool = False

    def __post_init__(self) -> None:
        if self.hidden < 1 or self.layers < 0:
            raise CheckpointError(f"model config: bad hidden={self.hidden!r} / layers={self.layers!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> ModelConfig:
        if not isinstance(obj, dict) or set(obj) - {"hidden", "layers", "wait_choice"}:
            raise CheckpointError(f"model config: unexpected {obj!r}")
        try:
            return cls(
                hidden=int(obj["hidden"]), layers=int(obj["layers"]), wait_choice=bool(obj["wait_choice"])
            )
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


class PlacementGNN(nn.Module):
    """Scores (ready task, pool) pairs; see the module docstring for the maths and shapes."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config or ModelConfig()
        h = self.config.hidden
        self.task_in = nn.Linear(F_TASK, h)
        self.convs = nn.ModuleList([SAGEConv(h, h, aggr="max") for _ in range(self.config.layers)])
        self.pool_in = nn.Sequential(nn.Linear(F_POOL, h), nn.ReLU(), nn.Linear(h, h))
        self.ready_in = nn.Linear(F_READY, h)
        self.head_task = nn.Linear(3 * h, h)
        self.head_pool = nn.Linear(2 * h, h, bias=False)
        self.head_pair = nn.Linear(F_PAIR, h, bias=False)
        self.head_out = nn.Linear(h, 1)
        self.wait_in = nn.Linear(4 * h, h) if self.config.wait_choice else None
        self.wait_out = nn.Linear(h, 1) if self.config.wait_choice else None
        self.value = nn.Sequential(nn.Linear(2 * h, h), nn.ReLU(), nn.Linear(h, 1))

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
        return self.head_task(torch.cat([h_ready, s_ready, torch.relu(self.ready_in(ready_x))], dim=-1))

    def pool_part(self, q: Tensor, g: Tensor) -> Tensor:
        """``[S, P, H]``: the pool side of the first head layer."""
        return self.head_pool(torch.cat([q, g.unsqueeze(1).expand_as(q)], dim=-1))

    def pair_logits(self, a: Tensor, b: Tensor, pair_x: Tensor, mask: Tensor) -> Tensor:
        """``[R, P]`` masked logits from ``a [R, H]``, ``b [R, P, H]`` and ``pair_x [R, P, F_PAIR]``.

        A row whose mask is all False (no pool fits) is left unmasked, so the caller can still
        choose (and say that nothing fits), as :class:`~policy.placement.EarliestFinishPlacer` does.
        """
        z = torch.relu(a.unsqueeze(1) + b + self.head_pair(pair_x))
        logits = self.head_out(z).squeeze(-1)
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

    def wait_logits(self, h_ready: Tensor, s_ready: Tensor, ready_x: Tensor, g_ready: Tensor) -> Tensor:
        """``[R]`` logits of the wait choice (only with ``wait_choice``)."""
        assert self.wait_in is not None and self.wait_out is not None
        r = torch.relu(self.ready_in(ready_x))
        z = torch.relu(self.wait_in(torch.cat([h_ready, s_ready, r, g_ready], dim=-1)))
        return self.wait_out(z).squeeze(-1)

    # --- the whole thing ----------------------------------------------------------------------

    def forward(self, bt: BatchTensors) -> tuple[Tensor, Tensor]:
        """``(logits [R, P (+1)], value [S])`` for a collated batch."""
        h, summary = self.encode_graph(bt.x, bt.edge_index, bt.node_run, bt.num_runs)
        q, g = self.encode_pools(bt.pool_x)
        h_ready = h[bt.ready_node]
        s_ready = summary[bt.ready_run]
        a = self.task_part(h_ready, s_ready, bt.ready_x)
        b = self.pool_part(q, g)[bt.ready_sample]
        logits = self.pair_logits(a, b, bt.pair_x, bt.mask)
        if self.config.wait_choice:
            w = self.wait_logits(h_ready, s_ready, bt.ready_x, g[bt.ready_sample])
            logits = torch.cat([logits, w.unsqueeze(1)], dim=1)
        pooled = scatter(a, bt.ready_sample, dim=0, dim_size=bt.num_samples, reduce="mean")
        value = self.value(torch.cat([pooled, g], dim=-1)).squeeze(-1)
        return logits, value


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
