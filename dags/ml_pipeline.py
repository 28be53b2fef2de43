"""Sample ML pipeline DAG: a chain with checkpoint branches and one GPU-friendly training step.

``kind`` hints give the policy task-type affinity: a ``gpu_train`` task runs many times faster on
the GPU-class pool, a plain CPU task does not.
"""

from __future__ import annotations

import time

import pendulum
from airflow.sdk import dag, task


@dag(
    dag_id="drl_ml_pipeline",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["drl-demo"],
    default_args={"executor_config": {"drl": {"duration_s": 2, "cpus": 1, "memory_gb": 2}}},
)
def ml_pipeline() -> None:
    @task
    def fetch_data() -> str:
        time.sleep(0.5)
        return "s3://bucket/data"

    @task
    def validate(path: str) -> str:
        time.sleep(0.5)
        return path

    @task(executor_config={"drl": {"duration_s": 6, "cpus": 4, "memory_gb": 8}})
    def features(path: str) -> str:
        time.sleep(1.0)
        return path + "/features"

    @task(executor_config={"drl": {"duration_s": 40, "cpus": 4, "memory_gb": 16, "gpus": 1,
                                   "kind": "gpu_train"}})
    def train(feats: str) -> str:
        time.sleep(2.0)
        return "model-v1"

    @task
    def checkpoint(model: str) -> None:
        time.sleep(0.3)

    @task(executor_config={"drl": {"duration_s": 10, "cpus": 2, "memory_gb": 8, "kind": "inference"}})
    def evaluate(model: str) -> float:
        time.sleep(1.0)
        return 0.9

    @task
    def report(score: float) -> None:
        time.sleep(0.3)

    model = train(features(validate(fetch_data())))
    checkpoint(model)
    report(evaluate(model))


ml_pipeline()
