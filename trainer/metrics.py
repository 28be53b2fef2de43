"""Metrics of one simulation, against the lower bounds of :mod:`trainer.bounds`.

Keys are stable (``drl-trainer bench`` writes them to JSON):

* ``mean_jct_s``, ``p95_jct_s`` -- job completion time = finish - arrival;
* ``mean_slowdown`` -- mean over jobs of JCT / the job's critical-path bound (per-job ratio);
* ``mean_jct_over_lb`` -- mean JCT / mean critical-path bound (ratio of means);
* ``mean_jct_over_stream_lb`` -- mean JCT / the stream bound on mean JCT;
* ``makespan_s`` -- last finish; ``cost`` -- worker billing (see :mod:`trainer.cluster`);
* ``sla_violation_rate`` -- share of jobs finishing after their deadline (default: arrival +
  2 x the critical-path bound);
* ``utilization`` -- per pool, busy slot-seconds / available slot-seconds; ``mean_utilization``;
* ``decisions_per_s`` -- tasks placed per second spent inside the placer.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from policy.catalogue import Catalogue
from trainer.bounds import critical_path_lb, pooled_work_s, stream_lb, total_speed
from trainer.simulator import Job, SimResult

KEYS = (
    "policy", "mean_jct_s", "p95_jct_s", "mean_slowdown", "mean_jct_over_lb", "mean_jct_over_stream_lb",
    "makespan_s", "cost", "sla_violation_rate", "utilization", "decisions_per_s",
)


class Bounds:
    """The per-job and stream lower bounds of one job list (computed once, shared by policies)."""

    def __init__(self, jobs: Sequence[Job], catalogue: Catalogue, sla_factor: float = 2.0) -> None:
        cache: dict[str, tuple[float, float]] = {}
        self.cp: dict[str, float] = {}
        works = []
        for j in jobs:
            hit = cache.get(j.graph.digest)
            if hit is None:
                hit = cache[j.graph.digest] = (critical_path_lb(j.graph, catalogue),
                                               pooled_work_s(j.graph, catalogue))
            self.cp[j.run_key] = hit[0]
            works.append(hit[1])
        self.deadline = {
            j.run_key: (j.deadline_s if j.deadline_s is not None
                        else j.arrival_s + sla_factor * self.cp[j.run_key])
            for j in jobs
        }
        total = stream_lb([j.arrival_s for j in jobs], works, [self.cp[j.run_key] for j in jobs],
                          total_speed(catalogue))
        self.stream_mean_jct = total / max(1, len(jobs))


def summarize(result: SimResult, bounds: Bounds) -> dict[str, Any]:
    """The metrics of one run, under the keys of :data:`KEYS` (plus a few extras)."""
    jct = np.array([j.jct_s for j in result.jobs])
    cp = np.array([bounds.cp[j.run_key] for j in result.jobs])
    late = [j.finish_s > bounds.deadline[j.run_key] + 1e-9 for j in result.jobs]
    safe_cp = np.maximum(cp, 1e-9)
    return {
        "policy": result.policy,
        "mean_jct_s": float(jct.mean()) if len(jct) else 0.0,
        "p95_jct_s": float(np.percentile(jct, 95)) if len(jct) else 0.0,
        "mean_slowdown": float((jct / safe_cp).mean()) if len(jct) else 0.0,
        "mean_jct_over_lb": float(jct.mean() / max(cp.mean(), 1e-9)) if len(jct) else 0.0,
        "mean_jct_over_stream_lb": float(jct.mean() / max(bounds.stream_mean_jct, 1e-9)) if len(jct) else 0.0,
        "makespan_s": result.makespan_s,
        "cost": result.cost,
        "sla_violation_rate": float(np.mean(late)) if late else 0.0,
        "utilization": dict(result.utilization),
        "mean_utilization": float(np.mean(list(result.utilization.values()))),
        "decisions_per_s": result.decisions / result.placer_s if result.placer_s > 0 else float("inf"),
        "failed_tries": result.failed_tries,
        "refused_decisions": result.refused_decisions,
        "wait_fallbacks": result.wait_fallbacks,
        "events": result.events,
        "wall_s": result.wall_s,
    }


def average(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean of several runs' metrics (numbers averaged, utilisation per pool averaged)."""
    out: dict[str, Any] = {"policy": rows[0]["policy"]}
    for key, value in rows[0].items():
        if key == "policy":
            continue
        if isinstance(value, dict):
            out[key] = {k: float(np.mean([r[key][k] for r in rows])) for k in value}
        elif isinstance(value, (int, float)):
            out[key] = float(np.mean([r[key] for r in rows]))
        else:
            out[key] = value
    return out
