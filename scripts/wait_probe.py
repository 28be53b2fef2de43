"""How long tasks wait between ready and start, per placer, on one stream of a setting.

    python scripts/wait_probe.py [--setting wfcommons:seismology:200:3] [--position 2] [--seed 0]
        [--policies drl,srpt+eft] [--checkpoint DIR]

Simulates the stream ``drl-trainer bench`` draws for ``--setting`` at ``--position`` of its
``--workflows`` list (the validation bench: Cycles 0, RNA-seq 1, Seismology 2) and ``--seed``, on the
GPU-affinity cluster at load 0.85, noise 0.3, 30 runs, under the executor's two hold bounds
(``--max-wait-s 60``), and prints per placer: mean JCT, the wait of each successful try after its
task was ready (its parents' last end, or its run's arrival) as mean / p50 / p90, the mean run
time, the tasks per pool, and how many ready tasks its requests offered against how many it
placed (late binding holds the rest). Found with it (2026-12-07): on Seismology seed 0 the
default and ``srpt+eft`` place the same tasks per pool with the same run times, and the default's
tasks wait longer (docs/policy.md, "A stronger SRPT prior").
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from typing import Any, Mapping

import numpy as np

from policy.catalogue import load_catalogue
from policy.schema import PlacementRequest, RunGraph
from trainer.baselines import make_placer
from trainer.bench import setting_jobs
from trainer.simulator import SimConfig, Simulator, executor_holds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setting", default="wfcommons:seismology:200:3")
    ap.add_argument("--position", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="drl,srpt+eft")
    ap.add_argument("--checkpoint", default=None, help="the learned policy's checkpoint (default: the packaged one)")
    ap.add_argument("--pools", default="policy/catalogues/gpu-affinity.yaml")
    args = ap.parse_args()
    catalogue = load_catalogue(args.pools)
    jobs = setting_jobs(args.setting, args.position, args.seed, catalogue, 30, 0.85)
    max_wait_s, max_hold_s = executor_holds(60.0, None)
    config = SimConfig(duration_noise=0.3, max_wait_s=max_wait_s, max_hold_s=max_hold_s, scale_in="sustained")
    graphs = {j.run_key: j.graph for j in jobs}
    arrival = {j.run_key: j.arrival_s for j in jobs}
    parents: dict[tuple[str, str], list[str]] = defaultdict(list)
    for key, g in graphs.items():
        for a, b in g.edges:
            parents[(key, g.tasks[b].task_id)].append(g.tasks[a].task_id)
    for policy in args.policies.split(","):
        placer = make_placer(policy, catalogue, args.seed, args.checkpoint if policy == "drl" else None)
        counts: Counter[str] = Counter()
        place = placer.place

        def counted(request: PlacementRequest, run_graphs: Mapping[str, RunGraph], place: Any = place,
                    counts: Counter[str] = counts) -> Any:
            out = place(request, run_graphs)
            counts["offered"] += len(request.ready)
            counts["placed"] += len(out)
            return out

        placer.place = counted  # type: ignore[method-assign,assignment]
        result = Simulator(catalogue, jobs, placer, seed=args.seed, config=config).run()
        ended = {(t.run_key, t.task_id): t.end_s for t in result.tasks if t.ok}
        waits, runs, pools = [], [], Counter[str]()
        for t in result.tasks:
            if t.ok:
                ready = max((ended[(t.run_key, p)] for p in parents[(t.run_key, t.task_id)]),
                            default=arrival[t.run_key])
                waits.append(t.start_s - ready)
                runs.append(t.end_s - t.start_s)
                pools[t.pool] += 1
        w = np.array(waits)
        print(f"{policy}: mean JCT {np.mean([j.jct_s for j in result.jobs]):.2f} s, wait after ready mean "
              f"{w.mean():.2f} / p50 {np.median(w):.2f} / p90 {np.quantile(w, 0.9):.2f} s, run {np.mean(runs):.2f} s, "
              f"tasks per pool {dict(pools)}, ready offered {counts['offered']} / placed {counts['placed']}")


if __name__ == "__main__":
    main()
