"""Sample DAG with deferrable tasks: wait for an upstream export without holding a worker slot,
then load it.

``wait_for_export`` defers to the triggerer and returns to a worker when its trigger fires (a
second placement of the same try: DRLExecutor places the resumed try again); ``settle`` ends in
the triggerer itself (``WaitSensor`` on Airflow 3). Their worker time is what the executor takes
as their duration, not the wait in the triggerer (``graph_builder.GraphBuilder._durations``).
Needs an ``airflow triggerer`` (the local stack and docker-compose run one).
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pendulum
from airflow.providers.standard.sensors.time_delta import WaitSensor
from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
from airflow.sdk import BaseOperator, dag, task

WAIT_S = 12


class WaitForExport(BaseOperator):
    """Defers until the export is due, then checks it on a worker."""

    def execute(self, context: Any) -> None:
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(seconds=WAIT_S)), method_name="check")

    def check(self, context: Any, event: Any = None) -> str:
        time.sleep(1.0)  # the worker-side part after the trigger fired
        return "export-ready"


@dag(
    dag_id="drl_deferrable_wait",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["drl-demo"],
    default_args={"executor_config": {"drl": {"duration_s": 1, "cpus": 1, "memory_gb": 1}}},
)
def deferrable_wait() -> None:
    @task
    def load(marker: str) -> int:
        return len(marker)

    waited = WaitForExport(task_id="wait_for_export")
    settle = WaitSensor(task_id="settle", time_to_wait=dt.timedelta(seconds=2), deferrable=True)
    waited >> settle
    load(waited.output) << settle


deferrable_wait()
