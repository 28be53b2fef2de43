"""Export recorded placements as replay runs (``policy.replay``) for the nightly fine-tuning.

For every DAG run that ended in a time window, with every placement it had (found by review: the
window selected placements by their decision time, so a run going at the cut-off was exported by
two nights, each copy with half its durations observed and the rest made up, and a run still
going had its tasks that were still running at their declared durations), the run's task graph is rebuilt from
its serialized DAG, and each task's duration becomes what was observed (end - start of its last
successful try) times the effective speed of the pool that ran it, i.e. the duration at speed 1.0
that the simulator expects. Tasks without a successful try keep their expected duration. Runs of
DAGs tagged ``drl-exclude`` (the retraining DAG itself, tests) are left out: only production
traffic trains the policy.

Nodes are what the graph builder sends the policy: a placed task keeps the features recorded with
its placement; a task never placed (skipped, or its run ended first) is built from its
``executor_config["drl"]`` hints by :func:`~airflow_drl_executor.graph_builder.lenient_node` (less
the invalid ones, as the executor sent it), with
``default_duration_s`` when it declares no duration (the export reads no duration history). As
in the graph builder, an expanded mapped task is one node per instance (``task_id[map_index]``,
the task's edges), each with its own observed duration (its last successful try), or the
longest of its task's instances' when it has none.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import DateTime, bindparam, text

from airflow_drl_executor.graph_builder import (
    GraphBuilder,
    expand_mapped,
    expansions,
    lenient_node,
    node_id,
    worker_seconds,
    worker_starts,
)
from policy.catalogue import Catalogue, VMClass
from policy.errors import PolicyError, SchemaError
from policy.replay import ReplayRun
from policy.schema import MAX_EDGES_PER_RUN, MAX_TASKS_PER_RUN, RunGraph, TaskNode

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

EXCLUDE_TAG = "drl-exclude"

_QUERY = text(
    """
    SELECT p.dag_id, p.run_id, p.task_id, p.map_index, p.try_number, p.pool, p.features, p.decided_at,
           t.dag_version_id, t.state, t.start_date, t.end_date, t.queued_dttm, t.next_method
    FROM drl_placement p
    JOIN task_instance t
      ON t.id = p.ti_id AND t.try_number = p.try_number
    JOIN dag_run r
      ON r.dag_id = p.dag_id AND r.run_id = p.run_id
    WHERE r.end_date >= :since AND r.end_date < :until
    ORDER BY p.try_number, p.id
    """
).bindparams(  # typed, so that every database (SQLite too) compares and returns datetimes
    bindparam("since", type_=DateTime(timezone=True)), bindparam("until", type_=DateTime(timezone=True)),
).columns(decided_at=DateTime(timezone=True), start_date=DateTime(timezone=True), end_date=DateTime(timezone=True),
           queued_dttm=DateTime(timezone=True))

#: Each run's arrival: its first placement of any try since it was last queued (found by review:
#: the placements joined above are the current tries' only, so a run whose first task was retried
#: arrived at the retry; and a run cleared after an export, exported again when it ended again,
#: arrived at its day-old first placement, shifting every other run of the night's file by a day).
#: Clearing a finished run queues it again (``queued_at`` = the clear).
_ARRIVALS = text(
    """
    SELECT p.dag_id, p.run_id, MIN(p.decided_at) AS arrived
    FROM drl_placement p
    JOIN dag_run r
      ON r.dag_id = p.dag_id AND r.run_id = p.run_id
    WHERE r.end_date >= :since AND r.end_date < :until
      AND (r.queued_at IS NULL OR p.decided_at >= r.queued_at)
    GROUP BY p.dag_id, p.run_id
    """
).bindparams(
    bindparam("since", type_=DateTime(timezone=True)), bindparam("until", type_=DateTime(timezone=True)),
).columns(arrived=DateTime(timezone=True))


def export_runs(session: Session, catalogue: Catalogue, *, since: dt.datetime, until: dt.datetime,
                exclude_dags: Sequence[str] = (), default_queue: str = "default",
                default_duration_s: float = 60.0) -> list[ReplayRun]:
    """Replay runs of the DAG runs that ended in ``[since, until)`` (a run still going is exported
    by the window it ends in), ordered by arrival (their first placement, of any try, since they were
    last queued). A task never placed is the node the executor would have sent: pass its
    ``[operators] default_queue`` and ``[drl_executor] default_duration_s`` (found by review: 60 s
    and "default" were written here whatever the executor used)."""
    excluded = set(exclude_dags) | _tagged_dags(session, EXCLUDE_TAG)
    by_run: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in session.execute(_QUERY, {"since": since, "until": until}):
        r = dict(row._mapping)
        if r["dag_id"] not in excluded:
            by_run[(r["dag_id"], r["run_id"])].append(r)
    # a try resumed from deferral: its run after the trigger fired, from its last start (Airflow's
    # log), as the graph builder's history counts it (was: from its first start, the wait in the
    # triggerer counted as run time)
    def try_of(r: Mapping[str, Any]) -> tuple[str, str, str, int, int]:
        return (r["dag_id"], r["task_id"], r["run_id"], r["map_index"], r["try_number"])

    every = [r for rows in by_run.values() for r in rows]
    logged = worker_starts(session, [try_of(r) for r in every if r["queued_dttm"] and r["start_date"]
                                     and r["queued_dttm"] > r["start_date"]])
    for r in every:
        r["logged_start"] = logged.get(try_of(r))
    vms = {p.name: p.vm_class for p in catalogue.pools}
    foreign = Counter(str(r["pool"]) for r in every if r["pool"] not in vms)
    if foreign:
        # found by review: with another catalogue than the scheduler's (a worker without [drl_executor]
        # catalogue reads the packaged demo one) every observed duration was dropped without a word
        n = sum(foreign.values())
        where = f"{n} of {len(every)} placements were on pools not in the catalogue {catalogue.source}"
        if n == len(every):
            raise PolicyError(f"export: {where} ({', '.join(sorted(foreign))}): this worker reads another "
                              "catalogue than the scheduler's (set [drl_executor] catalogue here as there), or the "
                              "catalogue's pools were renamed since")
        log.warning("export: %s (%s): their durations are not observed", where,
                    ", ".join(f"{p} {n}" for p, n in foreign.most_common(10)))
    builder = GraphBuilder(pool_names=catalogue.names, default_queue=default_queue,
                           default_duration_s=default_duration_s, history_ttl_s=0, vm_classes=vms)
    arrived = {(r.dag_id, r.run_id): r.arrived for r in session.execute(_ARRIVALS, {"since": since, "until": until})}
    graphs: list[tuple[dt.datetime, RunGraph]] = []
    for (dag_id, run_id), rows in by_run.items():
        try:
            graph = _graph(f"{dag_id}/{run_id}", rows, builder, vms, session)
        except PolicyError as exc:
            log.warning("export: skipping %s/%s: %s", dag_id, run_id, exc)
            continue
        if len(graph.tasks) > MAX_TASKS_PER_RUN or len(graph.edges) > MAX_EDGES_PER_RUN:
            # found by review: such a run was written, and made the whole file unreadable
            log.warning("export: skipping %s/%s: %d tasks, %d edges, more than a replay run may hold (%d, %d)",
                        dag_id, run_id, len(graph.tasks), len(graph.edges), MAX_TASKS_PER_RUN, MAX_EDGES_PER_RUN)
            continue
        graphs.append((arrived.get((dag_id, run_id)) or min(r["decided_at"] for r in rows), graph))
    if not graphs:
        return []
    graphs.sort(key=lambda g: g[0])
    t0 = graphs[0][0]
    return [ReplayRun(graph=g, arrival_s=(at - t0).total_seconds(), source="airflow") for at, g in graphs]


def _features(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A placement row's task node as JSON; :class:`SchemaError` (its run is skipped) for text that
    is not a JSON object (found by review: JSONDecodeError out of the nightly export, every night
    until the row was pruned)."""
    try:
        node = json.loads(rec["features"])
    except (TypeError, ValueError, RecursionError) as exc:
        raise SchemaError(f"task {rec['task_id']!r}: its placement's features are not JSON: {exc}") from None
    if not isinstance(node, dict):
        raise SchemaError(f"task {rec['task_id']!r}: its placement's features are not a JSON object")
    return node


def _graph(run_key: str, rows: Sequence[dict[str, Any]], builder: GraphBuilder, vms: Mapping[str, VMClass],
           session: Session) -> RunGraph:
    """One run's graph from its placement rows (ordered by id: a later try comes later); ``vms``:
    each pool's VM class."""
    structure = builder.structure(str(rows[0]["dag_version_id"]), session)
    placed = {r["task_id"]: r for r in rows}  # the task's last placement, of any instance
    instances = {(r["task_id"], r["map_index"]): r for r in rows}  # each instance's last try
    observed: dict[str, list[tuple[str, float]]] = defaultdict(list)  # (pool, seconds) of successful runs
    for (task_id, _), r in instances.items():
        seconds = _seconds(r)
        if seconds is not None and r["pool"] in vms:
            observed[task_id].append((r["pool"], seconds))
    nodes = []
    for task_id, hints, queue in zip(structure.task_ids, structure.hints, structure.queues, strict=True):
        rec = placed.get(task_id)
        if rec is not None and rec["features"] != "{}":  # (an instance's node: named for the task here)
            node = replace(TaskNode.from_json(_features(rec)), task_id=task_id)
        else:  # never placed (or placed outside the graph): what the graph builder would send
            node, _ = lenient_node(task_id, hints, queue, duration_s=builder.default_duration_s,
                                   pool_names=builder.pool_names, default_queue=builder.default_queue)
        if observed[task_id]:
            node = replace(node, duration_s=max(
                s * vms[pool].speed_for(node.kind) for pool, s in observed[task_id]))
        nodes.append(node)
    # a mapped task's instances as the graph builder sent them, each with its own observed time
    expansion = expansions((run_key, t, m, "") for t, m in instances).get(run_key, {})
    kinds = {n.task_id: n.kind for n in nodes}
    own: dict[str, float] = {}
    for (task_id, m), r in instances.items():
        seconds = _seconds(r)
        if m >= 0 and seconds is not None and r["pool"] in vms:
            own[node_id(task_id, m)] = seconds * vms[r["pool"]].speed_for(kinds.get(task_id, "default"))
    tasks, edges = expand_mapped(nodes, structure.edges, expansion, paired=structure.paired)
    tasks = tuple(replace(n, duration_s=own[n.task_id]) if n.task_id in own else n for n in tasks)
    return RunGraph(run_key=run_key, tasks=tasks, edges=edges)


def _seconds(r: Mapping[str, Any]) -> float | None:
    """A successful try's time on a worker, seconds (:func:`graph_builder.worker_seconds`); none
    for a try that ended in the triggerer (its ``next_method`` still set: its time on a worker is
    recorded nowhere)."""
    if str(r["state"]) == "success" and r["start_date"] and r["end_date"] and not r.get("next_method"):
        return max(worker_seconds(r["start_date"], r["end_date"], r.get("queued_dttm"), r.get("logged_start")), 0.001)
    return None


def _tagged_dags(session: Session, tag: str) -> set[str]:
    rows = session.execute(text("SELECT dag_id FROM dag_tag WHERE name = :tag"), {"tag": tag})
    return {r[0] for r in rows}
