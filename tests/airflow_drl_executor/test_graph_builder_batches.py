"""The graph builder on batches: one run's problem costs that run only, and a batch of many runs is
read in bounded queries (found by review; each test failed on the code before its fix)."""

from __future__ import annotations

from typing import Any

import pytest

POOLS = ("cpu-small", "cpu-large", "gpu")


def _builder() -> Any:
    from airflow_drl_executor.graph_builder import GraphBuilder

    return GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)


def test_an_unreadable_dag_version_costs_only_its_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GraphBuilder._graph`` catches ``PolicyError`` only, but reading a DAG version can raise
    anything: a rolling upgrade's newer serialized DAG ("Unsure how to deserialize version N"), a
    timetable or operator link not registered in this scheduler (``_declared`` handles exactly
    this for another scheduler's tasks). The error leaves ``build`` and the executor's
    ``except Exception`` sends every task of the batch, of every other run too, to the fallback,
    at every heartbeat while that run has ready tasks. Expected: that run in ``Batch.failed``,
    the other run still asked about."""
    import airflow.models.dagbag as dagbag
    from airflow.providers.standard.operators.empty import EmptyOperator
    from airflow.sdk import DAG
    from airflow.serialization.serialized_objects import DagSerialization

    from airflow_drl_executor.graph_builder import ReadyInstance

    with DAG("good", schedule=None) as dag:
        EmptyOperator(task_id="a") >> EmptyOperator(task_id="b")
    serialized = DagSerialization.from_dict(DagSerialization.to_dict(dag))

    class Bag:
        def __init__(self, **_: Any) -> None:
            pass

        def get_dag(self, version_id: str, session: Any) -> Any:
            if version_id == "v-new":
                raise ValueError("Unsure how to deserialize version 4")
            return serialized

    monkeypatch.setattr(dagbag, "DBDagBag", Bag)
    gb = _builder()
    monkeypatch.setattr(gb, "_ti_rows", lambda runs, session, tries_of=(): ([], {}))
    monkeypatch.setattr(gb, "_run_ages", lambda runs, session: {f"{d}/{r}": 0.0 for d, r in runs})
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: {})
    try:
        batch = gb.build([ReadyInstance("good", "r1", "a", 1, "v-old"),
                          ReadyInstance("other", "r1", "a", 1, "v-new")], None)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"one run's unreadable DAG version failed the whole batch: {type(exc).__name__}: {exc}")
    assert "other/r1" in batch.failed
    assert [(t.run_key, t.task_id) for t in batch.ready] == [("good/r1", "a")]


def _ti_db() -> Any:
    from sqlalchemy import create_engine, text

    engine = create_engine("sqlite://")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE task_instance (dag_id TEXT, run_id TEXT, task_id TEXT, map_index INTEGER, "
                          "state TEXT, max_tries INTEGER)"))
        conn.execute(text("CREATE TABLE dag_run (id INTEGER PRIMARY KEY, dag_id TEXT, run_id TEXT, "
                          "start_date TIMESTAMP)"))
    return engine


def test_a_batch_of_a_thousand_runs_is_read_in_bounded_or_lists() -> None:
    """``_ti_rows`` and ``_run_ages`` put one ``(dag_id = ? AND run_id = ?)`` term per run of the
    batch into a single OR: on SQLite a batch of ready tasks from ~1,000 runs (a backfill; a
    request takes 4,096 ready tasks) fails with "Expression tree is too large (maximum depth
    1000)", an SQLAlchemyError, and the whole batch goes to the fallback at every heartbeat.
    ``worker_starts`` already chunks its OR list by 200 for this very reason. Expected: the
    rows of every run."""
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    engine = _ti_db()
    runs = {("etl", f"backfill__{i:05d}") for i in range(1200)}
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO task_instance VALUES (:d, :r, 't', -1, 'queued', 0)"),
                     [{"d": d, "r": r} for d, r in sorted(runs)])
    gb = _builder()
    from sqlalchemy.exc import OperationalError

    error = ""
    with Session(engine) as session:
        try:
            rows, _ = gb._ti_rows(runs, session)
            ages = gb._run_ages(runs, session)
        except OperationalError as exc:
            error = str(exc.orig)[:120]
    if error:
        pytest.fail(f"one OR term per run: {error}")
    assert len(rows) == 1200 and len(ages) == 1200
