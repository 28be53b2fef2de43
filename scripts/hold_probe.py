"""How much does a checkpoint hold, and what do its holds buy?

    python scripts/hold_probe.py --checkpoint CK [--workflows wfcommons:soykb:200:3 --position 2]
                                 [--seed 0] [--dag-runs 30] [--max-wait-s 60] [--hold-ratio 1]

Simulates one stream (the stream ``drl-trainer bench`` draws for that setting at that position of
its ``--workflows`` list and that seed; GPU-affinity cluster, load 0.85, duration noise 0.3) with
the checkpoint's policy twice: holds allowed (the "stop" choice: the rest of the batch waits for a
later decision point) and ``allow_wait=False`` (every ready task placed at once). Prints mean JCT,
utilisation, the tasks it left without a decision (summed over requests: a task held at ten
decision points counts ten times) and, with ``--max-wait-s``, how many the executor's bound
handed to the fallback. ``--hold-ratio`` sets the decoder's stop guard
(:data:`policy.features.HOLD_RATIO`, work-conserving; the figures in docs/policy.md from before
the work-conserving stop are reproduced with ``--hold-ratio 1``).
"""

from __future__ import annotations

import argparse
from typing import Mapping

from policy.catalogue import load_catalogue
from policy.features import HOLD_RATIO
from policy.gnn import GNNPlacer
from policy.schema import Decision, PlacementRequest, RunGraph
from trainer.bench import setting_jobs
from trainer.metrics import Bounds, summarize
from trainer.simulator import SimConfig, Simulator, executor_holds


class _Counting:
    """Wraps a placer; counts the ready tasks it was offered and those it left without a decision."""

    def __init__(self, placer: GNNPlacer) -> None:
        self.placer, self.name, self.version = placer, placer.name, placer.version
        self.offered = self.held = 0

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        decisions = self.placer.place(request, graphs)
        self.offered += len(request.ready)
        self.held += len(request.ready) - len(decisions)
        return decisions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="policy/checkpoints/default")
    ap.add_argument("--workflows", default="wfcommons:soykb:200:3")
    ap.add_argument("--position", type=int, default=2, help="the setting's index in bench's --workflows list")
    ap.add_argument("--pools", default="policy/catalogues/gpu-affinity.yaml")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dag-runs", type=int, default=30)
    ap.add_argument("--max-wait-s", type=float, default=None)
    ap.add_argument("--max-hold-s", type=float, default=None,
                    help="with --max-wait-s: the executor's bound on the whole hold (default 300; = --max-wait-s: "
                         "the single bound of the figures before 2026-12-07)")
    ap.add_argument("--hold-ratio", type=float, default=HOLD_RATIO)
    args = ap.parse_args()
    cat = load_catalogue(args.pools)
    jobs = setting_jobs(args.workflows, args.position, args.seed, cat, args.dag_runs)
    max_wait_s, max_hold_s = executor_holds(args.max_wait_s, args.max_hold_s)
    config = SimConfig(duration_noise=0.3, max_wait_s=max_wait_s, max_hold_s=max_hold_s)
    for allow_wait in (True, False):
        placer = _Counting(GNNPlacer.from_checkpoint(args.checkpoint, allow_wait=allow_wait,
                                                     hold_ratio=args.hold_ratio))
        result = Simulator(cat, jobs, placer, seed=args.seed, config=config).run()
        m = summarize(result, Bounds(jobs, cat))
        print(f"{placer.version} allow_wait={allow_wait}: mean JCT {m['mean_jct_s']:.0f} s, "
              f"utilisation {m['mean_utilization']:.2f}, offered {placer.offered}, held {placer.held}, "
              f"placed by the max-wait fallback {result.wait_fallbacks}", flush=True)


if __name__ == "__main__":
    main()
