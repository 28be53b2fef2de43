"""DRLExecutor's task-state handling around held tasks: open slots, tries, what is sent.

Each test drives the executor through Airflow's own ``trigger_tasks`` / ``slots_available`` with
the graph builder, the policy client and Celery's publish faked out (no DB, no Redis, no broker),
and a fake monotonic clock where the hold time matters. Each test failed on the code before its
fix, for the reason its docstring gives.
"""

from __future__ import annotations

import types
import uuid
from typing import Any

import pytest

# _no_other_scheduler: test_executor's autouse fixture (every DB read of the placement step empty)
from test_executor import FakeClient, _no_other_scheduler, _reply  # noqa: F401

from airflow_drl_executor import executor as executor_mod
from airflow_drl_executor.executor import DRLExecutor
from airflow_drl_executor.graph_builder import Batch
from airflow_drl_executor.metrics import fallback_cause
from airflow_drl_executor.traces import PlacementRecord
from policy.schema import ReadyTask, RunGraph, TaskNode

RUN = "etl/run1"


class Task(types.SimpleNamespace):
    """Stands for ``airflow.executors.workloads.ExecuteTask`` (patched in by the fixture)."""


def _task(task_id: str, *, priority: int = 1, try_number: int = 1, queue: str = "default") -> Task:
    ti = types.SimpleNamespace(id=uuid.uuid4(), dag_id="etl", run_id="run1", task_id=task_id, try_number=try_number,
                               dag_version_id=uuid.uuid4(), map_index=-1, queue=queue, priority_weight=priority,
                               key=("etl", task_id, "run1", try_number, -1), executor_config={})
    return Task(ti=ti)


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """An executor (parallelism 4) whose publishes all go (recorded in ``sent`` as (task id, try,
    queue)), with a fake monotonic clock (``clock[0]``)."""
    import airflow.executors.workloads as wl

    monkeypatch.setattr(wl, "ExecuteTask", Task)
    ex = DRLExecutor(parallelism=4)
    monkeypatch.setattr(ex.graph_builder, "build", lambda ready, session, not_sent=(), placed_before=None: Batch(
        {RUN: RunGraph(RUN, tuple(TaskNode(t) for t in sorted({r.task_id for r in ready})), ())}, [],
        [ReadyTask(RUN, r.task_id) for r in ready]))
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    monkeypatch.setattr(ex, "_record", lambda records: None)
    sent: list[tuple[str, int, str]] = []

    def send(tuples):  # type: ignore[no-untyped-def]
        for key, w, queue, _team in tuples:
            ex.queued_tasks.pop(key, None)
            ex.running.add(key)
            sent.append((w.ti.task_id, w.ti.try_number, queue))
    monkeypatch.setattr(ex, "_send_workloads", send)
    clock = [1000.0]
    monkeypatch.setattr(executor_mod.time, "monotonic", lambda: clock[0])
    return types.SimpleNamespace(ex=ex, sent=sent, clock=clock)


def _queue(ex: DRLExecutor, *tasks: Task) -> None:
    for w in tasks:
        ex.queued_tasks[w.ti.key] = w  # type: ignore[index]


def _heartbeat(ex: DRLExecutor) -> None:
    """The part of BaseExecutor.heartbeat that places and sends (sync is Celery's polling)."""
    ex.trigger_tasks(ex.parallelism - len(ex.running))


def test_a_held_task_does_not_block_a_task_routed_to_a_queue_of_its_own(harness: types.SimpleNamespace) -> None:
    """One slot open. The policy holds ``train`` (priority 10) for a better pool; ``report``
    (priority 5) is routed by its author to the ``reporting`` queue (sent there unplaced).

    User sees: ``report`` sits in queued for the whole ``max_wait_s`` (60 s by default) with a
    free slot, behind a task that is not going anywhere, while a task it outranks would be sent.
    Expected: as for any other task (test_tasks_held_for_a_better_pool_do_not_take_the_open_slots),
    once ``train`` is held, ``report`` takes the open slot at the next heartbeat."""
    ex, sent = harness.ex, harness.sent
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]  # the policy holds every task it sees
    ex.running.update({("busy", 1), ("busy", 2), ("busy", 3)})  # one slot open
    train, report = _task("train", priority=10), _task("report", priority=5, queue="reporting")
    _queue(ex, train)
    _heartbeat(ex)
    assert sent == [] and train.ti.key in ex._holds, "train is held for a better pool"
    _queue(ex, report)
    _heartbeat(ex)
    assert sent == [("report", 1, "reporting")], \
        "the held task must not take the only open slot from a task routed to its own queue"


def test_held_tasks_do_not_take_the_schedulers_free_slots(harness: types.SimpleNamespace) -> None:
    """Parallelism 4, two tasks running, two held by the policy for a better pool.

    The scheduler decides how many more task instances to queue from the executor's
    ``slots_available`` (and core.parallelism from ``slots_occupied``), which count every queued
    workload: the two held tasks make it 0, so no other ready task is queued at all.
    User sees: two free slots idle, every other ready task left in ``scheduled``, for up to
    ``max_wait_s`` each time the policy holds a task (the widened selection of
    ``_get_workloads_to_schedule`` only helps tasks already queued before the hold).
    Expected: held tasks do not take the executor's open slots, as the executor's own docstring
    says: the scheduler may queue two more task instances."""
    ex = harness.ex
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]
    ex.running.update({("busy", 1), ("busy", 2)})
    _queue(ex, _task("g1", priority=10), _task("g2", priority=10))
    _heartbeat(ex)
    assert harness.sent == [] and len(ex._holds) == 2, "both held for a better pool"
    assert ex.slots_available == 2, "the scheduler may queue two more ready tasks"
    assert ex.slots_occupied == 2, "core.parallelism: the held tasks occupy no slot"


def test_a_try_cleared_while_held_is_not_sent_with_its_next_try(harness: types.SimpleNamespace) -> None:
    """``transform`` try 1 is held for a better pool; the user clears it meanwhile (Airflow 3
    gives the task instance a new id and queues try 2; nothing tells the executor, whose queue
    still has try 1's workload). The policy then places the task.

    User sees: two Celery messages for one task instance (try 1 with the id the clear retired,
    try 2), two worker slots taken, the pool charged twice in the ledger, and a placement trace for
    a try that never ran. Plain Celery never has a stale queued try: it sends at once.
    Expected: only the newest queued try of a task instance is sent; the superseded one is dropped
    from the executor's queue."""
    ex, sent = harness.ex, harness.sent
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]
    first = _task("transform", try_number=1)
    _queue(ex, first)
    _heartbeat(ex)
    assert sent == [] and first.ti.key in ex.queued_tasks, "try 1 held"
    second = _task("transform", try_number=2)  # the clear: a new ti id, the next try queued
    _queue(ex, second)
    ex._client = FakeClient(_reply({"transform": "cpu-large"}))  # type: ignore[assignment]
    _heartbeat(ex)
    assert sent == [("transform", 2, "cpu-large")], "one message, for the live try"
    assert first.ti.key not in ex.queued_tasks and first.ti.key not in ex.running
    assert len(ex.ledger) == 1, "the pool is charged once"


def test_a_task_whose_publish_timed_out_after_its_hold_is_not_held_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """``train`` is held for a better pool until ``max_wait_s``, then placed by the fallback; its
    publish to the broker times out (Celery keeps it queued and retries at the next heartbeat).

    User sees: at the next heartbeat the policy holds it again from zero (its hold clock was
    dropped when it was placed, not when it was sent): it waits a second ``max_wait_s``, and after
    each further timeout yet another one, though the fallback had already placed it.
    Expected: a task held ``max_wait_s`` is not held again; the retried publish goes at the next
    heartbeat."""
    import airflow.executors.workloads as wl
    from airflow.exceptions import AirflowTaskTimeout
    from airflow.providers.celery.executors.celery_executor_utils import ExceptionWithTraceback

    monkeypatch.setattr(wl, "ExecuteTask", Task)
    ex = DRLExecutor(parallelism=4)
    monkeypatch.setattr(ex.graph_builder, "build", lambda ready, session, not_sent=(), placed_before=None: Batch(
        {RUN: RunGraph(RUN, (TaskNode("train"),), ())}, [], [ReadyTask(RUN, r.task_id) for r in ready]))
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    monkeypatch.setattr(ex, "_record", lambda records: None)
    timeouts = [1]
    published: list[str] = []

    def publish(tuples):  # type: ignore[no-untyped-def]
        out = []
        for key, w, queue, _team in tuples:
            if timeouts[0]:
                timeouts[0] -= 1
                out.append((key, None, ExceptionWithTraceback(AirflowTaskTimeout("publish timed out"), "tb")))
            else:
                published.append(queue)
                out.append((key, None, types.SimpleNamespace(task_id=f"celery-{w.ti.task_id}")))
        return out
    monkeypatch.setattr(ex, "_send_workloads_to_celery", publish)
    clock = [1000.0]
    monkeypatch.setattr(executor_mod.time, "monotonic", lambda: clock[0])
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]  # the policy keeps waiting
    train = _task("train")
    _queue(ex, train)
    _heartbeat(ex)
    assert train.ti.key in ex._holds
    clock[0] += ex.drl_config.max_wait_s + 1
    _heartbeat(ex)  # placed by the fallback; the publish times out
    assert train.ti.key in ex.queued_tasks and published == [] and timeouts == [0]
    clock[0] += 1
    _heartbeat(ex)
    assert published and train.ti.key in ex.running, \
        "held max_wait_s already: sent at the retry, not held for another max_wait_s"


def test_a_held_task_the_user_marked_success_is_not_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """``load`` is held for a better pool; meanwhile the user marks it success in the UI (its
    task instance row leaves ``queued``; nothing tells the executor, whose queue still has it).

    User sees: once ``max_wait_s`` has passed the executor places it by the fallback, writes its
    queue, charges the pool and sends it to Celery: a worker slot taken by a task that is already
    done (its start is refused), a training trace for a run that never happened. Plain Celery
    sends at once, so only the hold opens this window.
    Expected: a held task whose task instance is no longer queued is dropped, not sent."""
    import contextlib

    import airflow.executors.workloads as wl
    from airflow.models import import_all_models
    from airflow.models.base import Base
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import create_engine, insert, update
    from sqlalchemy.orm import Session

    import_all_models()
    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine)
    monkeypatch.setattr("airflow.utils.session.create_session", contextlib.contextmanager(
        lambda scoped=True: (yield Session(engine))))
    monkeypatch.setattr(wl, "ExecuteTask", Task)
    ex = DRLExecutor(parallelism=4)
    monkeypatch.setattr(ex.graph_builder, "build", lambda ready, session, not_sent=(), placed_before=None: Batch(
        {RUN: RunGraph(RUN, (TaskNode("load"),), ())}, [], [ReadyTask(RUN, r.task_id) for r in ready]))
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    monkeypatch.setattr(ex, "_record", lambda records: None)
    sent: list[str] = []

    def send(tuples):  # type: ignore[no-untyped-def]
        for key, w, _queue, _team in tuples:
            ex.queued_tasks.pop(key, None)
            ex.running.add(key)
            sent.append(w.ti.task_id)
    monkeypatch.setattr(ex, "_send_workloads", send)
    clock = [1000.0]
    monkeypatch.setattr(executor_mod.time, "monotonic", lambda: clock[0])
    load = _task("load")
    with engine.begin() as conn:
        conn.execute(insert(TaskInstance.__table__).values(
            id=load.ti.id, dag_id="etl", run_id="run1", task_id="load", map_index=-1, try_number=1,
            state="queued", pool="default_pool", queue="default", priority_weight=1,
            external_executor_id="celery-load"))
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]  # the policy waits
    _queue(ex, load)
    _heartbeat(ex)
    assert sent == [] and load.ti.key in ex._holds
    with engine.begin() as conn:  # marked success in the UI
        conn.execute(update(TaskInstance.__table__).where(TaskInstance.__table__.c.id == load.ti.id)
                     .values(state="success"))
    clock[0] += ex.drl_config.max_wait_s + 1
    _heartbeat(ex)
    assert sent == [], "a task already marked success is not sent to a worker"
    assert load.ti.key not in ex.queued_tasks and len(ex.ledger) == 0


def test_a_task_whose_hold_expired_is_not_starved_by_lower_priority_tasks_routed_elsewhere(
        harness: types.SimpleNamespace) -> None:
    """One slot open. The policy holds ``train`` (priority 10) for a better pool; its hold then
    runs out (``max_wait_s``), so it must be placed now. Meanwhile an author-routed task of a
    queue of its own (``reporting``, priority 1) arrives at every heartbeat.

    In ``_place`` (executor.py, the ``elsewhere`` budget loop) every task found in
    ``_holds`` is skipped when the open slots are shared out, whether or not its hold has
    expired, so the lower-priority ``reporting`` tasks take the only slot at every heartbeat and
    ``train`` is "held for want of a slot" again and again: it sits in queued past
    ``task_queued_timeout``, where the scheduler requeues it and finally fails it. Plain Celery
    sends by priority. Expected: a task whose hold is over competes for the slots by priority."""
    ex, sent = harness.ex, harness.sent
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]  # the policy holds every task it sees
    ex.running.update({("busy", 1), ("busy", 2), ("busy", 3)})  # one slot open
    train = _task("train", priority=10)
    _queue(ex, train)
    _heartbeat(ex)
    assert sent == [] and train.ti.key in ex._holds, "train is held for a better pool"
    harness.clock[0] += ex.drl_config.max_wait_s + 1  # its hold is over: placed by the fallback now
    for i in range(5):  # a steady stream of low-priority tasks routed to their own queue
        report = _task(f"report{i}", priority=1, queue="reporting")
        _queue(ex, report)
        _heartbeat(ex)
        ex.running.discard(report.ti.key)  # the report finishes before the next heartbeat
        harness.clock[0] += 1
    assert ("train", 1) in [(task, try_) for task, try_, _ in sent], \
        f"train (priority 10, hold over) was never sent; sent: {sent}"
    assert sent[0][0] == "train", "the highest-priority task whose hold is over takes the first open slot"


def test_time_when_every_pool_is_full_does_not_count_towards_max_wait_s(
        harness: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy holds ``train`` at every heartbeat; for a while every pool is full.

    User sees (before 2026-12-07, one bound on the whole time held): on a saturated cluster every
    task the policy kept back for a free slot was placed by the fallback after 60 s, into a pool's
    first-come-first-served Celery queue: on 1,000-task runs 80-90% of the tasks, the run order
    the policy chose lost (docs/policy.md, "At 1,000 tasks the 60 s hold bound places most tasks
    by the fallback"). Expected: ``max_wait_s`` counts only the time a pool that fits the task
    had a free slot (as the previous heartbeat saw it, after that heartbeat's placements);
    ``max_hold_s`` (default: half of ``task_queued_timeout``, 300 s) bounds the whole hold."""
    ex, sent, clock = harness.ex, harness.sent, harness.clock
    records: list[tuple[Any, PlacementRecord]] = []
    monkeypatch.setattr(ex, "_record", records.extend)
    free = ex.pool_states()
    full = tuple(p.__class__(**{**p.__dict__, "busy": p.slots}) for p in free)
    state = {"pools": free}
    monkeypatch.setattr(ex, "pool_states", lambda: state["pools"])
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]  # the policy holds every task it sees
    assert ex.max_hold_s == 300.0
    train = _task("train")
    _queue(ex, train)
    for at, pools in ((1000.0, free), (1040.0, full), (1100.0, full), (1110.0, free)):
        clock[0], state["pools"] = at, pools
        _heartbeat(ex)
        assert sent == [] and train.ti.key in ex._holds, f"held at {at}"
    assert ex._holds.waited_s(train.ti.key, 1110.0) == pytest.approx(40.0), "1040-1110 was full: not counted"
    clock[0] = 1129.0
    _heartbeat(ex)
    assert sent == [], "59 s of 60 with a free slot"
    clock[0] = 1130.0
    _heartbeat(ex)
    assert [t for t, _, _ in sent] == ["train"] and train.ti.key not in ex._holds
    (rec,) = [r for _, r in records]
    assert rec.fallback and "waited 60s for a better pool while one had a free slot (max_wait_s)" in rec.reason
    assert rec.waited_s == pytest.approx(130.0), "the trace keeps the whole time held"

    # every pool full from the start: held past max_wait_s, until max_hold_s
    load = _task("load")
    state["pools"] = full
    clock[0] = 2000.0
    _queue(ex, load)
    for at in (2000.0, 2061.0, 2299.0):
        clock[0] = at
        _heartbeat(ex)
        assert load.ti.key in ex._holds and len(sent) == 1, f"held at {at}"
    clock[0] = 2300.0
    _heartbeat(ex)
    assert len(sent) == 2 and load.ti.key not in ex._holds
    assert "held 300s in all (max_hold_s), placing now" in records[-1][1].reason
    assert fallback_cause(records[-1][1].reason) == "max_hold"
    assert fallback_cause(rec.reason) == "max_wait"
