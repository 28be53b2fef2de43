"""Shared checks of simulation results (imported by the trainer tests)."""

from __future__ import annotations

from collections import Counter, defaultdict

from policy.catalogue import Catalogue
from trainer.simulator import Job, SimResult


def check_conservation(jobs: list[Job], result: SimResult, catalogue: Catalogue) -> None:
    """Every task finishes exactly once, after its parents, and no pool exceeds its slots."""
    ok = Counter((t.run_key, t.task_id) for t in result.tasks if t.ok)
    expected = {(j.run_key, t.task_id) for j in jobs for t in j.graph.tasks}
    assert set(ok) == expected
    assert all(v == 1 for v in ok.values())
    end = {(t.run_key, t.task_id): t.end_s for t in result.tasks if t.ok}
    start = {(t.run_key, t.task_id): t.start_s for t in result.tasks if t.ok}
    arrival = {j.run_key: j.arrival_s for j in jobs}
    for j in jobs:
        g = j.graph
        for p, c in g.edges:
            assert start[(g.run_key, g.tasks[c].task_id)] >= end[(g.run_key, g.tasks[p].task_id)] - 1e-9
        for t in g.tasks:
            assert start[(g.run_key, t.task_id)] >= arrival[g.run_key] - 1e-9
    # Capacity: at any instant, running tries per pool <= the pool's max slots.
    cap = {p.name: (p.max_workers if p.max_workers is not None else p.workers) * p.slots_per_worker
           for p in catalogue.pools}
    by_pool = defaultdict(list)
    for t in result.tasks:
        by_pool[t.pool].append((t.start_s, 1))
        by_pool[t.pool].append((t.end_s, -1))
    for pool, evs in by_pool.items():
        level = 0
        for _, d in sorted(evs, key=lambda e: (e[0], e[1])):
            level += d
            assert level <= cap[pool]
    assert len(result.jobs) == len(jobs)
