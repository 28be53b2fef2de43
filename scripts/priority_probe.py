"""Does priority decide a contended slot? (docs/policy.md, "Priority: what the policy learnt it as")

Two otherwise identical ready tasks of one run, priorities p and k x p, on the GPU-affinity cluster
under 200 random loads (seeded); for each request the default checkpoint places: count which task
took the faster pool, or the only slot placed, and which the policy chose first (sent, or
reserving a busy pool: late binding). Then the same requests as the executor sends them since
2026-12-06: both at priority 1, listed in Airflow's priority order (higher ``priority_weight``
first), which decides where the policy finds them equal (``policy.model.TIE_TOLERANCE``).

    python scripts/priority_probe.py [SEED]

The policy learnt ``priority`` from the lab's WfFormat traces (Pegasus: 20 + 10 x the task's depth,
a later stage higher), so raw priorities are read that way round: "higher priority favoured 2,
lower favoured 48, same speed 135, none placed 15; chosen first: higher 0, lower 199". As the
executor sends them: chosen first: higher 198, lower 0, the other two held both (without the
tolerance, ``TIE_TOLERANCE = 0.0``: 50 / 148, the rounding of identical rows decided).
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
    first = {"hi": 0, "lo": 0}
    sent_first = {"hi": 0, "lo": 0}
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
        steps = placer.decode(request, {g.run_key: g}, temperature=0.0).steps
        if steps and steps[0].action is not None:
            first[request.ready[steps[0].action[0]].task_id] += 1
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
        # as the executor sends them: priority 1, the higher priority_weight listed first
        # (another run key: the placer caches a run's embeddings by its key)
        sent = RunGraph(f"sent/{trial}", tuple(dataclasses.replace(t, priority=1.0) for t in g.tasks), ())
        ranked = dataclasses.replace(request, ready=(ReadyTask(sent.run_key, "hi"), ReadyTask(sent.run_key, "lo")),
                                     runs=(sent,))
        steps = placer.decode(ranked, {sent.run_key: sent}, temperature=0.0).steps
        if steps and steps[0].action is not None:
            sent_first[ranked.ready[steps[0].action[0]].task_id] += 1
    print(f"raw priorities: higher priority favoured {higher}, lower favoured {lower}, same speed {same},"
          f" none placed {none}; chosen first: higher {first['hi']}, lower {first['lo']}")
    print(f"as the executor sends them: chosen first: higher {sent_first['hi']}, lower {sent_first['lo']}")


if __name__ == "__main__":
    main()
