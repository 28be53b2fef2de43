"""The graph builder (DAG run -> wire graph) and the executor on DAGs a user gets wrong or makes
huge: hints of the wrong shape, a map wider than the wire, a history with impossible times, a
backfill queued after the history.

Each test failed on the code before its fix, for the bug its docstring names.
"""

from __future__ import annotations

import types
import uuid
from typing import Any

import pytest

# _no_other_scheduler: test_executor's autouse fixture, here too
from test_executor import FakeClient, _no_other_scheduler, _reply  # noqa: F401
from test_graph_builder import _history_db

from airflow_drl_executor.executor import DRLExecutor
from airflow_drl_executor.graph_builder import GraphBuilder, ReadyInstance, _Structure

POOLS = ("cpu-small", "cpu-large", "gpu")


def _builder() -> GraphBuilder:
    return GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)


def _no_db(monkeypatch: pytest.MonkeyPatch, gb: GraphBuilder, structure: _Structure,
           rows: list[tuple[str, str, int, str]] | None = None,
           durations: dict[str, list[tuple[str, float, int]]] | None = None) -> None:
    """``gb`` reads ``structure`` for every DAG version, these task-instance rows and this
    history, without a database."""
    monkeypatch.setattr(gb, "structure", lambda vid, session: structure)
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: dict(durations or {}))
    monkeypatch.setattr(gb, "_ti_rows", lambda runs, session, tries_of=(): (list(rows or []), {}))
    monkeypatch.setattr(gb, "_run_ages", lambda runs, session: {f"{d}/{r}": 0.0 for d, r in runs})


def _workload(task_id: str, version: str, executor_config: Any = None) -> types.SimpleNamespace:
    ti = types.SimpleNamespace(id=uuid.uuid4(), dag_id="etl", run_id="run1", task_id=task_id, try_number=1,
                               dag_version_id=version, map_index=-1, queue="default", priority_weight=1,
                               key=("etl", task_id, "run1", 1, -1), executor_config=executor_config or {})
    return types.SimpleNamespace(ti=ti)


# --- invalid hints ---------------------------------------------------------------------------


@pytest.mark.parametrize("pool", [["gpu"], {"name": "gpu"}])
def test_a_pool_hint_that_is_a_list_or_a_mapping_is_ignored_not_raised(monkeypatch: pytest.MonkeyPatch,
                                                                       pool: Any) -> None:
    """A DAG author writes ``executor_config={"drl": {"pool": ["gpu"]}}`` (a list, or a mapping).
    The README promises that a hint that is not valid "is dropped, that hint only: the run is
    still placed by the policy". What happens: ``lenient_node`` tests ``pool not in
    set(pool_names)``, which raises ``TypeError: unhashable type`` for a list or a dict, so
    building the run's graph raises instead of reporting the hint as ignored. Expected: the run's
    graph is built, the task unpinned, and the ignored hint named in ``Batch.ignored``."""
    gb = _builder()
    structure = _Structure(task_ids=("a", "b"), edges=((0, 1),), hints=({"pool": pool}, {}),
                           queues=("default", "default"))
    _no_db(monkeypatch, gb, structure)
    batch = gb.build([ReadyInstance("etl", "r1", "a", 1, "v")], None)  # type: ignore[arg-type]
    assert [t.pool for t in batch.graphs["etl/r1"].tasks] == [None, None]
    assert "pinned pool" in batch.ignored[("etl/r1", "a")]


@pytest.mark.parametrize(("hints", "named"), [
    ({"pool": ["gpu"]}, "ignored: task 'a': pinned pool"),
    ({"memory_gb": 10**400}, "ignored: task 'a': executor_config drl.memory_gb"),
])
def test_a_hint_of_the_wrong_shape_does_not_stop_the_scheduler(monkeypatch: pytest.MonkeyPatch, hints: dict,
                                                               named: str) -> None:
    """The typos of the tests beside this one, seen from the scheduler: ``DRLExecutor._place`` catches the graph
    builder's error and falls back to ``_place_alone``, which builds the task's node from the
    workload's ``executor_config`` with the same ``lenient_node`` outside any ``try``
    (executor.py, ``_place_alone``): the TypeError / OverflowError leaves ``_place`` (and
    ``_process_workloads``, and the scheduler loop, which exits). Every heartbeat that queues
    that task kills the scheduler again. Expected: both tasks placed, the typo'd one with its
    hint ignored and named in the reason."""
    ex = DRLExecutor()
    version = str(uuid.UUID(int=1))
    structure = _Structure(task_ids=("a", "b"), edges=(), hints=(hints, {}), queues=("default", "default"))
    _no_db(monkeypatch, ex.graph_builder, structure)
    monkeypatch.setattr(ex, "_set_queues", lambda tasks: None)
    ex._client = FakeClient(_reply({"a": "cpu-large", "b": "cpu-small"}))  # type: ignore[assignment]
    a = _workload("a", version, {"drl": hints})
    b = _workload("b", version)
    records, held = ex._place([a, b])
    by_task = {r.task_id: r for _, r in records}
    assert not held and set(by_task) == {"a", "b"}
    assert named in by_task["a"].reason


def test_a_huge_integer_hint_is_ignored_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """``executor_config={"drl": {"memory_gb": 10**400}}`` (an integer, so JSON and the
    serialized DAG carry it as is) passes ``0 <= value < math.inf`` and then ``float(value)``
    raises ``OverflowError`` in ``lenient_node`` (graph_builder.py:136): the run's graph is not
    built and the error leaves ``GraphBuilder.build``. Expected, as for any hint that is not a
    finite number: that hint is ignored and named, the run still built."""
    gb = _builder()
    structure = _Structure(task_ids=("a",), edges=(), hints=({"memory_gb": 10**400},), queues=("default",))
    _no_db(monkeypatch, gb, structure)
    batch = gb.build([ReadyInstance("etl", "r1", "a", 1, "v")], None)  # type: ignore[arg-type]
    assert batch.graphs["etl/r1"].tasks[0].memory_gb == 1.0
    assert "drl.memory_gb" in batch.ignored[("etl/r1", "a")]


# --- huge fan-out ----------------------------------------------------------------------------


def test_a_mapped_task_wider_than_the_servers_task_limit_costs_only_its_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mapped task with more instances than ``policy.schema.MAX_TASKS_PER_RUN`` (50,000; a
    legal DAG once ``[core] max_map_length`` is raised) becomes one node per instance, and
    ``build`` hands the executor a graph the policy server refuses to decode (``run[..].tasks:
    50002 entries, limit is 50000``): the request is answered ``bad_request`` and every task of the
    batch, of every other run too, is placed by the fallback, at every heartbeat while that run
    has ready tasks. (The nightly export, ``export.py``, checks the same limit; the graph builder
    does not.) Expected: every graph ``build`` returns is one the server's schema accepts (a run
    that cannot be described within the limits costs only that run), and the other run of the
    batch is still asked about."""
    from policy.schema import MAX_TASKS_PER_RUN, RunGraph, RunProgress

    gb = _builder()
    structure = _Structure(task_ids=("m", "split"), edges=((1, 0),), hints=({}, {}), queues=("default", "default"))
    wide = MAX_TASKS_PER_RUN + 1
    rows = [("etl/big", "m", i, "") for i in range(wide)] + [("etl/big", "split", -1, "success"),
                                                              ("etl/small", "m", 0, ""), ("etl/small", "split", -1, "success")]
    _no_db(monkeypatch, gb, structure, rows)
    batch = gb.build([ReadyInstance("etl", "big", "m", 1, "v", map_index=0),
                      ReadyInstance("etl", "small", "m", 1, "v", map_index=0)], None)  # type: ignore[arg-type]
    assert [t.task_id for t in batch.ready if t.run_key == "etl/small"] == ["m[0]"]
    for run_key, graph in batch.graphs.items():
        try:
            RunGraph.from_json(graph.to_json())
        except Exception as exc:  # noqa: BLE001 - what the policy server answers bad_request for
            pytest.fail(f"the server refuses the graph of {run_key}: {exc}")
    for p in batch.progress:
        RunProgress.from_json(p.to_json())


# --- duration history ------------------------------------------------------------------------


def test_a_negative_duration_in_the_history_is_left_out_not_averaged_in() -> None:
    """A worker whose clock stepped back while a task ran (an NTP step after a VM resumed)
    leaves a successful try with ``end_date < start_date``, and Airflow stores its negative
    ``duration`` (``end - start``). ``_durations`` leaves out a negative time for a try resumed
    from deferral (``if seconds >= 0``) but averages the plain tries' ``duration`` as stored
    (graph_builder.py, the ``func.avg(TI.duration)`` query): one try of -3,590 s among nineteen of
    10 s makes the task's expected duration negative, clamped to 0.001 s for the next 20 runs, so
    a 10 s task looks free to the policy (its critical path, its pool's backlog). Expected: the
    impossible negative time is left out, as on the resumed path: 10 s from the 19 real tries."""
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    engine = _history_db()
    with engine.begin() as conn:
        for i in range(20):
            conn.execute(text("INSERT INTO dag_run (dag_id, run_id) VALUES ('etl', :r)"), {"r": f"r{i}"})
            seconds = -3590.0 if i == 7 else 10.0
            conn.execute(text("INSERT INTO task_instance (dag_id, run_id, task_id, queue, state, duration) "
                              "VALUES ('etl', :r, 't', 'cpu-small', 'success', :s)"), {"r": f"r{i}", "s": seconds})
    gb = _builder()
    with Session(engine) as session:
        got = gb._durations("etl", session)
    assert got == {"t": [("cpu-small", 10.0, 19)]}


def _airflow_db() -> Any:
    """An in-memory SQLite database with Airflow's own ``dag_run``, ``task_instance`` and ``log``
    tables (every column a query may read)."""
    from airflow.models import import_all_models
    from airflow.models.base import Base
    from sqlalchemy import create_engine

    import_all_models()
    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine, tables=[Base.metadata.tables[n] for n in ("dag_run", "task_instance", "log")])
    return engine


def test_a_backfill_queued_after_the_history_does_not_erase_it() -> None:
    """Airflow 3's ``airflow backfill create`` (and the UI's backfill) creates every run of the
    backfill at once, queued (``models/backfill.py``: ``_create_runs_non_partitioned``), and runs
    them a few at a time (``max_active_runs``). ``_durations`` takes "the DAG's latest
    ``HISTORY_RUNS`` runs" as the 20 highest ``dag_run.id``: for all but the last hours of a
    30-run backfill those are runs that have not started, with no successful try, so every task
    of the DAG loses its history (a 1-hour training task is sent as the 60 s default) for as long
    as the backfill lasts. Expected: the history is read from the latest runs that ran: 10 s
    from the 20 finished runs here."""
    import datetime as dt

    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import insert
    from sqlalchemy.orm import Session

    engine = _airflow_db()
    t0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    with engine.begin() as conn:
        for i in range(20):  # the DAG's finished runs: t took 10 s on cpu-small
            start = t0 + dt.timedelta(hours=i)
            conn.execute(insert(DagRun.__table__).values(
                dag_id="etl", run_id=f"scheduled_{i}", run_type="scheduled", state="success", start_date=start,
                end_date=start + dt.timedelta(seconds=10), run_after=start, log_template_id=None))
            conn.execute(insert(TaskInstance.__table__).values(
                id=uuid.uuid4(), dag_id="etl", run_id=f"scheduled_{i}", task_id="t", map_index=-1, try_number=1,
                pool="default_pool", queue="cpu-small", state="success", start_date=start,
                end_date=start + dt.timedelta(seconds=10), duration=10.0, queued_dttm=start))
        for i in range(30):  # then a backfill of 30 days: created at once, queued, not started
            conn.execute(insert(DagRun.__table__).values(
                dag_id="etl", run_id=f"backfill_{i}", run_type="backfill", state="queued",
                run_after=t0 - dt.timedelta(days=30 - i), log_template_id=None))
            conn.execute(insert(TaskInstance.__table__).values(
                id=uuid.uuid4(), dag_id="etl", run_id=f"backfill_{i}", task_id="t", map_index=-1, try_number=0,
                pool="default_pool", queue="default", state=None))
    gb = _builder()
    with Session(engine) as session:
        got = gb._durations("etl", session)
    assert got == {"t": [("cpu-small", 10.0, 20)]}
