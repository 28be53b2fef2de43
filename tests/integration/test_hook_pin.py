"""A task_instance_mutation_hook's queue is a pin under real Airflow (the test stack's cluster
policy, tests/integration/airflow_local_settings.py)."""

from __future__ import annotations

import pytest
from demo import Api, placements, ran_on_chosen_pool
from localstack import Stack

pytestmark = pytest.mark.integration

DAG = "drl_etl_fanout"
PIN = "cpu-small"


def test_a_mutation_hooks_queue_pins_the_task_to_that_pool(stack: Stack, api: Api) -> None:
    """was: a pin was read from the DAG only: the policy placed the hook's tasks wherever it saw
    fit (the fan-out's tasks spread over the pools)"""
    api.wait_dag(DAG)
    run_id = api.trigger(DAG, conf={"drl_test_pin": PIN})
    assert api.wait_run(DAG, run_id, timeout=240) == "success"
    rows = placements(stack, [(DAG, run_id)])
    assert len(rows) == 15
    for r in rows:
        assert "task_instance_mutation_hook" in r["reason"], r["reason"]
        assert ran_on_chosen_pool(r), f"{r['task_id']} ran on {r['hostname']}"
        if r["task_id"] == "join":  # 8 CPUs, 48 GB: a hard constraint outranks a pin, as for a DAG's
            assert r["pool"] != PIN and "placed off its pin" in r["reason"], r["reason"]
        else:
            assert r["pool"] == PIN, f"{r['task_id']} placed on {r['pool']}: {r['reason']}"
