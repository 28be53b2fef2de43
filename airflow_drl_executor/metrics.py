"""The executor's metrics, through Airflow's own metrics backend: StatsD, Datadog or OpenTelemetry
as ``[metrics]`` in airflow.cfg says (``statsd_on``, ``otel_on``, ...), next to the scheduler's
``executor.open_slots`` and the rest; nothing is sent when metrics are off.

Every metric is named ``drl_executor.*`` (after ``[metrics] statsd_prefix``, ``airflow.`` by
default). The tagged ones are sent twice, as Airflow sends its own: once tagged (Datadog,
InfluxDB-style StatsD, OpenTelemetry) and once with the tag in the name (plain StatsD drops tags).

=====================================  =======  ===========================================================
name                                   type     what
=====================================  =======  ===========================================================
``placements`` (``.<pool>``)           counter  tasks sent to Celery on a pool (tags ``pool``, ``fallback``)
``fallbacks`` (``.<cause>``)           counter  of those, placed by the fallback heuristic (tag ``cause``:
                                                :data:`CAUSES`)
``placement_time``                     timer    one heartbeat's placement step (DB reads, the policy
                                                server's round trip, the decision)
``held``                               gauge    tasks kept back for a better pool
``unwritten_traces``                   gauge    placement rows the metadata DB has not taken yet (also on
                                                disk: :mod:`.spool`)
``pools_down``                         gauge    pools with no live Celery worker
=====================================  =======  ===========================================================
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from airflow.observability import stats

from airflow_drl_executor.traces import PlacementRecord

PREFIX = "drl_executor"

#: the start of a fallback's reason (as the executor and its client write them) -> its cause
_REASONS: tuple[tuple[str, str], ...] = (
    ("fallback (no reply within", "timeout"),
    ("fallback (redis error", "redis"),
    ("fallback (redis unreachable", "redis"),
    ("fallback (no policy server", "no_server"),
    ("fallback (no live policy server", "no_server"),
    ("fallback (policy server error", "server_error"),
    ("fallback (request of", "too_large"),
    ("fallback (malformed reply", "bad_reply"),
    ("fallback (reply for", "bad_reply"),
    ("fallback (policy chose a pool not in the catalogue", "unknown_pool"),
    ("fallback (waited", "max_wait"),
    ("fallback (not held: a held task keeps its slot of Airflow pool", "airflow_pool"),
    ("fallback: cannot build the graph of its run", "graph"),
    ("fallback: cannot build the request", "request"),
    ("fallback: placement failed", "error"),
    ("fallback: the task is not in its run's graph", "not_in_graph"),
)
#: every cause a fallback is counted under; ``server``: the policy server's own fallback (its
#: load-skew breaker, a placer error: counted by reason in the server's Prometheus metrics)
CAUSES: tuple[str, ...] = (*dict.fromkeys(c for _, c in _REASONS), "server", "other")


def fallback_cause(reason: str) -> str:
    """The cause (one of :data:`CAUSES`) of a fallback placement with this ``reason``."""
    for start, cause in _REASONS:
        if reason.startswith(start):
            return cause
    return "other" if reason.startswith("fallback") else "server"


def sent(records: Iterable[PlacementRecord]) -> None:
    """Count the placements Celery accepted."""
    for rec in records:
        pool = stats.normalize_name_for_stats(rec.pool, log_warning=False)
        stats.incr(f"{PREFIX}.placements", tags={"pool": pool, "fallback": str(rec.fallback).lower()})
        stats.incr(f"{PREFIX}.placements.{pool}")
        if rec.fallback:
            cause = fallback_cause(rec.reason)
            stats.incr(f"{PREFIX}.fallbacks", tags={"cause": cause})
            stats.incr(f"{PREFIX}.fallbacks.{cause}")


def placement_step(decision_ms: float, held: int, pools_down: int) -> None:
    """One heartbeat's placement step: how long it took, what it kept back, the pools down."""
    stats.timing(f"{PREFIX}.placement_time", dt.timedelta(milliseconds=decision_ms))
    stats.gauge(f"{PREFIX}.held", held)
    stats.gauge(f"{PREFIX}.pools_down", pools_down)


def unwritten(rows: int) -> None:
    stats.gauge(f"{PREFIX}.unwritten_traces", rows)
