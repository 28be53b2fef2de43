"""Sample DAG with a retried task: ``fetch`` fails its first try (a transient error, as a flaky
source gives) and succeeds on its retry; ``load`` follows.

Airflow gives each try a new task-instance id and keeps the queue DRLExecutor wrote for the
first try; the retry is placed again by the policy (not pinned to that queue), and reaches it as
a retry (``try_number`` 2 since the last clear).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pendulum
from airflow.sdk import dag, task

FIRST_TRY_FAILS = "transient error on the first try"


@dag(
    dag_id="drl_retry_batch",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["drl-demo"],
    default_args={"executor_config": {"drl": {"duration_s": 1, "cpus": 1, "memory_gb": 1}}},
)
def retry_batch() -> None:
    @task(retries=1, retry_delay=dt.timedelta(seconds=1))
    def fetch(**context: Any) -> int:
        ti = context["ti"]
        # the first try since the last clear: a clear leaves try_number as it was and sets
        # max_tries to it plus retries (found by review: a cleared run's fetch never failed)
        if ti.try_number == ti.max_tries - ti.task.retries + 1:
            raise RuntimeError(FIRST_TRY_FAILS)
        return 42

    @task
    def load(rows: int) -> int:
        return rows

    load(fetch())


retry_batch()
