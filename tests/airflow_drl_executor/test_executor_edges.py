"""Pool liveness, the ledger, the executor's options, the client's back-off and the worker
hostname callable at their edges: each test failed on the code before its fix, for the reason its
docstring gives (what an operator saw, and what is expected instead)."""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest
import redis
from test_config import FakeConf

from airflow_drl_executor.config import ExecutorConfig
from airflow_drl_executor.ledger import Ledger
from airflow_drl_executor.liveness import PoolWatch, Replies
from policy.config import ServerConfig
from policy.schema import PoolState, SchemaError

POOLS = ("cpu-small", "cpu-large", "gpu")


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# --- config: a pool check interval its own broadcast outlasts ----------------------------------


def test_an_answer_lasts_three_rounds_of_wait_and_broadcast() -> None:
    """An operator who wants dead pools noticed fast sets ``pool_check_interval_s = 0.5`` and
    keeps ``pool_check_timeout_s = 2``. Celery's ``inspect()`` broadcast waits its timeout for
    replies, so an answer comes every interval + timeout = 2.5 s; an answer taken for unknown
    after 3 intervals (1.5 s) left every pool up for most of every round: a pool whose only
    worker died kept getting tasks no worker would run (and ``drl_executor.pools_down`` read 0).
    Expected: an answer counts for three rounds of wait and broadcast."""
    clock = Clock()
    interval, timeout = 0.5, 2.0

    def ask() -> Replies:
        clock.t += timeout  # Celery's broadcast collects replies until its timeout
        return {"gpu@h": [{"name": "gpu"}], "cpu-small@h": [{"name": "cpu-small"}]}

    watch = PoolWatch(ask, POOLS, interval_s=interval, answer_s=timeout, clock=clock)
    assert watch.check() == {"cpu-small": 1, "cpu-large": 0, "gpu": 1}
    clock.t += interval + 0.75 * timeout  # the loop's wait, then most of the next broadcast
    assert watch.live_workers() == {"cpu-small": 1, "cpu-large": 0, "gpu": 1}, "cpu-large counts as up"
    clock.t += 3 * (interval + timeout)  # over three rounds without an answer: unknown
    assert watch.live_workers() is None


# --- config: a key prefix the policy server can never have -------------------------------------


@pytest.mark.parametrize("prefix", ["drl prod", "drl\n", " drl"])
def test_a_key_prefix_the_policy_server_refuses_is_not_accepted(prefix: str) -> None:
    """``key_prefix`` is shared with the policy server (``drl-policy serve --prefix``), which
    refuses any whitespace in it; the executor refuses ':' but takes whitespace. A prefix set
    from a Helm block scalar or a quoted env var (``AIRFLOW__DRL_EXECUTOR__KEY_PREFIX="drl\\n"``:
    Airflow does not strip environment values) starts the executor on keys no server can ever
    serve: every batch is placed by the fallback with "no policy server has registered a
    heartbeat", for ever. Expected: what the executor accepts as its prefix is a prefix the server
    accepts too (refused at start, or stripped to one)."""
    try:
        cfg = ExecutorConfig.from_conf(FakeConf({"key_prefix": prefix}))
    except ValueError as exc:
        assert "key_prefix" in str(exc)
        return
    try:
        ServerConfig(prefix=cfg.key_prefix)
    except ValueError as exc:
        pytest.fail(f"the executor took key_prefix {cfg.key_prefix!r}, which no policy server accepts: {exc}")


# --- ledger: an infinite run time poisons every request -----------------------------------------


def test_a_run_time_that_is_not_finite_never_reaches_a_pools_expected_finishes() -> None:
    """``Ledger.add`` refuses a NaN or negative ``run_s`` but takes ``inf``: the executor's
    ``_run_s`` is a duration over the pool's speed, so a hint ``duration_s: 1e308`` (finite, and
    accepted by the hint check) on a pool of speed 0.5 gives ``inf``. That ``inf`` goes into the
    pool's ``free_at``, which the wire schema refuses (``free_at: expected at most 512 finite
    numbers``): the policy server answers every request with an error and every task of every run
    is placed by the fallback while that one task is in flight. Expected: the ledger refuses (or
    bounds) a run time that is not finite, so the pool states it reports are valid on the wire."""
    run_s = 1e308 / 0.5
    ledger = Ledger()
    try:
        ledger.add("k", "gpu", "k", run_s, 0.0)
    except ValueError:
        return
    load = ledger.load("gpu", 2, 0.0, alive={"k"})
    state = PoolState(name="gpu", vm_class="g", slots=2, cpus=8, memory_gb=32, busy=load.busy,
                      queued=load.queued, free_at=load.free_at)
    try:
        PoolState.from_json(state.to_json())
    except SchemaError as exc:
        pytest.fail(f"the ledger took run_s={run_s!r} and reports a pool the server refuses: {exc}")


# --- hostname: without DRL_WORKER_NAME it is not Airflow's hostname ------------------------------


def test_without_a_worker_name_the_hostname_is_airflows_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``[core] hostname_callable = airflow_drl_executor.hostname.worker_hostname`` is set for
    every Airflow container in docker-compose.yaml (scheduler, api-server, triggerer too), but only
    the workers have ``DRL_WORKER_NAME``; the others, and a worker alone on its host, fall back to
    ``socket.getfqdn()``, not to Airflow's default ``airflow.utils.net.getfqdn`` (a patched version
    for CPython issue 49254: ``socket.getfqdn`` goes through ``gethostbyaddr`` and returns
    ``localhost`` where the host name maps to a loopback address). Here the host is
    ``worker-gpu.example.internal``: Airflow's callable says so, this one says ``localhost``, so
    the task instance's hostname (and the triggerer's) is ``localhost`` and the UI fetches served
    logs from its own host. Expected: without ``DRL_WORKER_NAME``, the same name as Airflow's
    default callable."""
    from airflow.utils.net import getfqdn as airflow_getfqdn

    from airflow_drl_executor.hostname import worker_hostname

    monkeypatch.delenv("DRL_WORKER_NAME", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "worker-gpu")
    monkeypatch.setattr(socket, "gethostbyaddr", lambda name: ("localhost", ["ip6-localhost"], ["::1"]))
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [
        (socket.AF_INET, socket.SOCK_DGRAM, 17, "worker-gpu.example.internal", ("10.1.2.3", 0))])
    assert airflow_getfqdn() == "worker-gpu.example.internal"
    assert worker_hostname() == airflow_getfqdn()


# --- reconnect_backoff_max_s: the cap overflows after a long Redis outage ------------------------


def test_the_reconnect_backoff_survives_a_long_redis_outage(caplog: pytest.LogCaptureFixture) -> None:
    """``reconnect_backoff_max_s`` caps ``0.5 * 2 ** (failures - 1)``, but the uncapped term is
    computed first: at the 1,025th consecutive Redis failure (about 85 minutes of outage at the
    default 5 s cap) ``2 ** 1024`` does not convert to a float and ``_on_redis_error`` raises
    OverflowError before setting the next retry. The operator then sees a traceback ("placement
    request ... failed", reason "fallback: placement failed: OverflowError: int too large to
    convert to float") at every heartbeat, and no back-off any more: each heartbeat waits on
    Redis's connect timeout. Expected: every failure is a PlacementUnavailable with the capped
    back-off, however long the outage."""
    from airflow_drl_executor.client import PlacementClient, PlacementUnavailable

    caplog.set_level(logging.ERROR, logger="airflow_drl_executor.client")  # one warning per failure
    clock = Clock(0.0)
    client = PlacementClient("redis://127.0.0.1:1/0", timeout_ms=200, backoff_max_s=5, clock=clock)

    def down(now: float) -> None:
        raise redis.ConnectionError("Connection refused")

    client._check_live = down  # type: ignore[method-assign]
    request: Any = object()  # never read: the liveness check fails first
    for _ in range(1100):
        clock.t = client._retry_at
        with pytest.raises(PlacementUnavailable, match="redis error"):
            client.place(request, {})
        assert client._retry_at - clock.t <= 5.0
