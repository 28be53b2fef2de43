"""``airflow drl-executor check`` against a real redis-server and an in-process policy server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from airflow.executors.executor_utils import ExecutorName

from airflow_drl_executor.check import FAIL, OK, WARN, Finding, check_executor, run_checks
from airflow_drl_executor.spool import Spool
from policy.catalogue import PACKAGED_CATALOGUES
from policy.server import PolicyServer
from policy.transport import redacted_url

DRL = "airflow_drl_executor.DRLExecutor"

LIVE = {"w1": [{"name": "cpu-small"}], "w2": [{"name": "cpu-large"}, {"name": "x"}], "w3": [{"name": "gpu"}]}


class Conf:
    def __init__(self, values: dict[tuple[str, str], str]) -> None:
        self.values = values

    def get(self, section: str, key: str, fallback: object = None) -> object:
        return self.values.get((section, key), fallback)


def conf(redis_url: str, tmp_path: Path, **drl: str) -> Conf:
    values = {("core", "executor"): "DRLExecutor:airflow_drl_executor.DRLExecutor",
              ("drl_executor", "redis_url"): redis_url, ("drl_executor", "key_prefix"): "t",
              ("drl_executor", "spool_dir"): str(tmp_path / "spool")}
    values.update({("drl_executor", k): v for k, v in drl.items()})
    return Conf(values)


def by_name(found: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in found}


def checks(conf: Conf, workers: Callable[[], Any] | None = lambda: LIVE) -> dict[str, Finding]:
    """Every check but the trace table's, with [core] executor = DRLExecutor alone."""
    return by_name(run_checks(conf, workers=workers, database=False,
                              executor_names=lambda: [ExecutorName(DRL, alias="DRLExecutor")]))


def test_a_working_setup_is_ok_throughout(redis_url: str, tmp_path: Path,
                                          policy_server: Callable[..., PolicyServer]) -> None:
    policy_server()
    found = checks(conf(redis_url, tmp_path))
    assert list(found) == ["config", "executor", "limits", "redis", "policy servers", "round trip", "workers",
                           "spool"]
    assert {f.status for f in found.values()} == {OK}, found
    assert "c0 eft:" in found["policy servers"].detail and "on cpu" in found["policy servers"].detail
    # the hold bounds the executor will use, max_hold_s derived from the scheduler's timeout
    assert "holds: max_wait_s 60 s with a free slot, max_hold_s 300 s in all (task_queued_timeout 600 s)" \
        in found["config"].detail
    assert "extract -> " in found["round trip"].detail  # a real placement of the probe request
    assert "cpu-small 1, cpu-large 1, gpu 1" in found["workers"].detail


def test_no_server_a_wrong_password_and_a_missing_worker_are_reported(
        redis_url: str, tmp_path: Path, policy_server: Callable[..., PolicyServer]) -> None:
    found = checks(conf(redis_url, tmp_path), workers=lambda: {"w1": [{"name": "gpu"}]})
    assert found["policy servers"].status == FAIL and "no heartbeat" in found["policy servers"].detail
    assert "round trip" not in found  # nothing to ask
    assert found["workers"].status == WARN and "marked down: cpu-small, cpu-large" in found["workers"].detail
    # another prefix than the servers': no server either (a typo shows here, not as silent fallbacks)
    policy_server()
    found = checks(conf(redis_url, tmp_path, key_prefix="other"))
    assert found["policy servers"].status == FAIL and "'other'" in found["policy servers"].detail
    # a password the private redis-server does not take (it requires one): the URL's, redacted
    scheme, rest = redis_url.split("://", 1)
    wrong = f"{scheme}://:nope@{rest.split('@', 1)[-1]}"
    found = checks(conf(wrong, tmp_path))
    assert found["redis"].status == FAIL and "nope" not in found["redis"].detail and ":***@" in found["redis"].detail
    assert "policy servers" not in found


def test_a_config_the_executor_would_refuse_stops_the_checks(redis_url: str, tmp_path: Path) -> None:
    bad = conf(redis_url, tmp_path, max_wait_s="900")  # above [scheduler] task_queued_timeout's 600
    found = list(checks(bad).values())
    assert [(f.check, f.status) for f in found] == [("config", FAIL), ("executor", OK)]
    assert "task_queued_timeout" in found[0].detail
    found = list(checks(conf(redis_url, tmp_path, catalogue=str(tmp_path / "none.yaml"))).values())
    assert found[0].status == FAIL and "none.yaml" in found[0].detail


def test_rows_waiting_in_the_spool_and_an_unwritable_spool(redis_url: str, tmp_path: Path,
                                                           policy_server: Callable[..., PolicyServer]) -> None:
    policy_server()
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / "host-1.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    (tmp_path / "spool" / "host-1.rejected.jsonl").write_text('{"a": 3}\n')  # set aside: not waiting
    found = checks(conf(redis_url, tmp_path))
    assert found["spool"].status == WARN and "2 placement row(s) and 0 not-sent" in found["spool"].detail
    # a process's not-sent marks wait for the database too (found by review: "nothing waiting")
    spool = Spool(tmp_path / "spool")
    spool.save([], unsent={("c1", "r1"), ("c2", "r2")})
    found = checks(conf(redis_url, tmp_path))
    assert "2 placement row(s) and 2 not-sent mark(s)" in found["spool"].detail
    spool.close()
    (tmp_path / "file").write_text("")
    found = checks(conf(redis_url, tmp_path, spool_dir=str(tmp_path / "file" / "spool")))
    # the executor runs on without a spool (rows in memory only): degraded, not failed
    assert found["spool"].status == WARN and "not writable" in found["spool"].detail


def test_the_airflow_command_prints_json_and_exits_1_on_a_failure(tmp_path: Path) -> None:
    """Through Airflow's own CLI (the provider's get_cli_commands): no Redis at that URL."""
    env = {"AIRFLOW_HOME": str(tmp_path), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
           "AIRFLOW__CORE__EXECUTOR": "DRLExecutor:airflow_drl_executor.DRLExecutor",
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__DRL_EXECUTOR__REDIS_URL": "redis://127.0.0.1:1/0",
           "AIRFLOW__CELERY__BROKER_URL": "redis://127.0.0.1:1/0"}
    proc = subprocess.run([str(Path(sys.executable).parent / "airflow"), "drl-executor", "check", "--output",
                           "json", "--timeout", "0.5"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    found: list[dict[str, Any]] = json.loads(proc.stdout[proc.stdout.index("["):])
    status = {f["check"]: f["status"] for f in found}
    assert status["config"] == OK and status["executor"] == OK and status["redis"] == FAIL


def test_the_executor_setting_as_airflow_reads_it() -> None:
    """Found by review: a substring test took a typo'd class, DRLExecutor behind another default and a
    plain CeleryExecutor aliased DRLExecutor for ok."""
    celery = "airflow.providers.celery.executors.celery_executor.CeleryExecutor"
    cases = [
        ([ExecutorName(DRL, alias="DRLExecutor")], OK, "is the default executor"),
        ([ExecutorName("airflow_drl_executor.DRLExecuter", alias="DRLExecutor")], FAIL, "DRLExecuter"),
        ([ExecutorName(celery, alias="CeleryExecutor"), ExecutorName(DRL, alias="DRLExecutor")], WARN,
         "only tasks that name it"),
        ([ExecutorName(celery, alias="DRLExecutor")], WARN, "not in use"),
        ([ExecutorName(DRL, team_name="team_a")], WARN, "names no executor"),
    ]
    for names, status, text in cases:
        found = check_executor(lambda names=names: names)
        assert found.status == status and text in found.detail, (names, found)
    assert check_executor(lambda: [ExecutorName(DRL, team_name="team_a")], team="team_a").status == OK


def test_pools_that_may_scale_to_zero_are_not_reported_down(redis_url: str, tmp_path: Path) -> None:
    """Found by review: every pool without a live worker was called marked down, where the executor
    keeps a pool with min_workers 0 up; with the liveness check off it asked the workers all the same."""
    cat = str(PACKAGED_CATALOGUES / "gpu-affinity.yaml")
    found = checks(conf(redis_url, tmp_path, catalogue=cat), workers=lambda: {"w": [{"name": "cpu-small"}]})
    assert found["workers"].status == OK, found["workers"]

    def never() -> Any:
        raise AssertionError("no broadcast with the check off")

    found = checks(conf(redis_url, tmp_path, pool_check_interval_s="0"), workers=never)
    assert found["workers"].status == OK and "no liveness check" in found["workers"].detail


def test_secrets_stay_out_of_urls_shown() -> None:
    """Found by review: a password in the query, or holding an @, was shown."""
    assert redacted_url("redis://127.0.0.1:1/0?password=hunter2&db=1") == "redis://127.0.0.1:1/0?password=***&db=1"
    assert redacted_url("redis://:p@ss@host:6379/0") == "redis://:***@host:6379/0"
    assert redacted_url("unix:///run/redis.sock?password=x") == "unix:///run/redis.sock?password=***"
    assert redacted_url("rediss://svc:s3cret@h/0") == "rediss://svc:***@h/0"
    assert redacted_url("redis://s3cret@h/0") == "redis://***@h/0"
    assert redacted_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redacted_url("redis://:ab/cd+ef=@host:6379/0") == "redis://:***@host:6379/0"  # a "/" in a password
    assert redacted_url("redis://:ab#cd@host/0") == "redis://:***@host/0"
    assert redacted_url("redis://:pw@[::1]:6379/0") == "redis://:***@[::1]:6379/0"
    assert redacted_url("not a url") == "<a Redis URL that does not parse>"


def test_each_servers_objective_is_shown_and_replicas_that_disagree_are_a_warning(redis_url: str,
                                                                                  tmp_path: Path) -> None:
    """Replicas reading different registries (one seeded for the SLA model, one for the mean) place
    one DAG run's tasks for different objectives: said, as a server's heartbeat reports it."""
    import redis

    from airflow_drl_executor.check import check_servers
    from airflow_drl_executor.config import ExecutorConfig
    from policy.transport import Keys

    r = redis.Redis.from_url(redis_url)
    cfg = ExecutorConfig.from_conf(conf(redis_url, tmp_path))
    now = float(r.time()[0])

    def beat(name: str, **doc: object) -> None:
        r.hset(Keys("t").heartbeat, name, json.dumps({"ts": now, "version": "drl:v", "device": "cpu", **doc}))

    beat("a", objective="sla_violation_rate")
    beat("b")  # a heuristic-only server names none
    found = check_servers(cfg, r)
    assert found.status == OK and "a drl:v for sla_violation_rate on cpu" in found.detail, found
    beat("c", objective="mean_jct")
    found = check_servers(cfg, r)
    assert found.status == WARN and "different objectives (mean_jct, sla_violation_rate)" in found.detail, found
    r.hdel(Keys("t").heartbeat, "c")
    beat("a", objective="unknown")
    found = check_servers(cfg, r)
    assert found.status == WARN and "does not say a valid objective" in found.detail, found
    beat("a", objective="mean_jct", objective_given="sla_violation_rate")
    found = check_servers(cfg, r)
    assert found.status == WARN and "a was started with --objective sla_violation_rate" in found.detail, found
    r.close()


def _limits(values: dict[tuple[str, str], str],
            read_db: Callable[[], tuple[int | None, dict[str, int]]] | None) -> Finding:
    from airflow_drl_executor.check import check_limits
    from policy.catalogue import load_catalogue

    return check_limits(Conf(values), load_catalogue("policy/catalogues/gpu-affinity.yaml"), read_db)


WIDE = {("core", "max_active_tasks_per_dag"): "64", ("core", "parallelism"): "64"}


def test_airflow_limits_below_the_worker_slots_are_a_warning() -> None:
    """Airflow's defaults (16 tasks of a run, 128 default_pool slots, parallelism 32) against the
    GPU-affinity cluster's 28 slots at max_workers: the per-run limit keeps the policy from most of
    a wide run's ready tasks (in the lab: the rules 12-55% slower held out)."""
    found = _limits({}, lambda: (128, {}))
    assert found.status == WARN
    assert "[core] max_active_tasks_per_dag 16" in found.detail and "28 worker slots" in found.detail
    assert "raise [core] max_active_tasks_per_dag to at least 28" in found.detail
    ok = _limits({("core", "max_active_tasks_per_dag"): "64", ("core", "parallelism"): "0"}, lambda: (128, {"a": 64}))
    assert ok.status == OK and "parallelism" not in ok.detail and "1 active DAG(s) read" in ok.detail
    low_pool = _limits(WIDE, lambda: (10, {}))
    assert low_pool.status == WARN and "raise default_pool slots to at least 28" in low_pool.detail


def test_a_dags_own_max_active_tasks_below_the_slots_is_named() -> None:
    """``max_active_tasks_per_dag`` is only the default: a DAG that sets its own lower limit (the
    dag processor writes the effective one to the ``dag`` table) hides its runs' ready tasks too."""
    dags = {f"narrow{i}": 4 + i for i in range(7)} | {"roomy": 64, "exact": 28}
    found = _limits(WIDE, lambda: (128, dags))
    assert found.status == WARN
    assert "the max_active_tasks of DAG(s) narrow0 (4), narrow1 (5), narrow2 (6), narrow3 (7), narrow4 (8) " \
           "and 2 more below" in found.detail
    assert "roomy" not in found.detail and "exact" not in found.detail


def test_the_limits_are_read_from_airflows_own_tables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """default_pool's slots and the max_active_tasks of the DAGs that are neither paused nor stale,
    from Airflow's ``slot_pool`` and ``dag`` tables."""
    import contextlib

    from airflow.models import import_all_models
    from airflow.models.base import Base
    from airflow.models.dag import DagModel
    from airflow.models.pool import Pool
    from airflow.utils import session as airflow_session
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from airflow_drl_executor.check import airflow_limits

    import_all_models()
    engine = create_engine(f"sqlite:///{tmp_path / 'airflow.db'}")
    Base.metadata.create_all(engine, tables=[Base.metadata.tables[n] for n in ("slot_pool", "dag")])
    with Session(engine) as session:
        session.add(Pool(pool=Pool.DEFAULT_POOL_NAME, slots=40, description="", include_deferred=False))
        for dag_id, paused, stale, limit in [("live", False, False, 8), ("paused", True, False, 2),
                                             ("stale", False, True, 2)]:
            session.add(DagModel(dag_id=dag_id, is_paused=paused, is_stale=stale, max_active_tasks=limit,
                                 bundle_name="b"))
        session.commit()

    @contextlib.contextmanager
    def create_session(scoped=True):  # type: ignore[no-untyped-def]
        with Session(engine) as session:
            yield session

    monkeypatch.setattr(airflow_session, "create_session", create_session)
    assert airflow_limits(5.0)() == (40, {"live": 8})


def test_airflow_limits_without_the_database_or_with_bad_settings() -> None:
    def broken() -> tuple[int | None, dict[str, int]]:
        raise TimeoutError("no answer")

    found = _limits(WIDE, broken)
    assert found.status == OK and "default_pool and DAGs not read (TimeoutError: no answer)" in found.detail
    assert "no default_pool" in _limits(WIDE, lambda: (None, {})).detail
    assert _limits({("core", "parallelism"): "many"}, None).status == FAIL
