"""The executor's metrics on the real stack: the scheduler sends them through Airflow's own StatsD
client ([metrics] statsd_on) to the test's UDP socket, next to Airflow's own."""

from __future__ import annotations

import socket
import time
from collections import Counter

import pytest
from demo import Api
from localstack import Stack
from sqlalchemy import create_engine, text

pytestmark = pytest.mark.integration

DAG = "drl_etl_fanout"


def test_the_scheduler_sends_the_executors_metrics_to_statsd(stack: Stack, api: Api) -> None:
    """Every placement of a run is counted on its pool, and each heartbeat's placement step is
    timed, in the same stream as Airflow's own scheduler metrics (was: no executor metric)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", stack.ports.statsd))
    sock.settimeout(0.5)
    lines: list[str] = []
    try:
        api.wait_dag(DAG)
        run_id = api.trigger(DAG)
        end = time.monotonic() + 240
        state = ""
        while time.monotonic() < end:
            try:
                lines.extend(sock.recv(65536).decode().splitlines())
            except TimeoutError:
                state = api.call("GET", f"/api/v2/dags/{DAG}/dagRuns/{run_id}")["state"]
                if state in ("success", "failed"):
                    break
        for _ in range(20):  # what the scheduler sent after the run ended
            try:
                lines.extend(sock.recv(65536).decode().splitlines())
            except TimeoutError:
                break
    finally:
        sock.close()
    assert state == "success"
    engine = create_engine(stack.sql_conn)
    with engine.connect() as conn:
        placed = Counter(p for (p,) in conn.execute(
            text("SELECT pool FROM drl_placement WHERE dag_id = :d AND run_id = :r"), {"d": DAG, "r": run_id}))
    engine.dispose()
    assert sum(placed.values()) >= 5
    counted = Counter()
    for line in lines:
        name, _, value = line.partition(":")
        if name.startswith("airflow.drl_executor.placements.") and value.endswith("|c"):
            counted[name.rsplit(".", 1)[1]] += int(value.split("|")[0])
    for pool, n in placed.items():  # at least: another test's run may place meanwhile
        assert counted[pool] >= n, (pool, counted, placed)
    assert any(line.startswith("airflow.drl_executor.placement_time:") and line.endswith("|ms") for line in lines)
    assert any(line.startswith("airflow.scheduler_heartbeat:") for line in lines), "Airflow's own, same client"
