"""A task a user clears and re-runs under real Airflow reaches the policy as a first try."""

from __future__ import annotations

import time

import pytest
from demo import Api
from localstack import Stack
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from airflow_drl_executor.graph_builder import GraphBuilder, ReadyInstance

pytestmark = pytest.mark.integration

DAG = "drl_etl_fanout"
TASK = "load"


def test_a_cleared_task_is_sent_as_its_first_try_since_the_clear(stack: Stack, api: Api) -> None:
    """Airflow raises ``try_number`` when a cleared task runs again. was: sent as it, so the
    policy read a cleared task as a retry after a failure (its ``retry`` input)"""
    api.wait_dag(DAG)
    run_id = api.trigger(DAG)
    assert api.wait_run(DAG, run_id, timeout=240) == "success"
    api.call("POST", f"/api/v2/dags/{DAG}/clearTaskInstances",
             {"dry_run": False, "task_ids": [TASK], "dag_run_id": run_id, "only_failed": False,
              "reset_dag_runs": True})
    engine = create_engine(stack.sql_conn)
    query = text("SELECT try_number, max_tries, state, dag_version_id FROM task_instance "
                 "WHERE dag_id = :d AND run_id = :r AND task_id = :t")
    deadline = time.monotonic() + 240
    while True:
        with engine.connect() as conn:
            try_number, max_tries, state, version = conn.execute(query, {"d": DAG, "r": run_id, "t": TASK}).one()
        if try_number >= 2 and state == "success":
            break
        assert time.monotonic() < deadline, f"{TASK} not re-run after the clear: try {try_number}, {state}"
        time.sleep(1.0)
    with engine.connect() as conn:
        placed = conn.execute(text("SELECT try_number FROM drl_placement WHERE dag_id = :d AND run_id = :r "
                                   "AND task_id = :t ORDER BY id"), {"d": DAG, "r": run_id, "t": TASK}).scalars().all()
    assert placed == [1, 2], "the cleared task was placed again, as Airflow's try 2"
    gb = GraphBuilder(pool_names=("cpu-small", "cpu-large", "gpu"), default_queue="default",
                      default_duration_s=60, history_ttl_s=0)
    with Session(engine) as session:  # what the executor sent for that try, from the DB as Airflow left it
        batch = gb.build([ReadyInstance(DAG, run_id, TASK, try_number, str(version))], session)
    engine.dispose()
    assert (try_number, max_tries) == (2, 1)  # a clear sets max_tries to the try number then + retries (0)
    assert [t.try_number for t in batch.ready] == [1]
