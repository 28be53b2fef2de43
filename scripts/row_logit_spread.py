"""How far apart are a model's rows, and does a row bias of weight K reorder them? One stream.

    python scripts/row_logit_spread.py CHECKPOINT [--k K] [--workflows wfcommons:seismology:200:3] [--seed 0]

Replays the stream of ``scripts/srpt_replay.py`` (GPU-affinity cluster, load 0.85, duration
noise 0.3, 30 DAG runs, unbounded holds) with the checkpoint's greedy decoding; with ``--k`` the
model decodes with a row bias of that weight (``ModelConfig.row_bias``; the same weights
otherwise, the model given the bias if it had none). At each request whose ready tasks belong
to several runs it reads the one-shot logits (``PlacementGNN.forward`` on the request's
features) and prints, over those requests: the mean standard deviation across rows of each
row's best logit without the bias, that of the bias, how often the best row is of the run with
the least work left without and with the bias, and the stream's mean JCT (docs/policy.md, "A
direct path for the run order: the row bias").
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from srpt_replay import Replay, parse_args, replay_stream  # noqa: E402

from policy.features import READY_FEATURES, featurize  # noqa: E402
from policy.gnn import GNNPlacer  # noqa: E402
from policy.model import collate  # noqa: E402
from policy.schema import Decision, PlacementRequest, RunGraph  # noqa: E402

_WORK_LEFT = READY_FEATURES.index("log_run_work_left")


class Spread(Replay):
    """:class:`Replay`, also reading each multi-run request's one-shot row logits."""

    def __init__(self, model: GNNPlacer) -> None:
        super().__init__(model)
        self.rows: list[tuple[float, float, bool, bool]] = []

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        out = super().place(request, graphs)
        if len({t.run_key for t in request.ready}) > 1:
            fb = featurize(request, graphs)
            model = self.model.model
            with torch.no_grad():
                best = model(collate([fb]))[0].numpy().max(axis=1)
                bias = model.row_bias(torch.from_numpy(fb.ready_x)).numpy()
            plain = best - bias
            left = fb.ready_x[:, _WORK_LEFT]
            srpt = left == left.min()
            self.rows.append((float(plain.std()), float(bias.std()), bool(srpt[plain.argmax()]),
                              bool(srpt[best.argmax()])))
        return out


def with_row_bias(placer: GNNPlacer, k: float) -> GNNPlacer:
    """``placer`` with a row bias of weight ``k`` on its model (its other weights unchanged)."""
    return GNNPlacer(placer.model.with_row_bias(k), version=placer.version, manifest=placer.manifest,
                     reserve_busy=placer.reserve_busy, premium_ratio=placer.premium_ratio, cp_gate=placer.cp_gate,
                     cp_gate_scope=placer.cp_gate_scope)


def main() -> None:
    args = parse_args(__doc__, k=float)
    placer = GNNPlacer.from_checkpoint(args.checkpoint)
    if placer.members:
        raise SystemExit("an ensemble: give one of its members")
    if args.k is not None:
        placer = with_row_bias(placer, args.k)
    spread = Spread(placer)
    res = replay_stream(args, spread)
    r = np.array(spread.rows)
    k = float(placer.model.row_k.detach()[0]) if placer.model.config.row_bias else 0.0
    print(f"{args.checkpoint} k={k:g}: mean JCT {res['mean_jct_s']:.2f} s; {len(r)} multi-run requests; "
          f"row spread (std of the rows' best logit) {r[:, 0].mean():.2f} without the bias, bias {r[:, 1].mean():.2f}; "
          f"best row is SRPT's run {r[:, 2].mean():.0%} without the bias, {r[:, 3].mean():.0%} with it")


if __name__ == "__main__":
    main()
