"""The placements page (plugin.py) on an upgraded or unreachable database: a page or a readable
error, never HTTP 500 (found by review; each test failed on the code before its fix)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import pytest
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient
from sqlalchemy import Boolean, Column, DateTime, Float, Integer, MetaData, String, Table, Text, create_engine, insert
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from airflow_drl_executor import plugin

sys.path.insert(0, str(Path(__file__).parent))
from test_plugin import OneDagReader  # noqa: E402
from test_traces import U1, _airflow_tables  # noqa: E402


def _client(monkeypatch: pytest.MonkeyPatch, session: Any) -> TestClient:
    monkeypatch.setattr("airflow.utils.session.create_session", session)
    monkeypatch.setattr(plugin, "get_auth_manager", lambda: OneDagReader())
    monkeypatch.setattr(plugin, "_serving", lambda: "1 live")
    monkeypatch.setattr(plugin, "_upgraded", False)
    app = plugin.create_app()
    app.dependency_overrides[get_user] = lambda: object()
    return TestClient(app, raise_server_exceptions=False)


def _first_release_table(engine: Any) -> None:
    """``drl_placement`` as the first release (6904547) created it: ``ti_id`` as 36-character text,
    and no ``waited_s`` (added by 43908ed) -- the table ``ensure_schema`` says it upgrades."""
    meta = MetaData()
    old = Table(
        "drl_placement", meta,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("ti_id", String(36), nullable=False, index=True),
        Column("dag_id", String(250), nullable=False), Column("run_id", String(250), nullable=False),
        Column("task_id", String(250), nullable=False), Column("map_index", Integer, nullable=False, default=-1),
        Column("try_number", Integer, nullable=False), Column("pool", String(250), nullable=False),
        Column("vm_class", String(250), nullable=False), Column("score", Float, nullable=False),
        Column("reason", Text, nullable=False), Column("fallback", Boolean, nullable=False),
        Column("policy", String(100), nullable=False), Column("policy_version", String(100), nullable=False),
        Column("request_id", String(64), nullable=False), Column("decision_ms", Float, nullable=False),
        Column("celery_id", String(64), nullable=True), Column("features", Text, nullable=False),
        Column("decided_at", DateTime(timezone=True), nullable=False),
    )
    meta.create_all(engine)
    import datetime as dt

    with engine.begin() as conn:
        conn.execute(insert(old), [{
            "ti_id": str(U1), "dag_id": "mine", "run_id": "r", "task_id": "t", "map_index": -1, "try_number": 1,
            "pool": "gpu", "vm_class": "gpu-a10", "score": -1.0, "reason": "because", "fallback": False,
            "policy": "eft", "policy_version": "1", "request_id": "q", "decision_ms": 3.2, "celery_id": "c1",
            "features": "{}", "decided_at": dt.datetime(2026, 12, 1, tzinfo=dt.UTC)}])


def test_a_table_of_the_first_release_is_shown_not_a_500(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """plugin._rows upgrades "a table of an earlier release" with traces.ensure_schema, which only
    converts ti_id and adds indexes; outcomes_query then selects p.waited_s, a column such a table
    lacks: sqlite3.OperationalError "no such column" (PostgreSQL: UndefinedColumn), HTTP 500 for
    the page and the JSON API after an upgrade."""
    engine = create_engine(f"sqlite:///{tmp_path / 'airflow.db'}")
    _airflow_tables(engine)
    _first_release_table(engine)

    @contextlib.contextmanager
    def session() -> Any:
        with Session(engine) as s:
            yield s

    client = _client(monkeypatch, session)
    for path in ("/api/placements", "/"):
        response = client.get(path)
        assert response.status_code != 500, f"{path}: {response.status_code} {response.text[:200]}"
    rows = client.get("/api/placements").json()
    assert [(r["dag_id"], r["task_id"], r["pool"]) for r in rows] == [("mine", "t", "gpu")], rows


def test_a_database_that_does_not_answer_is_said_not_a_500(monkeypatch: pytest.MonkeyPatch) -> None:
    """_rows has no error handling at all: any database error (the metadata DB restarting, a lock
    timeout, a dropped connection) escapes as HTTP 500 with no readable message. The product rule:
    a clear error (e.g. 503 naming the database), never a crash."""

    @contextlib.contextmanager
    def session() -> Any:
        raise OperationalError("SELECT 1", {}, Exception("could not connect to server: Connection refused"))
        yield  # pragma: no cover

    client = _client(monkeypatch, session)
    for path in ("/api/placements", "/"):
        response = client.get(path)
        assert response.status_code != 500, f"{path}: {response.status_code} {response.text[:200]}"
        assert "database" in response.text.lower() or "connect" in response.text.lower(), response.text[:300]
