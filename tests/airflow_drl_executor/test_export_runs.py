"""Recorded placements become replay runs: nodes as the graph builder builds them, on SQLite.

(The real stack's export is tests/integration/test_export.py.)
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

import pytest
from airflow.models.taskinstance import TaskInstance
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, create_engine, insert, select, text
from sqlalchemy.orm import Session

from airflow_drl_executor import traces
from airflow_drl_executor.config import packaged_catalogue
from airflow_drl_executor.export import export_runs
from airflow_drl_executor.graph_builder import GraphBuilder, _Structure
from policy.catalogue import load_catalogue
from policy.errors import SchemaError
from policy.schema import TaskNode

CATALOGUE = load_catalogue(packaged_catalogue())
T0 = dt.datetime(2026, 12, 1, 2, 0, tzinfo=dt.UTC)

dag_runs = Table("dag_run", MetaData(), Column("dag_id", String(250)), Column("run_id", String(250)),
                 Column("end_date", DateTime(timezone=True)), Column("queued_at", DateTime(timezone=True)))
task_instances = Table(
    "task_instance", MetaData(),
    Column("id", TaskInstance.__table__.c.id.type), Column("try_number", Integer), Column("map_index", Integer),
    Column("dag_version_id", String(36)), Column("state", String(20)),
    Column("start_date", DateTime(timezone=True)), Column("end_date", DateTime(timezone=True)),
    Column("queued_dttm", DateTime(timezone=True)), Column("next_method", String(1000)),
)
logs = Table("log", MetaData(), Column("dttm", DateTime(timezone=True)), Column("event", String(30)),
             Column("dag_id", String(250)), Column("task_id", String(250)), Column("run_id", String(250)),
             Column("map_index", Integer), Column("try_number", Integer))

# extract -> (train, report, mapped); report is never placed (its run failed before it was ready)
STRUCTURE = _Structure(
    task_ids=("extract", "mapped", "report", "train"),
    edges=((0, 1), (0, 2), (0, 3)),
    hints=({}, {}, {"duration_s": 300, "cpus": 4, "memory_gb": 16, "kind": "etl"}, {"kind": "gpu_train"}),
    queues=("default", "default", "cpu-large", "default"),
)


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(GraphBuilder, "structure", lambda self, version_id, session: STRUCTURE)
    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    task_instances.create(engine)
    logs.create(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE dag_tag (dag_id VARCHAR(250), name VARCHAR(100))"))
        dag_runs.create(conn)
    with Session(engine) as s:
        yield s
    engine.dispose()


def _ran(session: Session, task_id: str, pool: str, seconds: float, *, map_index: int = -1,
         state: str = "success", decided: dt.datetime = T0, run_id: str = "r1",
         run_ended: dt.datetime | None = T0 + dt.timedelta(minutes=30), deferred_s: float = 0.0,
         next_method: str | None = None) -> None:
    """One placed instance of ``task_id`` (features as the executor records them) and its outcome;
    its run (ended at ``run_ended``, None: still going) recorded once. ``deferred_s``: its try
    waited that long in the triggerer, then was queued again and ran ``seconds`` on a worker (2 s
    of them in its pool's Celery queue), as Airflow records it: its first start date kept, and a
    ``running`` log row at each start."""
    ti_id = uuid.uuid4()
    start = decided + dt.timedelta(minutes=1)
    end = start + dt.timedelta(seconds=deferred_s + seconds)
    queued = start - dt.timedelta(seconds=1) if not deferred_s else start + dt.timedelta(seconds=deferred_s)
    if session.execute(select(dag_runs.c.run_id).where(dag_runs.c.run_id == run_id)).first() is None:
        session.execute(insert(dag_runs), [{"dag_id": "etl", "run_id": run_id, "end_date": run_ended}])
    session.execute(insert(task_instances), [{
        "id": ti_id, "try_number": 1, "map_index": map_index, "dag_version_id": "v1", "state": state,
        "start_date": start, "end_date": end, "queued_dttm": queued, "next_method": next_method}])
    if deferred_s:
        session.execute(insert(logs), [
            {"dttm": when, "event": "running", "dag_id": "etl", "task_id": task_id, "run_id": run_id,
             "map_index": map_index, "try_number": 1}
            for when in (start, queued + dt.timedelta(seconds=2))])
    node = TaskNode(task_id, duration_s=60.0, kind="gpu_train" if task_id == "train" else "default")
    record = traces.PlacementRecord(
        ti_id=str(ti_id), dag_id="etl", run_id=run_id, task_id=task_id, map_index=map_index, try_number=1,
        pool=pool, vm_class="x", score=0.0, reason="", fallback=False, policy="eft", policy_version="1",
        request_id="q", decision_ms=1.0, features=node.to_json())
    session.execute(insert(traces.placements), [record.row(decided)])


def _export(session: Session):  # type: ignore[no-untyped-def]
    (run,) = export_runs(session, CATALOGUE, since=T0 - dt.timedelta(hours=1), until=T0 + dt.timedelta(hours=1))
    return {t.task_id: t for t in run.graph.tasks}, run


def test_an_unplaced_task_carries_its_declared_hints(session: Session) -> None:
    """was: ``TaskNode("report")``, 60 s on one CPU of kind default, whatever the DAG declared"""
    _ran(session, "extract", "cpu-small", 10.0)
    nodes, run = _export(session)
    report = nodes["report"]
    assert (report.duration_s, report.cpus, report.memory_gb, report.kind) == (300.0, 4.0, 16.0, "etl")
    assert (report.priority, report.pool) == (1.0, "cpu-large")  # priority and queue pin, as graph_builder.task_node
    # with no hint, the graph builder's default duration; a placed task keeps its observed one
    assert nodes["train"].kind == "gpu_train" and nodes["train"].duration_s == 60.0
    assert nodes["extract"].duration_s == pytest.approx(10.0)  # speed 1.0 on cpu-small
    assert [t.task_id for t in run.graph.tasks] == list(STRUCTURE.task_ids) and run.graph.edges == STRUCTURE.edges


def test_a_mapped_task_is_one_node_per_instance_with_its_own_duration(session: Session) -> None:
    """As the graph builder sends it (one node and one placement per instance: ``mapped[i]``, the
    task's edges); an instance without a successful try lasts as long as its task's longest.
    was: one node lasting as long as the longest instance"""
    _ran(session, "extract", "cpu-small", 10.0)
    _ran(session, "mapped", "cpu-small", 12.0, map_index=0)
    _ran(session, "mapped", "cpu-large", 20.0, map_index=1)  # speed 2.0: 40 s at speed 1
    _ran(session, "mapped", "cpu-small", 30.0, map_index=2)
    _ran(session, "mapped", "cpu-small", 99.0, map_index=3, state="failed")  # no observed duration
    _ran(session, "train", "gpu", 2.0)  # gpu_train on gpu: speed 1.5 x affinity 8
    nodes, run = _export(session)
    assert [t.task_id for t in run.graph.tasks] == ["extract", "mapped[0]", "mapped[1]", "mapped[2]", "mapped[3]",
                                                    "report", "train"]
    assert [nodes[f"mapped[{i}]"].duration_s for i in range(4)] == pytest.approx([12.0, 40.0, 30.0, 40.0])
    assert nodes["train"].duration_s == pytest.approx(24.0)
    assert sorted(run.graph.edges) == sorted([(0, k) for k in (1, 2, 3, 4)] + [(0, 5), (0, 6)])


def test_a_bad_hint_is_dropped_as_the_executor_dropped_it(session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    """was: the whole run was skipped; the executor places such a run with the hint ignored"""
    bad = dataclasses.replace(STRUCTURE, hints=({}, {}, {"cpus": -1, "memory_gb": 16}, {}))
    monkeypatch.setattr(GraphBuilder, "structure", lambda self, version_id, session: bad)
    _ran(session, "extract", "cpu-small", 10.0)
    nodes, _ = _export(session)
    assert (nodes["report"].cpus, nodes["report"].memory_gb) == (TaskNode("x").cpus, 16.0)


def test_a_run_without_its_serialized_dag_is_skipped(session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    def gone(self, version_id, session):  # type: ignore[no-untyped-def]
        raise SchemaError(f"dag version {version_id}: no serialized DAG in the metadata database")
    monkeypatch.setattr(GraphBuilder, "structure", gone)
    _ran(session, "extract", "cpu-small", 10.0)
    assert export_runs(session, CATALOGUE, since=T0 - dt.timedelta(hours=1), until=T0 + dt.timedelta(hours=1)) == []


def test_a_run_is_exported_whole_by_the_night_it_ended(session: Session) -> None:
    """was: placements were selected by decision time, so a run going at the 02:00 cut-off was in
    two nights' replays, each with half its durations observed and the rest made up"""
    night = T0 + dt.timedelta(hours=1)  # the cut-off between two exports
    _ran(session, "extract", "cpu-small", 10.0, decided=night - dt.timedelta(minutes=2), run_ended=night + dt.timedelta(minutes=5))
    for task_id in ("mapped", "report", "train"):
        _ran(session, task_id, "cpu-small", 20.0, decided=night + dt.timedelta(minutes=1))
    _ran(session, "extract", "cpu-small", 10.0, run_id="going", decided=night - dt.timedelta(minutes=3), run_ended=None)
    first = export_runs(session, CATALOGUE, since=night - dt.timedelta(days=1), until=night)
    (second,) = export_runs(session, CATALOGUE, since=night, until=night + dt.timedelta(days=1))
    assert first == [], "neither run had ended"
    seconds = {t.task_id: t.duration_s for t in second.graph.tasks}
    assert seconds == {"extract": pytest.approx(10.0), "mapped": pytest.approx(20.0), "report": pytest.approx(20.0),
                       "train": pytest.approx(20.0)}


def test_a_deferrable_tasks_duration_is_its_time_on_a_worker(session: Session) -> None:
    """As the graph builder's history counts it. was: from its first start date, which Airflow
    keeps for a resumed try: an hour in the triggerer exported as an hour of work"""
    _ran(session, "extract", "cpu-small", 10.0, deferred_s=3600.0)  # 2 s in the Celery queue, 8 s of work
    _ran(session, "train", "gpu", 5.0, next_method="execute_complete")  # ended in the triggerer
    nodes, _ = _export(session)
    assert nodes["extract"].duration_s == pytest.approx(8.0)
    assert nodes["train"].duration_s == 60.0, "no time on a worker recorded: as never observed"


def test_placements_on_pools_the_catalogue_lacks_are_said(session: Session, caplog: pytest.LogCaptureFixture) -> None:
    """Found by review: a worker reading another catalogue than the scheduler's (none set: the packaged demo
    one) dropped every observed duration without a word."""
    from policy.errors import PolicyError

    _ran(session, "extract", "cpu-small", 10.0)
    _ran(session, "train", "prod-gpu-a100", 5000.0)
    nodes, _ = _export(session)
    assert nodes["extract"].duration_s == pytest.approx(10.0) and nodes["train"].duration_s == 60.0
    assert "1 of 2 placements were on pools not in the catalogue" in caplog.text and "prod-gpu-a100 1" in caplog.text
    session.execute(text("DELETE FROM drl_placement WHERE pool = 'cpu-small'"))
    with pytest.raises(PolicyError, match="this worker reads another catalogue than the scheduler's"):
        _export(session)


def test_a_run_too_large_for_a_replay_is_skipped_not_the_night(session: Session,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a run of more nodes than a replay run may hold was written, and made the whole
    file unreadable: every nightly fine-tune failed."""
    import airflow_drl_executor.export as export

    monkeypatch.setattr(export, "MAX_TASKS_PER_RUN", 6)  # the test run has 7 nodes (4 mapped instances)
    _ran(session, "extract", "cpu-small", 10.0)
    for i in range(4):
        _ran(session, "mapped", "cpu-small", 12.0, map_index=i)
    _ran(session, "extract", "cpu-small", 10.0, run_id="r2")
    runs = export_runs(session, CATALOGUE, since=T0 - dt.timedelta(hours=1), until=T0 + dt.timedelta(hours=1))
    assert [r.graph.run_key for r in runs] == ["etl/r2"]
    # the edges' bound too (r1: 6 edges, r2: 3)
    monkeypatch.setattr(export, "MAX_TASKS_PER_RUN", 100)
    monkeypatch.setattr(export, "MAX_EDGES_PER_RUN", 5)
    runs = export_runs(session, CATALOGUE, since=T0 - dt.timedelta(hours=1), until=T0 + dt.timedelta(hours=1))
    assert [r.graph.run_key for r in runs] == ["etl/r2"]


def test_a_never_placed_task_is_exported_with_the_executors_defaults(session: Session) -> None:
    """Found by review: the export wrote 60 s and queue "default" for a task never placed, whatever
    ``[drl_executor] default_duration_s`` and ``[operators] default_queue`` the executor sent."""
    _ran(session, "extract", "cpu-small", 10.0)
    (run,) = export_runs(session, CATALOGUE, since=T0 - dt.timedelta(hours=1), until=T0 + dt.timedelta(hours=1),
                         default_queue="cpu-large", default_duration_s=42.0)
    nodes = {t.task_id: t for t in run.graph.tasks}
    assert nodes["train"].duration_s == 42.0
