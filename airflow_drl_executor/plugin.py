"""Airflow UI plugin: a "Placements" page listing every placement DRLExecutor made, and why.

Mounted under ``/drl`` in the api-server (FastAPI sub-application) and linked from the navigation
bar as an external view. Plugin apps get no authentication from Airflow, so every route depends on
Airflow's own user dependency (the session cookie of a logged-in user, or a bearer token) and
shows only the placements of the DAGs the auth manager lets that user read
(``get_authorized_dag_ids``), to a user who may read task instances, as Airflow's own
task-instance list does.
"""

from __future__ import annotations

import html
from typing import Any

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.core_api.security import GetUserDep
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Query, status
from fastapi.responses import HTMLResponse

from airflow_drl_executor import traces

URL_PREFIX = "/drl"


_upgraded = False


def _rows(limit: int, dag_ids: set[str]) -> list[dict[str, Any]]:
    from airflow.utils.session import create_session
    from sqlalchemy import inspect

    global _upgraded
    with create_session() as session:
        conn = session.connection()
        if not inspect(conn).has_table(traces.placements.name):
            return []
        if not _upgraded:  # a table of an earlier release, before this release's executor wrote to it
            traces.ensure_schema(conn.engine)
            _upgraded = True
        return [dict(r._mapping) for r in conn.execute(traces.outcomes_query(limit, dag_ids))]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if hasattr(value, "isoformat"):
        return html.escape(value.isoformat(timespec="seconds"))
    if isinstance(value, float):
        return f"{value:.1f}"
    return html.escape(str(value))


COLUMNS = ("dag_id", "run_id", "task_id", "try_number", "pool", "vm_class", "fallback", "policy_version",
           "decision_ms", "state", "hostname", "start_date", "end_date", "reason")


def create_app() -> FastAPI:
    def readable(user: GetUserDep) -> set[str]:
        """The DAGs this user may read: the only ones whose placements are shown. A placement is
        a task instance's record: as for Airflow's own task-instance list, a user without read
        access to task instances gets 403."""
        auth = get_auth_manager()
        if not auth.is_authorized_dag(method="GET", access_entity=DagAccessEntity.TASK_INSTANCE,
                                      details=DagDetails(), user=user):
            raise HTTPException(status.HTTP_403_FORBIDDEN, "Forbidden: no read access to task instances")
        return set(auth.get_authorized_dag_ids(user=user, method="GET"))

    app = FastAPI(title="DRL Executor placements")

    @app.get("/api/placements")
    def placements_json(dag_ids: set[str] = Depends(readable),
                        limit: int = Query(200, ge=1, le=5000)) -> list[dict[str, Any]]:
        """Latest placements joined with their outcome, as JSON."""
        return _rows(limit, dag_ids)

    @app.get("/", response_class=HTMLResponse)
    def placements_page(dag_ids: set[str] = Depends(readable), limit: int = Query(200, ge=1, le=5000)) -> str:
        rows = _rows(limit, dag_ids)
        head = "".join(f"<th>{c}</th>" for c in COLUMNS)
        body = "".join(
            "<tr class='{}'>".format("fallback" if r.get("fallback") else "policy")
            + "".join(f"<td>{_cell(r.get(c))}</td>" for c in COLUMNS) + "</tr>"
            for r in rows
        )
        fallbacks = sum(1 for r in rows if r.get("fallback"))
        return f"""<!doctype html><html><head><meta charset="utf-8"><title>DRL placements</title>
<style>body{{font-family:sans-serif;margin:1em}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:left}} tr.fallback{{background:#fff3cd}}
th{{background:#eef}}</style></head><body>
<h2>DRLExecutor placements</h2>
<p id="summary">{len(rows)} placements shown, {fallbacks} by the fallback heuristic
(highlighted). Reason = the policy's evidence for its choice.</p>
<table id="placements"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></body></html>"""

    return app


class DRLExecutorPlugin(AirflowPlugin):
    name = "drl_executor"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "DRL placements"}]
    external_views = [{
        "name": "Placements",
        "href": f"{URL_PREFIX}/",
        "destination": "nav",
        "url_route": "drl-placements",
        "category": "browse",
    }]
