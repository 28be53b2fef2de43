"""The placements page shows only the DAGs its user may read (plugin.py, with the auth manager faked)."""

from __future__ import annotations

from typing import Any

import pytest
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_drl_executor import plugin, traces

ROWS = [{"dag_id": "mine", "run_id": "r1", "task_id": "t", "pool": "gpu", "fallback": False, "reason": "<b>ok</b>"},
        {"dag_id": "payroll", "run_id": "r2", "task_id": "export", "pool": "gpu", "fallback": True, "reason": "x"}]


class OneDagReader:
    """An auth manager whose user may read DAG ``mine`` only."""

    ti_access = True

    def get_authorized_dag_ids(self, *, user: Any, method: str = "GET", **kw: Any) -> set[str]:
        return {"mine"}

    def is_authorized_dag(self, *, method: str, user: Any, access_entity: Any = None, details: Any = None) -> bool:
        from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity

        return method == "GET" and (self.ti_access or access_entity != DagAccessEntity.TASK_INSTANCE)


class DagReaderWithoutTaskInstances(OneDagReader):
    ti_access = False


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setattr(plugin, "get_auth_manager", lambda: OneDagReader())
    monkeypatch.setattr(plugin, "_rows",
                        lambda limit, dag_ids, where: [r for r in ROWS if r["dag_id"] in dag_ids][:limit])
    monkeypatch.setattr(plugin, "_serving", lambda: "1 live: <i>c0</i>")
    app = plugin.create_app()
    app.dependency_overrides[get_user] = lambda: object()
    return TestClient(app)


@pytest.mark.parametrize("query", ["", "?dag_id=mine", "?dag_id=payroll", "?dag_id=~"])
def test_only_the_dags_the_user_may_read_whatever_the_query_names(client: TestClient, query: str) -> None:
    assert [r["dag_id"] for r in client.get(f"/api/placements{query}").json()] == ["mine"]
    page = client.get(f"/{query}")
    assert page.status_code == 200 and "payroll" not in page.text.split("<table")[1], "the form may echo it"
    assert "&lt;b&gt;ok&lt;/b&gt;" in page.text, "reasons are escaped"
    assert '<p id="serving">Policy servers: 1 live: &lt;i&gt;c0&lt;/i&gt;</p>' in page.text


def test_the_page_says_which_policy_servers_serve_what(redis_url: str, policy_server: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Read from the servers' heartbeats with the executor's options; a Redis that does not answer is said."""
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__REDIS_URL", redis_url)
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__KEY_PREFIX", "t")
    policy_server()
    line = plugin._serving()
    assert line.startswith("1 live: c0 eft:") and " on cpu (" in line, line
    monkeypatch.setenv("AIRFLOW__DRL_EXECUTOR__REDIS_URL", "redis://:secret@127.0.0.1:1/0")
    line = plugin._serving()
    assert line.startswith("unknown (Redis redis://:***@127.0.0.1:1/0: ConnectionError") and "secret" not in line


def test_no_user_no_page() -> None:
    for path in ("/", "/api/placements"):
        assert TestClient(plugin.create_app()).get(path).status_code == 401


def test_a_user_who_may_not_read_task_instances_gets_403(monkeypatch: pytest.MonkeyPatch) -> None:
    """was: DAG read access alone showed every placement (task id, try, host, state)"""
    monkeypatch.setattr(plugin, "get_auth_manager", lambda: DagReaderWithoutTaskInstances())
    monkeypatch.setattr(plugin, "_rows", lambda limit, dag_ids, where: ROWS)
    app = plugin.create_app()
    app.dependency_overrides[get_user] = lambda: object()
    for path in ("/", "/api/placements"):
        response = TestClient(app).get(path)
        assert response.status_code == 403 and "task instances" in response.text


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> tuple[TestClient, list[traces.PlacementFilter]]:
    """A client whose every query's filter is recorded; the rows are ids 10..1, as many as asked."""
    seen: list[traces.PlacementFilter] = []

    def rows(limit: int, dag_ids: set[str], where: traces.PlacementFilter) -> list[dict[str, Any]]:
        seen.append(where)
        return [{"id": i, "dag_id": "mine", "pool": "gpu" if i % 2 else "cpu-small", "fallback": i == 3}
                for i in range(10, 0, -1)][:limit]

    monkeypatch.setattr(plugin, "get_auth_manager", lambda: OneDagReader())
    monkeypatch.setattr(plugin, "_rows", rows)
    app = plugin.create_app()
    app.dependency_overrides[get_user] = lambda: object()
    return TestClient(app), seen


def test_the_query_string_becomes_the_filter(asked: tuple[TestClient, list[traces.PlacementFilter]]) -> None:
    client, seen = asked
    client.get("/api/placements?dag_id=mine&run_id=r1&task_id=t&pool=gpu&fallback=yes&before=7")
    assert seen[-1] == traces.PlacementFilter(dag_id="mine", run_id="r1", task_id="t", pool="gpu",
                                              fallback=True, before_id=7)
    client.get("/?dag_id=+mine+&run_id=&task_id=&pool=&fallback=no")  # what the page's form sends
    assert seen[-1] == traces.PlacementFilter(dag_id="mine", fallback=False)
    client.get("/?fallback=")
    assert seen[-1] == traces.PlacementFilter()


@pytest.mark.parametrize("query", ["fallback=maybe", "before=0", "before=x", "limit=0", "dag_id=" + "x" * 251,
                                   # was HTTP 500: PostgreSQL's driver refuses a NUL, SQLite an id past 2**63
                                   "dag_id=%00", "task_id=a%0Ab", "pool=%7F", "before=9223372036854775808"])
def test_a_bad_filter_is_refused_with_the_field_named(asked: tuple[TestClient, list[traces.PlacementFilter]],
                                                       query: str) -> None:
    client, seen = asked
    for path in ("/", "/api/placements"):
        response = client.get(f"{path}?{query}")
        assert response.status_code == 422 and query.split("=")[0] in response.text
    assert seen == [], "no query ran"


def test_a_full_page_links_to_the_older_placements_with_the_same_filters(
        asked: tuple[TestClient, list[traces.PlacementFilter]]) -> None:
    client, _ = asked
    page = client.get("/?pool=gpu&fallback=no&limit=4").text
    assert "older placements" in page
    assert "href='?pool=gpu&amp;fallback=no&amp;limit=4&amp;before=7'" in page, "the last row shown is id 7"
    assert "value='gpu'" in page and "<option value='no' selected>" in page, "the form keeps the filters"
    assert "by pool: cpu-small 2, gpu 2" in page
    assert "older placements" not in client.get("/?limit=20").text, "the last page has no link back"


def test_the_page_reads_the_real_table_with_the_same_types_on_every_database(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Any) -> None:
    """The real ``_rows`` and ``outcomes_query`` on SQLite. was: ``fallback`` 1/0 and dates as naive
    text on SQLite (on PostgreSQL in its session's time zone), and mapped instances of one task
    shown as identical rows (no map index, no decision time)"""
    import contextlib
    import datetime as dt
    import sys
    import uuid
    from pathlib import Path

    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    sys.path.insert(0, str(Path(__file__).parent))
    from test_traces import U1, _airflow_tables, _record

    engine = create_engine(f"sqlite:///{tmp_path / 'airflow.db'}")  # the app reads it from another thread
    _airflow_tables(engine)
    traces.ensure_schema(engine)
    with engine.begin() as conn:
        conn.execute(text("UPDATE task_instance SET start_date = '2026-12-06 10:00:00.000000'"))
        traces.write(conn, [_record(U1, dag_id="mine", fallback=True)]
                     + [_record(uuid.uuid4(), dag_id="mine", task_id="fan", map_index=m) for m in range(2)])

    @contextlib.contextmanager
    def session() -> Any:
        with Session(engine) as s:
            yield s

    monkeypatch.setattr("airflow.utils.session.create_session", session)
    monkeypatch.setattr(plugin, "get_auth_manager", lambda: OneDagReader())
    app = plugin.create_app()
    app.dependency_overrides[get_user] = lambda: object()
    client = TestClient(app)
    rows = client.get("/api/placements").json()
    assert [(r["task_id"], r["map_index"], r["fallback"]) for r in rows] == [("fan", 1, False), ("fan", 0, False),
                                                                               ("t", -1, True)]
    assert rows[2]["start_date"] == "2026-12-06T10:00:00Z", "UTC, with its zone"
    assert dt.datetime.fromisoformat(rows[0]["decided_at"]).tzinfo is not None
    page = client.get("/").text
    assert "<th>map_index</th>" in page and "<th>decided_at</th>" in page
    assert "<td>fan</td><td>1</td>" in page and "<td>t</td><td></td>" in page, "-1 (not mapped) shows empty"


def test_the_nav_entry_is_relative_to_airflows_base_url() -> None:
    """The UI loads an external view's href in an iframe under ``<base href>`` (Airflow's
    ``[api] base_url``). was "/drl/": behind https://host/airflow it loaded https://host/drl/"""
    (view,) = plugin.DRLExecutorPlugin.external_views
    assert view["href"] == "drl/" and not view["href"].startswith("/")
