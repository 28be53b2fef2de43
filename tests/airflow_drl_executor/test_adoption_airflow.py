"""Adoption after a scheduler restart through Airflow's own scheduler code, on a real (SQLite)
metadata DB migrated by ``airflow db migrate``, in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "adopt_after_restart.py"
DIE = Path(__file__).parent / "scripts" / "die_with_unwritten.py"


def test_a_restarted_scheduler_adopts_what_its_predecessor_sent_and_reschedules_what_it_held(tmp_path: Path) -> None:
    """was: the executor's traces read went through Airflow's thread-local session, the
    scheduler's own adoption session: it was committed and closed under the scheduler, adoption
    raised DetachedInstanceError and the scheduler exited (at every restart, while a queued task
    was left). And: a scheduler killed while the DB refused its placement rows took them along
    (they waited in its memory): the next scheduler's adoption found no row for a task Celery
    held and sent it again; the rows now wait in a spool on disk too, taken over by the next
    executor started with that directory."""
    home = tmp_path / "airflow"
    env = {**os.environ, "AIRFLOW_HOME": str(home), "PYTHONPATH": str(REPO),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
           "AIRFLOW__CORE__EXECUTOR": "airflow_drl_executor.executor.DRLExecutor",
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_FOLDER": str(tmp_path / "dags"),
           # Celery's result tables in a file of their own: SQLite has one writer, and adoption
           # holds the metadata DB's write lock while Celery would create them there
           "AIRFLOW__CELERY__RESULT_BACKEND": f"db+sqlite:///{home / 'celery.db'}"}
    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    died = subprocess.run([sys.executable, str(DIE), "E-spooled"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert died.returncode == -9, died.stderr[-2000:]
    spool = home / "drl_executor" / "spool"
    assert [p.suffix for p in sorted(spool.iterdir())] == [".jsonl", ".lock"], "the dead executor's row, on disk"
    out = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"] == ""
    new_job = got["new_job"]
    assert got["states"]["held"][0] == "scheduled", "never sent: scheduled again, in the same try"
    assert got["states"]["sent"] == ["queued", new_job], "sent: adopted, Celery still holds it"
    assert got["states"]["run"] == ["running", new_job]
    assert got["states"]["spooled"] == ["queued", new_job], "sent while the DB was down: adopted, not sent again"
    assert got["adopted"] == ["run", "sent", "spooled"]
    assert got["recorded"] == ["E-sent", "E-spooled"], "the dead executor's row written by the next one"
    assert got["spool_files"] == [got["own_spool"] + ".lock"], "the dead executor's files gone, once written"
