"""DRLExecutor's placement step, with the policy client and the metadata DB faked out."""

from __future__ import annotations

import dataclasses
import time
import types
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from airflow_drl_executor import executor as executor_mod
from airflow_drl_executor.client import PlacementUnavailable
from airflow_drl_executor.executor import DRLExecutor
from airflow_drl_executor.graph_builder import Batch, GraphBuilder, _Structure
from policy.holds import HoldClocks
from policy.schema import Decision, PlacementReply, PlacementRequest, ReadyTask, RunGraph, TaskNode

RUN = "etl/run1"
RUNNING_BY_POOL = GraphBuilder.running_by_pool  # the queries, before the fixture below fakes them
STARTED = GraphBuilder.started
RUNNING_ROWS = GraphBuilder.running_rows
RUNNING_IDS = GraphBuilder.running_ids
AIRFLOW_POOLS = GraphBuilder.airflow_pools
GRAPH = RunGraph(RUN, (TaskNode("a", duration_s=10), TaskNode("b", duration_s=10, gpus=1, kind="gpu_train")), ())


class FakeClient:
    def __init__(self, answer: Callable[[PlacementRequest], PlacementReply]) -> None:
        self.answer = answer
        self.requests: list[PlacementRequest] = []

    def place(self, request: PlacementRequest, graphs: object) -> PlacementReply:
        self.requests.append(request)
        return self.answer(request)

    def close(self) -> None:
        pass


def _workload(task_id: str) -> types.SimpleNamespace:
    ti = types.SimpleNamespace(id=uuid.uuid4(), dag_id="etl", run_id="run1", task_id=task_id, try_number=1,
                               dag_version_id=uuid.uuid4(), map_index=-1, queue="default", priority_weight=1,
                               key=("etl", task_id, "run1", 1, -1), executor_config={})
    return types.SimpleNamespace(ti=ti)


@pytest.fixture(autouse=True)
def _no_other_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metadata DB's running tasks are read by a query of its own (tested below)."""
    monkeypatch.setattr(GraphBuilder, "running_by_pool", lambda self, session: {})
    monkeypatch.setattr(GraphBuilder, "running_rows", lambda self, session, ti_ids: [])
    monkeypatch.setattr(GraphBuilder, "running_ids", lambda self, session: [])
    monkeypatch.setattr(GraphBuilder, "started", lambda self, session, ti_ids: {})
    monkeypatch.setattr(GraphBuilder, "airflow_pools", lambda self, session, ti_ids: {})


@pytest.fixture
def executor(monkeypatch: pytest.MonkeyPatch) -> DRLExecutor:
    ex = DRLExecutor()
    def build(ready, session, not_sent=(), placed_before=None):
        return Batch({RUN: GRAPH}, [], [ReadyTask(RUN, r.task_id) for r in ready])
    monkeypatch.setattr(ex.graph_builder, "build", build)
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    return ex


def _reply(pool_of: dict[str, str]) -> Callable[[PlacementRequest], PlacementReply]:
    def answer(req: PlacementRequest) -> PlacementReply:
        return PlacementReply(req.request_id, tuple(
            Decision(t.run_key, t.task_id, pool_of[t.task_id], "vm", reason="policy")
            for t in req.ready if t.task_id in pool_of), policy="gnn", policy_version="7")
    return answer


def test_policy_decisions_set_the_queue(executor: DRLExecutor) -> None:
    executor._client = FakeClient(_reply({"a": "cpu-large", "b": "gpu"}))  # type: ignore[assignment]
    a, b = _workload("a"), _workload("b")
    records, held = executor._place([a, b])
    assert not held and (a.ti.queue, b.ti.queue) == ("cpu-large", "gpu")
    assert [(r.pool, r.fallback, r.policy_version) for _, r in records] == [("cpu-large", False, "7"), ("gpu", False, "7")]


def test_a_task_the_policy_leaves_out_waits_then_falls_back(executor: DRLExecutor, monkeypatch) -> None:
    executor._client = FakeClient(_reply({"a": "cpu-small"}))  # type: ignore[assignment]
    a, b = _workload("a"), _workload("b")
    executor.queued_tasks[b.ti.key] = b  # type: ignore[index]
    clock = [1000.0]
    monkeypatch.setattr(executor_mod.time, "monotonic", lambda: clock[0])
    records, held = executor._place([a, b])
    assert held == {id(b)} and [r.task_id for _, r in records] == ["a"]
    assert b.ti.queue == "default", "a waiting task is not dispatched"
    assert [t.held_s for t in executor._client.requests[-1].ready] == [0.0, 0.0]
    clock[0] += 5.0
    records, held = executor._place([b])
    assert held == {id(b)} and executor._client.requests[-1].ready[0].held_s == 5.0, "the policy is told"
    clock[0] += executor.drl_config.max_wait_s + 1
    records, held = executor._place([b])
    (rec,) = [r for _, r in records]
    assert not held and rec.fallback and "waited" in rec.reason and rec.waited_s > executor.drl_config.max_wait_s
    assert b.ti.queue == "gpu", "the fallback honours the GPU requirement"


def test_no_answer_means_fallback_for_all_with_the_reason(executor: DRLExecutor) -> None:
    def down(req: PlacementRequest) -> PlacementReply:
        raise PlacementUnavailable("no reply within 200 ms")
    executor._client = FakeClient(down)  # type: ignore[assignment]
    records, held = executor._place([_workload("a"), _workload("b")])
    assert not held and all(r.fallback and "no reply within 200 ms" in r.reason for _, r in records)


def test_the_fallback_reads_the_pools_expected_finishes_on_their_clock(executor: DRLExecutor,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """EFT (version 3) waits for a busy pool until its ``free_at``, read against the request's
    ``created_at``: the executor's own fallback requests must carry the wall clock the ledger's
    expected finishes are on (at the default 0, every busy slot would look ~56 years away)."""
    seen: list[PlacementRequest] = []
    place = executor.fallback_placer.place
    monkeypatch.setattr(executor.fallback_placer, "place", lambda req, graphs: seen.append(req) or place(req, graphs))

    def down(req: PlacementRequest) -> PlacementReply:
        raise PlacementUnavailable("no reply within 200 ms")
    executor._client = FakeClient(down)  # type: ignore[assignment]
    before = time.time()
    executor._place([_workload("a"), _workload("b")])
    assert seen and all(before <= req.created_at <= time.time() for req in seen), [r.created_at for r in seen]


def test_a_pool_outside_the_catalogue_is_replaced(executor: DRLExecutor) -> None:
    executor._client = FakeClient(_reply({"a": "nowhere", "b": "gpu"}))  # type: ignore[assignment]
    a, b = _workload("a"), _workload("b")
    records, _ = executor._place([a, b])
    by_task = {r.task_id: r for _, r in records}
    assert by_task["a"].fallback and a.ti.queue in executor.catalogue.names
    assert not by_task["b"].fallback and b.ti.queue == "gpu"


def test_pool_states_carry_the_ledger(executor: DRLExecutor) -> None:
    """Feature schema 3: each task sent gets an expected finish (a slot frees, then its run
    time on that pool); the pools report them for the tasks still running, with growth room."""
    executor._client = FakeClient(_reply({"a": "cpu-large", "b": "gpu"}))  # type: ignore[assignment]
    a, b = _workload("a"), _workload("b")
    before = time.time()
    executor._place([a, b])
    for w in (a, b):
        executor.running.add(w.ti.key)
    pools = {p.name: p for p in executor.pool_states()}
    spec = {p.name: p for p in executor.catalogue.pools}
    for name, task in (("cpu-large", GRAPH.tasks[0]), ("gpu", GRAPH.tasks[1])):
        (finish,) = pools[name].free_at
        run_s = task.duration_s / pools[name].speed_for(task.kind)
        assert before + run_s <= finish <= time.time() + run_s
        assert pools[name].boot_s == spec[name].boot_delay_s
    assert pools["cpu-small"].free_at == ()
    executor.change_state(a.ti.key, "success")
    assert {p.name: p for p in executor.pool_states()}["cpu-large"].free_at == ()


def _structure(*task_ids: str) -> _Structure:
    return _Structure(task_ids=task_ids, edges=(), hints=tuple({} for _ in task_ids),
                      queues=tuple("default" for _ in task_ids))


def test_one_run_with_two_dag_versions_in_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clear "on the latest version", or a workload held across a redeploy, puts instances of
    one run with different DAG versions in one batch: the newest version's graph is used, and a
    task it lacks is placed by the fallback from its own hints, never a scheduler crash."""
    ex = DRLExecutor()
    v1, v2 = str(uuid.UUID(int=1)), str(uuid.UUID(int=2))  # UUIDv7 ids: the newer sorts last
    structures = {v1: _structure("a", "b", "old"), v2: _structure("a", "b", "new")}
    monkeypatch.setattr(ex.graph_builder, "structure", lambda vid, session: structures[vid])
    monkeypatch.setattr(ex.graph_builder, "_durations", lambda dag_id, session: {})
    monkeypatch.setattr(ex.graph_builder, "_ti_rows", lambda runs, session, tries_of=(): ([], {}))
    monkeypatch.setattr(ex.graph_builder, "_run_ages", lambda runs, session: {})
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    ex._client = FakeClient(_reply({"b": "cpu-large", "new": "gpu"}))  # type: ignore[assignment]
    b, new, old = _workload("b"), _workload("new"), _workload("old")
    b.ti.dag_version_id, new.ti.dag_version_id, old.ti.dag_version_id = v1, v2, v1
    records, held = ex._place([b, old, new])
    by_task = {r.task_id: r for _, r in records}
    assert not held and set(by_task) == {"b", "new", "old"}
    assert [t.task_id for t in ex._client.requests[-1].ready] == ["b", "new"], "asked with V2's graph"
    assert (by_task["b"].pool, by_task["new"].pool) == ("cpu-large", "gpu")
    assert by_task["old"].fallback and "not in its run's graph" in by_task["old"].reason
    assert old.ti.queue in ex.catalogue.names


def test_a_bad_hint_or_a_missing_dag_costs_only_that_task_or_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """was: one SchemaError (a typo in one task's executor_config, or one run's serialized DAG
    gone) sent the whole batch to its own queue or the least-loaded pool, whatever it needed:
    a GPU task of another DAG landed on a CPU pool. Now the typo drops that hint only (the
    policy still places the run, and the reason names what was ignored), and a run without a
    graph is placed by the fallback from each workload's own hints, constraints kept."""
    from policy.errors import SchemaError

    ex = DRLExecutor()
    good, gone = str(uuid.UUID(int=1)), str(uuid.UUID(int=2))
    typo = dataclasses.replace(_structure("a", "b"), hints=({"pool": "gpuu", "cpus": 2}, {}))

    def structure(vid, session):  # type: ignore[no-untyped-def]
        if vid == gone:
            raise SchemaError(f"dag version {vid}: no serialized DAG in the metadata database")
        return typo
    monkeypatch.setattr(ex.graph_builder, "structure", structure)
    monkeypatch.setattr(ex.graph_builder, "_durations", lambda dag_id, session: {})
    monkeypatch.setattr(ex.graph_builder, "_ti_rows", lambda runs, session, tries_of=(): ([], {}))
    monkeypatch.setattr(ex.graph_builder, "_run_ages", lambda runs, session: {})
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    ex._client = FakeClient(_reply({"a": "cpu-large", "b": "cpu-small"}))  # type: ignore[assignment]
    a, b = _workload("a"), _workload("b")
    a.ti.dag_version_id = b.ti.dag_version_id = good
    other = [_workload(t) for t in ("train", "etl1", "etl2")]
    for w in other:
        w.ti.dag_id, w.ti.dag_version_id = "ml", gone
    other[0].ti.executor_config = {"drl": {"gpus": 1, "kind": "gpu_train"}}
    other[1].ti.executor_config = {"drl": {"cpus": "four"}}
    records, held = ex._place([a, b, *other])
    by_task = {r.task_id: r for _, r in records}
    assert not held and set(by_task) == {"a", "b", "train", "etl1", "etl2"}
    assert [t.task_id for t in ex._client.requests[-1].ready] == ["a", "b"], "the good run still asks the policy"
    assert (by_task["a"].pool, by_task["a"].fallback) == ("cpu-large", False)
    assert "ignored: task 'a': pinned pool 'gpuu'" in by_task["a"].reason
    assert by_task["train"].pool == "gpu", "the GPU task keeps its constraint without its run's graph"
    assert all(by_task[t].fallback and "cannot build the graph of its run: dag version" in by_task[t].reason
               for t in ("train", "etl1", "etl2"))
    assert "ignored: task 'etl1': executor_config drl.cpus" in by_task["etl1"].reason
    # the policy waits on a; past max_wait_s the fallback places it, the reason still names the hint
    ex._holds = HoldClocks(wait_s=0.0, hold_s=ex.max_hold_s)  # [drl_executor] max_wait_s = 0
    ex._client = FakeClient(_reply({"b": "cpu-small"}))  # type: ignore[assignment]
    again = _workload("a")
    again.ti.dag_version_id = good
    records, _ = ex._place([again])
    (late,) = [r for _, r in records]
    assert late.fallback and "for a better pool" in late.reason and "ignored: task 'a': pinned pool" in late.reason


def test_an_unexpected_error_while_placing_falls_back_instead_of_stopping_the_scheduler(
        executor: DRLExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ready, session, not_sent=(), placed_before=None):  # type: ignore[no-untyped-def]
        raise KeyError("t9")
    monkeypatch.setattr(executor.graph_builder, "build", broken)
    executor._client = FakeClient(_reply({}))  # type: ignore[assignment]
    a, b = _workload("a"), _workload("b")
    records, held = executor._place([a, b])
    assert not held and len(records) == 2
    assert all(r.fallback and r.reason.startswith("fallback: placement failed: KeyError: 't9': ") for _, r in records)
    assert {a.ti.queue, b.ti.queue} <= set(executor.catalogue.names)


def test_tasks_held_for_a_better_pool_do_not_take_the_open_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of four slots busy; the policy holds g1 and g2 (high priority) for a better pool and
    would place c and d at once. Once g1 and g2 are held, c and d are offered and sent at the next
    heartbeat, not after max_wait_s; and no heartbeat sends more tasks than it has open slots."""
    import airflow.executors.workloads as wl

    class Task(types.SimpleNamespace):
        pass

    monkeypatch.setattr(wl, "ExecuteTask", Task)
    ex = DRLExecutor(parallelism=4)
    monkeypatch.setattr(ex.graph_builder, "build", lambda ready, session, not_sent=(), placed_before=None: Batch(
        {RUN: RunGraph(RUN, tuple(TaskNode(t) for t in ("g1", "g2", "c", "d")), ())}, [],
        [ReadyTask(RUN, r.task_id) for r in ready]))
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    monkeypatch.setattr(ex, "_record", lambda records: None)
    sent: list[str] = []

    def send(tuples):  # type: ignore[no-untyped-def]
        for key, w, _queue, _team in tuples:
            ex.queued_tasks.pop(key, None)
            ex.running.add(key)
            sent.append(w.ti.task_id)
    monkeypatch.setattr(ex, "_send_workloads", send)
    ex._client = FakeClient(_reply({"c": "cpu-small", "d": "cpu-small"}))  # type: ignore[assignment]
    for tid, prio in (("g1", 10), ("g2", 10), ("c", 1), ("d", 1)):
        w = Task(ti=_workload(tid).ti)
        w.ti.priority_weight = prio
        ex.queued_tasks[w.ti.key] = w  # type: ignore[index]
    ex.running.update({("busy", "1"), ("busy", "2")})
    ex.trigger_tasks(ex.parallelism - len(ex.running))  # two open slots: g1, g2 offered, both held
    assert sent == [] and [t.task_id for t in ex._client.requests[-1].ready] == ["g1", "g2"]
    ex.trigger_tasks(ex.parallelism - len(ex.running))
    assert sent == ["c", "d"], "the held tasks no longer take the open slots"
    assert [t.task_id for t in ex._client.requests[-1].ready] == ["g1", "g2", "c", "d"]
    ex.running.discard(("busy", "1"))
    ex._client = FakeClient(_reply({"g1": "gpu", "g2": "gpu"}))  # type: ignore[assignment]
    ex.trigger_tasks(ex.parallelism - len(ex.running))  # one slot open
    assert sent == ["c", "d", "g1"], "one open slot: one task sent, the other kept queued"
    assert [w.ti.task_id for w in ex.queued_tasks.values()] == ["g2"], "g2 waits for a slot, still queued"
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]
    ex.running.discard(("busy", "2"))
    ex.trigger_tasks(ex.parallelism - len(ex.running))  # a slot, but the policy holds g2
    assert len(ex._client.requests) == 1 and sent == ["c", "d", "g1"]
    ex.running.add(("busy", "3"))
    for _ in range(3):  # no slot open: the held g2 is offered, but no request is made for it
        ex.trigger_tasks(ex.parallelism - len(ex.running))
    assert len(ex._client.requests) == 1, "was: a graph build and a policy round trip every heartbeat"
    assert [w.ti.task_id for w in ex.queued_tasks.values()] == ["g2"]


def _publishing_executor(monkeypatch: pytest.MonkeyPatch) -> tuple[DRLExecutor, type, list]:
    """An executor whose placements go through CeleryExecutor's own publishing (its
    ``_send_workloads_to_celery`` left to the test), the workload type its ``Task``, and the
    trace records it writes."""
    import airflow.executors.workloads as wl

    class Task(types.SimpleNamespace):
        pass

    monkeypatch.setattr(wl, "ExecuteTask", Task)
    ex = DRLExecutor()
    monkeypatch.setattr(ex.graph_builder, "build", lambda ready, session, not_sent=(), placed_before=None: Batch(
        {RUN: GRAPH}, [], [ReadyTask(RUN, r.task_id) for r in ready]))
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    written: list = []
    monkeypatch.setattr(ex, "_record", written.extend)
    return ex, Task, written


def test_only_what_celery_accepted_leaves_a_trace_and_a_ledger_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish that times out is retried at the next heartbeat (one trace, from the try that
    was sent); one that fails fails the task and leaves neither a trace nor a ledger entry."""
    from airflow.exceptions import AirflowTaskTimeout
    from airflow.providers.celery.executors.celery_executor_utils import ExceptionWithTraceback

    ex, Task, written = _publishing_executor(monkeypatch)
    outcome: dict[str, object] = {"a": ExceptionWithTraceback(AirflowTaskTimeout("publish timed out"), "tb"),
                                  "b": ExceptionWithTraceback(RuntimeError("broker down"), "tb")}

    def publish(tuples):  # type: ignore[no-untyped-def]
        return [(key, None, outcome.get(w.ti.task_id) or types.SimpleNamespace(task_id=f"celery-{w.ti.task_id}"))
                for key, w, _queue, _team in tuples]
    monkeypatch.setattr(ex, "_send_workloads_to_celery", publish)
    ex._client = FakeClient(_reply({"a": "cpu-large", "b": "gpu"}))  # type: ignore[assignment]
    a, b = Task(ti=_workload("a").ti), Task(ti=_workload("b").ti)
    for w in (a, b):
        ex.queued_tasks[w.ti.key] = w  # type: ignore[index]
    ex.trigger_tasks(8)
    assert written == [] and len(ex.ledger) == 0
    assert ex.event_buffer[b.ti.key][0] == "failed" and a.ti.key in ex.queued_tasks
    del outcome["a"]
    ex.trigger_tasks(8)
    assert [(k, r.task_id) for k, r in written] == [(a.ti.key, "a")]
    assert len(ex.ledger) == 1 and ex.ledger.pool_of(a.ti.key) == "cpu-large"


def test_a_resumed_try_queued_before_its_first_message_ended_is_neither_recorded_unsent_nor_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Airflow 3.3 queues a resumed deferral (or a sensor's next poke) even while the executor
    still has the key running from the try's previous message (base_executor.trigger_tasks).
    was: its publish that timed out was recorded as placed ("in running"), and its start was the
    one cached from the previous message: charged as running for an hour, while it waited"""
    from airflow.exceptions import AirflowTaskTimeout
    from airflow.providers.celery.executors.celery_executor_utils import ExceptionWithTraceback

    ex, Task, written = _publishing_executor(monkeypatch)
    timeout = ExceptionWithTraceback(AirflowTaskTimeout("publish timed out"), "tb")
    monkeypatch.setattr(ex, "_send_workloads_to_celery", lambda tuples: [(k, None, timeout) for k, *_ in tuples])
    ex._client = FakeClient(_reply({"a": "cpu-large"}))  # type: ignore[assignment]
    a = Task(ti=_workload("a").ti)
    ex.running.add(a.ti.key)  # the previous message, its end not synced yet
    ex.ledger.add(a.ti.key, "cpu-large", str(a.ti.id), 10.0, 0.0)
    ex._started = {str(a.ti.id): time.time() - 3600.0}  # it started an hour ago, then deferred
    ex.queued_tasks[a.ti.key] = a  # type: ignore[index]
    ex.trigger_tasks(8)
    assert written == [], "not sent: no trace (was: one, with the previous message's Celery id)"
    assert a.ti.key in ex.queued_tasks
    assert str(a.ti.id) not in ex._started, "placed again: its start is read anew once it runs"


def test_adoption_reschedules_what_was_never_sent_in_the_same_try_and_keeps_the_rest_in_the_ledger(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a scheduler restart: running tasks are adopted and count as busy on their pools; a
    queued one with a placement recorded under its Celery id is adopted; a queued one without
    (held for a better pool when the old scheduler stopped) is scheduled again in the same try,
    not watched as PENDING until task_queued_timeout, nor handed back (reset to a new try: a
    retry lost); nor is one placed in an earlier try's queuing of the same try number (a sensor's
    earlier poke: same ti id and try, another Celery id)."""
    import contextlib

    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from airflow_drl_executor import traces

    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    monkeypatch.setattr("airflow.utils.session.create_session", contextlib.contextmanager(
        lambda scoped=True: (yield Session(engine))))
    ex = DRLExecutor()
    monkeypatch.setattr(ex, "bulk_state_fetcher", types.SimpleNamespace(
        get_many=lambda results: {r.task_id: ("STARTED", None) for r in results}))
    tis = []
    for tid, state in (("r1", "running"), ("r2", "running"), ("sent", "queued"), ("held", "queued"),
                       ("poked", "queued")):
        ti = _workload(tid).ti
        ti.queue, ti.state, ti.external_executor_id = "gpu", state, f"celery-{tid}"
        tis.append(ti)
    sent, poked = tis[2], tis[4]
    report = _workload("report").ti  # routed to a queue of its own: sent unplaced, no placement row
    report.queue, report.state, report.external_executor_id = "reporting", "queued", "celery-report"
    tis.append(report)
    with engine.begin() as conn:
        for ti, celery_id in ((sent, "celery-sent"), (poked, "celery-first-poke")):
            traces.write(conn, [traces.PlacementRecord(
                ti_id=str(ti.id), dag_id="etl", run_id="run1", task_id=ti.task_id, map_index=-1, try_number=1,
                pool="gpu", vm_class="gpu-a10", score=0.0, reason="r", fallback=False, policy="gnn",
                policy_version="1", request_id="q", decision_ms=1.0, features={}, celery_id=celery_id)])
    not_adopted = ex.try_adopt_task_instances(tis)
    assert not_adopted == [], "nothing reset to a new try"
    held = tis[3]
    again = [ti.task_id for ti in tis if ti.state == "scheduled"]
    assert again == ["held", "poked"] and held.try_number == 1 and held.external_executor_id is None
    assert held.queued_dttm is None and held.scheduled_dttm is not None
    assert report.state == "queued" and report.key in ex.running, \
        "was: rescheduled while Celery held its message (sent again; the duplicate's slot never freed)"
    gpu = {p.name: p for p in ex.pool_states()}["gpu"]
    assert len(ex.running) == 4 and (gpu.slots, gpu.busy, gpu.queued) == (2, 2, 1), "2 slots: one waits"
    assert len(gpu.free_at) == 3, "the ledger knows them"


def test_a_callback_for_a_queue_no_pool_consumes_runs_on_a_live_cpu_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """was: sent to [operators] default_queue ("default"), which no pool worker consumes: the
    callback waited forever and held its executor slot"""
    import airflow.executors.workloads as wl

    class Callback(types.SimpleNamespace):
        pass

    monkeypatch.setattr(wl, "ExecuteCallback", Callback)
    ex = DRLExecutor()
    sent: dict[object, str] = {}
    monkeypatch.setattr(ex, "_send_workloads", lambda tuples: sent.update({key: queue for key, _, queue, _ in tuples}))
    from airflow.executors.workloads.callback import CallbackDTO

    def callback(**data: str) -> CallbackDTO:
        return CallbackDTO(id=str(uuid.uuid4()), fetch_method="import_path", data={"path": "m.f", **data})

    mine, pinned = Callback(callback=callback()), Callback(callback=callback(queue="gpu"))
    ex._process_workloads([mine, pinned])  # type: ignore[list-item]
    cpu = {p.name for p in ex.catalogue.pools if p.vm_class.gpus == 0}
    assert sent[mine.callback.key] in cpu
    assert mine.callback.data == {"path": "m.f", "queue": sent[mine.callback.key]}
    assert sent[pinned.callback.key] == "gpu", "a callback routed to one of the pools keeps it"


def test_held_tasks_do_not_let_callbacks_past_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection is widened by the held tasks (they must not take the open slots), and the
    base puts callbacks first: was, with the executor full and two tasks held, two callbacks were
    sent (4 running at parallelism 2). Callbacks past the open slots stay queued."""
    import airflow.executors.workloads as wl
    from airflow.executors.workloads.callback import CallbackDTO

    class Task(types.SimpleNamespace):
        pass

    class Callback(types.SimpleNamespace):
        pass
    monkeypatch.setattr(wl, "ExecuteTask", Task)
    monkeypatch.setattr(wl, "ExecuteCallback", Callback)
    ex = DRLExecutor(parallelism=2)
    monkeypatch.setattr(ex.graph_builder, "build", lambda ready, session, not_sent=(), placed_before=None: Batch(
        {RUN: GRAPH}, [], [ReadyTask(RUN, r.task_id) for r in ready]))
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    monkeypatch.setattr(ex, "_record", lambda records: None)

    def send(tuples):  # type: ignore[no-untyped-def]
        for key, _w, _queue, _team in tuples:
            ex.queued_tasks.pop(key, None)
            ex.queued_callbacks.pop(key, None)
            ex.running.add(key)
    monkeypatch.setattr(ex, "_send_workloads", send)
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]  # the policy holds every task
    for tid in ("a", "b"):
        w = Task(ti=_workload(tid).ti)
        ex.queued_tasks[w.ti.key] = w  # type: ignore[index]
    ex.trigger_tasks(ex.parallelism - len(ex.running))
    assert len(ex._holds) == 2 and not ex.running
    ex.running.update({("busy", 1), ("busy", 2)})  # full
    for _ in range(2):
        cb = Callback(callback=CallbackDTO(id=str(uuid.uuid4()), fetch_method="import_path",
                                           data={"path": "m.f", "queue": "cpu-small"}))
        ex.queued_callbacks[cb.callback.key] = cb  # type: ignore[index]
    ex.trigger_tasks(ex.parallelism - len(ex.running))
    assert len(ex.running) == 2 and len(ex.queued_callbacks) == 2, "nothing past parallelism"
    ex.running.discard(("busy", 1))
    ex.trigger_tasks(ex.parallelism - len(ex.running))
    assert len(ex.running) == 2 and len(ex.queued_callbacks) == 1, "one slot: one callback, first"


def test_with_ha_schedulers_the_pools_count_every_schedulers_running_tasks(
        executor: DRLExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """was: each scheduler's executor counted only the tasks it had sent: with two schedulers,
    each saw the pools half as busy as they were"""
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    engine = create_engine("sqlite://")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE task_instance (queue TEXT, state TEXT)"))
        conn.execute(text("INSERT INTO task_instance VALUES ('gpu', 'running'), ('gpu', 'running'), "
                          "('gpu', 'queued'), ('cpu-small', 'success'), ('default', 'running')"))
    with Session(engine) as session:
        counts = RUNNING_BY_POOL(executor.graph_builder, session)
    assert counts == {"gpu": 2}, "running only, on our pools only"
    monkeypatch.setattr(executor.graph_builder, "running_by_pool", lambda session: counts)
    executor._client = FakeClient(_reply({"a": "cpu-small", "b": "gpu"}))  # type: ignore[assignment]
    executor._place([_workload("a"), _workload("b")])
    gpu = next(p for p in executor._client.requests[-1].pools if p.name == "gpu")
    assert gpu.busy == 2, "the request saw the other scheduler's two GPU tasks"


def test_another_schedulers_running_tasks_are_charged_their_expected_finish(
        executor: DRLExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """Airflow HA: the GPU pool's 2 slots run tasks another scheduler sent. was: counted busy with
    no expected finish, so the request showed the pool's slots freeing now"""
    import datetime as dt

    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    t0 = time.time() - 20.0
    engine = create_engine("sqlite://")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE task_instance (id CHAR(32), dag_id TEXT, task_id TEXT, queue TEXT, "
                          "state TEXT, start_date TIMESTAMP, queued_dttm TIMESTAMP, run_id TEXT DEFAULT 'r', "
                          "map_index INTEGER DEFAULT -1, try_number INTEGER DEFAULT 1, dag_version_id CHAR(32))"))
        for i, (task, queue, state) in enumerate([("train", "gpu", "running"), ("train", "gpu", "running"),
                                                  ("x", "gpu", "queued"), ("y", "default", "running")]):
            start = dt.datetime.fromtimestamp(t0 + i, tz=dt.UTC).replace(tzinfo=None)
            conn.execute(text("INSERT INTO task_instance (id, dag_id, task_id, queue, state, start_date, queued_dttm) "
                              "VALUES (:id, 'ml', :t, :q, :s, :start, :start)"),
                         {"id": uuid.uuid4().hex, "t": task, "q": queue, "s": state,
                          "start": start.strftime("%Y-%m-%d %H:%M:%S.%f")})
    with Session(engine) as session:
        ids = RUNNING_IDS(executor.graph_builder, session)
        rows = RUNNING_ROWS(executor.graph_builder, session, [i for i, _, _ in ids] + [uuid.uuid4().hex])
    assert [q for _, q, _ in ids] == ["gpu", "gpu"], "running, on our pools"
    assert [(r[1], r[2], r[3]) for r in rows] == [("ml", "train", "gpu")] * 2
    assert sorted(r[4] for r in rows) == pytest.approx([t0, t0 + 1], abs=0.01)
    monkeypatch.setattr(executor.graph_builder, "running_by_pool", lambda session: {"gpu": 2})
    monkeypatch.setattr(executor.graph_builder, "running_ids", lambda session: ids)
    asked: list[list[str]] = []
    monkeypatch.setattr(executor.graph_builder, "running_rows",
                        lambda session, ti_ids: (asked.append(list(ti_ids)), [r for r in rows if r[0] in ti_ids])[1])
    monkeypatch.setattr(executor.graph_builder, "_durations",
                        lambda dag_id, session: {"train": [("gpu", 300.0, 4), ("cpu-small", 9000.0, 1)]})
    executor._client = FakeClient(_reply({"a": "cpu-small", "b": "gpu"}))  # type: ignore[assignment]
    executor._place([_workload("a"), _workload("b")])
    gpu = next(p for p in executor._client.requests[-1].pools if p.name == "gpu")
    assert gpu.busy == 2
    # their start + 300 s (their mean on the GPU pool); was: none (the slots free now)
    assert sorted(gpu.free_at) == pytest.approx([t0 + 300.0, t0 + 301.0], abs=0.01)
    executor._place([_workload("a")])
    assert len(asked) == 1, "their finishes are computed once, not at every heartbeat"
    assert sorted(executor._others["gpu"]) == pytest.approx([t0 + 300.0, t0 + 301.0], abs=0.01)
    # the first one deferred and resumed (same ti id, queued again): read anew
    again = [(ids[0][0], "gpu", "later"), ids[1]]
    rows[0] = (*rows[0][:4], t0 + 600.0, rows[0][5])
    monkeypatch.setattr(executor.graph_builder, "running_ids", lambda session: again)
    executor._place([_workload("a")])
    assert asked[-1] == [ids[0][0]]
    assert sorted(executor._others["gpu"]) == pytest.approx([t0 + 301.0, t0 + 900.0], abs=0.01)


def test_each_instance_of_a_mapped_task_is_placed_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """was: every instance of a mapped task took the one decision made for the task"""
    ex = DRLExecutor()
    mapped = RunGraph(RUN, (TaskNode("m[0]", duration_s=10), TaskNode("m[1]", duration_s=10)), ())
    asked: list[list[str]] = []

    def build(ready, session, not_sent=(), placed_before=None):  # type: ignore[no-untyped-def]
        asked.append([r.node for r in ready])
        return Batch({RUN: mapped}, [], [ReadyTask(RUN, r.node) for r in ready])
    monkeypatch.setattr(ex.graph_builder, "build", build)
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    ex._client = FakeClient(_reply({"m[0]": "gpu", "m[1]": "cpu-small"}))  # type: ignore[assignment]
    first, second = _workload("m"), _workload("m")
    first.ti.map_index, second.ti.map_index = 0, 1
    second.ti.key = ("etl", "m", "run1", 1, 1)
    records, held = ex._place([first, second])
    assert asked == [["m[0]", "m[1]"]] and not held
    assert (first.ti.queue, second.ti.queue) == ("gpu", "cpu-small")
    assert [(r.task_id, r.map_index, r.pool) for _, r in records] == [("m", 0, "gpu"), ("m", 1, "cpu-small")]


def test_a_task_routed_to_a_queue_of_its_own_is_sent_there_unplaced(executor: DRLExecutor) -> None:
    """was: a task its author (or a task_instance_mutation_hook) sent to 'vpn_queue', whose
    workers are not one of the pools, was placed on a pool like any task"""
    executor._client = FakeClient(_reply({"a": "cpu-small"}))  # type: ignore[assignment]
    a, vpn, vpn2 = _workload("a"), _workload("v1"), _workload("v2")
    vpn.ti.queue = vpn2.ti.queue = "vpn_queue"
    records, held = executor._place([vpn, a, vpn2], budget=2)
    assert [t.task_id for t in executor._client.requests[-1].ready] == ["a"], "not asked about"
    assert vpn.ti.queue == "vpn_queue" and [r.task_id for _, r in records] == ["a"] and a.ti.queue == "cpu-small"
    assert held == {id(vpn2)}, "the open slots still bound what a heartbeat sends: v1 and a take both"
    records, held = executor._place([vpn2])
    assert records == [] and held == set() and vpn2.ti.queue == "vpn_queue"


def test_a_task_in_an_airflow_pool_is_never_held(executor: DRLExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """Queued is an executing state to Airflow's pools: a held task would keep its pool slot (a
    one-slot rate-limit pool would idle while its task waits for a better worker pool). The pool
    is read from the metadata DB: a workload's ti (``TaskInstanceDTO``) does not carry it (was:
    read from ``ti.pool``, which a real workload lacks: every such task was held)."""
    from airflow.executors.workloads.task import TaskInstanceDTO

    assert "pool" not in TaskInstanceDTO.model_fields
    executor._client = FakeClient(_reply({}))  # the policy would wait for a better pool
    free, limited = _workload("a"), _workload("b")
    asked: list[list[str]] = []

    def airflow_pools(session: object, ti_ids: list[object]) -> dict[str, str]:
        asked.append([str(i) for i in ti_ids])
        return {str(limited.ti.id): "api_rate_limit"}
    monkeypatch.setattr(executor.graph_builder, "airflow_pools", airflow_pools)
    records, held = executor._place([free, limited])
    assert asked == [[str(free.ti.id), str(limited.ti.id)]]
    assert held == {id(free)}
    (rec,) = [r for _, r in records]
    assert rec.task_id == "b" and rec.fallback and "keeps its slot of Airflow pool 'api_rate_limit'" in rec.reason


def test_start_times_are_read_once_per_try(executor: DRLExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[list[str]] = []

    def started(session, ti_ids):  # type: ignore[no-untyped-def]
        asked.append(sorted(ti_ids))
        return {i: 100.0 for i in ti_ids if i.startswith("run")}

    monkeypatch.setattr(executor.graph_builder, "started", started)
    for k, ti_id in enumerate(("run-1", "wait-1", "run-2")):
        executor.ledger.add(("k", k), "gpu", ti_id, 10.0, 0.0)
        executor.running.add(("k", k))
    assert executor._starts(None) == {"run-1": 100.0, "run-2": 100.0}
    executor._started = {"run-1": 100.0, "run-2": 100.0}
    executor.running.discard(("k", 2))  # run-2 finished
    assert executor._starts(None) == {"run-1": 100.0}
    assert asked == [["run-1", "run-2", "wait-1"], ["wait-1"]], "a start seen once is not asked again"


def test_traces_the_database_refuses_are_written_at_a_later_heartbeat(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Any) -> None:
    """was: one DB error (a failover) lost the rows for good, and the traces are what adoption
    reads after a restart to tell a task sent to Celery from one never sent: a sent task without
    its row would have been rescheduled while Celery ran it. Now they are kept, with the time they
    were decided, and retried at every heartbeat (sync), the oldest dropped past the bound; and
    saved to the spool meanwhile (a scheduler killed then leaves them to the next one:
    test_adoption_airflow.py), the spool's file gone once the DB took them."""
    from sqlalchemy import create_engine, select

    from airflow_drl_executor import traces

    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    down = {"calls": 2}
    ex = _spooled_executor(monkeypatch, tmp_path, engine, down)
    monkeypatch.setattr(executor_mod.CeleryExecutor, "sync", lambda self: None)
    assert ex._spool is not None
    rec = traces.PlacementRecord(
        ti_id=uuid.uuid4().hex, dag_id="etl", run_id="run1", task_id="a", map_index=-1, try_number=1, pool="gpu",
        vm_class="gpu-a10", score=-1.0, reason="r", fallback=False, policy="drl", policy_version="1",
        request_id="q", decision_ms=1.0, features={}, celery_id=None)
    ex.workloads[("etl", "a")] = types.SimpleNamespace(task_id="celery-a")  # what Celery accepted
    ex._record([(("etl", "a"), rec)])
    ex.sync()  # the DB still refuses: kept
    assert len(ex._unwritten) == 1
    assert '"celery_id": "celery-a"' in ex._spool.data.read_text(), "on disk too"
    ex.sync()
    assert not ex._spool.data.exists(), "written: the spool's file goes"
    with engine.connect() as conn:
        rows = conn.execute(select(traces.placements.c.celery_id, traces.placements.c.decided_at)).all()
    assert [r.celery_id for r in rows] == ["celery-a"] and ex._unwritten == []
    assert rows[0].decided_at is not None
    monkeypatch.setattr(executor_mod, "_UNWRITTEN_MAX", 3)
    down["calls"] = 1
    ex._record([(("etl", t), dataclasses.replace(rec, task_id=t)) for t in "bcdef"])
    assert [r["task_id"] for r in ex._unwritten] == ["d", "e", "f"], "the newest kept, within the bound"


def test_the_airflow_pools_of_a_batch_are_read_from_the_metadata_db() -> None:
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import Column, MetaData, String, Table, create_engine, insert
    from sqlalchemy.orm import Session

    engine = create_engine("sqlite://")
    table = Table("task_instance", MetaData(), Column("id", TaskInstance.__table__.c.id.type), Column("pool", String(256)))
    table.metadata.create_all(engine)
    ids = [uuid.uuid4() for _ in range(3)]
    with engine.begin() as conn:
        conn.execute(insert(table), [{"id": ids[0], "pool": "default_pool"}, {"id": ids[1], "pool": "api_rate_limit"},
                                     {"id": ids[2], "pool": "default_pool"}])
    with Session(engine) as session:
        got = AIRFLOW_POOLS(DRLExecutor().graph_builder, session, [str(i) for i in ids] + [uuid.uuid4()])
    assert got == {str(ids[1]): "api_rate_limit"}


def test_a_placement_is_written_before_its_publish_and_taken_back_if_it_did_not_go(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The scheduler pre-assigns each try's Celery id (external_executor_id, the id apply_async
    gets). was: the row was written after the publish: a scheduler dying in between left a sent
    task without its row, and the next scheduler's adoption sent it again"""
    import contextlib

    import airflow.executors.workloads as wl
    import airflow.utils.session as airflow_session
    from airflow.exceptions import AirflowTaskTimeout
    from airflow.providers.celery.executors.celery_executor_utils import ExceptionWithTraceback
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from airflow_drl_executor import traces

    class Task(types.SimpleNamespace):
        pass

    engine = create_engine(f"sqlite:///{tmp_path / 'airflow.db'}")
    traces.ensure_schema(engine)

    @contextlib.contextmanager
    def create_session(scoped=True):  # type: ignore[no-untyped-def]
        with Session(engine) as session:
            yield session
            session.commit()
    monkeypatch.setattr(airflow_session, "create_session", create_session)
    monkeypatch.setattr(wl, "ExecuteTask", Task)
    ex = DRLExecutor()
    ex._traces_ready = True
    monkeypatch.setattr(ex.graph_builder, "build", lambda ready, session, not_sent=(), placed_before=None: Batch(
        {RUN: GRAPH}, [], [ReadyTask(RUN, r.task_id) for r in ready]))
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)

    def rows() -> list[str]:
        with engine.connect() as conn:
            return list(conn.execute(select(traces.placements.c.celery_id)).scalars())

    seen_at_publish: list[list[str]] = []
    timeout = {"on": True}

    def publish(tuples):  # type: ignore[no-untyped-def]
        seen_at_publish.append(rows())
        if timeout["on"]:
            return [(k, None, ExceptionWithTraceback(AirflowTaskTimeout("publish timed out"), "tb")) for k, *_ in tuples]
        return [(k, None, types.SimpleNamespace(task_id=w.ti.external_executor_id)) for k, w, *_ in tuples]
    monkeypatch.setattr(ex, "_send_workloads_to_celery", publish)
    ex._client = FakeClient(_reply({"a": "cpu-large"}))  # type: ignore[assignment]
    a = Task(ti=_workload("a").ti)
    a.ti.external_executor_id = "celery-a"
    ex.queued_tasks[a.ti.key] = a  # type: ignore[index]
    ex.trigger_tasks(8)
    assert seen_at_publish == [["celery-a"]], "written before the publish"
    # the publish timed out: kept without its Celery id (never taken for sent), saying so; was
    # deleted, and a restarted scheduler then read the queue, this executor's choice, as a pin
    assert rows() == [None] and a.ti.key in ex.queued_tasks
    with engine.connect() as conn:
        assert conn.execute(select(traces.placements.c.reason)).scalar().endswith(traces.NOT_SENT)
        assert traces.sent_celery_ids(conn, ["celery-a"]) == set()
        assert traces.last_placements(conn, [("etl", "run1", "a", -1)])[("etl", "run1", "a", -1)].pool == "cpu-large"
    timeout["on"] = False
    ex.trigger_tasks(8)
    assert seen_at_publish[-1] == [None, "celery-a"] and rows() == [None, "celery-a"], "sent: its row written before"


def test_the_executors_own_choice_is_never_read_as_a_hook_pin(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A publish that did not go takes its trace row back, and leaves the executor's choice in
    the task instance's queue. was: the next heartbeat found a queue on a pool and no row, and
    pinned the task there "by a task_instance_mutation_hook" (for every later try too)"""
    from airflow.exceptions import AirflowTaskTimeout
    from airflow.providers.celery.executors.celery_executor_utils import ExceptionWithTraceback
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from airflow_drl_executor import traces
    from airflow_drl_executor.graph_builder import ReadyInstance

    ex, Task, written = _publishing_executor(monkeypatch)
    seen: list = []
    monkeypatch.setattr(ex.graph_builder, "build", lambda ready, session, not_sent=(), placed_before=None: (
        seen.append(placed_before), Batch({RUN: GRAPH}, [], [ReadyTask(RUN, r.task_id) for r in ready]))[1])
    monkeypatch.setattr(ex, "_send_workloads_to_celery", lambda tuples: [
        (k, None, ExceptionWithTraceback(AirflowTaskTimeout("publish timed out"), "tb")) for k, *_ in tuples])
    ex._client = FakeClient(_reply({"a": "cpu-large"}))  # type: ignore[assignment]
    a = Task(ti=_workload("a").ti)
    ex.queued_tasks[a.ti.key] = a  # type: ignore[index]
    engine = create_engine(f"sqlite:///{tmp_path / 'airflow.db'}")
    traces.ensure_schema(engine)  # no row for it: the publish did not go
    with Session(engine) as session:
        ex.trigger_tasks(8)
        assert a.ti.queue == "cpu-large" and written == []
        inst = ReadyInstance("etl", "run1", "a", 1, "v", queue=a.ti.queue)
        got = ex._placed_before(session, [inst])
    assert got == {(RUN, "a"): traces.LastPlacement(1, "cpu-large", False)}, "its own, unpinned choice"


def test_earlier_placements_are_read_from_the_traces_for_queues_on_pools(tmp_path: Any) -> None:
    """What a fresh scheduler knows only from the trace rows (a pinned try, an unpinned one); a
    queue that is not a pool is not looked up"""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from airflow_drl_executor import traces
    from airflow_drl_executor.graph_builder import ReadyInstance

    engine = create_engine(f"sqlite:///{tmp_path / 'airflow.db'}")
    traces.ensure_schema(engine)

    def record(task_id: str, pinned: bool) -> traces.PlacementRecord:
        return traces.PlacementRecord(
            ti_id=uuid.uuid4().hex, dag_id="etl", run_id="run1", task_id=task_id, map_index=-1, try_number=1,
            pool="gpu", vm_class="gpu-a10", score=0.0, reason="r", fallback=False, policy="p", policy_version="1",
            request_id="q", decision_ms=1.0, features={"pool": "gpu"} if pinned else {}, celery_id=None)
    with engine.begin() as conn:
        traces.write(conn, [record("hooked", True), record("free", False)])
    ex = DRLExecutor()
    ready = [ReadyInstance("etl", "run1", t, 2, "v", queue=q) for t, q in
             (("hooked", "gpu"), ("free", "gpu"), ("new", "gpu"), ("own", "vpn_queue"))]
    with Session(engine) as session:
        got = ex._placed_before(session, ready)
    assert got == {(RUN, "hooked"): traces.LastPlacement(1, "gpu", True),
                   (RUN, "free"): traces.LastPlacement(1, "gpu", False)}
    ex.drl_config = dataclasses.replace(ex.drl_config, record_traces=False)
    with Session(engine) as session:
        assert ex._placed_before(session, ready) is None, "no traces: no queue is read as a pin"


def test_a_pin_read_from_the_queue_without_the_graph_is_honoured_but_not_recorded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the run's graph (a DB error for one heartbeat) the queue may be a DAG's pin, a
    hook's, or the executor's own earlier choice. was: recorded as a pin, so that every later try
    of the instance stayed on the executor's own earlier choice"""
    from sqlalchemy.exc import OperationalError

    ex = DRLExecutor()
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)

    def broken(*a: Any, **k: Any) -> None:
        raise OperationalError("SELECT", {}, Exception("server closed the connection"))
    monkeypatch.setattr(ex.graph_builder, "build", broken)
    ex._client = FakeClient(_reply({}))  # type: ignore[assignment]
    w = _workload("t")
    w.ti.try_number, w.ti.queue = 2, "cpu-large"
    ((_, rec),), _ = ex._place([w])
    assert rec.pool == "cpu-large" and rec.fallback, "honoured"
    assert "pool" not in rec.features, "not recorded as a pin"
    assert ex._wrote.get(("etl", "run1", "t", -1)) is None, "nor remembered either way: it cannot tell"
    # a pin it remembers (a hook's, honoured with the graph at an earlier try) stays one
    hooked = _workload("h")
    hooked.ti.try_number, hooked.ti.queue = 2, "gpu"
    ex._wrote.put(("etl", "run1", "h", -1), ("gpu", True))
    ((_, rec),), _ = ex._place([hooked])
    assert rec.pool == "gpu" and rec.features.get("pool") == "gpu"
    assert ex._wrote.get(("etl", "run1", "h", -1)) == ("gpu", True)


def test_a_failed_publish_of_a_try_still_running_from_its_previous_message_leaves_no_trace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed publish fails the task and drops its queued key; the key can still be in running
    from the try's previous message (a resumed deferral, a sensor's next poke): not sent"""
    from airflow.providers.celery.executors.celery_executor_utils import ExceptionWithTraceback

    ex, Task, written = _publishing_executor(monkeypatch)
    monkeypatch.setattr(ex, "_send_workloads_to_celery", lambda tuples: [
        (k, None, ExceptionWithTraceback(RuntimeError("broker down"), "tb")) for k, *_ in tuples])
    ex._client = FakeClient(_reply({"a": "cpu-large"}))  # type: ignore[assignment]
    a = Task(ti=_workload("a").ti)
    ex.running.add(a.ti.key)
    ex.queued_tasks[a.ti.key] = a  # type: ignore[index]
    ex.trigger_tasks(8)
    assert ex.event_buffer[a.ti.key][0] == "failed" and a.ti.key not in ex.queued_tasks
    assert written == [] and a.ti.key not in ex.ledger


def test_placements_fallbacks_and_the_step_reach_airflows_statsd(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's metrics go through Airflow's own backend ([metrics] statsd_on), here to a
    UDP socket standing in for the StatsD daemon: what was sent, on which pool, the fallbacks by
    cause, the step's time and what it held. (was: no metric at all from the executor)"""
    import socket

    from airflow.observability import stats
    from airflow.observability.metrics import stats_utils

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    for key, value in {"STATSD_ON": "True", "STATSD_HOST": "127.0.0.1", "STATSD_PORT": str(sock.getsockname()[1]),
                       "STATSD_PREFIX": "airflow"}.items():
        monkeypatch.setenv(f"AIRFLOW__METRICS__{key}", value)
    try:
        ex, Task, _ = _publishing_executor(monkeypatch)  # DRLExecutor() sets up Airflow's metrics backend
        monkeypatch.setattr(ex, "_send_workloads_to_celery", lambda tuples: [
            (key, None, types.SimpleNamespace(task_id=f"celery-{w.ti.task_id}")) for key, w, _q, _t in tuples])
        ex._client = FakeClient(_reply({"a": "cpu-large", "b": "nowhere"}))  # type: ignore[assignment]
        tasks = [Task(ti=_workload(t).ti) for t in "abc"]  # c: the policy waits
        for w in tasks:
            ex.queued_tasks[w.ti.key] = w  # type: ignore[index]
        ex.trigger_tasks(8)
        monkeypatch.setattr(executor_mod.CeleryExecutor, "sync", lambda self: None)
        ex._holds.hold(("gone", 1), 0.0, slot_free=False)  # a held task revoked since: not counted
        ex.sync()  # the gauges, at every heartbeat
        got: list[str] = []
        try:
            while True:
                got.extend(sock.recv(65536).decode().splitlines())
        except TimeoutError:
            pass
    finally:
        sock.close()
        monkeypatch.undo()  # the metrics settings too: the backend of the next tests is Airflow's default again
        stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=True)
    mine = sorted(m for m in got if m.startswith("airflow.drl_executor."))
    counts = [m for m in mine if m.endswith("|c")]
    assert counts == sorted(["airflow.drl_executor.placements:1|c"] * 2 + [
        "airflow.drl_executor.placements.cpu-large:1|c", "airflow.drl_executor.placements.gpu:1|c",
        "airflow.drl_executor.fallbacks:1|c", "airflow.drl_executor.fallbacks.unknown_pool:1|c"]), mine
    assert {"airflow.drl_executor.held:1|g", "airflow.drl_executor.pools_down:0|g",
            "airflow.drl_executor.unwritten_traces:0|g"} <= set(mine)
    (timing,) = [m for m in mine if m.endswith("|ms")]
    assert timing.startswith("airflow.drl_executor.placement_time:") and float(timing.split(":")[1][:-3]) > 0


def test_every_fallback_reason_has_a_cause() -> None:
    """Each reason the executor and its client give a fallback is counted under a cause of its
    own, not "other": the literals of client.py's PlacementUnavailable and of the executor's
    fallbacks, read from their source (a new reason without a cause fails here)."""
    import ast
    import inspect as pyinspect

    from airflow_drl_executor import client
    from airflow_drl_executor.metrics import fallback_cause

    def leads(module: Any, wrap: str) -> set[str]:
        out = set()
        for node in ast.walk(ast.parse(pyinspect.getsource(module))):
            values = [node.value] if isinstance(node, ast.Return | ast.Assign) and node.value is not None else []
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "PlacementUnavailable":
                values = list(node.args[:1])
            if isinstance(node, ast.keyword) and node.arg == "reason":  # replace(d, reason=...)
                values = [node.value]
            for v in values:
                first = v.values[0] if isinstance(v, ast.JoinedStr) and v.values else v
                if isinstance(first, ast.Constant) and isinstance(first.value, str) and len(first.value) > 8:
                    out.add(wrap.format(first.value))
        return out

    raw = leads(client, "{}") | leads(executor_mod, "{}")
    reasons = {r for r in raw if r.startswith("fallback") and r != "fallback ("}  # "fallback ({why}" below
    reasons |= {"fallback (" + r for r in leads(client, "{}") if not r.startswith(("fallback", "Sends"))}
    reasons |= {"fallback (policy chose a pool not in the catalogue", "fallback (waited 61s for a better pool",
                "fallback (not held: a held task keeps its slot of Airflow pool 'x'"}
    assert len(reasons) >= 12, reasons
    assert {r: fallback_cause(r) for r in reasons if fallback_cause(r) in ("other", "server")} == {}


def _spooled_executor(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, engine: Any,
                      down: dict[str, int]) -> DRLExecutor:
    """An executor with a spool in ``tmp_path`` whose sessions go to ``engine``, refused with an
    OperationalError (an outage) while ``down["calls"]`` lasts."""
    import contextlib

    import airflow.utils.session as airflow_session
    from sqlalchemy.exc import OperationalError

    @contextlib.contextmanager
    def create_session(scoped=True):  # type: ignore[no-untyped-def]
        if down["calls"]:
            down["calls"] -= 1
            raise OperationalError("INSERT INTO drl_placement", {}, Exception("server closed the connection"))
        with engine.begin() as conn:
            yield types.SimpleNamespace(connection=lambda: conn)

    monkeypatch.setattr(airflow_session, "create_session", create_session)
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__SPOOL_DIR", str(tmp_path))
    ex = DRLExecutor()
    ex._open_spool()
    ex._traces_ready = True
    return ex


def _record_of(task_id: str, **kw: Any) -> Any:
    from airflow_drl_executor import traces

    return traces.PlacementRecord(
        ti_id=str(uuid.uuid4()), dag_id="etl", run_id="run1", task_id=task_id, map_index=-1, try_number=1,
        pool="gpu", vm_class="gpu-a10", score=-1.0, reason="r", fallback=False, policy="drl", policy_version="1",
        request_id=uuid.uuid4().hex, decision_ms=1.0, features={}, celery_id=f"celery-{task_id}", **kw)


def test_a_row_the_db_refuses_for_its_content_is_set_aside_not_retried_for_ever(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """was: any refusal was taken for an outage: the row was retried at every heartbeat, with
    every row after it, and (spooled) across restarts; none reached the DB again"""
    from sqlalchemy import create_engine, select

    from airflow_drl_executor import traces

    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    ex = _spooled_executor(monkeypatch, tmp_path, engine, {"calls": 0})
    bad = dataclasses.replace(_record_of("bad"), dag_id=None)  # NOT NULL: an IntegrityError
    ex._record_before_send([("k1", _record_of("a")), ("k2", bad), ("k3", _record_of("b"))],
                           {k: types.SimpleNamespace(ti=types.SimpleNamespace(external_executor_id=f"c{k}"))
                            for k in ("k1", "k2", "k3")})
    with engine.connect() as conn:
        written = sorted(r.task_id for r in conn.execute(select(traces.placements.c.task_id)))
    assert written == ["a", "b"] and ex._unwritten == []
    assert '"task_id": "bad"' in ex._spool.rejected.read_text(), "kept for a person to read"
    nan = dataclasses.replace(_record_of("nan"), score=float("nan"))
    assert traces.PlacementRecord.row(nan, dt_now())["score"] == 0.0, "a NaN score is not a refused row"


def dt_now() -> Any:
    import datetime as dt

    return dt.datetime.now(dt.UTC)


def test_rows_a_lost_commit_or_a_dead_schedulers_spool_already_wrote_are_not_written_twice(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """was: a dead scheduler's rows were written again when its file outlived the commit: the
    second copy made a stale try the task instance's latest placement"""
    from sqlalchemy import create_engine, func, select

    from airflow_drl_executor import traces
    from airflow_drl_executor.spool import Spool

    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    rows = [_record_of(t).row(dt_now()) for t in "ab"]
    with engine.begin() as conn:
        traces.write_rows(conn, rows[:1])  # the dead one's commit went through, its file stayed
    dead = Spool(tmp_path)
    dead.save(rows)
    assert dead._lock_fd is not None
    import os

    os.close(dead._lock_fd)
    dead._lock_fd = None
    ex = _spooled_executor(monkeypatch, tmp_path, engine, {"calls": 0})
    with engine.connect() as conn:
        n = dict(conn.execute(select(traces.placements.c.task_id, func.count()).group_by(traces.placements.c.task_id)).all())
    assert n == {"a": 1, "b": 1} and ex._unwritten == []


def test_the_spool_is_written_only_when_its_rows_change_and_closed_after_the_last_sync(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """was: the whole file rewritten and fsynced at every flush of an outage (180 ms for 10,000
    rows, two or three times a heartbeat); and end() closed the spool before the base class's
    last sync wrote to it again"""
    from sqlalchemy import create_engine

    from airflow_drl_executor import traces

    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    down = {"calls": 10}
    ex = _spooled_executor(monkeypatch, tmp_path, engine, down)
    saves: list[int] = []
    real = type(ex._spool).save
    monkeypatch.setattr(type(ex._spool), "save", lambda self, rows, *a: (saves.append(len(rows)), real(self, rows, *a))[1])
    ex.workloads[("etl", "a")] = types.SimpleNamespace(task_id="celery-a")
    ex._record([(("etl", "a"), _record_of("a"))])
    monkeypatch.setattr(executor_mod.CeleryExecutor, "sync", lambda self: None)
    ex.sync()
    ex.sync()
    assert saves == [1], "saved once while the DB is down"
    down["calls"] = 0
    spool = ex._spool
    monkeypatch.setattr(executor_mod.CeleryExecutor, "end", lambda self, synchronous=False: self.sync())
    ex.end()
    assert saves == [1, 0] and ex._spool is None and spool._lock_fd is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "written: nothing left behind"


def test_a_failing_metrics_backend_never_stops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """was: a site's stat_name_handler (or a custom StatsD client) that raised stopped every
    heartbeat's dispatch, and left a ledger entry for a task never sent"""
    from airflow.observability import stats

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("unknown metric")

    for name in ("incr", "gauge", "timing"):
        monkeypatch.setattr(stats, name, broken)
    sent: list[str] = []
    ex, Task, written = _publishing_executor(monkeypatch)
    monkeypatch.setattr(ex, "_send_workloads_to_celery", lambda tuples: [
        (key, None, (sent.append(w.ti.task_id), types.SimpleNamespace(task_id="c"))[1]) for key, w, _q, _t in tuples])
    monkeypatch.setattr(executor_mod.CeleryExecutor, "sync", lambda self: None)
    ex._client = FakeClient(_reply({"a": "gpu"}))  # type: ignore[assignment]
    a = Task(ti=_workload("a").ti)
    ex.queued_tasks[a.ti.key] = a  # type: ignore[index]
    ex.trigger_tasks(8)
    ex.sync()
    assert sent == ["a"] and [r.task_id for _, r in written] == ["a"]


def test_an_unsent_mark_the_db_refuses_is_applied_at_a_later_heartbeat(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A publish that did not go takes its row's Celery id back. was: tried once; refused (a
    failover), the row kept the id and adoption after a restart watched the task as sent. And
    only that request's row (found by review: a timed-out publish is retried in the same try with
    the same Celery id; marked by id alone, the retry's row lost it too and adoption rescheduled a
    task Celery held)."""
    from sqlalchemy import create_engine, select

    from airflow_drl_executor import traces

    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    down = {"calls": 0}
    ex = _spooled_executor(monkeypatch, tmp_path, engine, down)
    workload = {"k": types.SimpleNamespace(ti=types.SimpleNamespace(external_executor_id="c1"))}
    first = _record_of("a")
    ex._record_before_send([("k", first)], workload)
    down["calls"] = 1
    ex._unrecord(["c1"], first.request_id)  # refused
    with engine.connect() as conn:
        assert conn.execute(select(traces.placements.c.celery_id)).scalars().all() == ["c1"]
    ti = types.SimpleNamespace(state="queued", external_executor_id="c1", queue="gpu")
    monkeypatch.setattr(executor_mod.DRLExecutor, "_apply_unmarks", lambda self: None)  # the DB still refuses
    assert ex._never_sent([ti]) == {id(ti)}, "not sent, whatever the row still says"
    ex._record_before_send([("k", _record_of("a"))], workload)  # the retry, same try, same Celery id: sent
    assert ex._never_sent([ti]) == set(), "the retry's row says sent"
    monkeypatch.undo()
    ex = _spooled_executor(monkeypatch, tmp_path, engine, down)
    ex._unmark = {("c1", first.request_id)}
    monkeypatch.setattr(executor_mod.CeleryExecutor, "sync", lambda self: None)
    ex.sync()  # the DB is back
    with engine.connect() as conn:
        got = conn.execute(select(traces.placements.c.request_id, traces.placements.c.celery_id)
                           .order_by(traces.placements.c.id)).all()
    assert [c for _, c in got] == [None, "c1"] and got[0][0] == first.request_id, "the first request's row only"
    assert ex._unmark == set()


def _counting_writes(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, engine: Any) -> tuple[DRLExecutor, list[int]]:
    """A spooled executor on ``engine`` (its table made) and the size of each insert it sends."""
    from airflow_drl_executor import traces

    traces.ensure_schema(engine)
    ex = _spooled_executor(monkeypatch, tmp_path, engine, {"calls": 0})
    writes: list[int] = []
    real = traces.write_rows
    monkeypatch.setattr(traces, "write_rows", lambda conn, rows: (writes.append(len(rows)), real(conn, rows))[1])
    return ex, writes


def test_a_refused_row_among_many_is_found_in_a_few_transactions(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """was: one transaction per row once the DB refused a batch (10,000 rows: 15 s of the
    scheduler loop); now halving: a few per refused row"""
    from sqlalchemy import create_engine, func, select

    from airflow_drl_executor import traces

    engine = create_engine("sqlite://")
    ex, writes = _counting_writes(monkeypatch, tmp_path, engine)
    records = [_record_of(f"t{i}") for i in range(256)]
    records[100] = dataclasses.replace(records[100], dag_id=None)
    ex._record([(("etl", r.task_id), r) for r in records])
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(traces.placements)).scalar() == 255
    assert len(writes) <= 2 * 8 + 2, writes  # the batch, then two per halving (was: 257)
    assert ex._unwritten == [] and '"task_id": "t100"' in ex._spool.rejected.read_text()


def test_rows_the_db_refuses_all_cost_a_bounded_number_of_transactions_a_heartbeat(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """found by review: with every row refused (a systematic reason), halving cost two
    transactions per row, all in one heartbeat; now a budget a heartbeat, the rest at the next"""
    from sqlalchemy import create_engine


    engine = create_engine("sqlite://")
    ex, writes = _counting_writes(monkeypatch, tmp_path, engine)
    bad = [dataclasses.replace(_record_of(f"t{i}"), dag_id=None) for i in range(200)]
    ex._record([(("etl", r.task_id), r) for r in bad])
    assert len(writes) == executor_mod._WRITE_EACH_BUDGET + 1 and 0 < len(ex._unwritten) < 200
    monkeypatch.setattr(executor_mod.CeleryExecutor, "sync", lambda self: None)
    for _ in range(20):
        ex.sync()
    assert ex._unwritten == [] and ex._spool.rejected.read_text().count("\n") == 200, "all set aside, over heartbeats"


def _placed_as_c1(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, engine: Any, down: dict[str, int]
                  ) -> tuple[DRLExecutor, Any]:
    """A spooled executor on ``engine`` (its table made) that recorded a placement under Celery id c1."""
    from airflow_drl_executor import traces

    traces.ensure_schema(engine)
    ex = _spooled_executor(monkeypatch, tmp_path, engine, down)
    rec = _record_of("a")
    ex._record_before_send([("k", rec)], {"k": types.SimpleNamespace(ti=types.SimpleNamespace(
        external_executor_id="c1"))})
    return ex, rec


def test_an_unsent_mark_the_db_refused_reaches_the_next_schedulers_adoption(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """found by review: the pending mark lived in memory only; a scheduler that died before the
    DB took it left the next one's adoption to watch that task as sent until task_queued_timeout"""
    from sqlalchemy import create_engine, select

    from airflow_drl_executor import traces

    engine = create_engine("sqlite://")
    down = {"calls": 0}
    ex, first = _placed_as_c1(monkeypatch, tmp_path, engine, down)
    down["calls"] = 1
    ex._unrecord(["c1"], first.request_id)  # refused; then the scheduler is killed
    assert ex._spool is not None and ex._spool._lock_fd is not None
    import os

    os.close(ex._spool._lock_fd)
    ex._spool._lock_fd = None
    nxt = _spooled_executor(monkeypatch, tmp_path, engine, down)  # the DB is back; the row still says c1
    ti = types.SimpleNamespace(state="queued", external_executor_id="c1", queue="gpu")
    assert nxt._never_sent([ti]) == {id(ti)}, "its publish did not go: rescheduled, not watched as sent"
    monkeypatch.setattr(executor_mod.CeleryExecutor, "sync", lambda self: None)
    nxt.sync()
    with engine.connect() as conn:
        assert conn.execute(select(traces.placements.c.celery_id)).scalars().all() == [None]
    assert nxt._spool.unsent_pairs() == set()


def test_a_cleared_row_and_its_pending_mark_are_on_disk_before_the_db_is_tried(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """found by review: the cleared row was saved first, its mark only after the DB's answer (a
    connect timeout): a scheduler killed meanwhile left the next one to take the task for sent;
    and a save the disk refused was not tried again while no new row came"""
    from sqlalchemy import create_engine


    engine = create_engine("sqlite://")
    down = {"calls": 1}
    ex, rec = _placed_as_c1(monkeypatch, tmp_path, engine, down)  # the DB refuses: the row waits with c1
    assert ex._spool is not None
    seen: list[tuple[set, bool]] = []
    monkeypatch.setattr(executor_mod.DRLExecutor, "_apply_unmarks", lambda self: seen.append(
        (self._spool.unsent_pairs(), '"celery_id": null' in self._spool.data.read_text())))
    ex._unrecord(["c1"], rec.request_id)
    assert seen == [({("c1", rec.request_id)}, True)], "both on disk when the DB is tried"
    real_save = type(ex._spool).save
    full = {"n": 1}

    def save(self, rows, unsent=()):  # type: ignore[no-untyped-def]
        if full["n"]:
            full["n"] -= 1
            raise OSError(28, "No space left on device")
        return real_save(self, rows, unsent)

    monkeypatch.setattr(type(ex._spool), "save", save)
    ex._unmark.add(("c2", "r2"))
    ex._spool_stale = True
    ex._keep()  # the disk refuses
    monkeypatch.setattr(executor_mod.CeleryExecutor, "sync", lambda self: None)
    down["calls"] = 5  # the DB still down: nothing new is written
    ex.sync()
    assert ("c2", "r2") in ex._spool.unsent_pairs(), "saved at the next heartbeat"


def test_a_reply_that_breaks_a_hard_constraint_is_placed_by_the_fallback(executor: DRLExecutor) -> None:
    """Found by review: the executor checked only that a decided pool was in the catalogue, so a
    reply sending a GPU task to a pool without GPUs (a replica with an older catalogue, a masking
    bug) was dispatched as the policy's choice, and the task failed on a worker that cannot run it."""
    cpu_pools = [p.name for p in executor.catalogue.pools if p.vm_class.gpus == 0]
    assert cpu_pools, executor.catalogue.names

    def answer(req: PlacementRequest) -> PlacementReply:
        return PlacementReply(req.request_id, tuple(Decision(t.run_key, t.task_id, cpu_pools[0], "vm",
                                                             reason="policy") for t in req.ready),
                              policy="gnn", policy_version="7")

    executor._client = FakeClient(answer)  # type: ignore[assignment]
    b = _workload("b")
    records, held = executor._place([b])
    [(_, rec)] = records
    gpu_pools = {p.name for p in executor.catalogue.pools if p.vm_class.gpus >= 1}
    assert rec.pool in gpu_pools, f"GPU task sent to {rec.pool!r} (no GPU) on the policy's word: {rec.reason}"
    assert rec.fallback
    assert "breaks the task's hard constraints" in rec.reason
