from __future__ import annotations

import os
from pathlib import Path

import pytest

from airflow_drl_executor.client import PlacementClient
from airflow_drl_executor.config import OPTIONS, ExecutorConfig, packaged_catalogue
from airflow_drl_executor.provider import get_provider_info


class FakeConf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, section: str, key: str, fallback: object = None) -> object:
        assert section == "drl_executor"
        return self.values.get(key, fallback)


def test_defaults_are_valid_and_use_the_packaged_catalogue() -> None:
    cfg = ExecutorConfig.from_conf(FakeConf({}))
    assert cfg.decision_timeout_ms == 200 and cfg.record_traces
    assert Path(cfg.catalogue).exists() and cfg.catalogue == packaged_catalogue()


def test_values_are_typed() -> None:
    cfg = ExecutorConfig.from_conf(FakeConf({"decision_timeout_ms": "50", "record_traces": "false",
                                             "default_duration_s": "2.5"}))
    assert (cfg.decision_timeout_ms, cfg.record_traces, cfg.default_duration_s) == (50, False, 2.5)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("decision_timeout_ms", "soon", "expected integer"),
        ("decision_timeout_ms", "0", "1..10000"),
        ("redis_url", "http://x", "redis_url"),
        ("key_prefix", "a:b", "key_prefix"),
        ("record_traces", "maybe", "expected boolean"),
        ("redis_ca_cert", "/no/such/ca.pem", "redis_ca_cert: a CA certificate .* needs a rediss:// URL"),
        # was: accepted; with NaN, 'waited < max_wait_s' is never true, so no task was ever held
        ("max_wait_s", "nan", "max_wait_s: expected float, got 'nan'"),
        ("default_duration_s", "inf", "default_duration_s: expected float, got 'inf'"),
        ("max_request_bytes", "100", "max_request_bytes must be in 1024..536870912"),
    ],
)
def test_bad_values_name_the_option(key: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExecutorConfig.from_conf(FakeConf({key: value}))


def test_a_ca_certificate_is_checked_where_it_enters(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    tls = {"redis_url": "rediss://placer:pw@redis.example:6380/0"}
    assert ExecutorConfig.from_conf(FakeConf({**tls, "redis_ca_cert": str(ca)})).redis_ca_cert == str(ca)
    with pytest.raises(ValueError, match="not a readable file"):
        ExecutorConfig.from_conf(FakeConf({**tls, "redis_ca_cert": str(tmp_path / "missing.pem")}))
    with pytest.raises(ValueError, match="needs a rediss:// URL"):  # TLS asked for, plain text configured
        ExecutorConfig.from_conf(FakeConf({"redis_url": "redis://redis.example:6379/0", "redis_ca_cert": str(ca)}))


def test_provider_declares_every_option_and_a_cli() -> None:
    info = get_provider_info()
    options = info["config"]["drl_executor"]["options"]
    assert set(options) == set(OPTIONS)
    assert all(o["description"] and o["type"] for o in options.values())
    assert info["executors"] == ["airflow_drl_executor.DRLExecutor"]
    assert info["cli"], "without a cli entry every airflow command fails (BRIEF)"


def test_max_wait_must_be_below_the_schedulers_queued_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A task held for a better pool stays queued: held past task_queued_timeout, the scheduler
    takes it for stuck and requeues it (or fails it after a few times)."""
    from airflow_drl_executor.executor import DRLExecutor

    monkeypatch.setenv("AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT", "30")
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__MAX_WAIT_S", "60")
    with pytest.raises(ValueError, match=r"max_wait_s \(60\) must be below \[scheduler\] task_queued_timeout \(30\)"):
        DRLExecutor()
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__MAX_WAIT_S", "20")
    assert DRLExecutor().drl_config.max_wait_s == 20.0


def test_max_hold_is_below_the_queued_timeout_and_at_least_max_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_hold_s`` bounds the whole hold (``max_wait_s`` only the time a pool had a free slot):
    by default half of task_queued_timeout, never under max_wait_s; set, it must be below the
    timeout (the scheduler would take the task for stuck first) and at least max_wait_s."""
    from airflow_drl_executor.executor import DRLExecutor

    assert DRLExecutor().max_hold_s == 300.0  # task_queued_timeout's default, 600
    monkeypatch.setenv("AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT", "100")
    assert DRLExecutor().max_hold_s == 60.0  # half would be 50: max_wait_s is the floor
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__MAX_HOLD_S", "100")
    with pytest.raises(ValueError, match=r"max_hold_s \(100\) must be below \[scheduler\] task_queued_timeout"):
        DRLExecutor()
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__MAX_HOLD_S", "30")
    with pytest.raises(ValueError, match=r"max_hold_s \(30\) must be at least max_wait_s \(60\)"):
        DRLExecutor()
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__MAX_HOLD_S", "90")
    assert DRLExecutor().max_hold_s == 90.0


def test_the_redis_url_is_sensitive_and_can_come_from_a_command() -> None:
    """was: not declared sensitive, so Airflow ignored AIRFLOW__DRL_EXECUTOR__REDIS_URL_CMD (and
    _SECRET): the executor placed every task by the fallback on the default URL, and the password
    was never masked in logs"""
    import subprocess
    import sys

    probe = ("from airflow.configuration import conf\n"
             "from airflow_drl_executor.config import ExecutorConfig\n"
             "print(('drl_executor', 'redis_url') in conf.sensitive_config_values)\n"
             "print(ExecutorConfig.from_conf(conf).redis_url)\n")
    env = {**os.environ, "AIRFLOW__DRL_EXECUTOR__REDIS_URL_CMD": "echo redis://placer:s3cret@redis.example:6379/0"}
    env.pop("AIRFLOW__DRL_EXECUTOR__REDIS_URL", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["True", "redis://placer:s3cret@redis.example:6379/0"]


def test_a_redis_url_query_cannot_lift_the_decision_deadline() -> None:
    """``decision_timeout_ms`` "bounds the scheduler loop's extra delay" (provider metadata), and
    the client sets the Redis socket timeout to deadline + 0.1 s for that. But redis-py lets the
    URL's query parameters override the keyword arguments of ``from_url`` (client.py
    ``redis.Redis.from_url(redis_url, socket_timeout=...)``), so ``redis_url =
    redis://host:6379/0?socket_timeout=30`` (a URL copied from another tool's settings) makes a hung
    Redis hold the scheduler loop 30 s per heartbeat with a 200 ms deadline, silently.
    Expected: such a URL is refused naming ``redis_url``, or the deadline wins over the URL."""
    url = "redis://127.0.0.1:6379/0?socket_timeout=30&socket_connect_timeout=30"
    try:
        ExecutorConfig(redis_url=url)
    except ValueError as exc:
        assert "redis_url" in str(exc)
        return
    client = PlacementClient(url, timeout_ms=200)
    try:
        kwargs = client._redis.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] <= 0.2 + 0.1 + 1e-9, f"a hung Redis holds the loop {kwargs['socket_timeout']} s"
        assert kwargs["socket_connect_timeout"] <= 1.0, f"connecting may take {kwargs['socket_connect_timeout']} s"
    finally:
        client.close()


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0?db=one",  # redis-py: ValueError at the executor's start()
    "redis://127.0.0.1:6379/0?socket_timeout=soon",  # same
    "redis://127.0.0.1:6379/one",  # redis-py silently ignores the path: db 0
])
def test_a_redis_url_redis_py_refuses_or_misreads_is_refused_naming_the_option(url: str) -> None:
    """``check_url`` (policy/transport.py, called by config.py ``__post_init__``) promises to
    "refuse a Redis URL that redis-py cannot parse", but only checks the port: a query value
    redis-py refuses passes the option's validation (and ``airflow drl-executor check``'s config
    part), then ``DRLExecutor.start()`` stops the scheduler with redis-py's "Invalid value for 'db'
    in connection URL." that names no option; a database number that is not a number is dropped by
    redis-py without a word, and every placement goes to database 0. Expected: ValueError naming
    ``[drl_executor] redis_url`` when the option is read."""
    with pytest.raises(ValueError, match=r"\[drl_executor\] redis_url"):
        ExecutorConfig(redis_url=url)


def test_the_request_limit_is_an_option_the_client_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: the client's limit was fixed at 8 MiB, so a server started with a lower
    --max-request-bytes refused every larger request (a round trip, then the fallback) and one
    started with a higher limit never got them."""
    from airflow_drl_executor.executor import DRLExecutor

    assert ExecutorConfig.from_conf(FakeConf({})).max_request_bytes == 8 * 1024 * 1024
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__MAX_REQUEST_BYTES", "65536")
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__RECORD_TRACES", "false")
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__POOL_CHECK_INTERVAL_S", "0")
    ex = DRLExecutor()
    ex.start()
    try:
        assert ex._client is not None and ex._client.max_request_bytes == 65536
    finally:
        ex._client.close()


class _Said:
    """A logger that keeps what it was told (Airflow's executor logs through structlog)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def warning(self, msg: str, *args: object) -> None:
        self.lines.append(("warning", msg % args))

    def info(self, msg: str, *args: object) -> None:
        self.lines.append(("info", msg % args))

    def debug(self, msg: str, *args: object) -> None:
        self.lines.append(("debug", msg % args))


@pytest.mark.parametrize(("per_run", "warned"), [("16", True), ("28", False)])
def test_the_executor_warns_at_start_when_airflows_limits_hide_ready_tasks(
        monkeypatch: pytest.MonkeyPatch, per_run: str, warned: bool) -> None:
    """Airflow's default max_active_tasks_per_dag (16, per DAG run) against the GPU-affinity
    cluster's 28 worker slots: the scheduler would hand the policy at most 16 tasks of a run, and
    the scheduler's log says so at start (as ``airflow drl-executor check`` does)."""
    from airflow_drl_executor.executor import DRLExecutor

    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__CATALOGUE", "policy/catalogues/gpu-affinity.yaml")
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__RECORD_TRACES", "false")
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__POOL_CHECK_INTERVAL_S", "0")
    monkeypatch.setenv("AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG", per_run)
    said = _Said()
    monkeypatch.setattr(DRLExecutor, "log", property(lambda self: said))
    ex = DRLExecutor(parallelism=64)
    ex.start()
    try:
        warnings = [text for level, text in said.lines if level == "warning" and "worker slots" in text]
        assert bool(warnings) == warned, said.lines
        if warned:
            assert "[core] max_active_tasks_per_dag 16 below the catalogue's 28 worker slots" in warnings[0]
            assert "parallelism" not in warnings[0]
    finally:
        ex._client.close()
