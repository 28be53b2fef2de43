"""Sample batch DAG with dynamic task mapping: list a batch's files, process each in its own mapped
task instance, merge the results.

DRLExecutor places every instance of ``process`` on its own (each is a node of the run's graph,
``process[0]``, ``process[1]``, ...), so a wide map spreads over the pools as the policy sees fit
instead of following one decision made for the task.
"""

from __future__ import annotations

import time

import pendulum
from airflow.sdk import dag, task

FILES = 8


@dag(
    dag_id="drl_mapped_batch",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["drl-demo"],
    default_args={"executor_config": {"drl": {"duration_s": 1, "cpus": 1, "memory_gb": 1}}},
)
def mapped_batch() -> None:
    @task
    def list_files() -> list[str]:
        return [f"part-{i:02d}.csv" for i in range(FILES)]

    @task(executor_config={"drl": {"duration_s": 4, "cpus": 2, "memory_gb": 4}})
    def process(name: str) -> int:
        time.sleep(1.0)
        return len(name)

    @task
    def merge(sizes: list[int]) -> int:
        return sum(sizes)

    merge(process.expand(name=list_files()))


mapped_batch()
