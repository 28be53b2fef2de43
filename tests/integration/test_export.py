"""Placements recorded by the real stack become replay runs for fine-tuning."""

from __future__ import annotations

import datetime as dt

import pytest
from demo import Api
from localstack import Stack
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from airflow_drl_executor import traces
from airflow_drl_executor.export import export_runs
from policy.catalogue import load_catalogue
from policy.graph import view
from policy.replay import read_replay, write_replay

pytestmark = pytest.mark.integration

DAG = "drl_ml_pipeline"


def test_recorded_runs_export_as_replay(stack: Stack, api: Api, tmp_path) -> None:
    api.wait_dag(DAG)
    run_id = api.trigger(DAG)
    assert api.wait_run(DAG, run_id, timeout=240) == "success"
    catalogue = load_catalogue(stack.catalogue)
    engine = create_engine(stack.sql_conn)
    now = dt.datetime.now(dt.UTC)
    with Session(engine) as session:
        runs = export_runs(session, catalogue, since=now - dt.timedelta(hours=1), until=now)
        excluded = export_runs(session, catalogue, since=now - dt.timedelta(hours=1), until=now,
                               exclude_dags=[DAG])
        # the Placements page of a user who may read no DAG, on PostgreSQL (was: a 500, the empty
        # IN compared varchar with integer)
        assert session.execute(traces.outcomes_query(10, set())).all() == []
        assert session.execute(traces.outcomes_query(10, {DAG})).all()
    engine.dispose()
    ours = next(r for r in runs if r.graph.run_key == f"{DAG}/{run_id}")
    assert len(ours.graph.tasks) == 7 and len(ours.graph.edges) == 6
    train = next(t for t in ours.graph.tasks if t.task_id == "train")
    # ran ~2 s on the gpu pool, whose effective speed for gpu_train is 1.5 x 8 = 12
    assert train.kind == "gpu_train" and train.duration_s > 12
    assert view(ours.graph).critical_path_s > 0
    assert all(r.graph.run_key.split("/")[0] != DAG for r in excluded)
    path = tmp_path / "replay.jsonl"
    write_replay(path, runs)
    assert [r.graph.digest for r in read_replay(path)] == [r.graph.digest for r in runs]
