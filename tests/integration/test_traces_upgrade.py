"""An earlier release's drl_placement (ti_id as VARCHAR(36)) upgraded in place on real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from airflow.models.taskinstance import TaskInstance
from localstack import Stack
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, insert, inspect, text

from airflow_drl_executor import traces

pytestmark = pytest.mark.integration


def test_legacy_ti_id_column_becomes_uuid_and_joins(stack: Stack) -> None:
    admin = create_engine(stack.sql_conn.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("DROP DATABASE IF EXISTS drl_upgrade_test"))
        conn.execute(text("CREATE DATABASE drl_upgrade_test"))
    engine = create_engine(stack.sql_conn.rsplit("/", 1)[0] + "/drl_upgrade_test")
    try:
        meta = MetaData()
        ti = Table("task_instance", meta, Column("id", TaskInstance.__table__.c.id.type, primary_key=True),
                   Column("try_number", Integer), Column("state", String(20)), Column("hostname", String(100)),
                   Column("start_date", traces.placements.c.decided_at.type),
                   Column("end_date", traces.placements.c.decided_at.type))
        Table("task_instance_history", meta, Column("task_instance_id", ti.c.id.type),
              *[Column(c.name, c.type) for c in ti.columns if c.name != "id"])
        old = traces.placements.to_metadata(meta)
        old.c.ti_id.type = String(36)
        meta.create_all(engine)
        ids = [uuid.uuid4(), uuid.uuid4()]
        rec = traces.PlacementRecord(
            ti_id=str(ids[0]), dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1, pool="gpu",
            vm_class="x", score=0.0, reason="", fallback=False, policy="eft", policy_version="1",
            request_id="q", decision_ms=1.0, features={}, celery_id="c0")
        with engine.begin() as conn:
            conn.execute(insert(ti), [{"id": u, "try_number": 1, "state": "success", "hostname": "gpu@h"} for u in ids])
            conn.execute(insert(old), [rec.row(dt.datetime.now(dt.UTC))])
        traces.ensure_schema(engine)
        with engine.begin() as conn:
            (column,) = [c for c in inspect(conn).get_columns("drl_placement") if c["name"] == "ti_id"]
            assert str(column["type"]) == "UUID"
            traces.write(conn, [traces.PlacementRecord(**{**rec.__dict__, "ti_id": str(ids[1]), "celery_id": "c1"})])
            rows = list(conn.execute(traces.outcomes_query()))
            plan = "\n".join(r[0] for r in conn.execute(text(
                "EXPLAIN SELECT * FROM drl_placement p JOIN task_instance t ON t.id = p.ti_id")))
            sent = traces.sent_celery_ids(conn, ["c0", "c1", "c2"])
        assert [(r.state, r.hostname) for r in rows] == [("success", "gpu@h")] * 2
        assert sent == {"c0", "c1"}
        assert "::text" not in plan and "CAST" not in plan.upper(), plan
        traces.ensure_schema(engine)  # a second start: nothing left to upgrade
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text("DROP DATABASE IF EXISTS drl_upgrade_test"))
        admin.dispose()
