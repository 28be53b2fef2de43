"""Does a checkpoint order runs by SRPT? Replays one stream with its decisions and asks the rule too.

    python scripts/srpt_replay.py CHECKPOINT [--workflows wfcommons:seismology:200:3] [--seed 0]

Simulates one stream (GPU-affinity cluster, load 0.85, duration noise 0.3, 30 DAG runs, the
trainer's stream for ``--seed``) placed by the checkpoint's greedy decoding. At every request it
also asks ``scripts/feature_rule_probe.py``'s rule with reservations (the feature SRPT+EFT rule
that decodes as the GNN does) what it would send, without using the answer, and counts:

* how often the two send a task to the same pool (``same pool / both sent``);
* among requests whose ready tasks belong to several runs, how often the first task sent is of
  the run with the least work left (``SRPT first``), for the model and for the rule.

Prints the model's mean JCT on the stream and the counts (docs/policy.md, "SRPT across runs on
any time scale" and "Three seeds of schema 4").
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))

from feature_rule_probe import _WORK_LEFT, FeatureRule  # noqa: E402

from policy.catalogue import load_catalogue  # noqa: E402
from policy.gnn import GNNPlacer  # noqa: E402
from policy.placement import Placer  # noqa: E402
from policy.schema import Decision, PlacementRequest, RunGraph  # noqa: E402
from trainer.train import Args, make_stream, settings_from, simulate  # noqa: E402


class Replay:
    """Places with the model; asks the rule at every request and counts where they differ."""

    name = "replay"
    version = "replay"

    def __init__(self, model: GNNPlacer) -> None:
        self.model, self.rule = model, FeatureRule(False, True)
        self.counts: collections.Counter[str] = collections.Counter()

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        dec = self.model.decode(request, graphs)
        out = self.model._decisions(dec, dec.placed_order)
        theirs = {(d.run_key, d.task_id): d.pool for d in self.rule.place(request, graphs)}
        first_rule = next(iter(theirs), None)
        c = self.counts
        for d in out:
            if (d.run_key, d.task_id) in theirs:
                c["both sent"] += 1
                c["same pool"] += theirs[(d.run_key, d.task_id)] == d.pool
        if out and len({t.run_key for t in request.ready}) > 1:
            fb = dec.batch  # the features the model decided on, not computed again
            left = {t.run_key: float(fb.ready_x[i, _WORK_LEFT]) for i, t in enumerate(fb.ready)}
            srpt = min(left, key=lambda k: left[k])
            c["multi-run requests"] += 1
            c["model SRPT first"] += out[0].run_key == srpt
            c["rule SRPT first"] += first_rule is not None and first_rule[0] == srpt
        return out


def parse_args(doc: str, **extra: type) -> argparse.Namespace:
    """``CHECKPOINT [--workflows W] [--seed S]`` and ``extra`` options (``--name``: type, default None)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("checkpoint")
    for name, kind in extra.items():
        ap.add_argument(f"--{name}", type=kind, default=None)
    ap.add_argument("--workflows", default="wfcommons:seismology:200:3")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def replay_stream(args: argparse.Namespace, placer: Placer) -> dict[str, float]:
    """Simulate ``args``'s stream (see the module docstring) placed by ``placer``."""
    cat = load_catalogue("policy/catalogues/gpu-affinity.yaml")
    sim_args = Args()
    sim_args.load, sim_args.duration_noise = 0.85, 0.3
    jobs = make_stream(settings_from(args.workflows, 1)[0], cat, 30, args.seed, sim_args)
    return simulate(cat, jobs, placer, args.seed, sim_args)


def main() -> None:
    args = parse_args(__doc__)
    replay = Replay(GNNPlacer.from_checkpoint(args.checkpoint))
    res = replay_stream(args, replay)
    c = replay.counts
    multi = max(c["multi-run requests"], 1)
    print(f"mean JCT {res['mean_jct_s']:.1f} s; same pool {c['same pool']} / both sent {c['both sent']}; "
          f"SRPT first: model {c['model SRPT first']} ({c['model SRPT first'] / multi:.0%}), "
          f"rule {c['rule SRPT first']} ({c['rule SRPT first'] / multi:.0%}) of {c['multi-run requests']} "
          "multi-run requests")


if __name__ == "__main__":
    main()
