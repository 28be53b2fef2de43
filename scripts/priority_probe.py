"""Does priority decide a contended slot? (docs/policy.md, "Found by review, 2026-12-06")

Two otherwise identical ready tasks of one run, priorities p and k x p, on the GPU-affinity cluster
under 200 random loads (seeded); for each request the default checkpoint places: count which task
took the faster pool, or the only slot placed.

    python scripts/priority_probe.py [SEED]
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from policy.catalogue import load_catalogue  # noqa: E402
from policy.gnn import GNNPlacer  # noqa: E402
from policy.schema import PlacementRequest, ReadyTask, RunGraph, TaskNode  # noqa: E402


def main() -> None:
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    placer = GNNPlacer.from_checkpoint(ROOT / "policy" / "checkpoints" / "default")
    states = load_catalogue(ROOT / "policy" / "catalogues" / "gpu-affinity.yaml").states()
    higher = lower = same = none = 0
    for trial in range(200):
        busy = {"cpu-small": int(rng.integers(0, 9)), "cpu-large": int(rng.integers(0, 5)),
                "gpu": int(rng.integers(0, 3))}
        pools = tuple(dataclasses.replace(p, busy=busy[p.name]) for p in states)
        duration = float(rng.uniform(5, 600))
        lo = float(rng.choice([1, 2, 5, 10]))
        hi = lo * float(rng.choice([2, 10, 100]))
        g = RunGraph(f"dag/{trial}", (TaskNode("lo", priority=lo, duration_s=duration),
                                      TaskNode("hi", priority=hi, duration_s=duration)), ())
        order = ("lo", "hi") if trial % 2 else ("hi", "lo")  # either listing order
        request = PlacementRequest(f"r{trial}", tuple(ReadyTask(g.run_key, t) for t in order), pools, runs=(g,))
        decisions = placer.place(request, {g.run_key: g})
        if not decisions:
            none += 1
        elif len(decisions) == 1:
            higher += decisions[0].task_id == "hi"
            lower += decisions[0].task_id == "lo"
        else:
            speed = {p.name: p.speed for p in pools}
            pool = {d.task_id: d.pool for d in decisions}
            higher += speed[pool["hi"]] > speed[pool["lo"]]
            lower += speed[pool["hi"]] < speed[pool["lo"]]
            same += speed[pool["hi"]] == speed[pool["lo"]]
    print(f"higher priority favoured {higher}, lower favoured {lower}, same speed {same}, none placed {none}")


if __name__ == "__main__":
    main()
