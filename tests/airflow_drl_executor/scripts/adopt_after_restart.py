"""Airflow 3.3's own adopt_or_reset_orphaned_tasks with DRLExecutor, on a migrated metadata DB
(run by tests/airflow_drl_executor/test_adoption_airflow.py in a private AIRFLOW_HOME): a dead
scheduler left four task instances on a pool: one held (never sent to Celery), one sent (its
placement recorded with its Celery id), one sent while the DB refused its row (in the dead
executor's spool: die_with_unwritten.py), one running. Prints a JSON line of what became of them."""

from __future__ import annotations

import datetime as dt
import json
import types
import uuid

from airflow import settings
from airflow.jobs.job import Job
from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
from airflow.utils.session import create_session
from sqlalchemy import text

from airflow_drl_executor import traces
from airflow_drl_executor.executor import DRLExecutor

engine = settings.engine
now = dt.datetime.now(dt.UTC)
old = now - dt.timedelta(hours=1)
with engine.begin() as c:
    c.execute(text("INSERT INTO dag_bundle (name, active) VALUES ('b', 1)"))
    c.execute(text("INSERT INTO dag (dag_id, is_paused, is_stale, exceeds_max_non_backfill, bundle_name, "
                   "timetable_type, timetable_partitioned, timetable_periodic, partition_mapper_info, "
                   "max_active_tasks, max_consecutive_failed_dag_runs, has_task_concurrency_limits, fail_fast) "
                   "VALUES ('etl', 0, 0, 0, 'b', '', 0, 0, '{}', 16, 0, 0, 0)"))
    c.execute(text("INSERT INTO dag_run (id, dag_id, run_id, run_type, run_after, clear_number, span_status, state) "
                   "VALUES (1, 'etl', 'run1', 'manual', :n, 0, 'not_started', 'running')"), {"n": now})
    c.execute(text("INSERT INTO job (id, job_type, state, latest_heartbeat, start_date) "
                   "VALUES (1, 'SchedulerJob', 'running', :o, :o)"), {"o": old})
    for task, state, celery_id in (("held", "queued", "E-held"), ("sent", "queued", "E-sent"),
                                   ("spooled", "queued", "E-spooled"), ("run", "running", "E-run")):
        c.execute(text("INSERT INTO task_instance (id, task_id, dag_id, run_id, map_index, try_number, max_tries, "
                       "pool, pool_slots, span_status, state, queue, queued_by_job_id, external_executor_id, "
                       "priority_weight, queued_dttm) VALUES (:id, :t, 'etl', 'run1', -1, 1, 0, 'default_pool', 1, "
                       "'not_started', :s, 'cpu-large', 1, :e, 1, :q)"),
                  {"id": uuid.uuid4().hex, "t": task, "s": state, "e": celery_id, "q": old})
traces.ensure_schema(engine)
with engine.begin() as c:
    traces.write(c, [traces.PlacementRecord(
        ti_id=str(uuid.uuid4()), dag_id="etl", run_id="run1", task_id="sent", map_index=-1, try_number=1,
        pool="cpu-large", vm_class="large-cpu", score=0.0, reason="r", fallback=False, policy="p", policy_version="1",
        request_id="q", decision_ms=1.0, features={}, celery_id="E-sent")])

executor = DRLExecutor()
executor._open_spool()  # what start() does
executor.bulk_state_fetcher = types.SimpleNamespace(get_many=lambda rs: {r.task_id: ("PENDING", None) for r in rs})
with create_session() as s:
    job = Job(job_type="SchedulerJob", state="running")
    job.latest_heartbeat = now
    s.add(job)
    s.flush()
runner = SchedulerJobRunner(job=job, executors=[executor])
error = ""
try:
    runner.adopt_or_reset_orphaned_tasks()
except Exception as exc:  # noqa: BLE001 - reported, the test asserts there was none
    error = f"{type(exc).__name__}: {exc}"[:300]
with engine.connect() as c:
    states = {t: [s, q] for t, s, q in c.execute(text("SELECT task_id, state, queued_by_job_id FROM task_instance"))}
    recorded = sorted(r[0] for r in c.execute(text("SELECT celery_id FROM drl_placement")))
spool = executor._spool.dir if executor._spool else None
print(json.dumps({"error": error, "states": states, "new_job": job.id, "recorded": recorded,
                  "adopted": sorted(k[1] for k in executor.running),
                  "spool_files": sorted(p.name for p in spool.iterdir()) if spool else None,
                  "own_spool": executor._spool.name if executor._spool else None}))
