"""The simulator's autoscaling, billing, outage and slow-down windows and retries, on small
workloads where the right answer is worked out by hand.

Each test failed on the code before its fix; its docstring says what was wrong.
"""

from __future__ import annotations

from typing import Any, Mapping

import pytest
from test_simulator import _ToPool

from policy.catalogue import Catalogue, parse_catalogue
from policy.placement import EarliestFinishPlacer
from policy.schema import Decision, PlacementRequest, RunGraph, TaskNode
from trainer.simulator import Job, Outage, SimulationError, Simulator, Slowdown

#: $1 a second, so that a cost is the billed worker-seconds
VM = {"v": {"cpus": 4, "memory_gb": 16, "speed": 1.0, "price_per_hour": 3600.0}}


def _catalogue(pools: dict[str, Any], vms: dict[str, Any] | None = None) -> Catalogue:
    return parse_catalogue({"vm_classes": vms or VM, "pools": pools})


def _one(key: str, d: float) -> RunGraph:
    return RunGraph(key, (TaskNode("t0", duration_s=d),), ())


class _ByTask:
    """Sends each ready task to the pool ``pools[task_id]``."""

    name = "by-task"

    def __init__(self, pools: dict[str, str]) -> None:
        self.pools = pools

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        vm = {p.name: p.vm_class for p in request.pools}
        return [Decision(t.run_key, t.task_id, self.pools[t.task_id], vm[self.pools[t.task_id]])
                for t in request.ready]


def test_scale_in_while_a_worker_boots_bills_each_worker_its_own_life() -> None:
    """Billing is per worker, "per ``billing_s`` started, from boot to removal"
    (trainer/cluster.py). Here one worker is up from 0 s; a task queued at 80 s makes a second
    one boot (ready at 180 s); the first worker, idle from 95 s, is removed at 105 s while the
    second is still booting; the second is removed at 190 s. With ``billing_s`` 100 s the first
    worker (105 s of life) and the second (110 s) each start two periods: $400.

    Wrong: ``PoolRuntime.remove_workers`` pops the *newest* boot time from ``alive_since``, which
    is the booting worker's (80 s), so the removed worker is billed 25 s and the booting one,
    later, from 0 s to 190 s: 1 + 2 periods, $300. (With ``billing_s`` 1 the totals happen to
    agree, which is why no test saw it.)"""
    cat = _catalogue({"e": {"vm_class": "v", "workers": 1, "min_workers": 0, "max_workers": 2,
                            "boot_delay_s": 100, "idle_scale_down_s": 10, "billing_s": 100}})
    jobs = [Job(_one("a", 90.0), 0.0), Job(_one("b", 5.0), 80.0)]
    sim = Simulator(cat, jobs, _ToPool("e"), seed=0)
    r = sim.run()
    assert [(t.run_key, t.start_s, t.end_s) for t in r.tasks] == [("a", 0.0, 90.0), ("b", 90.0, 95.0)]
    assert sim.pools[0].workers == 0
    assert r.cost == pytest.approx(400.0)


def test_window_scale_in_keeps_a_starting_worker_for_the_window() -> None:
    """``scale_in="window"`` (trainer/cluster.py): "a worker goes only after it has been surplus
    for ``idle_scale_down_s``" (here 300 s). An elastic pool starts with one worker (``workers``
    1, ``min_workers`` 0) and a one-task job arrives at 0 s: the worker should run it at once,
    0-5 s, as it does under ``"sustained"``.

    Wrong: the ``"window"`` history (``needed_log``) starts empty, so at the first instant
    (``Simulator._autoscale`` before any decision of that instant) the peak need is 0 and the
    worker, surplus for 0 s, is removed; the task then waits a 100 s boot (runs 100-105 s)."""
    cat = _catalogue({"e": {"vm_class": "v", "workers": 1, "min_workers": 0, "max_workers": 1,
                            "boot_delay_s": 100, "idle_scale_down_s": 300}})
    jobs = [Job(_one("a", 5.0), 0.0)]
    sustained = Simulator(cat, jobs, _ToPool("e"), seed=0, scale_in="sustained").run()
    assert [(t.start_s, t.end_s) for t in sustained.tasks] == [(0.0, 5.0)]
    window = Simulator(cat, jobs, _ToPool("e"), seed=0, scale_in="window").run()
    assert [(t.start_s, t.end_s) for t in window.tasks] == [(0.0, 5.0)]


def test_sustained_scale_in_counts_surplus_from_the_start() -> None:
    """``scale_in="sustained"`` removes surplus workers "once the pool has had surplus workers
    without a break for ``idle_scale_down_s``" (trainer/cluster.py), billed from boot to removal.
    An elastic pool starts with one idle worker (``min_workers`` 0, ``idle_scale_down_s`` 100,
    $1 a second); the only job (at 500 s) runs on another, free pool. The worker is surplus from
    0 s, so it should go at 100 s: $100.

    Wrong: ``Simulator._autoscale`` first runs after the first event (the arrival at 500 s;
    ``reset_state`` evaluates nothing at 0 s), so ``surplus_since`` is 500 s and the worker is
    billed to 600 s: $600 (the idle time before the first arrival counts for nothing)."""
    vms = {"free": {"cpus": 4, "memory_gb": 16, "speed": 1.0, "price_per_hour": 0.0}, **VM}
    cat = _catalogue({"f": {"vm_class": "free", "workers": 1},
                      "e": {"vm_class": "v", "workers": 1, "min_workers": 0, "max_workers": 1,
                            "idle_scale_down_s": 100}}, vms)
    sim = Simulator(cat, [Job(_one("a", 5.0), 500.0)], _ToPool("f"), seed=0, scale_in="sustained")
    r = sim.run()
    assert [(t.pool, t.start_s, t.end_s) for t in r.tasks] == [("f", 500.0, 505.0)]
    assert sim.pools[1].workers == 0
    assert r.cost == pytest.approx(100.0)


@pytest.mark.parametrize("kind", ["outage", "slowdown"])
def test_back_to_back_windows_listed_later_first(kind: str) -> None:
    """Back-to-back outages are accepted (tests/trainer/test_simulator.py: "back to back is
    fine"), and so are back-to-back slow-downs; the order they are listed in must not matter.

    Outages (50-60 s, 10-50 s) on a one-worker pool, a task sent to it at 55 s: the pool is down
    at 55 s, so the decision is refused and the task runs 60-70 s. Slow-downs (50-100 s, 10-50 s;
    factor 0.5), a 10 s task started at 75 s: it runs at half speed, 75-95 s.

    Wrong: ``Simulator.reset_state`` pushes each window's start and end events in list order and
    the heap breaks time ties by push order, so at 50 s the second window's start (pushed first)
    is applied before the first window's end, which then brings the pool up (``_UP``) or back to
    full speed (``_FAST``) for the whole of the second window: the task runs 55-65 s / 75-85 s."""
    cat = _catalogue({"p": {"vm_class": "v", "workers": 1}})
    if kind == "outage":
        jobs = [Job(_one("a", 10.0), 55.0)]
        r = Simulator(cat, jobs, _ToPool("p"), seed=0,
                      outages=(Outage("p", 50.0, 60.0), Outage("p", 10.0, 50.0))).run()
        assert [(t.start_s, t.end_s) for t in r.tasks] == [(60.0, 70.0)]
        assert r.refused_decisions == 1
    else:
        jobs = [Job(_one("a", 10.0), 75.0)]
        r = Simulator(cat, jobs, _ToPool("p"), seed=0,
                      slowdowns=(Slowdown("p", 50.0, 100.0, 0.5), Slowdown("p", 10.0, 50.0, 0.5))).run()
        assert [(t.start_s, t.end_s) for t in r.tasks] == [(75.0, 95.0)]


def test_overlapping_slowdowns_end_only_their_own_window() -> None:
    """A slow-down makes the pool run at ``factor`` x its speed "for tries started in the
    window" (``Slowdown``). With slow-downs 0-100 s and 50-200 s (factor 0.5 each), a 10 s task
    started at 150 s is inside the second window only and should take 20 s (150-170 s). (Refusing
    overlapping slow-downs, as overlapping outages are refused, would be a fix too.)

    Wrong: ``SimConfig.__post_init__`` refuses overlapping outages but not overlapping
    slow-downs, and the first window's end (``_FAST`` in ``Simulator._handle``) sets
    ``speed_factor = 1.0`` although the second window still lasts: the task runs 150-160 s."""
    cat = _catalogue({"p": {"vm_class": "v", "workers": 1}})
    jobs = [Job(_one("a", 10.0), 150.0)]
    try:
        sim = Simulator(cat, jobs, _ToPool("p"), seed=0,
                        slowdowns=(Slowdown("p", 0.0, 100.0, 0.5), Slowdown("p", 50.0, 200.0, 0.5)))
    except ValueError:
        return  # refused, as overlapping outages are: fine
    r = sim.run()
    assert [(t.start_s, t.end_s) for t in r.tasks] == [(150.0, 170.0)]


def test_without_autoscaling_a_task_queued_on_an_empty_pool_is_not_silently_dropped() -> None:
    """``SimConfig(autoscale=False)`` "keeps every pool at its ``workers``": an elastic pool that
    starts with 0 workers then never gets a slot. A job whose only pool it is can never finish;
    the simulation must say so (``SimulationError``, as for a placer that leaves tasks ready
    while nothing can happen) or finish the job, never report itself done without it.

    Wrong: the requests still advertise the pool's growth (``Simulator._pool_state`` sets
    ``max_slots`` from ``max_workers`` whatever ``autoscale``), so the placer queues the task
    there; nothing boots, the event heap empties, and ``Simulator._advance`` sets ``_done`` with
    the task still queued: ``run()`` returns a result with no job record (mean JCT, cost and
    SLA rate of an empty workload)."""
    cat = _catalogue({"e": {"vm_class": "v", "workers": 0, "min_workers": 0, "max_workers": 2,
                            "boot_delay_s": 10}})
    jobs = [Job(_one("a", 5.0), 0.0)]
    sim = Simulator(cat, jobs, EarliestFinishPlacer(), seed=0, autoscale=False)
    try:
        r = sim.run()
    except SimulationError:
        return
    assert [j.run_key for j in r.jobs] == ["a"]


def test_retries_see_the_same_realised_durations_under_every_policy() -> None:
    """The module docstring: noise and failure draws are "drawn at arrival, so every policy sees
    the same realised durations (common random numbers)". Two independent 10 s tasks on a speed-1
    and a speed-2 pool, failure rate 0.5, noise 0.5, seed 0: both first tries fail, both second
    tries succeed. Swapping which task goes to which pool must not change any try's realised
    work (run time x pool speed).

    Wrong: only first tries are drawn at arrival; ``Simulator._start`` draws a retry's noise and
    failure from the run's generator when the retry *starts*, so retries take the draws in the
    order the policy happens to start them: here t0's second try is 16.94 s of work under one
    placement and 4.69 s under the other (and t1's the reverse)."""
    vms = {"s": {"cpus": 4, "memory_gb": 16, "speed": 1.0}, "f": {"cpus": 4, "memory_gb": 16, "speed": 2.0}}
    cat = _catalogue({"slow": {"vm_class": "s", "workers": 1}, "fast": {"vm_class": "f", "workers": 1}}, vms)
    speed = {"slow": 1.0, "fast": 2.0}
    graph = RunGraph("j", (TaskNode("t0", duration_s=10.0), TaskNode("t1", duration_s=10.0)), ())

    def work(pools: dict[str, str]) -> dict[tuple[str, int], tuple[bool, float]]:
        r = Simulator(cat, [Job(graph, 0.0)], _ByTask(pools), seed=0, duration_noise=0.5,
                      failure_rate=0.5).run()
        return {(t.task_id, t.try_number): (t.ok, round((t.end_s - t.start_s) * speed[t.pool], 6))
                for t in r.tasks}

    a = work({"t0": "fast", "t1": "slow"})
    b = work({"t0": "slow", "t1": "fast"})
    assert {k for k in a if k[1] > 1} >= {("t0", 2), ("t1", 2)}, "both first tries fail here"
    assert a == b


def test_a_try_that_finishes_as_an_outage_starts_is_not_killed() -> None:
    """An ``Outage`` is "down from ``start_s`` to ``end_s``" (and a ``Slowdown`` counts a try
    started at ``start_s`` as inside, i.e. windows are [start, end)). A 10 s task starting at 0 s
    on a one-worker pool has finished at 10 s; an outage 10-20 s begins as it ends, so the job
    should finish at 10 s with one successful try.

    Wrong: outage events are pushed in ``Simulator.reset_state`` before any ``_FINISH``, and the
    heap breaks time ties by push order, so at 10 s ``_DOWN`` is handled first and kills the
    try that has just completed its whole run time (``_outage`` records it as a failed try);
    the retry waits for the pool and runs 20-30 s. A completion and an outage at the same
    instant should resolve in favour of the completion (e.g. give ``_DOWN`` a tie-break after
    ``_FINISH``)."""
    cat = _catalogue({"p": {"vm_class": "v", "workers": 1}})
    jobs = [Job(_one("a", 10.0), 0.0)]
    r = Simulator(cat, jobs, _ToPool("p"), seed=0, outages=(Outage("p", 10.0, 20.0),)).run()
    assert [(t.start_s, t.end_s, t.ok) for t in r.tasks] == [(0.0, 10.0, True)]
    assert r.failed_tries == 0
    assert r.jobs[0].finish_s == pytest.approx(10.0)


class _ReplaceQueued:
    """Places every ready task on ``p``; at its second request also sends again a task that was
    placed at the first one and is still queued (not ready)."""

    name = "re-place"

    def __init__(self) -> None:
        self.calls = 0

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        self.calls += 1
        out = [Decision(t.run_key, t.task_id, "p", "v") for t in request.ready]
        if self.calls == 2:
            out.append(Decision("a", "t1", "p", "v"))
        return out


def test_a_decision_for_a_task_queued_earlier_is_an_error() -> None:
    """The module docstring: "A decision for a task that is not ready raises
    :class:`SimulationError`". Job ``a`` (two independent 10 s tasks) at 0 s on a one-worker
    pool: t0 runs, t1 is queued. Job ``b`` arrives at 5 s; the placer's second request offers
    only b/t0, and the placer also returns a decision for a/t1, queued since 0 s: not ready.

    Wrong: ``Simulator._apply`` skips any decision for a task that is ``_QUEUED`` and not in
    ``_ready`` (meant for a duplicate decision *within one batch*), so a decision for a task
    queued at an earlier decision point is silently dropped instead of refused or raised.
    Fix: remember the tasks queued by this batch (e.g. a local set) and skip only those."""
    cat = _catalogue({"p": {"vm_class": "v", "workers": 1}})
    graph = RunGraph("a", (TaskNode("t0", duration_s=10.0), TaskNode("t1", duration_s=10.0)), ())
    jobs = [Job(graph, 0.0), Job(_one("b", 10.0), 5.0)]
    placer = _ReplaceQueued()
    with pytest.raises(SimulationError, match="not ready"):
        Simulator(cat, jobs, placer, seed=0).run()
