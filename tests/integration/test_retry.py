"""A retried task under real Airflow: a new task-instance id per try, the first try's queue kept."""

from __future__ import annotations

import json

import pytest
from demo import Api
from localstack import Stack
from sqlalchemy import create_engine, text

pytestmark = pytest.mark.integration

DAG = "drl_retry_batch"


def _placed(stack: Stack, run_id: str) -> list[tuple[str, int, str, str, dict]]:
    engine = create_engine(stack.sql_conn)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT task_id, try_number, pool, reason, features FROM drl_placement "
                                 "WHERE dag_id = :d AND run_id = :r AND task_id = 'fetch' ORDER BY id"),
                            {"d": DAG, "r": run_id}).all()
    engine.dispose()
    return [(t, n, p, r, json.loads(f)) for t, n, p, r, f in rows]


def test_a_retry_is_placed_again_and_a_hooks_pin_holds_for_it(stack: Stack, api: Api) -> None:
    """was: earlier placements were looked up by task-instance id, which Airflow renews at every
    try: the retry looked never placed, and its queue (the executor's own choice for the first
    try) was taken for a mutation hook's pin"""
    api.wait_dag(DAG)
    free = api.trigger(DAG)
    pinned = api.trigger(DAG, conf={"drl_test_pin": "gpu"})  # the test stack's cluster policy
    for run_id in (free, pinned):
        assert api.wait_run(DAG, run_id, timeout=240) == "success"
    tries = _placed(stack, free)
    assert [n for _, n, _, _, _ in tries] == [1, 2]
    for _, n, _, reason, node in tries:
        assert "mutation_hook" not in reason and "pool" not in node, (n, reason, node)
    tries = _placed(stack, pinned)
    assert [(n, p) for _, n, p, _, _ in tries] == [(1, "gpu"), (2, "gpu")]
    assert all(node.get("pool") == "gpu" and "mutation_hook" in reason for _, _, _, reason, node in tries)
