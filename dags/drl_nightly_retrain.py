"""Nightly retraining of the placement policy, itself an Airflow DAG placed by DRLExecutor.

1. ``export_traces`` turns the last ``hours`` of recorded placements (the ``drl_placement`` table,
   joined with what happened) into a replay file: each DAG run's task graph with the durations
   that were observed, normalised to a speed-1 VM.
2. ``finetune`` (``drl-trainer finetune``) starts from the active checkpoint, imitates the best
   heuristic on those replayed runs (and the seed families) for at most ``minutes``, evaluates
   the candidate against the incumbent on held-out replayed runs in the simulator, and promotes it
   in the model registry only if it beats the incumbent; policy servers hot-reload it.

The DAG is tagged ``drl-exclude``: its own runs never become training data. It needs the
``drl_traces`` connection (the database holding ``drl_placement``, usually Airflow's own) and
``DRL_REGISTRY_DIR`` on the workers (the folder the policy servers watch).
"""

from __future__ import annotations

import datetime as dt
import os

import pendulum
from airflow.providers.standard.operators.bash import BashOperator
from airflow.sdk import dag, get_current_context, task

TRACES_DIR = os.environ.get("DRL_TRACES_DIR", "/tmp/drl-traces")


@dag(
    dag_id="drl_nightly_retrain",
    schedule="0 2 * * *",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    is_paused_upon_creation=True,  # an operator turns retraining on deliberately
    tags=["drl", "drl-exclude"],
    # extra_args: more drl-trainer finetune flags (e.g. a small evaluation for a smoke test)
    params={"hours": 24, "minutes": 10, "min_improvement": 0.01, "seed": 1, "extra_args": ""},
)
def drl_nightly_retrain() -> None:
    @task(executor_config={"drl": {"duration_s": 30, "cpus": 1, "memory_gb": 2}})
    def export_traces() -> str:
        from airflow.sdk import BaseHook
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        from airflow_drl_executor.config import packaged_catalogue
        from airflow_drl_executor.export import export_runs
        from policy.catalogue import load_catalogue
        from policy.replay import write_replay

        ctx = get_current_context()
        until = ctx.get("data_interval_end") or dt.datetime.now(dt.UTC)  # manual runs have none
        since = until - dt.timedelta(hours=float(ctx["params"]["hours"]))
        catalogue = load_catalogue(os.environ.get("AIRFLOW__DRL_EXECUTOR__CATALOGUE") or packaged_catalogue())
        uri = BaseHook.get_connection("drl_traces").get_uri()
        engine = create_engine(uri.replace("postgres://", "postgresql://", 1))  # SQLAlchemy's dialect name
        try:
            with Session(engine) as session:
                runs = export_runs(session, catalogue, since=since, until=until)
        finally:
            engine.dispose()
        os.makedirs(TRACES_DIR, exist_ok=True)
        path = os.path.join(TRACES_DIR, f"replay-{until:%Y%m%dT%H%M%S}.jsonl")
        n = write_replay(path, runs)
        print(f"exported {n} DAG runs ({since} .. {until}) to {path}")
        return path

    finetune = BashOperator(
        task_id="finetune",
        bash_command=(
            "drl-trainer finetune --replay {{ ti.xcom_pull(task_ids='export_traces') }}"
            " --registry \"${DRL_REGISTRY_DIR:?set DRL_REGISTRY_DIR on the workers}\""
            " --pools \"${AIRFLOW__DRL_EXECUTOR__CATALOGUE}\""
            " --minutes {{ params.minutes }} --min-improvement {{ params.min_improvement }}"
            " --seed {{ params.seed }}"
            " {{ params.extra_args }}"
        ),
        executor_config={"drl": {"duration_s": 600, "cpus": 4, "memory_gb": 8, "kind": "gpu_train"}},
    )
    export_traces() >> finetune


drl_nightly_retrain()
