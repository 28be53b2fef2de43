"""The numpy and the compiled decode steps side by side, in one process (docs/server.md).

    python scripts/step_kernel_ab.py [--checkpoint policy/checkpoints/default] [--tasks 200]
        [--ready 16] [--batch 1] [--requests 1200] [--seed 0]

Decides the same requests (random ready sets of a layered ``--tasks``-task run, the demo
catalogue, one torch thread) with two placers of the checkpoint, ``step_kernel="numpy"`` and
``"compiled"``, alternating which goes first; ``--batch 1`` times ``place()``, ``--batch S``
times ``place_many()`` of S requests (one run each). Prints the p50 / p99 / mean milliseconds of
each (the first 10% left out as warm-up), whether every decision and reason was the same, and
the largest difference between the two decisions' scores (float32 rounding of the steps' sums).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from policy.bench import DEFAULT_CATALOGUE, layered_dag
from policy.catalogue import load_catalogue
from policy.gnn import GNNPlacer
from policy.schema import PlacementRequest, ReadyTask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="policy/checkpoints/default")
    ap.add_argument("--tasks", type=int, default=200, help="tasks per DAG run")
    ap.add_argument("--ready", type=int, default=16, help="ready tasks per request")
    ap.add_argument("--batch", type=int, default=1, help="requests per call (1: place, more: place_many)")
    ap.add_argument("--requests", type=int, default=1200, help="calls per placer")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    pools = load_catalogue(str(DEFAULT_CATALOGUE)).states()
    placers = {k: GNNPlacer.from_checkpoint(args.checkpoint, step_kernel=k) for k in ("numpy", "compiled")}
    rng = np.random.default_rng(args.seed)
    runs = [layered_dag(args.tasks, f"ab/{args.tasks}/{i}", rng) for i in range(args.batch)]
    graphs = [{g.run_key: g} for g in runs]
    times: dict[str, list[float]] = {k: [] for k in placers}
    same, gap = True, 0.0
    for i in range(args.requests):
        reqs = [PlacementRequest(
            request_id=f"ab-{i}-{j}", pools=pools, runs=(g,), created_at=0.0, deadline_ms=1000,
            ready=tuple(ReadyTask(g.run_key, g.tasks[int(t)].task_id)
                        for t in rng.choice(len(g.tasks), size=min(args.ready, len(g.tasks)), replace=False)))
            for j, g in enumerate(runs)]
        got = {}
        for k in (list(placers) if i % 2 else list(placers)[::-1]):
            t0 = time.perf_counter()
            out = (placers[k].place_many(reqs, graphs) if args.batch > 1
                   else [placers[k].place(reqs[0], graphs[0])])
            times[k].append(time.perf_counter() - t0)
            got[k] = [[(d.task_id, d.pool, d.reason, d.score) for d in x] for x in out]
        same &= [[d[:3] for d in x] for x in got["numpy"]] == [[d[:3] for d in x] for x in got["compiled"]]
        if same:
            gap = max([gap] + [abs(a[3] - b[3]) for x, y in zip(got["numpy"], got["compiled"], strict=True)
                               for a, b in zip(x, y, strict=True)])
    skip = args.requests // 10
    for k, v in times.items():
        a = np.array(v[skip:]) * 1e3
        print(f"{k:9s} p50 {np.percentile(a, 50):.3f} p99 {np.percentile(a, 99):.3f} mean {a.mean():.3f} ms "
              f"per {'place_many' if args.batch > 1 else 'place'} call")
    print(f"same decisions and reasons in all {args.requests} calls: {same}; largest score difference {gap:.2e}")


if __name__ == "__main__":
    main()
