"""Lower bounds on what any placement can achieve, per job and for a stream of jobs.

* :func:`critical_path_lb` -- the job's critical path with every task on the fastest pool that can
  hold it (speed including task-kind affinity): no schedule finishes the job sooner (the Schedule
  Length Ratio's denominator, Topcuoglu et al. 2002). With duration noise the bound uses the
  expected durations the policy sees, so it bounds the *expected* JCT, not every realisation;
  :func:`realised_critical_path_lb` uses the realised try durations instead.
* :func:`stream_lb` -- a lower bound on the sum of JCTs of a stream of jobs (issue 3): at every
  instant the jobs in the system are at least ``max(A(t), B(t))`` where ``A`` counts the jobs
  left under preemptive shortest-remaining-work on ONE pooled machine of the cluster's total
  speed (optimal for the sum of completion times on one machine, and a relaxation of the
  cluster) and ``B`` counts jobs still inside their own critical-path bound. Integrating
  ``max(A, B)`` over time bounds ``sum(JCT)``.
"""

from __future__ import annotations

import heapq
from typing import Mapping, Sequence

from policy.catalogue import Catalogue
from policy.graph import view
from policy.schema import RunGraph, TaskNode


def fastest_speed(task: TaskNode, catalogue: Catalogue) -> float:
    """Effective speed of the fastest VM class that can hold ``task`` (ignoring pins if none fits)."""
    best = 0.0
    fallback = 0.0
    for p in catalogue.pools:
        vm = p.vm_class
        s = vm.speed * vm.affinity.get(task.kind, 1.0)
        fallback = max(fallback, s)
        fits = task.cpus <= vm.cpus and task.memory_gb <= vm.memory_gb and task.gpus <= vm.gpus
        if fits and (task.pool is None or task.pool == p.name):
            best = max(best, s)
    return best or fallback


def critical_path_lb(graph: RunGraph, catalogue: Catalogue,
                     durations: Sequence[float] | None = None) -> float:
    """Longest path of ``duration / fastest feasible speed`` through the DAG, in seconds."""
    g = view(graph)
    dur = durations if durations is not None else [t.duration_s for t in graph.tasks]
    speeds = [fastest_speed(t, catalogue) for t in graph.tasks]
    finish = [0.0] * len(graph.tasks)
    for i in g.order:
        start = max((finish[p] for p in g.parents[i]), default=0.0)
        finish[i] = start + dur[i] / speeds[i]
    return max(finish, default=0.0)


def pooled_work_s(graph: RunGraph, catalogue: Catalogue) -> float:
    """The job's work for the pooled machine of :func:`stream_lb`: sum of ``duration / a_max``.

    ``a_max`` is the largest task-kind affinity any pool offers the task, so a pool of speed
    ``s`` processes at most ``s`` units of this work per slot-second, whatever it runs.
    """
    total = 0.0
    for t in graph.tasks:
        a_max = max((p.vm_class.affinity.get(t.kind, 1.0) for p in catalogue.pools), default=1.0)
        total += t.duration_s / max(a_max, 1.0)
    return total


def total_speed(catalogue: Catalogue, *, at_max: bool = True) -> float:
    """Sum over pools of slots x speed: the pooled machine of the stream bound.

    ``at_max`` uses each pool's ``max_workers`` (elastic pools may grow to it), which keeps the
    bound valid whatever the autoscaler does.
    """
    total = 0.0
    for p in catalogue.pools:
        n = p.max_workers if (at_max and p.max_workers is not None) else p.workers
        total += n * p.slots_per_worker * p.vm_class.speed
    return total


def stream_lb(arrivals: Sequence[float], works: Sequence[float], cp_lbs: Sequence[float],
              speed: float) -> float:
    """Lower bound on the SUM of JCTs (divide by the count for the mean).

    ``works[j]`` is job ``j``'s :func:`pooled_work_s`, ``cp_lbs[j]`` its :func:`critical_path_lb`
    and ``speed`` the pooled machine's :func:`total_speed` (units of work per second).
    """
    n = len(arrivals)
    if n == 0:
        return 0.0
    order = sorted(range(n), key=lambda j: arrivals[j])
    # A(t): preemptive SRPT on one machine; collect the completion time of each job.
    srpt_done: list[float] = []
    heap: list[tuple[float, int]] = []
    t = 0.0
    k = 0
    while k < n or heap:
        if not heap:
            t = max(t, arrivals[order[k]])
        while k < n and arrivals[order[k]] <= t:
            j = order[k]
            heapq.heappush(heap, (works[j] / speed, j))
            k += 1
        rem, j = heapq.heappop(heap)
        nxt = arrivals[order[k]] if k < n else float("inf")
        if t + rem <= nxt:
            t += rem
            srpt_done.append(t)
        else:
            heapq.heappush(heap, (rem - (nxt - t), j))
            t = nxt
    # Breakpoints: A(t) = #arrived - #srpt-done; B(t) = #{j: a_j <= t < a_j + cp_j}.
    events: list[tuple[float, int, int]] = []  # (time, dA, dB)
    for j in range(n):
        events.append((arrivals[j], 1, 1))
        events.append((arrivals[j] + cp_lbs[j], 0, -1))
    for d in srpt_done:
        events.append((d, -1, 0))
    events.sort()
    total = 0.0
    a = b = 0
    last = events[0][0]
    for when, da, db in events:
        total += max(a, b) * (when - last)
        last = when
        a += da
        b += db
    return total


def job_bounds(graphs: Sequence[RunGraph], catalogue: Catalogue) -> Mapping[str, float]:
    """run_key -> critical-path lower bound."""
    return {g.run_key: critical_path_lb(g, catalogue) for g in graphs}
