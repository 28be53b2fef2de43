"""PNG plots of a benchmark: metric bars per policy, and a Gantt chart of one run per policy."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

from trainer.simulator import SimResult

log = logging.getLogger(__name__)

BAR_METRICS = (
    ("mean_jct_s", "mean JCT (s)"),
    ("p95_jct_s", "p95 JCT (s)"),
    ("mean_jct_over_stream_lb", "mean JCT / stream LB"),
    ("cost", "cost ($)"),
    ("sla_violation_rate", "SLA violation rate"),
    ("mean_utilization", "mean pool utilisation"),
)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def metric_bars(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """One panel per metric, one bar per policy."""
    plt = _plt()
    names = [r["policy"] for r in rows]
    fig, axes = plt.subplots(len(BAR_METRICS), 1, figsize=(max(8, 0.45 * len(names)), 2.4 * len(BAR_METRICS)),
                             sharex=True)
    for ax, (key, label) in zip(axes, BAR_METRICS, strict=True):
        values = [float(r.get(key, 0.0)) for r in rows]
        best = min(range(len(values)), key=lambda i: values[i]) if key != "mean_utilization" else None
        colors = ["tab:green" if i == best else "tab:blue" for i in range(len(values))]
        ax.bar(range(len(values)), values, color=colors)
        ax.set_ylabel(label, fontsize=8)
    axes[-1].set_xticks(range(len(names)))
    axes[-1].set_xticklabels(names, rotation=60, ha="right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def gantt(result: SimResult, path: Path, max_jobs: int = 25) -> Path:
    """Tries of the first ``max_jobs`` runs, one lane per slot of each pool, coloured by run."""
    plt = _plt()
    keep = {j.run_key for j in result.jobs[:max_jobs]}
    color_of = {k: plt.cm.tab20(i % 20) for i, k in enumerate(sorted(keep))}
    lanes: dict[str, list[float]] = {p: [] for p in result.pool_names}
    bars: list[tuple[str, int, float, float, str, bool]] = []
    for t in sorted(result.tasks, key=lambda t: t.start_s):
        if t.run_key not in keep:
            continue
        free = lanes.setdefault(t.pool, [])
        lane = next((i for i, end in enumerate(free) if end <= t.start_s + 1e-9), None)
        if lane is None:
            free.append(t.end_s)
            lane = len(free) - 1
        else:
            free[lane] = t.end_s
        bars.append((t.pool, lane, t.start_s, t.end_s - t.start_s, t.run_key, t.ok))
    offsets: dict[str, int] = {}
    y = 0
    for p in result.pool_names:
        offsets[p] = y
        y += max(1, len(lanes.get(p, [])))
    fig, ax = plt.subplots(figsize=(12, max(3, 0.25 * y + 1)))
    for pool, lane, start, dur, key, ok in bars:
        ax.barh(offsets[pool] + lane, dur, left=start, height=0.8, color=color_of[key],
                edgecolor="red" if not ok else "none")
    ax.set_yticks([offsets[p] for p in result.pool_names])
    ax.set_yticklabels(result.pool_names)
    ax.set_xlabel("simulated time (s)")
    ax.set_title(f"{result.policy}: first {len(keep)} runs (colour = run, red edge = failed try)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
