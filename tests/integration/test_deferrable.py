"""Deferrable tasks under real Airflow (a triggerer, PostgreSQL, Celery): they run through
DRLExecutor, and their duration history is their worker time, not their wait in the triggerer."""

from __future__ import annotations

import pytest
from demo import Api, placements
from localstack import Stack
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from airflow_drl_executor.graph_builder import GraphBuilder

pytestmark = pytest.mark.integration

DAG = "drl_deferrable_wait"
WAIT_S = 12  # dags/deferrable_wait.py


def test_a_deferred_task_is_placed_again_when_it_resumes_and_its_wait_is_not_its_duration(
        stack: Stack, api: Api) -> None:
    """was: no triggerer in the stack (a deferred task stayed deferred for ever), and a resumed
    try's ``duration`` (Airflow keeps its first start date) taken as its run time: ~7 s here, an
    hour for a task that waits an hour"""
    api.wait_dag(DAG)
    run_id = api.trigger(DAG)
    assert api.wait_run(DAG, run_id, timeout=240) == "success"
    engine = create_engine(stack.sql_conn)
    with engine.connect() as conn:
        placed = conn.execute(text(
            "SELECT task_id, try_number, fallback FROM drl_placement WHERE dag_id = :d AND run_id = :r "
            "ORDER BY id"), {"d": DAG, "r": run_id}).all()
        durations = dict(conn.execute(text(
            "SELECT task_id, duration FROM task_instance WHERE dag_id = :d AND run_id = :r"),
            {"d": DAG, "r": run_id}).all())
    # the resumed try is a second workload of the same try: placed again, as the first
    assert [(t, n) for t, n, _ in placed if t == "wait_for_export"] == [("wait_for_export", 1)] * 2
    assert sorted(t for t, _, _ in placed) == ["load", "settle", "wait_for_export", "wait_for_export"]
    assert not any(fallback for _, _, fallback in placed)
    assert all(r["state"] == "success" for r in placements(stack, [(DAG, run_id)]))
    assert durations["wait_for_export"] >= WAIT_S and durations["settle"] >= 2, durations
    gb = GraphBuilder(pool_names=("cpu-small", "cpu-large", "gpu"), default_queue="default",
                      default_duration_s=60, history_ttl_s=0)
    with Session(engine) as session:
        history = gb._durations(DAG, session)
    engine.dispose()
    ((_, seconds, n),) = history["wait_for_export"]
    assert n >= 1 and 1.0 <= seconds < WAIT_S, history  # its 1 s on the worker after the trigger
    assert "settle" not in history, "ended in the triggerer: its slot time is not recorded"
    assert "load" in history
