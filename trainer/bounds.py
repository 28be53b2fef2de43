"""Lower bounds on what any placement can achieve, per job and for a stream of jobs.

* :func:`critical_path_lb` -- the job's critical path with every task on the fastest pool that can
  hold it (speed including task-kind affinity): no schedule finishes the job sooner (the Schedule
  Length Ratio's denominator, Topcuoglu et al. 2002). With duration noise the bound uses the
  expected durations the policy sees, so it bounds the *expected* JCT, not every realisation
  (pass ``durations`` for realised ones).
* :func:`makespan_lb` -- a tighter bound on one job run alone on the whole cluster: heads and
  tails with non-preemptive stage bounds (a wide stage cannot all run on the fastest slots).
  ``drl-trainer makespan`` measures policies on single DAGs against it (issue 3's check
  against an independent figure: insertion HEFT at a median of at most 1.05 of the bound).
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

import numpy as np

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
        # found by review: was max(a_max, 1), so a kind slower on every pool counted at speed 1
        total += t.duration_s / a_max
    return total


def total_speed(catalogue: Catalogue, *, at_max: bool = True) -> float:
    """Sum over pools of slots x speed: the pooled machine of the stream bound.

    ``at_max`` uses each pool's ``max_workers`` (elastic pools may grow to it), which keeps the
    bound valid whatever the autoscaler does.
    """
    total = 0.0
    for p in catalogue.pools:
        n = p.ceiling if at_max else p.workers
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


# --- the single-DAG makespan bound ---------------------------------------------------------------

#: budget of (tail thresholds x task prefixes x work thresholds) cells :func:`window_lb` evaluates;
#: above it the thresholds are thinned evenly (every subset of thresholds gives a valid bound)
WINDOW_CELLS = 20_000_000
#: the same for bound (c), in (tail thresholds x work thresholds x tasks x speed classes^2) cells
BACK_TO_BACK_CELLS = 50_000_000


def _slot_rates(graph: RunGraph, catalogue: Catalogue) -> tuple[np.ndarray, np.ndarray]:
    """``rates[v, k]``: speed of pool ``k`` on task ``v`` (0 where it cannot hold it); the pool of each slot.

    Slots are counted at each pool's ``max_workers`` (the most an elastic pool can have). A task
    that no pool can hold gets every pool, as in :func:`fastest_speed`.

    Shapes: ``rates`` (n tasks, pools); slot pools (slots,).
    """
    slot_pool = np.array([k for k, p in enumerate(catalogue.pools)
                          for _ in range(p.ceiling_slots)], dtype=np.int64)
    rates = np.zeros((len(graph.tasks), len(catalogue.pools)))
    for v, t in enumerate(graph.tasks):
        for k, p in enumerate(catalogue.pools):
            vm = p.vm_class
            fits = t.cpus <= vm.cpus and t.memory_gb <= vm.memory_gb and t.gpus <= vm.gpus
            if fits and (t.pool is None or t.pool == p.name):
                rates[v, k] = vm.speed * vm.affinity.get(t.kind, 1.0)
        if not rates[v].any():
            rates[v] = [p.vm_class.speed * p.vm_class.affinity.get(t.kind, 1.0) for p in catalogue.pools]
    return rates, slot_pool


def _thin(values: np.ndarray, cap: int) -> np.ndarray:
    """The sorted distinct ``values``, at most ``cap`` of them spread evenly (extremes kept)."""
    u = np.unique(values)
    if len(u) > cap:
        u = u[np.unique(np.linspace(0, len(u) - 1, cap).round().astype(np.int64))]
    return u


def _turns(speeds: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` smallest values of ``{i / e: i = 1, 2, ...; e in speeds}``, ascending.

    ``N`` tasks of work ``>= w`` each, run without preemption, need ``>= w * turns[N - 1]``
    seconds on slots of these speeds: a slot of speed ``e`` fits ``i`` of them in ``i * w / e``.
    """
    if n == 0 or len(speeds) == 0:
        return np.full(max(n, 1), np.inf)
    classes, count = np.unique(speeds, return_counts=True)
    out = np.concatenate([np.repeat(np.arange(1, -(-n // c) + 1) / e, c)
                          for e, c in zip(classes, count, strict=True)])
    return np.sort(out)[:n]


def _back_to_back(work: np.ndarray, pis: np.ndarray, speeds: np.ndarray) -> np.ndarray:
    """Bound (c) for each ``T = {work > pi}``: the ``|T|``-th smallest of ``{S_x / e_j}``.

    ``S_x`` is the sum of the ``x`` smallest works of ``T``: a slot that runs ``x`` tasks of
    ``T`` one after another needs at least ``S_x / e_j`` seconds. 0 where ``T`` is empty.

    Shapes: ``work`` (n,) ascending; ``pis`` (G,); ``speeds`` (m,); result (G,).
    """
    n = len(work)
    start = np.searchsorted(work, pis, side="right")
    size = n - start
    csum = np.concatenate(([0.0], np.cumsum(work)))
    x = np.arange(1, n + 1)
    sums = csum[np.minimum(start[:, None] + x, n)] - csum[start][:, None]  # (G, n)
    classes, count = np.unique(speeds, return_counts=True)
    cand = sums[:, None, :] / classes[None, :, None]  # (G, classes, n)
    cand = np.where((x <= size[:, None])[:, None, :], cand, np.inf).reshape(len(pis), -1)
    mult = np.repeat(count, n)
    order = np.argsort(cand, axis=1, kind="stable")
    reached = np.cumsum(mult[order], axis=1) >= size[:, None]
    pick = np.take_along_axis(cand, order, axis=1)[np.arange(len(pis)), reached.argmax(axis=1)]
    return np.where(size > 0, pick, 0.0)


def window_lb(head: np.ndarray, tail: np.ndarray, work: np.ndarray, speeds: np.ndarray) -> float:
    """``max`` over task sets ``T`` of ``min head(T) + min tail(T) + L(T)`` (lemma of :func:`makespan_lb`).

    ``speeds[j]`` bounds the rate (units of ``work`` per second) at which slot ``j`` processes
    any of these tasks, so a task of work ``w`` occupies slot ``j`` for ``>= w / speeds[j]``
    seconds. The sets tried are ``{tail >= q, head >= r, work > pi}`` (thresholds thinned to
    :data:`WINDOW_CELLS`; bound (c), the costliest, on ``{tail >= q, work > pi}`` alone, within
    :data:`BACK_TO_BACK_CELLS`); ``L(T)`` is the largest of the time bounds (a)-(d).

    Shapes: ``head``, ``tail``, ``work`` (n,); ``speeds`` (m,).
    """
    n = len(work)
    if n == 0 or len(speeds) == 0:
        return 0.0
    e = np.sort(np.asarray(speeds, float))[::-1]
    m = len(e)
    cap = np.cumsum(e)  # cap[k-1] = E_k, the k fastest slots together
    steps = np.nonzero(e[:-1] > e[1:])[0]  # k-1 for every k with e_k > e_(k+1)
    turns = _turns(e, n)
    turns_fast = [_turns(e[: k + 1], n) for k in steps]
    per_axis = max(8, int((WINDOW_CELLS / n) ** 0.5))
    distinct = np.unique(work)
    pis = np.concatenate(([-1.0], _thin(work, per_axis)[:-1]))  # T = {work > pi}; -1: all
    low = distinct[np.searchsorted(distinct, pis, side="right")]  # least work in {work > pi}
    by_head = np.argsort(-head, kind="stable")
    h, t, w = head[by_head], tail[by_head], work[by_head]
    best = 0.0
    for q in _thin(tail, per_axis):
        sel = t >= q
        hs, ws = h[sel], w[sel]  # row i: the tasks of head >= hs[i] (prefix), column: work > pi
        above = ws[:, None] > pis[None, :]
        total = np.cumsum(np.where(above, ws[:, None], 0.0), axis=0)
        count = np.cumsum(above, axis=0)
        some = count > 0
        k = np.clip(count, 1, n) - 1
        length = np.maximum(total / cap[np.minimum(k, m - 1)], low * turns[k])  # (a), (b)
        for step, fast in zip(steps, turns_fast, strict=True):  # (d): under pi / e_(k+1), on k slots
            beyond = pis / e[step + 1]
            length = np.maximum(length, np.minimum(beyond, np.maximum(total / cap[step], low * fast[k])))
        best = max(best, float(np.where(some, hs[:, None] + length, 0.0).max()) + float(q))
    per_q = len(pis) * n * (len(steps) + 1) ** 2  # candidates sorted per tail threshold
    for q in _thin(tail, max(1, min(per_axis, BACK_TO_BACK_CELLS // per_q))):
        sel = t >= q
        by_work = np.argsort(w[sel], kind="stable")
        ws, hs = w[sel][by_work], h[sel][by_work]
        first = np.minimum(np.searchsorted(ws, pis, side="right"), len(ws) - 1)
        r = np.minimum.accumulate(hs[::-1])[::-1][first]  # least head in {work > pi}
        length = _back_to_back(ws, pis, e)
        for step in steps:
            fast = _back_to_back(ws, pis, e[: step + 1])
            length = np.maximum(length, np.minimum(pis / e[step + 1], fast))
        best = max(best, float((np.where(length > 0, r + length, 0.0)).max()) + float(q))
    return best


def makespan_lb(graph: RunGraph, catalogue: Catalogue,
                durations: Sequence[float] | None = None) -> float:
    """A lower bound on the makespan of ``graph`` run alone on the whole cluster, in seconds.

    Never below :func:`critical_path_lb` nor the job's work over the cluster's total speed; much
    tighter where a wide stage cannot all run on the fastest slots. Heads and tails as in
    Fernandez & Bussell (1973) and Carlier (1982), on the slots of the catalogue (every pool at
    ``max_workers``):

    * ``p(v)``: the task's time on its fastest feasible slot. ``head(v)`` bounds its start from
      below, ``tail(v)`` the time from its finish to the end of the run; both start as longest
      paths of ``p`` and are raised below.
    * Work ``w(v) = duration / a(v)``, ``a(v)`` the largest affinity among the pools that can
      hold the task; slot ``j`` then processes any task at ``<= e_j`` units of work per second,
      ``e_j`` = its speed x the largest ``affinity / a(v)`` over the tasks it can hold (its
      speed when nothing has an affinity). ``E_k`` = the ``k`` largest ``e`` summed.

    **Lemma.** For any set ``T`` of tasks and any schedule of makespan ``C``, every task of
    ``T`` runs inside ``[r, C - q]``, ``r = min head(T)``, ``q = min tail(T)``, so
    ``C >= r + q + L`` for any lower bound ``L`` on the time to process ``T`` alone:

    (a) a task runs on one slot at a time, so ``|T|`` tasks never get more than ``E_|T|``
        (``E_m`` for ``m`` slots): ``L >= w(T) / E_min(|T|, m)``;
    (b) tries are not preempted (the simulator and Celery run a try to its end): if every task
        of ``T`` has ``w >= w_min``, a slot of speed ``e`` fits at most ``floor(L e / w_min)``
        of them, so ``L >= w_min * turns[|T|]`` (the ``|T|``-th smallest ``i / e_j``);
    (c) more finely, a slot that runs ``x`` tasks of ``T`` back to back needs ``S_x / e_j``,
        ``S_x`` the sum of the ``x`` smallest works of ``T``; so ``L`` is at least the
        ``|T|``-th smallest of ``{S_x / e_j: x >= 1, slot j}``;
    (d) if ``L <= pi / e_(k+1)``, every task of ``T`` with ``w > pi`` finishes on one of the
        ``k`` fastest slots (any other needs more than ``L``), so (a)-(c) apply on those ``k``
        slots alone: ``L >= min(pi / e_(k+1), their bound on the k fastest slots)``.

    Heads are raised in topological order with ``T`` = a subset of a task's parents (all finish
    before it starts: ``head(v) >= min head(T) + L(T)``), tails in reverse order with the
    children, and the bound is the lemma over the subsets ``{head >= r, tail >= q, w > pi}`` of
    the whole DAG (:func:`window_lb`), again with exact rates inside each group of tasks that
    share one rate profile over the pools. Each step uses only bounds proved before it, so the
    result bounds every schedule, whatever the placement and order; failures, outages,
    boot delays and dispatch latency only delay a run. With duration noise it bounds the
    makespan at the expected durations (``durations`` overrides them), like
    :func:`critical_path_lb`.
    """
    n = len(graph.tasks)
    if n == 0:
        return 0.0
    g = view(graph)
    dur = np.asarray(durations if durations is not None else [t.duration_s for t in graph.tasks], float)
    rates, slot_pool = _slot_rates(graph, catalogue)
    p = dur / rates.max(axis=1)
    speed = np.array([pool.vm_class.speed for pool in catalogue.pools])
    aff = (rates / speed).max(axis=1)  # a(v)
    work = dur / aff
    e = (rates / aff[:, None]).max(axis=0)[slot_pool]
    e = e[e > 0]
    head = np.zeros(n)
    for v in g.order:
        ps = list(g.parents[v])
        if ps:
            head[v] = float((head[ps] + p[ps]).max())
            if len(ps) > 1:
                head[v] = max(head[v], window_lb(head[ps], np.zeros(len(ps)), work[ps], e))
    tail = np.zeros(n)
    for v in reversed(g.order):
        cs = list(g.children[v])
        if cs:
            tail[v] = float((tail[cs] + p[cs]).max())
            if len(cs) > 1:
                tail[v] = max(tail[v], window_lb(tail[cs], np.zeros(len(cs)), work[cs], e))
    best = max(float((head + p + tail).max()), window_lb(head, tail, work, e),
               critical_path_lb(graph, catalogue, durations))
    profiles, group = np.unique(rates, axis=0, return_inverse=True)
    if len(profiles) > 1:
        group = np.asarray(group).reshape(-1)
        for k, profile in enumerate(profiles):
            mine = group == k
            if mine.sum() > 1:
                rate = profile[slot_pool]
                best = max(best, window_lb(head[mine], tail[mine], dur[mine], rate[rate > 0]))
    return best


def job_bounds(graphs: Sequence[RunGraph], catalogue: Catalogue) -> Mapping[str, float]:
    """run_key -> critical-path lower bound."""
    return {g.run_key: critical_path_lb(g, catalogue) for g in graphs}
