"""A mapped task under real Airflow: each instance is its own node, placed on its own."""

from __future__ import annotations

import json

import pytest
from demo import Api, placements, ran_on_chosen_pool
from localstack import Stack
from sqlalchemy import create_engine, text

pytestmark = pytest.mark.integration

DAG = "drl_mapped_batch"
FILES = 8


def test_each_instance_of_a_mapped_task_is_placed_as_its_own_node(stack: Stack, api: Api) -> None:
    """was: the instances shared one node and one decision, and the policy counted one task where
    eight went to the pool"""
    api.wait_dag(DAG)
    run_id = api.trigger(DAG)
    assert api.wait_run(DAG, run_id, timeout=240) == "success"
    rows = placements(stack, [(DAG, run_id)])
    process = sorted((r for r in rows if r["task_id"] == "process"), key=lambda r: r["map_index"])
    assert [r["map_index"] for r in process] == list(range(FILES))
    assert {r["task_id"] for r in rows} == {"list_files", "process", "merge"} and len(rows) == FILES + 2
    for r in process:
        assert not r["fallback"], r["reason"]
        assert ran_on_chosen_pool(r), f"process[{r['map_index']}] placed on {r['pool']} ran on {r['hostname']}"
    engine = create_engine(stack.sql_conn)
    with engine.connect() as conn:  # the node the policy saw, as the placement recorded it
        nodes = {m: json.loads(f) for m, f in conn.execute(
            text("SELECT map_index, features FROM drl_placement WHERE dag_id = :d AND run_id = :r "
                 "AND task_id = 'process'"), {"d": DAG, "r": run_id})}
    engine.dispose()
    assert sorted(nodes) == list(range(FILES))
    for m, node in nodes.items():
        assert node["task_id"] == f"process[{m}]", "its own node"
        assert node["cpus"] == 2.0, "with its task's hints"
