"""The executor's metrics, through Airflow's own metrics backend: StatsD, Datadog or OpenTelemetry
as ``[metrics]`` in airflow.cfg says (``statsd_on``, ``otel_on``, ...), next to the scheduler's
``executor.open_slots`` and the rest; nothing is sent when metrics are off.

Every metric is named ``drl_executor.*`` (after ``[metrics] statsd_prefix``, ``airflow.`` by
default). The tagged ones are sent tagged (Datadog, InfluxDB-style StatsD, OpenTelemetry) and,
with ``[metrics] legacy_names_on`` (Airflow's switch for its own such names), again with the tag in
the name, for plain StatsD, which drops tags (a dot in a pool's name written ``__``, as Airflow
writes its task ids there). The gauges are sent at every heartbeat. A metrics backend that fails
is logged once and never stops the scheduler.

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
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from airflow.configuration import conf
from airflow.observability import stats

from airflow_drl_executor.traces import PlacementRecord

PREFIX = "drl_executor"
log = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., None])
_failed = False


def _guarded(fn: _F) -> _F:
    """``fn``, its errors logged (the first with its traceback) and swallowed: a site's
    ``stat_name_handler``, a custom StatsD client or a bad allow-list must not stop scheduling
    (found by review: a handler that refused the names stopped every heartbeat's dispatch)."""
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> None:
        global _failed
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - metrics are never worth a heartbeat
            log.warning("DRLExecutor: metrics %s failed", fn.__name__, exc_info=not _failed)
            _failed = True
    return guarded  # type: ignore[return-value]


def _named(value: str) -> str:
    """``value`` as one level of a metric's name."""
    return stats.normalize_name_for_stats(value.replace(".", "__"), log_warning=False)


def _legacy() -> bool:
    return conf.getboolean("metrics", "legacy_names_on", fallback=True)

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
    ("fallback (held", "max_hold"),
    ("fallback (not held: a held task keeps its slot of Airflow pool", "airflow_pool"),
    ("fallback: cannot build the graph of its run", "graph"),
    ("fallback: cannot build the request", "request"),
    ("fallback: placement failed", "error"),
    ("fallback: the task is not in its run's graph", "not_in_graph"),
    ("fallback: the run's graph", "too_large"),
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


@_guarded
def sent(records: Iterable[PlacementRecord]) -> None:
    """Count the placements Celery accepted."""
    legacy = _legacy()
    for rec in records:
        # the tag as a name part may hold it (found by review: InfluxDB-style StatsD folds tags
        # into the name, whose validator refused "gpu:a100", and the counter was dropped)
        pool = stats.normalize_name_for_stats(rec.pool, log_warning=False)
        stats.incr(f"{PREFIX}.placements", tags={"pool": pool, "fallback": str(rec.fallback).lower()})
        if legacy:
            stats.incr(f"{PREFIX}.placements.{_named(rec.pool)}")
        if rec.fallback:
            cause = fallback_cause(rec.reason)
            stats.incr(f"{PREFIX}.fallbacks", tags={"cause": cause})
            if legacy:
                stats.incr(f"{PREFIX}.fallbacks.{cause}")


@_guarded
def placement_step(decision_ms: float) -> None:
    """How long one heartbeat's placement step took."""
    stats.timing(f"{PREFIX}.placement_time", dt.timedelta(milliseconds=decision_ms))


@_guarded
def gauges(*, held: int, pools_down: int, unwritten: int) -> None:
    """What the executor keeps back, the pools with no live worker, the rows the DB has not taken."""
    stats.gauge(f"{PREFIX}.held", held)
    stats.gauge(f"{PREFIX}.pools_down", pools_down)
    stats.gauge(f"{PREFIX}.unwritten_traces", unwritten)
