"""The nightly traces where a review (2026-12-06) found them wrong: a run's arrival in the export
(a retried first task, a run cleared after an export) and replay lines the fine-tune could not
run (a NaN arrival, a cycle). The export tests use SQLite with the tables the export reads, as
``tests/airflow_drl_executor/test_export_runs.py`` does."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path

import pytest
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, create_engine, insert, text
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parents[2]


# --- export: a SQLite stand-in for Airflow's tables ----------------------------------------------

T0 = dt.datetime(2026, 12, 1, 2, 0, tzinfo=dt.UTC)

_meta = MetaData()


def _ti_id_type():  # type: ignore[no-untyped-def]
    """Airflow's ``task_instance.id`` type (a UUID, stored on SQLite as the export's join expects)."""
    from airflow.models.taskinstance import TaskInstance

    return TaskInstance.__table__.c.id.type

dag_runs = Table("dag_run", _meta, Column("dag_id", String(250)), Column("run_id", String(250)),
                 Column("end_date", DateTime(timezone=True)), Column("queued_at", DateTime(timezone=True)))
task_instances = Table(
    "task_instance", _meta,
    Column("id", _ti_id_type()), Column("try_number", Integer), Column("map_index", Integer),
    Column("dag_version_id", String(36)), Column("state", String(20)),
    Column("start_date", DateTime(timezone=True)), Column("end_date", DateTime(timezone=True)),
    Column("queued_dttm", DateTime(timezone=True)), Column("next_method", String(1000)),
)


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A SQLite session with ``drl_placement``, ``task_instance``, ``dag_run`` and ``dag_tag``;
    every run's DAG is ``extract -> train``."""
    from airflow_drl_executor import traces
    from airflow_drl_executor.graph_builder import GraphBuilder, _Structure

    structure = _Structure(task_ids=("extract", "train"), edges=((0, 1),), hints=({}, {}),
                           queues=("default", "default"))
    monkeypatch.setattr(GraphBuilder, "structure", lambda self, version_id, session: structure)
    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    with engine.begin() as conn:
        _meta.create_all(conn)
        conn.execute(text("CREATE TABLE dag_tag (dag_id VARCHAR(250), name VARCHAR(100))"))
    with Session(engine) as s:
        yield s
    engine.dispose()


def _run(session: Session, run_id: str, ended: dt.datetime, queued: dt.datetime | None = None) -> None:
    """The DAG run ``etl/run_id``, queued at ``queued`` and ended at ``ended`` (a re-run: both
    moved, as Airflow's clear queues a finished run again)."""
    session.execute(text("DELETE FROM dag_run WHERE run_id = :r"), {"r": run_id})
    session.execute(insert(dag_runs), [{"dag_id": "etl", "run_id": run_id, "end_date": ended, "queued_at": queued}])


def _placed(session: Session, run_id: str, task_id: str, decided: dt.datetime, *, try_number: int = 1,
            seconds: float | None = 10.0, state: str = "success") -> None:
    """A placement of ``task_id``'s try ``try_number`` decided at ``decided``, on cpu-small (speed 1).
    With ``seconds`` the try is the task instance's current one (a ``task_instance`` row with a
    new id, as Airflow 3 gives every try: ``prepare_db_for_next_try``), which started a second
    after the decision and ran that long in ``state``; with None it is an earlier try, whose row
    Airflow moved to ``task_instance_history`` (so its id is in ``task_instance`` no more)."""
    from airflow_drl_executor import traces
    from policy.schema import TaskNode

    ti_id = uuid.uuid4()
    if seconds is not None:
        start = decided + dt.timedelta(seconds=1)
        session.execute(insert(task_instances), [{
            "id": ti_id, "try_number": try_number, "map_index": -1, "dag_version_id": "v1", "state": state,
            "start_date": start, "end_date": start + dt.timedelta(seconds=seconds),
            "queued_dttm": decided, "next_method": None}])
    record = traces.PlacementRecord(
        ti_id=str(ti_id), dag_id="etl", run_id=run_id, task_id=task_id, map_index=-1, try_number=try_number,
        pool="cpu-small", vm_class="small-cpu", score=0.0, reason="", fallback=False, policy="eft",
        policy_version="1", request_id="q", decision_ms=1.0, features=TaskNode(task_id).to_json())
    session.execute(insert(traces.placements), [record.row(decided)])


def _export(session: Session, since: dt.datetime, until: dt.datetime) -> dict[str, float]:
    """Each exported run's arrival, seconds after the file's first, by run id."""
    from airflow_drl_executor.config import packaged_catalogue
    from airflow_drl_executor.export import export_runs
    from policy.catalogue import load_catalogue

    runs = export_runs(session, load_catalogue(packaged_catalogue()), since=since, until=until)
    return {r.graph.run_key.split("/", 1)[1]: r.arrival_s for r in runs}


def test_a_retried_first_task_does_not_delay_its_runs_arrival(session: Session) -> None:
    """The export dates a run's arrival by its first placement (``export_runs``' docstring), but
    it reads only placements joined with the task instance's *current* try (``t.id = p.ti_id AND
    t.try_number = p.try_number``): Airflow 3 gives every try a new id, so the placement of a
    retried task's first try never joins. A run whose first task failed and was retried
    "arrives" at the retry, after runs that really arrived later: the replay file's order and
    arrival times are wrong, and ``--workflows replay:FILE`` (which replays the recorded
    arrivals) simulates a different stream from the one production saw."""
    _run(session, "r1", T0 + dt.timedelta(minutes=30))
    _placed(session, "r1", "extract", T0, seconds=None)  # try 1: failed, retried 10 minutes later
    _placed(session, "r1", "extract", T0 + dt.timedelta(minutes=10), try_number=2)
    _placed(session, "r1", "train", T0 + dt.timedelta(minutes=11))
    _run(session, "r2", T0 + dt.timedelta(minutes=30))
    _placed(session, "r2", "extract", T0 + dt.timedelta(minutes=5))
    _placed(session, "r2", "train", T0 + dt.timedelta(minutes=6))
    arrivals = _export(session, T0 - dt.timedelta(hours=1), T0 + dt.timedelta(hours=1))
    assert arrivals == {"r1": 0.0, "r2": 300.0}, "r1 arrived (its first placement) 5 minutes before r2"


def test_a_run_cleared_after_its_export_does_not_arrive_before_the_night(session: Session) -> None:
    """A run that ended (failed) and was exported by night 1, then had its failed task cleared
    and re-run the next day, ends again, so night 2 exports it too, with the tries it did not
    re-run (and their observations, already trained on by night 1). Its arrival is then its
    oldest placement still current: a day-old one, before night 2's window. Every other run of
    night 2's file is shifted by that day (``arrival_s`` counts from the file's first run): the
    replay starts with one run and a day of idle cluster before the night's real traffic."""
    night = T0
    _run(session, "r1", night - dt.timedelta(hours=2), queued=night - dt.timedelta(hours=3, minutes=1))
    _placed(session, "r1", "extract", night - dt.timedelta(hours=3))  # day 1: done, never re-run
    _placed(session, "r1", "train", night - dt.timedelta(hours=3) + dt.timedelta(minutes=1), state="failed")
    assert set(_export(session, night - dt.timedelta(days=1), night)) == {"r1"}  # night 1
    # day 2: train cleared at night + 10 h (its failed try goes to the history, a new try runs)
    session.execute(text("DELETE FROM task_instance WHERE state = 'failed'"))
    _placed(session, "r1", "train", night + dt.timedelta(hours=10), try_number=2)
    _run(session, "r1", night + dt.timedelta(hours=10, minutes=5), queued=night + dt.timedelta(hours=10))
    _run(session, "r2", night + dt.timedelta(hours=12, minutes=5))  # the night's own traffic
    _placed(session, "r2", "extract", night + dt.timedelta(hours=12))
    _placed(session, "r2", "train", night + dt.timedelta(hours=12, minutes=1))
    arrivals = _export(session, night, night + dt.timedelta(days=1))  # night 2
    # r2 arrived 2 h after r1's re-run (or first, if a re-run is not exported again); was 15 h
    assert arrivals["r2"] <= 2 * 3600.0, arrivals


# --- the replay file format ----------------------------------------------------------------------


def _graph_json(run_key: str, edges: list[list[int]]) -> dict[str, object]:
    from policy.schema import RunGraph, TaskNode

    graph = RunGraph(run_key, (TaskNode("a"), TaskNode("b"), TaskNode("c")), ())
    doc = graph.to_json()
    doc.pop("digest")
    doc["edges"] = edges
    return doc


def test_a_replay_arrival_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    """``read_replay`` checks ``arrival_s >= 0``, which NaN passes (every comparison with NaN is
    false) and so does Infinity: Python's ``json`` reads both literals. The run is accepted, the
    file is "sorted" by a NaN key (no order at all), and the error comes later, from the
    simulator ("bad arrival time") of ``--workflows replay:``, naming neither file nor line."""
    from policy.errors import ReplayError
    from policy.replay import read_replay

    for literal in ("NaN", "Infinity"):
        path = tmp_path / f"{literal}.jsonl"
        graph = json.dumps(_graph_json("etl/r1", []))
        path.write_text(f'{{"arrival_s": {literal}, "graph": {graph}}}\n')
        with pytest.raises(ReplayError, match=r"\.jsonl:1"):
            read_replay(path)


def test_a_replayed_run_with_a_cycle_is_refused_where_it_is_read(tmp_path: Path) -> None:
    """``read_replay`` validates each run's schema (edge indices in range, no self-loop) but not
    that the graph is a DAG. A run with a cycle is read as valid and the nightly fine-tune stops
    later, inside the teacher's simulation (``SchemaError: run 'etl/r1': the task graph has a
    cycle`` from ``make_jobs``), naming neither the file nor the line and after the run passed
    ``read_runnable``'s filter, which leaves out runs the simulator cannot run."""
    from policy.errors import ReplayError
    from policy.replay import read_replay

    path = tmp_path / "cycle.jsonl"
    ok = {"arrival_s": 0.0, "graph": _graph_json("etl/r0", [[0, 1], [1, 2]])}
    cyclic = {"arrival_s": 1.0, "graph": _graph_json("etl/r1", [[0, 1], [1, 2], [2, 1]])}
    path.write_text(json.dumps(ok) + "\n" + json.dumps(cyclic) + "\n")
    with pytest.raises(ReplayError, match=r"cycle\.jsonl:2"):
        read_replay(path)
