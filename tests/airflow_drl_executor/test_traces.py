from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

import pytest
from airflow.models.taskinstance import TaskInstance
from airflow.models.taskinstancehistory import TaskInstanceHistory
from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, create_engine, insert
from sqlalchemy.engine import Engine

from airflow_drl_executor import traces

U1, U2 = uuid.uuid4(), uuid.uuid4()


def _airflow_tables(engine: Engine) -> None:
    """task_instance and its history with the id types Airflow declares (CHAR(32) on SQLite)."""
    meta = MetaData()

    def outcome() -> list[Column[object]]:
        return [Column("try_number", Integer), Column("start_date", DateTime), Column("end_date", DateTime),
                Column("state", String(20)), Column("hostname", String(100))]

    ti = Table("task_instance", meta, Column("id", TaskInstance.__table__.c.id.type), *outcome())
    Table("task_instance_history", meta,
          Column("task_instance_id", TaskInstanceHistory.__table__.c.task_instance_id.type), *outcome())
    meta.create_all(engine)
    with engine.begin() as conn:
        conn.execute(insert(ti), [{"id": U1, "try_number": 1, "state": "success", "hostname": "gpu@h"}])


def _record(ti_id: uuid.UUID, **changes: object) -> traces.PlacementRecord:
    rec = traces.PlacementRecord(
        ti_id=str(ti_id), dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1, pool="gpu",
        vm_class="gpu-a10", score=-1.0, reason="because", fallback=False, policy="eft", policy_version="1",
        request_id="q", decision_ms=3.2, features={"duration_s": 5.0}, celery_id="c1")
    return dataclasses.replace(rec, **changes)  # type: ignore[arg-type]


@pytest.fixture
def engine() -> Engine:
    engine = create_engine("sqlite://")
    _airflow_tables(engine)
    return engine


def test_records_are_written_and_joined_with_outcomes(engine: Engine) -> None:
    """was: joined on CAST(t.id AS VARCHAR(36)), which never matched the 32 hex digits Airflow's
    Uuid stores on SQLite: every placement showed no state, no host"""
    traces.ensure_schema(engine)
    traces.ensure_schema(engine)  # idempotent
    with engine.begin() as conn:
        traces.write(conn, [_record(U1)])
        rows = [dict(r._mapping) for r in conn.execute(traces.outcomes_query())]
    assert len(rows) == 1
    assert rows[0]["pool"] == "gpu" and rows[0]["state"] == "success" and rows[0]["hostname"] == "gpu@h"
    with engine.begin() as conn:
        traces.write(conn, [_record(U2, dag_id="payroll")])
        assert [r.dag_id for r in conn.execute(traces.outcomes_query())] == ["payroll", "d"]
        assert [r.dag_id for r in conn.execute(traces.outcomes_query(dag_ids={"d", "other"}))] == ["d"]
        assert list(conn.execute(traces.outcomes_query(dag_ids=set()))) == [], "no readable DAG: no rows"
        traces.write(conn, [_record(U2, celery_id="c2", try_number=2)])
        assert traces.sent_celery_ids(conn, ["c1", "c2", "c3"]) == {"c1", "c2"}


def legacy_table() -> Table:
    """drl_placement as the earlier release created it: ti_id the 36-character text of the UUID."""
    table = traces.placements.to_metadata(MetaData())
    table.c.ti_id.type = String(36)
    return table


def test_a_table_of_the_earlier_release_is_upgraded_in_place(engine: Engine) -> None:
    """its rows join after the upgrade, and new rows are written as this release writes them"""
    old = legacy_table()
    old.create(engine)
    with engine.begin() as conn:
        conn.execute(insert(old), [_record(U1).row(dt.datetime(2026, 12, 1, tzinfo=dt.UTC))])
        assert [r.state for r in conn.execute(traces.outcomes_query())] == [None], "the bug: no join"
    traces.ensure_schema(engine)
    with engine.begin() as conn:
        assert [r.state for r in conn.execute(traces.outcomes_query())] == ["success"]
        traces.write(conn, [_record(U2)])
        assert len(list(conn.execute(traces.outcomes_query()))) == 2
        assert traces.sent_celery_ids(conn, ["c1", "c9"]) == {"c1"}


def test_prune_deletes_only_what_is_older_than_the_cutoff_in_batches(engine: Engine) -> None:
    traces.ensure_schema(engine)
    t0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    with engine.begin() as conn:
        conn.execute(insert(traces.placements), [
            _record(uuid.uuid4(), task_id=f"t{i}").row(t0 + dt.timedelta(days=i)) for i in range(25)])
    assert traces.prune(engine, t0 + dt.timedelta(days=20), batch=7) == 20
    with engine.begin() as conn:
        left = sorted(r.task_id for r in conn.execute(traces.outcomes_query()))
    assert left == [f"t{i}" for i in range(20, 25)]
    assert traces.prune(engine, t0 + dt.timedelta(days=20)) == 0


@pytest.mark.parametrize("columns", [["decided_at"], ["dag_id", "run_id"], ["celery_id"]])
def test_an_earlier_table_gets_the_indexes_added_since(engine: Engine, columns: list[str]) -> None:
    old = legacy_table()
    for index in list(old.indexes):
        if index.columns.keys() == columns:
            old.indexes.discard(index)
    old.create(engine)
    from sqlalchemy import inspect
    assert not any(i["column_names"] == columns for i in inspect(engine).get_indexes("drl_placement"))
    traces.ensure_schema(engine)
    assert any(i["column_names"] == columns for i in inspect(engine).get_indexes("drl_placement"))


def test_placements_are_filtered_and_paged_back_to_the_first(engine: Engine) -> None:
    traces.ensure_schema(engine)
    recs = [_record(uuid.uuid4(), dag_id=f"d{i % 2}", run_id=f"r{i % 3}", task_id=f"t{i}",
                    pool="gpu" if i % 4 == 0 else "cpu-small", fallback=i % 5 == 0) for i in range(30)]
    with engine.begin() as conn:
        traces.write(conn, recs)

        def tasks(limit: int = 100, dag_ids: set[str] | None = None, **where: object) -> list[str]:
            query = traces.outcomes_query(limit, dag_ids, traces.PlacementFilter(**where))  # type: ignore[arg-type]
            return [r.task_id for r in conn.execute(query)]

        def expect(keep: object) -> list[str]:
            return [f"t{i}" for i in range(29, -1, -1) if keep(i)]  # type: ignore[operator]

        assert tasks(dag_id="d1") == expect(lambda i: i % 2 == 1)
        assert tasks(dag_id="d1", run_id="r0") == expect(lambda i: i % 2 == 1 and i % 3 == 0)
        assert tasks(task_id="t7") == ["t7"]
        assert tasks(pool="gpu") == expect(lambda i: i % 4 == 0)
        assert tasks(fallback=True) == expect(lambda i: i % 5 == 0)
        assert tasks(fallback=False, pool="gpu") == expect(lambda i: i % 4 == 0 and i % 5 != 0)
        assert tasks(dag_ids={"d0"}, dag_id="d1") == [], "a filter never widens what the user may read"
        assert tasks(dag_ids={"d0"}, pool="gpu") == expect(lambda i: i % 4 == 0)
        # paging back by the last id shown visits every row once, newest first
        seen: list[str] = []
        before = None
        while True:
            page = list(conn.execute(traces.outcomes_query(7, {"d0", "d1"}, traces.PlacementFilter(before_id=before))))
            seen += [r.task_id for r in page]
            if len(page) < 7:
                break
            before = page[-1].id
        assert seen == expect(lambda i: True)
    with pytest.raises(ValueError, match="before_id must be a placement id >= 1, got 0"):
        traces.PlacementFilter(before_id=0)


def test_last_placements_are_each_task_instances_latest_of_any_try_and_say_if_it_was_pinned(engine: Engine) -> None:
    """Airflow gives every try a new ti id. was: read by id, a retry looked never placed (and its
    queue, the executor's own last choice, was taken for a mutation hook's pin)"""
    traces.ensure_schema(engine)
    t0 = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)
    with engine.begin() as conn:
        conn.execute(insert(traces.placements), [
            _record(uuid.uuid4(), task_id="free", pool="gpu", features={"pool": "gpu"}).row(t0),  # try 1: pinned
            _record(uuid.uuid4(), task_id="free", try_number=2, pool="cpu-small").row(t0),  # its retry: placed freely
            _record(uuid.uuid4(), task_id="pinned", pool="cpu-large", features={"pool": "cpu-large", "cpus": 4}).row(t0),
            _record(uuid.uuid4(), task_id="fan", map_index=3, pool="gpu").row(t0),
            _record(uuid.uuid4(), task_id="free", run_id="other", pool="cpu-large").row(t0),
        ])
        got = traces.last_placements(conn, [("d", "r", "free", -1), ("d", "r", "pinned", -1), ("d", "r", "never", -1),
                                            ("d", "r", "fan", 3), ("d", "r", "fan", 4)])
    assert got == {("d", "r", "free", -1): traces.LastPlacement(2, "cpu-small", False),
                   ("d", "r", "pinned", -1): traces.LastPlacement(1, "cpu-large", True),
                   ("d", "r", "fan", 3): traces.LastPlacement(1, "gpu", False)}


def test_a_row_without_a_key_writes_null_there_and_not_the_others_rows_without_it() -> None:
    """was: an executemany took its columns from the first row: a first row without celery_id
    wrote every row of the batch without its Celery id (adoption then re-sent those tasks)"""
    from sqlalchemy import select

    engine = create_engine("sqlite://")
    traces.ensure_schema(engine)
    now = dt.datetime(2026, 12, 6, tzinfo=dt.UTC)
    first = _record(U1, celery_id=None).row(now)
    del first["celery_id"], first["waited_s"]
    with engine.begin() as conn:
        traces.write_rows(conn, [first, _record(U2, celery_id="c2").row(now)])
        got = conn.execute(select(traces.placements.c.celery_id).order_by(traces.placements.c.id)).scalars().all()
    assert got == [None, "c2"]
