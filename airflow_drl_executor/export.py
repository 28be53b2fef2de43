"""Export recorded placements as replay runs (``policy.replay``) for the nightly fine-tuning.

For every DAG run with placements decided in a time window, the run's task graph is rebuilt from
its serialized DAG, and each task's duration becomes what was observed (end - start of its last
successful try) times the effective speed of the pool that ran it, i.e. the duration at speed 1.0
that the simulator expects. Tasks without a successful try keep their expected duration. Runs of
DAGs tagged ``drl-exclude`` (the retraining DAG itself, tests) are left out: only production
traffic trains the policy.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from airflow_drl_executor.graph_builder import GraphBuilder
from policy.catalogue import Catalogue
from policy.errors import PolicyError
from policy.replay import ReplayRun
from policy.schema import RunGraph, TaskNode

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

EXCLUDE_TAG = "drl-exclude"

_QUERY = text(
    """
    SELECT p.dag_id, p.run_id, p.task_id, p.pool, p.features, p.decided_at,
           t.dag_version_id, t.state, t.start_date, t.end_date
    FROM drl_placement p
    JOIN task_instance t
      ON CAST(t.id AS VARCHAR(36)) = p.ti_id AND t.try_number = p.try_number
    WHERE p.decided_at >= :since AND p.decided_at < :until
    ORDER BY p.id
    """
)


def export_runs(session: Session, catalogue: Catalogue, *, since: dt.datetime, until: dt.datetime,
                exclude_dags: Sequence[str] = ()) -> list[ReplayRun]:
    """Replay runs for placements decided in ``[since, until)``, ordered by arrival."""
    excluded = set(exclude_dags) | _tagged_dags(session, EXCLUDE_TAG)
    by_run: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in session.execute(_QUERY, {"since": since, "until": until}):
        r = dict(row._mapping)
        if r["dag_id"] not in excluded:
            by_run[(r["dag_id"], r["run_id"])].append(r)
    builder = GraphBuilder(pool_names=catalogue.names, default_queue="default", default_duration_s=60.0,
                           history_ttl_s=0)
    speeds = {p.name: p.vm_class for p in catalogue.pools}
    graphs: list[tuple[dt.datetime, RunGraph]] = []
    for (dag_id, run_id), rows in by_run.items():
        try:
            structure = builder.structure(str(rows[0]["dag_version_id"]), session)
        except PolicyError as exc:
            log.warning("export: skipping %s/%s: %s", dag_id, run_id, exc)
            continue
        latest = {r["task_id"]: r for r in rows}  # placements are ordered: the last try wins
        nodes = []
        for task_id in structure.task_ids:
            rec = latest.get(task_id)
            node = (TaskNode.from_json(json.loads(rec["features"])) if rec and rec["features"] != "{}"
                    else TaskNode(task_id))
            if (rec and str(rec["state"]) == "success" and rec["start_date"] and rec["end_date"]
                    and rec["pool"] in speeds):
                vm = speeds[rec["pool"]]
                observed = (rec["end_date"] - rec["start_date"]).total_seconds()
                node = replace(node, duration_s=max(observed, 0.001) * vm.speed * vm.affinity.get(node.kind, 1.0))
            nodes.append(node)
        graph = RunGraph(run_key=f"{dag_id}/{run_id}", tasks=tuple(nodes), edges=structure.edges)
        graphs.append((min(r["decided_at"] for r in rows), graph))
    if not graphs:
        return []
    graphs.sort(key=lambda g: g[0])
    t0 = graphs[0][0]
    return [ReplayRun(graph=g, arrival_s=(at - t0).total_seconds(), source="airflow") for at, g in graphs]


def _tagged_dags(session: Session, tag: str) -> set[str]:
    rows = session.execute(text("SELECT dag_id FROM dag_tag WHERE name = :tag"), {"tag": tag})
    return {r[0] for r in rows}
