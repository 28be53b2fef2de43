"""A scheduler's DRLExecutor that places a task while the metadata DB refuses writes, publishes
it, and is killed (SIGKILL) before the DB is back (run by
tests/airflow_drl_executor/test_adoption_airflow.py before adopt_after_restart.py, in the same
AIRFLOW_HOME). Its placement row, with the Celery id argv[1], can only be in its spool."""

from __future__ import annotations

import os
import signal
import sys
import types
import uuid

from sqlalchemy.exc import OperationalError

from airflow_drl_executor import traces
from airflow_drl_executor.executor import DRLExecutor


def refuse(conn, rows):  # type: ignore[no-untyped-def]
    raise OperationalError("INSERT INTO drl_placement", {}, Exception("server closed the connection unexpectedly"))


traces.write_rows = refuse
executor = DRLExecutor()
executor._open_spool()  # what start() does
rec = traces.PlacementRecord(
    ti_id=str(uuid.uuid4()), dag_id="etl", run_id="run1", task_id="spooled", map_index=-1, try_number=1,
    pool="cpu-large", vm_class="large-cpu", score=0.0, reason="r", fallback=False, policy="p", policy_version="1",
    request_id="q", decision_ms=1.0, features={}, celery_id=None)
workload = types.SimpleNamespace(ti=types.SimpleNamespace(external_executor_id=sys.argv[1]))
executor._record_before_send([("key", rec)], {"key": workload})
assert executor._unwritten, "the DB refused the row"
os.kill(os.getpid(), signal.SIGKILL)  # dies after the publish, before the DB takes the row
