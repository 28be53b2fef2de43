"""The test stack's cluster policy (copied into its ``$AIRFLOW_HOME/config``): a
``task_instance_mutation_hook`` that queues every task instance of a run triggered with
``{"drl_test_pin": "<queue>"}`` on that queue, as platform teams route tasks with cluster
policies. Runs without that conf are left alone."""

from __future__ import annotations

from typing import Any


def task_instance_mutation_hook(task_instance: Any, dag_run: Any = None) -> None:
    conf = getattr(dag_run, "conf", None) or {}
    queue = conf.get("drl_test_pin") if isinstance(conf, dict) else None
    if isinstance(queue, str) and queue:
        task_instance.queue = queue
