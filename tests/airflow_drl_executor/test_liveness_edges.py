"""The executor's supporting modules (liveness, ledger, metrics, duration history) at their edges:
found by review, each test failed on the code before its fix and names the bug in its docstring.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import threading
import time
import types
import uuid
from typing import Any

import pytest

from airflow_drl_executor.liveness import PoolWatch, Replies

POOLS = ("cpu-small", "cpu-large", "gpu")


def _replies(*workers: tuple[str, ...]) -> Replies:
    return {f"w{i}@h": [{"name": q, "exchange": {}} for q in queues] for i, queues in enumerate(workers)}


# --- liveness ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("interval_s", "answer_s"), [
    (float("inf"), 0.0), (float("nan"), 0.0), (10.0, float("inf")), (10.0, float("nan")),
])
def test_a_non_finite_interval_or_answer_time_is_refused(interval_s: float, answer_s: float) -> None:
    """PoolWatch checks ``interval_s <= 0 or answer_s < 0`` only, and NaN / inf pass it
    (``[drl_executor] pool_check_interval_s = inf`` passes the config's ``>= 0`` check too).
    inf: the thread's ``self._stop.wait(inf)`` raises OverflowError outside the loop's try, so the
    watch thread dies after its first check, and ``shelf_s`` is inf, so that first answer never
    goes stale: a pool down at start stays down for ever. NaN: ``wait(nan)`` returns at once (a
    broadcast after broadcast) and ``x > nan`` is False, so no answer ever goes stale.
    Expected: a clear ValueError, as for a negative value."""
    with pytest.raises(ValueError):
        PoolWatch(lambda: None, POOLS, interval_s=interval_s, answer_s=answer_s)


def test_a_watch_stopped_while_its_broadcast_runs_and_started_again_leaves_one_thread() -> None:
    """``stop()`` gives up joining after ``timeout_s`` (a broadcast may take the broadcast timeout
    plus BROADCAST_GRACE_S, longer than the default 5 s) and forgets the thread; ``start()`` then
    clears the one shared stop event, so the old thread, once its broadcast returns, loops on for
    ever beside the new one: two threads broadcasting, and one more per stop/start.
    Expected: the thread that was told to stop ends (e.g. one stop event per thread)."""
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def ask() -> Replies:
        calls.append(1)
        if len(calls) == 1:
            entered.set()
            release.wait(10)
        return _replies(("gpu",))

    watch = PoolWatch(ask, POOLS, interval_s=0.01)
    watch.start()
    first = watch._thread
    assert first is not None and entered.wait(10)
    watch.stop(timeout_s=0.01)  # its broadcast still runs
    watch.start()
    second = watch._thread
    release.set()
    try:
        first.join(3)
        assert not first.is_alive(), "the stopped watch thread runs on beside the new one"
    finally:
        watch._stop.set()
        first.join(5)
        if second is not None:
            second.join(5)


# --- metrics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pool", ["gpu:a100", "gpu a100"])
def test_a_pool_name_statsd_cannot_take_still_counts_its_placements_tagged(
        monkeypatch: pytest.MonkeyPatch, pool: str) -> None:
    """metrics.sent (metrics.py:107) sends the pool tag as the catalogue spells it. With
    ``[metrics] statsd_influxdb_enabled`` Airflow writes the tags into the name
    (``drl_executor.placements,pool=gpu:a100,fallback=false``), its name validator refuses the
    ':' (or a space), and the whole tagged counter is dropped, with an ERROR and a traceback at
    every placement. The catalogue accepts any non-empty pool name, and the legacy name of the
    same metric is normalised (``_named``): the tag value is not. Expected: the tagged counter
    is sent, its pool tag normalised as the legacy name's is."""
    from airflow._shared.observability.metrics import stats as shared_stats
    from airflow._shared.observability.metrics import statsd_logger

    from airflow_drl_executor import metrics
    from airflow_drl_executor.traces import PlacementRecord

    got: list[str] = []

    class Client:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def incr(self, stat: str, count: int = 1, rate: float = 1) -> None:
            got.append(stat)

    backend = statsd_logger.get_statsd_logger(stats_class=Client, host="localhost", port=8125, prefix="airflow",
                                              influxdb_tags_enabled=True, statsd_influxdb_enabled=True)
    monkeypatch.setattr(shared_stats, "_backend", backend)
    rec = PlacementRecord(ti_id=str(uuid.uuid4()), dag_id="d", run_id="r", task_id="t", map_index=-1, try_number=1,
                          pool=pool, vm_class="v", score=0.0, reason="policy", fallback=False, policy="gnn",
                          policy_version="1", request_id="q", decision_ms=1.0, features={})
    metrics.sent([rec])
    tagged = [s for s in got if s.startswith("drl_executor.placements,")]
    assert len(tagged) == 1 and ",pool=" in tagged[0], got


# --- the ledger after a restart ------------------------------------------------------------------


def test_an_adopted_task_is_charged_its_expected_run_time_not_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a scheduler restart, try_adopt_task_instances (executor.py:213) puts each adopted
    task in the ledger with ``_run_s(pool, None)``: ``default_duration_s`` over the pool's speed
    (40 s on the gpu pool), whatever the task's history. A 1-hour training task adopted on the gpu
    pool then shows the pool free 40 s after the restart, for as long as it runs, and the policy
    sends work there to wait; another scheduler's task (Airflow HA) is charged its history
    (``expected_run_s``), and so should an adopted one be.
    Expected: its expected finish is its history's 3,600 s away, not 40 s."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from airflow_drl_executor.executor import DRLExecutor

    engine = create_engine("sqlite://")
    monkeypatch.setattr("airflow.utils.session.create_session", contextlib.contextmanager(
        lambda scoped=True: (yield Session(engine))))
    ex = DRLExecutor()
    monkeypatch.setattr(ex, "bulk_state_fetcher", types.SimpleNamespace(
        get_many=lambda results: {r.task_id: ("STARTED", None) for r in results}))
    monkeypatch.setattr(ex.graph_builder, "_durations", lambda dag_id, session: {"train": [("gpu", 3600.0, 5)]})
    ti = types.SimpleNamespace(id=uuid.uuid4(), dag_id="etl", run_id="run1", task_id="train", try_number=1,
                               dag_version_id=uuid.uuid4(), map_index=-1, queue="gpu", priority_weight=1,
                               key=("etl", "train", "run1", 1, -1), executor_config={}, state="running",
                               external_executor_id="celery-train", start_date=dt.datetime.now(dt.UTC))
    assert ex.try_adopt_task_instances([ti]) == []
    assert ti.key in ex.ledger
    now = time.time()
    load = ex.ledger.load("gpu", 2, now, alive=ex.running)
    assert load.busy == 1 and load.free_at[0] > now + 1800, load


# --- duration history ----------------------------------------------------------------------------


def _airflow_db() -> Any:
    """An in-memory SQLite database with Airflow's own ``dag_run``, ``task_instance`` and ``log`` tables."""
    from airflow.models import import_all_models
    from airflow.models.base import Base
    from sqlalchemy import create_engine

    import_all_models()
    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine, tables=[Base.metadata.tables[n] for n in ("dag_run", "task_instance", "log")])
    return engine


def test_a_task_marked_success_without_running_is_not_history() -> None:
    """An operator marks a task success in the UI/API to skip it: ``TaskInstance.set_state``
    sets ``start_date = end_date = now`` and ``duration = 0.0`` on a try that never ran
    (models/taskinstance.py, set_state). ``_durations`` (graph_builder.py:392, ``TI.duration >= 0``)
    counts it as a successful try of 0 s, on the DAG's own queue: ten such runs halve the
    expected duration of a 10-minute task for the next HISTORY_RUNS runs. Expected: only the tries
    that ran count (a try that held a worker slot has a duration > 0)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import insert
    from sqlalchemy.orm import Session

    from airflow_drl_executor.graph_builder import GraphBuilder

    engine = _airflow_db()
    t0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    with engine.begin() as conn:
        for i in range(20):
            start = t0 + dt.timedelta(hours=i)
            ran = i < 10  # the last ten runs: t marked success by hand, never ran
            conn.execute(insert(DagRun.__table__).values(
                dag_id="etl", run_id=f"scheduled_{i}", run_type="scheduled", state="success", start_date=start,
                end_date=start + dt.timedelta(seconds=600), run_after=start, log_template_id=None))
            conn.execute(insert(TaskInstance.__table__).values(
                id=uuid.uuid4(), dag_id="etl", run_id=f"scheduled_{i}", task_id="t", map_index=-1, try_number=1,
                pool="default_pool", queue="cpu-small" if ran else "default", state="success",
                start_date=start, end_date=start + dt.timedelta(seconds=600 if ran else 0),
                duration=600.0 if ran else 0.0, queued_dttm=start - dt.timedelta(seconds=1) if ran else None,
                hostname="cpu-small@h" if ran else ""))
    gb = GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)
    with Session(engine) as session:
        got = gb._durations("etl", session)
    assert got == {"t": [("cpu-small", 600.0, 10)]}
