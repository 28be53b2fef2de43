"""Airflow UI plugin: a "Placements" page listing every placement DRLExecutor made, and why,
under a line saying which policy servers are live and what model each serves.

Mounted under ``/drl`` in the api-server (FastAPI sub-application) and linked from the navigation
bar as an external view. Plugin apps get no authentication from Airflow, so every route depends on
Airflow's own user dependency (the session cookie of a logged-in user, or a bearer token) and
shows only the placements of the DAGs the auth manager lets that user read
(``get_authorized_dag_ids``), to a user who may read task instances, as Airflow's own
task-instance list does.

The page filters by DAG, run, task, pool and who placed the task (the policy or the fallback
heuristic), and pages back through every placement kept (``before``: the id of the last row
shown), so a placement of any age is one query away, not only the latest ``limit``.
"""

from __future__ import annotations

import html
from collections import Counter
from typing import Any
from urllib.parse import urlencode

from airflow.api_fastapi.app import get_auth_manager
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
from airflow.api_fastapi.core_api.security import GetUserDep
from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Query, status
from fastapi.responses import HTMLResponse

from airflow_drl_executor import traces

URL_PREFIX = "/drl"


_upgraded = False


def _rows(limit: int, dag_ids: set[str], where: traces.PlacementFilter) -> list[dict[str, Any]]:
    from airflow.utils.session import create_session
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError

    global _upgraded
    try:
        with create_session() as session:
            conn = session.connection()
            if not inspect(conn).has_table(traces.placements.name):
                return []
            if not _upgraded:  # a table of an earlier release, before this release's executor wrote to it
                traces.ensure_schema(conn.engine)
                _upgraded = True
            return [dict(r._mapping) for r in conn.execute(traces.outcomes_query(limit, dag_ids, where))]
    except SQLAlchemyError as exc:  # found by review: a bare HTTP 500 for a database that did not answer
        cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0][:300]
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE,
                            f"the metadata database did not answer the placements query: {type(exc).__name__}: "
                            f"{cause}") from None


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if hasattr(value, "isoformat"):
        return html.escape(value.isoformat(timespec="seconds"))
    if isinstance(value, float):
        return f"{value:.1f}"
    return html.escape(str(value))


def _serving() -> str:
    """What the policy servers serve now, from their heartbeats in Redis (model version, device,
    age), read with the executor's ``[drl_executor]`` options; bounded (0.5 s), and a Redis or an
    option that does not work is said, not raised: the page shows the placements all the same."""
    from airflow.configuration import conf

    from airflow_drl_executor.check import check_redis, check_servers
    from airflow_drl_executor.config import ExecutorConfig

    try:
        cfg = ExecutorConfig.from_conf(conf)
    except Exception as exc:  # noqa: BLE001 - found by review: a redis_url_cmd that fails here (the
        # api-server lacks the scheduler's secret) raised AirflowConfigException: HTTP 500 for the page
        return f"unknown ({type(exc).__name__}: {exc})"
    reached, r = check_redis(cfg, 0.5)
    if r is None:
        return f"unknown (Redis {reached.detail})"
    try:
        return check_servers(cfg, r).detail
    finally:
        r.close()


COLUMNS = ("dag_id", "run_id", "task_id", "map_index", "try_number", "pool", "vm_class", "fallback",
           "policy_version", "decided_at", "decision_ms", "state", "hostname", "start_date", "end_date", "reason")
FILTERS = ("dag_id", "run_id", "task_id", "pool")


def _text(value: str | None) -> str | None:
    """A filter field as a form sends it: an empty field filters nothing."""
    return value.strip() or None if value is not None else None


#: a filter field: printable text (a NUL or a control character made PostgreSQL's driver raise:
#: HTTP 500 where a bad filter gets 422)
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"


def placement_filter(dag_id: str | None = Query(None, max_length=250, pattern=PRINTABLE),
                     run_id: str | None = Query(None, max_length=250, pattern=PRINTABLE),
                     task_id: str | None = Query(None, max_length=250, pattern=PRINTABLE),
                     pool: str | None = Query(None, max_length=250, pattern=PRINTABLE),
                     fallback: str | None = Query(None, pattern="^(|yes|no)$",
                                                  description="yes: the fallback's placements only; no: the policy's"),
                     # the id column is an Integer: past it SQLite's driver raised (HTTP 500)
                     before: int | None = Query(None, ge=1, le=2**31 - 1,
                                                description="page back: placements older than this id"),
                     ) -> traces.PlacementFilter:
    """The page's query string as a :class:`traces.PlacementFilter`."""
    return traces.PlacementFilter(dag_id=_text(dag_id), run_id=_text(run_id), task_id=_text(task_id),
                                  pool=_text(pool), fallback={"yes": True, "no": False}.get(fallback or ""),
                                  before_id=before)


def _form(where: traces.PlacementFilter, limit: int) -> str:
    fields = "".join(
        f"<label>{name} <input name='{name}' value='{_cell(getattr(where, name))}' size='14'></label> "
        for name in FILTERS)
    chosen = {None: "", True: "yes", False: "no"}[where.fallback]
    options = "".join(f"<option value='{v}'{' selected' if v == chosen else ''}>{label}</option>"
                      for v, label in (("", "any"), ("yes", "fallback only"), ("no", "policy only")))
    return (f"<form id='filters' method='get'>{fields}<label>placed by <select name='fallback'>{options}"
            f"</select></label> <input type='hidden' name='limit' value='{limit}'>"
            "<button type='submit'>filter</button> <a href='?'>clear</a></form>")


def _older(where: traces.PlacementFilter, limit: int, rows: list[dict[str, Any]]) -> str:
    """The link to the next page back: the same filters, before the last row shown."""
    if len(rows) < limit:
        return ""
    query = {name: getattr(where, name) for name in FILTERS if getattr(where, name) is not None}
    if where.fallback is not None:
        query["fallback"] = "yes" if where.fallback else "no"
    query.update(limit=str(limit), before=str(rows[-1]["id"]))
    return f"<p><a id='older' href='?{html.escape(urlencode(query))}'>older placements</a></p>"


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
                        where: traces.PlacementFilter = Depends(placement_filter),
                        limit: int = Query(200, ge=1, le=5000)) -> list[dict[str, Any]]:
        """Latest placements joined with their outcome, as JSON; the filters as on the page, and
        ``before`` (the last row's ``id``) for the next page back."""
        return _rows(limit, dag_ids, where)

    @app.get("/", response_class=HTMLResponse)
    def placements_page(dag_ids: set[str] = Depends(readable),
                        where: traces.PlacementFilter = Depends(placement_filter),
                        limit: int = Query(200, ge=1, le=5000)) -> str:
        rows = _rows(limit, dag_ids, where)
        head = "".join(f"<th>{c}</th>" for c in COLUMNS)
        body = "".join(
            "<tr class='{}'>".format("fallback" if r.get("fallback") else "policy")
            + "".join(f"<td>{_cell(r.get(c) if c != 'map_index' or r.get(c) != -1 else None)}</td>"
                      for c in COLUMNS) + "</tr>"
            for r in rows
        )
        fallbacks = sum(1 for r in rows if r.get("fallback"))
        per_pool = Counter(str(r.get("pool")) for r in rows)
        pools = ", ".join(f"{_cell(pool)} {n}" for pool, n in sorted(per_pool.items()))
        return f"""<!doctype html><html><head><meta charset="utf-8"><title>DRL placements</title>
<style>body{{font-family:sans-serif;margin:1em}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:left}} tr.fallback{{background:#fff3cd}}
th{{background:#eef}} form{{margin:0 0 .8em}}</style></head><body>
<h2>DRLExecutor placements</h2>
<p id="serving">Policy servers: {html.escape(_serving())}</p>
{_form(where, limit)}
<p id="summary">{len(rows)} placements shown, {fallbacks} by the fallback heuristic
(highlighted){f"; by pool: {pools}" if pools else ""}. Reason = the policy's evidence for its choice.</p>
<table id="placements"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>
{_older(where, limit, rows)}</body></html>"""

    return app


class DRLExecutorPlugin(AirflowPlugin):
    name = "drl_executor"
    fastapi_apps = [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "DRL placements"}]
    external_views = [{
        "name": "Placements",
        # relative: the UI's <base href> (Airflow's base_url) resolves it, under a path prefix too
        # (was "/drl/": behind https://host/airflow the view loaded https://host/drl/, outside Airflow)
        "href": f"{URL_PREFIX.lstrip('/')}/",
        "destination": "nav",
        "url_route": "drl-placements",
        "category": "browse",
    }]
