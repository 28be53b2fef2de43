"""Sample ETL DAG: many sources extracted in parallel, transformed, joined in a hub, then loaded.

A fan-out/fan-in of 15 tasks. The ``executor_config={"drl": ...}`` hints tell DRLExecutor what each
task needs and how long it usually takes (history replaces the duration once the DAG has run).
"""

from __future__ import annotations

import time

import pendulum
from airflow.sdk import dag, task

SOURCES = ["orders", "customers", "payments", "inventory", "shipments", "returns"]


@dag(
    dag_id="drl_etl_fanout",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["drl-demo"],
    default_args={"executor_config": {"drl": {"duration_s": 2, "cpus": 1, "memory_gb": 2}}},
)
def etl_fanout() -> None:
    @task
    def start() -> str:
        return "batch-" + str(int(time.time()))

    @task
    def extract(source: str, batch: str) -> dict[str, str]:
        time.sleep(1.0)
        return {"source": source, "batch": batch}

    @task
    def transform(extracted: dict[str, str]) -> str:
        time.sleep(0.5)
        return extracted["source"]

    @task(executor_config={"drl": {"duration_s": 8, "cpus": 8, "memory_gb": 48}})
    def join(sources: list[str]) -> int:
        time.sleep(1.5)
        return len(sources)

    @task
    def load(rows: int) -> None:
        time.sleep(0.5)

    batch = start()
    transformed = [transform.override(task_id=f"transform_{s}")(
        extract.override(task_id=f"extract_{s}")(s, batch)) for s in SOURCES]
    load(join(transformed))


etl_fanout()
