from __future__ import annotations

import dataclasses

from sqlalchemy import create_engine, text

from airflow_drl_executor import traces


def test_records_are_written_and_joined_with_outcomes() -> None:
    engine = create_engine("sqlite://")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE task_instance (id VARCHAR(36), try_number INT, start_date TIMESTAMP, "
                          "end_date TIMESTAMP, state VARCHAR(20), hostname VARCHAR(100))"))
        conn.execute(text("CREATE TABLE task_instance_history (task_instance_id VARCHAR(36), try_number INT, "
                          "start_date TIMESTAMP, end_date TIMESTAMP, state VARCHAR(20), hostname VARCHAR(100))"))
        conn.execute(text("INSERT INTO task_instance VALUES ('u1', 1, NULL, NULL, 'success', 'gpu@h')"))
    traces.ensure_schema(engine)
    traces.ensure_schema(engine)  # idempotent
    rec = traces.PlacementRecord(
        ti_id="u1", dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1, pool="gpu",
        vm_class="gpu-a10", score=-1.0, reason="because", fallback=False, policy="eft", policy_version="1",
        request_id="q", decision_ms=3.2, features={"duration_s": 5.0}, celery_id="c1")
    with engine.begin() as conn:
        traces.write(conn, [rec])
        rows = [dict(r._mapping) for r in conn.execute(traces.outcomes_query())]
    assert len(rows) == 1
    assert rows[0]["pool"] == "gpu" and rows[0]["state"] == "success" and rows[0]["hostname"] == "gpu@h"
    with engine.begin() as conn:
        traces.write(conn, [dataclasses.replace(rec, dag_id="payroll", ti_id="u2")])
        assert [r.dag_id for r in conn.execute(traces.outcomes_query())] == ["payroll", "d"]
        assert [r.dag_id for r in conn.execute(traces.outcomes_query(dag_ids={"d", "other"}))] == ["d"]
        assert list(conn.execute(traces.outcomes_query(dag_ids=set()))) == [], "no readable DAG: no rows"
