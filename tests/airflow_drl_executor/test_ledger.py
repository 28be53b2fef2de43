"""The executor's ledger reports pool load as the simulator the policy was trained in does."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from airflow_drl_executor.ledger import Ledger, PoolLoad
from policy.catalogue import load_catalogue
from policy.placement import EarliestFinishPlacer
from policy.schema import Decision, PlacementRequest, RunGraph
from trainer.simulator import Job, Simulator
from trainer.workloads import seed_graph

CATALOGUES = "policy/catalogues"


def _sent(ledger: Ledger, pool: str, n: int, run_s: float, at: float) -> list[str]:
    keys = [f"{pool}-{len(ledger) + i}" for i in range(n)]
    for k in keys:
        ledger.add(k, pool, ti_id=k, run_s=run_s, start_at=at)
    return keys


def test_a_backlog_on_an_overrunning_pool_shows_its_wait() -> None:
    """Six 60 s tasks sent at t=0 to 2 slots run twice as long: at t=200 two finished, two run
    (since 120) and two wait. was: busy 4, queued 0 and every expected finish in the past (wait 0)."""
    ledger = Ledger()
    keys = _sent(ledger, "p", 6, run_s=60.0, at=0.0)
    alive = set(keys[2:])
    load = ledger.load("p", 2, 200.0, alive=alive, started={keys[2]: 120.0, keys[3]: 120.0}, running_there=2)
    assert load == PoolLoad(busy=2, queued=2, free_at=(180.0, 180.0, 260.0, 260.0))


def test_busy_never_exceeds_the_slots_and_others_tasks_hold_slots() -> None:
    ledger = Ledger()
    keys = _sent(ledger, "p", 3, run_s=10.0, at=0.0)
    # another scheduler's 3 tasks run on 3 of the 4 slots; ours have not started
    load = ledger.load("p", 4, 5.0, alive=set(keys), started={}, running_there=3)
    assert (load.busy, load.queued) == (3, 3)
    assert load.free_at == (15.0, 15.0, 15.0), "the others' finish is unknown here: taken as now"
    # more running than the catalogue's slots (its worker count is stale): busy is the slots
    load = ledger.load("p", 2, 5.0, alive=set(keys), started={k: 1.0 for k in keys}, running_there=3)
    assert (load.busy, load.queued, load.free_at) == (2, 1, (11.0, 11.0, 11.0))


def test_another_schedulers_running_tasks_hold_their_slots_until_their_expected_finish() -> None:
    """Airflow HA: both slots run the other scheduler's tasks, due at 100 s and 300 s; ours (50 s)
    waits for the first. was: their finish taken as now, so ours looked startable at once (free_at
    (50,) where the simulator shows (100, 150, 300))"""
    ledger = Ledger()
    (ours,) = _sent(ledger, "p", 1, run_s=50.0, at=0.0)
    load = ledger.load("p", 2, 0.0, alive={ours}, started={}, running_there=2, others=[300.0, 100.0])
    assert load == PoolLoad(busy=2, queued=1, free_at=(100.0, 150.0, 300.0))
    assert ledger.load("p", 2, 0.0, alive={ours}, started={}, running_there=2).free_at == (50.0,), \
        "unknown finishes: as before"


def test_without_a_db_read_the_first_sent_are_the_running_ones() -> None:
    ledger = Ledger()
    keys = _sent(ledger, "p", 3, run_s=10.0, at=0.0)
    load = ledger.load("p", 2, 4.0, alive=set(keys))
    assert load == PoolLoad(busy=2, queued=1, free_at=(10.0, 10.0, 20.0))
    assert ledger.load("p", 0, 4.0, alive=set(keys)) == PoolLoad(busy=0, queued=3, free_at=())


def test_expected_start_waits_for_a_slot_in_turn() -> None:
    ledger = Ledger()
    assert ledger.expected_start("p", 2, 0.0) == 0.0
    _sent(ledger, "p", 3, run_s=10.0, at=0.0)
    assert ledger.expected_start("p", 2, 0.0) == 10.0, "two run to 10, the third takes the first slot to 20"
    assert ledger.expected_start("p", 4, 3.0) == 3.0
    with pytest.raises(ValueError, match="run_s must be a number >= 0, got -1"):
        ledger.add("k", "p", "k", -1.0, 0.0)


def test_keep_and_drop() -> None:
    ledger = Ledger()
    keys = _sent(ledger, "p", 3, run_s=1.0, at=0.0)
    ledger.drop(keys[0])
    ledger.keep({keys[1]})
    assert len(ledger) == 1 and keys[1] in ledger and ledger.pool_of(keys[1]) == "p"
    assert ledger.in_flight({keys[1]}) == [keys[1]]


class _Mirror:
    """EFT, comparing at each request every pool state the simulator reports with what the
    executor's ledger reports from the same facts: what was sent to each pool in order, which
    of it started and when (the metadata DB's start_date), how many run there."""

    def __init__(self, sim_ref: list[Simulator]) -> None:
        self.inner = EarliestFinishPlacer()
        self.sim_ref = sim_ref
        self.compared = 0
        self.backlogged = 0

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        sim = self.sim_ref[0]
        for pool, state in zip(sim.pools, request.pools, strict=True):
            ledger, started = Ledger(), {}
            vm = pool.spec.vm_class
            for (r, i), finish in pool.expect.items():
                task = sim._runs[r].graph.tasks[i]  # type: ignore[union-attr]
                run_s = task.duration_s / (vm.speed * vm.affinity.get(task.kind, 1.0))
                ledger.add((r, i), pool.name, f"{r}/{i}", run_s, start_at=-1.0)
                started[f"{r}/{i}"] = finish - run_s
            for r, i in pool.queue:
                task = sim._runs[r].graph.tasks[i]  # type: ignore[union-attr]
                ledger.add((r, i), pool.name, f"{r}/{i}", task.duration_s / (vm.speed * vm.affinity.get(task.kind, 1.0)),
                           start_at=-1.0)
            load = ledger.load(pool.name, state.slots, request.created_at, alive=ledger._sent,
                               started=started, running_there=pool.running)
            assert (load.busy, load.queued) == (state.busy, state.queued), pool.name
            assert load.free_at == pytest.approx(state.free_at, abs=1e-6), pool.name
            self.compared += 1
            self.backlogged += state.queued > 0
        return self.inner.place(request, graphs)


def test_the_ledger_reports_what_the_simulator_reports() -> None:
    cat = load_catalogue(f"{CATALOGUES}/gpu-affinity.yaml")
    rng = np.random.default_rng(3)
    jobs = [Job(seed_graph(fam, 20, 0, rng, run_key=f"r{k}"), arrival_s=5.0 * k)
            for k, fam in enumerate(["montecarlo", "etl", "mlpipeline"] * 3)]
    ref: list[Simulator] = []
    mirror = _Mirror(ref)
    sim = Simulator(cat, jobs, mirror, seed=1, duration_noise=0.3)
    ref.append(sim)
    sim.run()
    assert mirror.compared > 100 and mirror.backlogged > 10, (mirror.compared, mirror.backlogged)


def test_a_batchs_planner_gives_the_starts_one_scan_per_placement_gave() -> None:
    """The planner builds each pool's slot heap once per batch (was: a scan of the whole ledger per
    placed task: placed x in flight, 28 ms a heartbeat with 2,000 tasks in flight)."""
    rng = np.random.default_rng(5)
    slow, fast = Ledger(), Ledger()
    for k in range(40):  # a backlog on both pools, some of it overrunning
        for ledger in (slow, fast):
            ledger.add(f"old{k}", "ab"[k % 2], f"old{k}", run_s=float(rng.integers(1, 30)) if ledger is slow else 0.0,
                       start_at=float(k))
    for k in range(40):  # the same entries in both
        fast._sent[f"old{k}"] = slow._sent[f"old{k}"]
    planner = fast.planner({"a": 3, "b": 0}, now=25.0)
    for k in range(30):
        pool, run_s = "ab"[k % 3 == 0], float(rng.integers(1, 20))
        want = slow.expected_start(pool, 3 if pool == "a" else 0, 25.0)
        assert planner.start(pool, run_s) == want, k
        slow.add(f"new{k}", pool, f"new{k}", run_s, want)
