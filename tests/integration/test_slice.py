"""The vertical slice, end to end on real processes: Airflow (api-server, scheduler,
dag-processor), PostgreSQL, Redis, three Celery workers and the policy server.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from demo import Api, placements, ran_on_chosen_pool
from localstack import Stack
from sqlalchemy import create_engine, text

pytestmark = pytest.mark.integration

DAG = "drl_etl_fanout"
#: [drl_executor] decision_timeout_ms and [scheduler] scheduler_heartbeat_sec of the stack (defaults)
DEADLINE_S = 0.2
HEARTBEAT_S = 5.0


def _task_instances(stack: Stack, run_id: str, dag_id: str = DAG) -> list[dict[str, Any]]:
    engine = create_engine(stack.sql_conn)
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT task_id, state, queue, hostname, queued_dttm, start_date FROM task_instance "
                 "WHERE dag_id = :d AND run_id = :r"),
            {"d": dag_id, "r": run_id},
        ).all()
    engine.dispose()
    return [dict(r._mapping) for r in rows]


def _run(stack: Stack, api: Api) -> tuple[str, list[dict[str, Any]]]:
    api.wait_dag(DAG)
    run_id = api.trigger(DAG)
    assert api.wait_run(DAG, run_id, timeout=240) == "success"
    return run_id, placements(stack, [(DAG, run_id)])


def test_every_task_runs_on_the_pool_the_policy_chose(stack: Stack, api: Api) -> None:
    run_id, rows = _run(stack, api)
    tis = {r["task_id"]: r for r in _task_instances(stack, run_id)}
    assert len(tis) == 15 and all(t["state"] == "success" for t in tis.values())
    assert {r["task_id"] for r in rows} == set(tis), "every task instance has a placement trace"
    for row in rows:
        assert not row["fallback"], row["reason"]
        assert row["policy"] and row["policy_version"]
        assert row["celery_id"], "the Celery task id is recorded at dispatch"
        assert ran_on_chosen_pool(row), f"{row['task_id']} placed on {row['pool']} ran on {row['hostname']}"
        assert tis[row["task_id"]]["queue"] == row["pool"], "task_instance.queue shows the chosen pool"
    # The 48 GB join cannot fit the 16 GB small-cpu VM class: a hard constraint, not a preference.
    join = next(r for r in rows if r["task_id"] == "join")
    assert join["pool"] != "cpu-small"


def test_fallback_when_the_policy_server_is_down(stack: Stack, api: Api) -> None:
    stack.kill("policy-server")
    try:
        run_id, rows = _run(stack, api)
    finally:
        stack.start_policy_server()
    tis = _task_instances(stack, run_id)
    assert len(rows) == len(tis) == 15
    for row in rows:
        assert row["fallback"], f"{row['task_id']} not marked as fallback"
        assert row["reason"].startswith("fallback ("), row["reason"]
        assert ran_on_chosen_pool(row)
        assert row["decision_ms"] <= DEADLINE_S * 1000 + 100, row["decision_ms"]
    # From queued (scheduler) to sent to Celery (executor): the policy's share of the wait. What
    # follows is the wait for a free worker slot of the chosen pool, which no placement avoids.
    queued_at = {ti["task_id"]: ti["queued_dttm"] for ti in tis}
    for row in rows:
        waited = (row["decided_at"] - queued_at[row["task_id"]]).total_seconds()
        assert waited <= DEADLINE_S + HEARTBEAT_S, f"{row['task_id']} waited {waited:.1f}s before dispatch"


ML = "drl_ml_pipeline"


def _log_says(path: Path, since: int, text: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with path.open("rb") as f:
            f.seek(since)
            if text.encode() in f.read():
                return
        time.sleep(0.5)
    raise AssertionError(f"{path.name} did not say {text!r} within {timeout:.0f}s")


def test_a_pool_whose_worker_died_gets_only_the_tasks_no_other_pool_may_run(stack: Stack, api: Api) -> None:
    """With the GPU pool's only Celery worker killed, the executor marks the pool down: the ETL
    run (which sends a third of its tasks to the GPU pool when it is up) finishes on the other
    pools, and the ML run's ``train`` (gpus=1: no other pool may run it) is queued on the GPU
    pool and waits there, not sent to a CPU box; it runs once the worker is back."""
    log = stack.logs / "scheduler.log"
    since = log.stat().st_size
    stack.kill("worker-gpu")
    try:
        _log_says(log, since, "no live Celery worker consumes queue 'gpu'", 60)
        api.wait_dag(DAG)
        api.wait_dag(ML)
        etl, ml = api.trigger(DAG), api.trigger(ML)
        assert api.wait_run(DAG, etl, timeout=240) == "success"
        rows = placements(stack, [(DAG, etl)])
        assert len(rows) == 15 and all(r["pool"] != "gpu" and ran_on_chosen_pool(r) for r in rows), \
            [(r["task_id"], r["pool"]) for r in rows]
        end = time.monotonic() + 120
        while not (train := [r for r in placements(stack, [(ML, ml)]) if r["task_id"] == "train"]):
            assert time.monotonic() < end, "train was never placed"
            time.sleep(1)
        assert train[0]["pool"] == "gpu", train[0]["reason"]
        time.sleep(3)
        state = {t["task_id"]: t["state"] for t in _task_instances(stack, ml, ML)}
        assert state["train"] == "queued", state
    finally:
        since = log.stat().st_size
        stack.start("worker-gpu")
    _log_says(log, since, "pool 'gpu' is back", 60)
    assert api.wait_run(ML, ml, timeout=240) == "success"
    assert all(ran_on_chosen_pool(r) for r in placements(stack, [(ML, ml)]))
