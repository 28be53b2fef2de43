"""Hold clocks: what the executor's and the simulator's bounds on holding count."""

from __future__ import annotations

import pytest

from policy.holds import HoldClocks, slot_free_for
from policy.schema import PoolState, TaskNode


def test_the_wait_bound_counts_only_time_with_a_free_slot():
    c = HoldClocks(wait_s=60.0, hold_s=300.0)
    assert c.hold("t", 0.0, slot_free=True) == [300.0, 60.0]  # both bounds, if nothing changes
    assert c.hold("t", 40.0, slot_free=False) == []  # 40 s with a free slot, then the pools fill
    assert c.waited_s("t", 100.0) == pytest.approx(40.0) and c.overdue("t", 100.0) is None
    assert c.hold("t", 200.0, slot_free=True) == [220.0]  # a slot again: 20 s left of the 60
    assert c.overdue("t", 219.0) is None
    assert c.overdue("t", 220.0) == "max_wait"
    assert c.held_s("t", 220.0) == pytest.approx(220.0) and c.since("t") == 0.0


def test_the_hold_bound_counts_every_second_held_and_comes_first_when_it_is_sooner():
    c = HoldClocks(wait_s=60.0, hold_s=100.0)
    c.hold("t", 0.0, slot_free=False)
    assert c.hold("t", 90.0, slot_free=True) == []  # the wait bound would end at 150: after the hold's
    assert c.overdue("t", 99.0) is None
    assert c.overdue("t", 100.0) == "max_hold"


def test_equal_bounds_are_the_single_bound_of_earlier_versions():
    c = HoldClocks(wait_s=60.0, hold_s=60.0)
    assert c.hold("t", 5.0, slot_free=True) == [65.0]  # one wake: the wait bound cannot come sooner
    c.hold("u", 5.0, slot_free=False)
    assert c.overdue("t", 65.0) == c.overdue("u", 65.0) == "max_hold"


def test_unbounded_clocks_only_tell_how_long_a_task_was_held():
    c = HoldClocks(wait_s=None)
    assert c.hold("t", 1.0, slot_free=True) == []
    assert c.overdue("t", 1e9) is None and c.held_s("t", 11.0) == 10.0
    assert c.held_s("gone", 11.0) == 0.0 and c.waited_s("gone", 11.0) == 0.0


def test_a_bound_of_zero_ends_every_hold_at_once_even_before_the_first_note():
    assert HoldClocks(wait_s=0.0).overdue("new", 3.0) == "max_wait"
    assert HoldClocks(wait_s=60.0, hold_s=0.0).overdue("new", 3.0) == "max_hold"
    assert HoldClocks(wait_s=60.0, hold_s=300.0).overdue("new", 3.0) is None


def test_forget_and_keep_only():
    c = HoldClocks(wait_s=60.0)
    for k in "abc":
        c.hold(k, 0.0, slot_free=True)
    c.forget("a")
    c.keep_only(["b", "z"])
    assert len(c) == 1 and "b" in c and "a" not in c and "c" not in c
    assert c.hold("a", 10.0, slot_free=True) == [70.0]  # held again: a new clock


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_bad_bounds_are_refused(bad):
    with pytest.raises(ValueError, match="wait_s"):
        HoldClocks(wait_s=bad)
    with pytest.raises(ValueError, match="hold_s"):
        HoldClocks(wait_s=1.0, hold_s=bad)


def _pool(name: str, slots: int, busy: int = 0, gpus: int = 0, up: bool = True) -> PoolState:
    return PoolState(name=name, vm_class=name, slots=slots, cpus=8, memory_gb=32, gpus=gpus, speed=1.0,
                     price_per_hour=0.1, busy=busy, up=up)


def test_a_free_slot_is_one_on_a_pool_that_is_up_and_fits_the_task():
    gpu_task = TaskNode("train", duration_s=10.0, gpus=1)
    cpu_task = TaskNode("etl", duration_s=10.0)
    pools = [_pool("cpu", 4, busy=2), _pool("gpu", 1, busy=1, gpus=1), _pool("gpu-down", 1, gpus=1, up=False)]
    assert slot_free_for(cpu_task, pools)
    assert not slot_free_for(gpu_task, pools)  # its only pool up is full; the free one is down
    assert not slot_free_for(cpu_task, pools, taken={"cpu": 2})  # given away this heartbeat
    assert slot_free_for(TaskNode("x", duration_s=1.0, pool="cpu"), pools)
    assert not slot_free_for(TaskNode("x", duration_s=1.0, pool="gpu"), pools)  # pinned to a full pool
