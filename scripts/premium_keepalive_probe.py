"""How often a placer keeps a premium pool's workers up, and for which tasks (issue 4's cost).

    python scripts/premium_keepalive_probe.py [--policy drl:DIR@3 | cost-cp] [--family 1] [--seed 0]

Simulates one held-out stream of ``scripts/cost_frontier.py`` (family 0 Epigenomics, 1 BWA,
2 SoyKB; 30 DAG runs, GPU-affinity cluster, load 0.85, noise 0.3) and counts, over the placer's
requests, those in which the GPU pool had a live worker (slots > 0) and a free slot, and, over
its decisions, the tasks sent to the GPU and how many of them were on their run's critical path by
``cost-cp``'s test; prints the bill per pool.
"""

from __future__ import annotations

import argparse
import runpy
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

from policy.catalogue import load_catalogue
from policy.schema import PlacementRequest, RunGraph
from trainer.baselines import make_placer
from trainer.baselines.rules import _items, _remaining_cp
from trainer.bench import setting_jobs
from trainer.simulator import SimConfig, Simulator

FRONTIER = runpy.run_path(str(Path(__file__).with_name("cost_frontier.py")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="drl:policy/checkpoints/default@3",
                    help="a rule name, or drl:DIR[@GATE[/all]] as in cost_frontier.py --checkpoints")
    ap.add_argument("--family", type=int, default=1, choices=(0, 1, 2))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pools", default="policy/catalogues/gpu-affinity.yaml")
    args = ap.parse_args()
    catalogue = load_catalogue(args.pools)
    jobs = setting_jobs(FRONTIER["settings"]()[args.family], args.family, args.seed, catalogue, 30, 0.85)
    if args.policy.startswith("drl:"):
        ckpt, _, gate = args.policy[4:].partition("@")
        gate, _, scope = gate.partition("/")
        placer = make_placer("drl", catalogue, args.seed, checkpoint=ckpt, cp_gate=float(gate) if gate else None,
                             cp_gate_scope=scope or None)
    else:
        placer = make_placer(args.policy, catalogue, args.seed)
    counts: Counter[str] = Counter()
    place = placer.place

    def counted(request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> Any:
        out = place(request, graphs)
        gpu = next(p for p in request.pools if p.name == "gpu")
        items = _items(request, graphs)
        crit = _remaining_cp(items, request)
        on_cp = {(r.run_key, r.task_id): g.rank[i] >= crit[r.run_key] for r, _, g, i in items}
        counts["requests"] += 1
        counts["gpu live"] += gpu.slots > 0
        counts["gpu free slot"] += gpu.slots > gpu.busy + gpu.queued
        for d in out:
            counts["decisions"] += 1
            if d.pool == "gpu":
                counts["to gpu"] += 1
                counts["to gpu, on the critical path"] += on_cp[(d.run_key, d.task_id)]
        return out

    placer.place = counted  # type: ignore[method-assign]
    sim = Simulator(catalogue, jobs, placer, seed=args.seed, config=SimConfig(duration_noise=0.3))
    res = sim.run()
    print(f"{args.policy}, family {args.family}, seed {args.seed}: mean JCT "
          f"{sum(j.jct_s for j in res.jobs) / len(res.jobs):.1f} s, cost ${res.cost:.2f} "
          f"({', '.join(f'{p.name} ${p.cost:.2f}' for p in sim._pools)})")
    print(", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
