"""``airflow drl-executor check`` on the real stack: every part a deployment needs answers."""

from __future__ import annotations

import json

import pytest
from demo import deployment_check
from localstack import Stack

pytestmark = pytest.mark.integration


def test_the_check_finds_the_stack_ready_to_place(stack: Stack) -> None:
    proc = deployment_check(stack, output="json")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    found = {f["check"]: f for f in json.loads(proc.stdout[proc.stdout.index("["):])}
    for name in ("config", "executor", "limits", "redis", "policy servers", "round trip", "workers", "spool"):
        assert found[name]["status"] == "ok", found[name]
    # Airflow's limits from the real metadata database: default_pool and the DAGs' own limits
    assert "default_pool slots 128" in found["limits"]["detail"], found["limits"]
    assert "active DAG(s) read" in found["limits"]["detail"], found["limits"]
    assert found["traces"]["status"] in ("ok", "warn")  # warn: no placement yet in this session
    # the stack's policy server serves the packaged GNN checkpoint, and placed the probe on a pool
    assert "drl:" in found["policy servers"]["detail"] and "drl " in found["round trip"]["detail"]
    assert " -> " in found["round trip"]["detail"]
    for pool in ("cpu-small 1", "cpu-large 1", "gpu 1"):
        assert pool in found["workers"]["detail"]
