"""The placements page's "Policy servers" line with a misconfigured or unusual deployment (found
by review, 2026-12-06): a Redis password redis-py cannot parse, a ``redis_url_cmd`` that fails on
the api-server, a heartbeat no page can print. The line says so; the page stays up."""

from __future__ import annotations

import json
from typing import Any

import pytest
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_drl_executor import plugin
from policy.transport import Keys


class Reader:
    """An auth manager whose user may read DAG ``mine`` and its task instances."""

    def get_authorized_dag_ids(self, *, user: Any, method: str = "GET", **kw: Any) -> set[str]:
        return {"mine"}

    def is_authorized_dag(self, *, method: str, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        return method == "GET"


def _client(monkeypatch: pytest.MonkeyPatch) -> TestClient:
    """The page with a logged-in reader, no placements, and the real "Policy servers" line."""
    monkeypatch.setattr(plugin, "get_auth_manager", lambda: Reader())
    monkeypatch.setattr(plugin, "_rows", lambda limit, dag_ids, where: [])
    app = plugin.create_app()
    app.dependency_overrides[get_user] = lambda: object()
    return TestClient(app, raise_server_exceptions=False)


def test_the_redis_password_is_not_shown_when_redis_py_cannot_parse_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis password with a ``/``, ``?`` or ``#`` not percent-encoded (common: ``openssl rand
    -base64`` makes them) makes redis-py's URL parser read the password as the port and raise
    ``ValueError: Port could not be cast to integer value as '<password>'``. ``_serving`` shows that
    message on the placements page, under a correctly redacted URL: the password (up to its first
    ``/``) goes to every user who may read task instances. (``redacted_url`` was made for exactly
    such passwords; the exception text bypasses it.)"""
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__REDIS_URL", "redis://:Zq8s3cr3tPw/x+Tail=@127.0.0.1:1/0")
    page = _client(monkeypatch).get("/")
    assert page.status_code == 200
    serving = page.text.split('<p id="serving">')[1].split("</p>")[0]
    assert "unknown (" in serving and "redis://:***@127.0.0.1:1/0 does not parse" in serving, serving
    assert "Zq8s3cr3tPw" not in serving, f"the password is on the page: {serving}"


def test_a_redis_url_command_that_fails_on_the_api_server_is_said_not_a_500(monkeypatch: pytest.MonkeyPatch) -> None:
    """``redis_url`` is declared sensitive, so deployments give it as ``..._REDIS_URL_CMD`` /
    ``_SECRET``; the api-server often lacks the scheduler's secret file or backend. Airflow's
    ``conf.get`` then raises ``AirflowConfigException``, which ``_serving`` does not catch (only
    ``ValueError``): the whole placements page is HTTP 500, where its docstring promises "an option
    that does not work is said, not raised: the page shows the placements all the same"."""
    monkeypatch.delenv("AIRFLOW__DRL_EXECUTOR__REDIS_URL", raising=False)
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__REDIS_URL_CMD", "cat /nonexistent/drl-review/redis_url")
    page = _client(monkeypatch).get("/")
    assert page.status_code == 200, f"HTTP {page.status_code}: the page is gone, not the one line"
    assert '<p id="serving">Policy servers: unknown (' in page.text


def test_a_heartbeat_with_a_lone_surrogate_does_not_take_the_page_down(redis_url: str, private_redis: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat is JSON in Redis; ``json.loads`` turns an escaped lone surrogate (``"\\udcff"``:
    what ``json.dumps`` writes for a name read with ``surrogateescape``, e.g. a checkpoint file
    or host name in bytes that are not UTF-8) into a str that cannot be encoded as UTF-8.
    ``check_servers`` puts the version in the "Policy servers" line as is, and the page's
    HTMLResponse fails to encode: HTTP 500 for the whole placements page, where a dead or odd
    policy server must only be said."""
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__REDIS_URL", redis_url)
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__KEY_PREFIX", "t")
    r = private_redis.client()
    sec, usec = r.time()
    r.hset(Keys("t").heartbeat, "c0", json.dumps({"ts": sec + usec / 1e6, "version": "ckpt-\udcff", "device": "cpu"}))
    page = _client(monkeypatch).get("/")
    assert page.status_code == 200, f"HTTP {page.status_code}: one heartbeat took the page down"
    assert '<p id="serving">Policy servers: 1 live: c0 ckpt-' in page.text


def test_the_executor_refuses_a_redis_url_that_does_not_parse_without_its_password() -> None:
    """The same URL in ``[drl_executor] redis_url``: one line naming the setting, no password."""
    from airflow_drl_executor.config import ExecutorConfig

    with pytest.raises(ValueError, match="redis_url: .* does not parse") as err:
        ExecutorConfig(redis_url="redis://:Zq8s3cr3tPw/xTail@127.0.0.1:1/0")
    assert "Zq8s3cr3tPw" not in str(err.value)

