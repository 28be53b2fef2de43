"""The placements page shows only the DAGs its user may read (plugin.py, with the auth manager faked)."""

from __future__ import annotations

from typing import Any

import pytest
from airflow.api_fastapi.core_api.security import get_user
from fastapi.testclient import TestClient

from airflow_drl_executor import plugin

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
    monkeypatch.setattr(plugin, "_rows", lambda limit, dag_ids: [r for r in ROWS if r["dag_id"] in dag_ids][:limit])
    app = plugin.create_app()
    app.dependency_overrides[get_user] = lambda: object()
    return TestClient(app)


@pytest.mark.parametrize("query", ["", "?dag_id=mine", "?dag_id=payroll", "?dag_id=~"])
def test_only_the_dags_the_user_may_read_whatever_the_query_names(client: TestClient, query: str) -> None:
    assert [r["dag_id"] for r in client.get(f"/api/placements{query}").json()] == ["mine"]
    page = client.get(f"/{query}")
    assert page.status_code == 200 and "payroll" not in page.text
    assert "&lt;b&gt;ok&lt;/b&gt;" in page.text, "reasons are escaped"


def test_no_user_no_page() -> None:
    for path in ("/", "/api/placements"):
        assert TestClient(plugin.create_app()).get(path).status_code == 401


def test_a_user_who_may_not_read_task_instances_gets_403(monkeypatch: pytest.MonkeyPatch) -> None:
    """was: DAG read access alone showed every placement (task id, try, host, state)"""
    monkeypatch.setattr(plugin, "get_auth_manager", lambda: DagReaderWithoutTaskInstances())
    monkeypatch.setattr(plugin, "_rows", lambda limit, dag_ids: ROWS)
    app = plugin.create_app()
    app.dependency_overrides[get_user] = lambda: object()
    for path in ("/", "/api/placements"):
        response = TestClient(app).get(path)
        assert response.status_code == 403 and "task instances" in response.text
