"""Trace rows a person, another release or a dead scheduler left behind (spool files taken over,
rows written late, text the database cannot take): found by review, each failed on the code before."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import types
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, insert, select
from sqlalchemy.engine import Engine

from airflow_drl_executor import traces
from airflow_drl_executor.executor import DRLExecutor
from airflow_drl_executor.spool import Spool

T0 = dt.datetime(2026, 12, 6, 9, 30, tzinfo=dt.UTC)


def _rec(**changes: Any) -> traces.PlacementRecord:
    base: dict[str, Any] = dict(
        ti_id=str(uuid.uuid4()), dag_id="etl", run_id="r", task_id="t", map_index=-1, try_number=1, pool="gpu",
        vm_class="gpu-a10", score=-1.0, reason="because", fallback=False, policy="drl", policy_version="1",
        request_id=uuid.uuid4().hex, decision_ms=1.0, features={"kind": "x"}, celery_id="c-good")
    base.update(changes)
    return traces.PlacementRecord(**base)


def _die(spool: Spool) -> None:
    """What the kernel does for a killed process: its lock goes, its files stay."""
    assert spool._lock_fd is not None
    os.close(spool._lock_fd)
    spool._lock_fd = None


def _orphan(directory: Path, rows: list[dict[str, Any]]) -> None:
    """A dead executor's spool file holding ``rows`` (JSON lines, as a person or another release wrote it)."""
    dead = Spool(directory)
    dead.data.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), encoding="utf-8")
    dead._saved = True
    _die(dead)


def _json_row(**raw: Any) -> dict[str, Any]:
    """A row as PlacementRecord.row makes it, dated as the spool writes it, with ``raw`` values put in as they are."""
    row = _rec().row(T0)
    row["decided_at"] = row["decided_at"].isoformat()
    row.update(raw)
    return row


def _executor_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, engine: Engine) -> DRLExecutor:
    """An executor whose sessions go to ``engine`` and whose spool is ``tmp_path`` (not opened yet)."""
    import airflow.utils.session as airflow_session

    @contextlib.contextmanager
    def create_session(scoped=True):  # type: ignore[no-untyped-def]
        with engine.begin() as conn:
            yield types.SimpleNamespace(connection=lambda: conn)

    monkeypatch.setattr(airflow_session, "create_session", create_session)
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__SPOOL_DIR", str(tmp_path))
    ex = DRLExecutor()
    ex._traces_ready = True
    return ex


def _written(engine: Engine) -> list[str | None]:
    with engine.connect() as conn:
        return sorted(conn.execute(select(traces.placements.c.celery_id)).scalars().all())


def test_a_spooled_row_of_the_wrong_type_is_set_aside_not_blocking_every_row_for_ever(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A dead executor's file holds a row with every column, but ``features`` a JSON object rather
    than the text of one (a file written by hand or by another release: what adopt_orphans guards
    against). The driver refuses to bind it with a ProgrammingError, which _refused_for_content takes
    for an outage: the batch, the good row with it, is retried at every heartbeat and never written
    (the oldest lost past _UNWRITTEN_MAX)."""
    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    _orphan(tmp_path, [_json_row(celery_id="c-bad", features={"kind": "x"}), _json_row(celery_id="c-good")])
    ex = _executor_on(monkeypatch, tmp_path, engine)
    ex._open_spool()  # start(): takes the dead one's rows over and writes them
    for _ in range(3):  # heartbeats
        ex._flush_traces()
    assert _written(engine) == ["c-good"], "the good row reaches the DB"
    assert ex._unwritten == [], "the bad row is not retried for ever"
    assert ex._spool is not None and "c-bad" in ex._spool.rejected.read_text(), "kept for a person to read"


def test_a_spooled_row_with_a_number_the_db_cannot_hold_does_not_stop_the_scheduler(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A spooled row whose try number is past 64 bits: the SQLite driver raises OverflowError (no
    SQLAlchemyError), which _flush_traces does not catch: it goes up through _open_spool and start(),
    at every start (each takes the dead file over again)."""
    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    _orphan(tmp_path, [_json_row(celery_id="c-bad", try_number=2**70), _json_row(celery_id="c-good")])
    ex = _executor_on(monkeypatch, tmp_path, engine)
    ex._open_spool()  # raised OverflowError
    assert _written(engine) == ["c-good"]
    assert ex._spool is not None and "c-bad" in ex._spool.rejected.read_text()


def test_the_latest_placement_is_the_latest_try_whatever_order_the_rows_were_written_in() -> None:
    """A row of try 1 written after try 2's (a dead or cut-off HA scheduler's spooled rows, taken over
    and written later) was taken for the task instance's latest placement: max(id), not the latest try.
    Its pool then reads as the executor's last choice (or as a mutation hook's pin) for the next try."""
    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    with engine.begin() as conn:
        conn.execute(insert(traces.placements), [
            _rec(try_number=2, pool="cpu-small", features={}).row(T0),
            _rec(try_number=1, pool="gpu", features={"pool": "gpu"}).row(T0 - dt.timedelta(hours=1)),  # late write
        ])
        got = traces.last_placements(conn, [("etl", "r", "t", -1)])
    assert got == {("etl", "r", "t", -1): traces.LastPlacement(2, "cpu-small", False)}


def test_a_placement_whose_features_are_not_json_skips_its_run_not_the_nights_export(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``features`` is free text to the DB (a spooled row taken over is checked for its keys only): one
    row whose features do not parse raised JSONDecodeError out of export_runs (not a PolicyError, so not
    the per-run skip): every nightly export failed until the row was pruned, 90 days later."""
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, text
    from sqlalchemy.orm import Session

    from airflow_drl_executor.config import packaged_catalogue
    from airflow_drl_executor.export import export_runs
    from airflow_drl_executor.graph_builder import GraphBuilder, _Structure
    from policy.catalogue import load_catalogue

    structure = _Structure(task_ids=("extract",), edges=(), hints=({},), queues=("default",))
    monkeypatch.setattr(GraphBuilder, "structure", lambda self, version_id, session: structure)
    meta = MetaData()
    dag_run = Table("dag_run", meta, Column("dag_id", String(250)), Column("run_id", String(250)),
                    Column("end_date", DateTime(timezone=True)), Column("queued_at", DateTime(timezone=True)))
    ti = Table("task_instance", meta, Column("id", TaskInstance.__table__.c.id.type), Column("try_number", Integer),
               Column("map_index", Integer), Column("dag_version_id", String(36)), Column("state", String(20)),
               Column("start_date", DateTime(timezone=True)), Column("end_date", DateTime(timezone=True)),
               Column("queued_dttm", DateTime(timezone=True)), Column("next_method", String(1000)))
    Table("log", meta, Column("dttm", DateTime(timezone=True)), Column("event", String(30)),
          Column("dag_id", String(250)), Column("task_id", String(250)), Column("run_id", String(250)),
          Column("map_index", Integer), Column("try_number", Integer))
    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    meta.create_all(engine)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE dag_tag (dag_id VARCHAR(250), name VARCHAR(100))"))
        for run_id, features in (("good", '{"task_id": "extract", "duration_s": 5.0}'), ("bad", "{not json")):
            ti_id = uuid.uuid4()
            conn.execute(insert(dag_run), [{"dag_id": "etl", "run_id": run_id, "end_date": T0 + dt.timedelta(minutes=30)}])
            conn.execute(insert(ti), [{"id": ti_id, "try_number": 1, "map_index": -1, "dag_version_id": "v1",
                                       "state": "success", "start_date": T0 + dt.timedelta(minutes=1),
                                       "end_date": T0 + dt.timedelta(minutes=1, seconds=10),
                                       "queued_dttm": T0 + dt.timedelta(seconds=59)}])
            row = _rec(ti_id=str(ti_id), run_id=run_id, task_id="extract", pool="cpu-small").row(T0)
            row["features"] = features
            conn.execute(insert(traces.placements), [row])
    with Session(engine) as session:
        runs = export_runs(session, load_catalogue(packaged_catalogue()), since=T0 - dt.timedelta(hours=1),
                           until=T0 + dt.timedelta(hours=1))
    assert [r.graph.run_key for r in runs] == ["etl/good"], "the bad run skipped (logged), the good one exported"


def test_a_nul_in_a_placements_text_is_replaced_before_the_db_sees_it() -> None:
    """PostgreSQL's text takes no NUL: psycopg2 raised a bare ValueError for a reason or a policy
    version holding one (both come from the policy server), out of the scheduler's heartbeat."""
    row = _rec(reason="a\x00b", policy_version="v\x00", features={"kind": "x\x00"}).row(T0)
    assert all("\x00" not in v for v in row.values() if isinstance(v, str))
    assert row["reason"] == "a\ufffdb" and traces.row_problem(row) is None


@pytest.mark.parametrize("change", [
    {"try_number": True}, {"map_index": 2**31}, {"score": "1"}, {"score": float("nan")}, {"fallback": 0},
    {"decided_at": dt.datetime(2026, 12, 6)}, {"ti_id": "not-a-uuid"}, {"features": {"kind": "x"}},
    {"reason": "a\x00"}, {"request_id": "x" * 65}, {"dag_id": None},
], ids=lambda c: next(iter(c)))
def test_row_problem_names_what_the_db_could_not_take(change: dict[str, Any]) -> None:
    row = {**_rec().row(T0), **change}
    problem = traces.row_problem(row)
    assert problem is not None and problem.startswith(next(iter(change)))
