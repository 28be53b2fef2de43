from __future__ import annotations

from typing import Any

import pytest

from airflow_drl_executor.graph_builder import task_node
from policy.errors import SchemaError

POOLS = ("cpu-small", "cpu-large", "gpu")


def _node(hints: dict, queue: str = "default"):
    return task_node("t", hints, queue, duration_s=60.0, pool_names=POOLS, default_queue="default")


def test_hints_override_defaults() -> None:
    node = _node({"duration_s": 120, "gpus": 1, "kind": "gpu_train", "memory_gb": 8})
    assert (node.duration_s, node.gpus, node.kind, node.memory_gb, node.priority) == (120.0, 1.0, "gpu_train", 8.0, 1.0)
    assert _node({"priority": 30}).priority == 30.0  # the lab's priority, set explicitly
    assert node.pool is None


def test_a_queue_naming_one_of_our_pools_is_a_pin() -> None:
    assert _node({}, queue="gpu").pool == "gpu"
    assert _node({}, queue="default").pool is None
    assert _node({}, queue="elsewhere").pool is None
    assert _node({"pool": "cpu-large"}).pool == "cpu-large"


@pytest.mark.parametrize(("hints", "message"), [
    ({"cpus": -1}, "drl.cpus"), ({"duration_s": "long"}, "drl.duration_s"), ({"kind": 3}, "drl.kind"),
    # not JSON: the request carrying it would be refused, and the whole batch fall back
    ({"duration_s": float("inf")}, "drl.duration_s"), ({"gpus": float("nan")}, "drl.gpus"),
    ({"pool": "nowhere"}, "pinned pool 'nowhere'"),
])
def test_bad_hints_name_the_task_and_field(hints: dict, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        _node(hints)


def _no_db(monkeypatch: pytest.MonkeyPatch, gb: object, rows: list[tuple] = (), ages: dict | None = None,  # type: ignore[assignment]
           max_tries: dict | None = None) -> None:
    """The run's task-instance rows ``(run key, task id, map index, state)``, ``max_tries`` and
    ages, without a DB."""
    monkeypatch.setattr(gb, "_ti_rows", lambda runs, session, tries_of=(): (list(rows), dict(max_tries or {})))
    monkeypatch.setattr(gb, "_run_ages", lambda runs, session: ages if ages is not None else {})


def test_anexpand_mappeded_mapped_task_is_one_node_per_instance() -> None:
    """was: one node (and one decision) for every instance, finished when all were"""
    from airflow_drl_executor.graph_builder import _progress

    rows = [("etl/r1", "m", 0, "success"), ("etl/r1", "m", 1, "running"), ("etl/r1", "m", 2, "queued"),
            ("etl/r1", "m", -1, "removed"),  # an unexpanded row beside the instances: not a node
            ("etl/r1", "done", -1, "success"), ("etl/r1", "later", -1, ""),
            ("etl/r1", "wait", -1, "deferred"), ("etl/r1", "sensor", -1, "up_for_reschedule")]
    (p,) = _progress(rows, {"etl/r1": 5.0})
    assert (p.finished, p.age_s) == (("done", "m[0]"), 5.0)
    # a deferred task and a sensor between pokes were dispatched: running, as in the simulator
    assert p.running == ("m[1]", "m[2]", "sensor", "wait")


def test_mapped_instances_take_their_tasks_edges_hints_and_history(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_drl_executor import graph_builder as gbm
    from airflow_drl_executor.graph_builder import GraphBuilder, ReadyInstance, _Structure, expand_mapped

    gb = GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)
    structure = _Structure(task_ids=("a", "b", "m"), edges=((0, 2), (2, 1)), queues=("default",) * 3, hints=({}, {}, {"cpus": 4}))
    monkeypatch.setattr(gb, "structure", lambda vid, session: structure)
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: {"m": [("default", 30.0, 5)]})
    _no_db(monkeypatch, gb, [("d/r", "a", -1, "success"), ("d/r", "m", 0, "queued"), ("d/r", "m", 1, "queued"),
                             ("d/r", "m", 2, "running"), ("d/r", "b", -1, "")], {"d/r": 1.0})
    batch = gb.build([ReadyInstance("d", "r", "m", 1, "v", map_index=0),
                      ReadyInstance("d", "r", "m", 1, "v", map_index=1)], None)  # type: ignore[arg-type]
    graph = batch.graphs["d/r"]
    ids = [t.task_id for t in graph.tasks]
    assert ids == ["a", "b", "m[0]", "m[1]", "m[2]"]
    assert all(t.cpus == 4 and t.duration_s == 30.0 for t in graph.tasks if t.task_id.startswith("m["))
    assert set(graph.edges) == {(0, k) for k in (2, 3, 4)} | {(k, 1) for k in (2, 3, 4)}
    assert [t.task_id for t in batch.ready] == ["m[0]", "m[1]"]
    assert batch.progress[0].running == ("m[2]",), "the two ready instances are not running"
    # the mapped task expands further: the cached graph is rebuilt
    _no_db(monkeypatch, gb, [("d/r", "m", i, "queued") for i in range(4)], {"d/r": 1.0})
    again = gb.build([ReadyInstance("d", "r", "m", 1, "v", map_index=3)], None)  # type: ignore[arg-type]
    assert [t.task_id for t in again.graphs["d/r"].tasks][-1] == "m[3]"
    # two wide mapped tasks joined index by index, not every pair
    monkeypatch.setattr(gbm, "MAX_CROSS_EDGES", 100)
    nodes = [gbm.TaskNode("x"), gbm.TaskNode("y")]
    _, wide = expand_mapped(nodes, ((0, 1),), {"x": tuple(range(20)), "y": tuple(range(20))})
    assert sorted(wide) == [(k, 20 + k) for k in range(20)]
    _, narrow = expand_mapped(nodes, ((0, 1),), {"x": tuple(range(5)), "y": tuple(range(20))})
    assert len(narrow) == 100


def _history_db() -> Any:
    """An in-memory database with the columns of ``dag_run`` and ``task_instance`` that
    ``GraphBuilder._durations`` reads."""
    from sqlalchemy import create_engine, text

    engine = create_engine("sqlite://")
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE dag_run (id INTEGER PRIMARY KEY, dag_id TEXT, run_id TEXT, "
                          "start_date TIMESTAMP DEFAULT CURRENT_TIMESTAMP)"))
        conn.execute(text("CREATE TABLE task_instance (dag_id TEXT, run_id TEXT, task_id TEXT, queue TEXT, "
                          "state TEXT, duration FLOAT, start_date TIMESTAMP, end_date TIMESTAMP, "
                          "queued_dttm TIMESTAMP, next_method TEXT, map_index INTEGER DEFAULT -1, "
                          "try_number INTEGER DEFAULT 1)"))
        conn.execute(text("CREATE TABLE log (id INTEGER PRIMARY KEY, dttm TIMESTAMP, dag_id TEXT, task_id TEXT, "
                          "run_id TEXT, map_index INTEGER, try_number INTEGER, event TEXT)"))
    return engine


def test_durations_are_the_mean_of_the_dags_latest_runs_only() -> None:
    """was: AVG over every successful try the DAG ever had, on the heartbeat: a DAG run hourly for
    years scanned all of them, and a task that got faster kept its old mean"""
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from airflow_drl_executor.graph_builder import HISTORY_RUNS, GraphBuilder

    engine = _history_db()
    with engine.begin() as conn:
        for i in range(100):  # 80 old runs at 100 s, then HISTORY_RUNS at 10 s; another DAG at 1 s
            conn.execute(text("INSERT INTO dag_run (dag_id, run_id) VALUES ('etl', :r), ('other', :r)"),
                         {"r": f"r{i}"})
            seconds = 10.0 if i >= 100 - HISTORY_RUNS else 100.0
            conn.execute(text("INSERT INTO task_instance (dag_id, run_id, task_id, queue, state, duration) "
                              "VALUES ('etl', :r, 't', 'cpu-large', 'success', :s), "
                              "('etl', :r, 'u', 'gpu', 'failed', 500), ('other', :r, 't', 'gpu', 'success', 1)"),
                         {"r": f"r{i}", "s": seconds})
    gb = GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)
    with Session(engine) as session:
        assert gb._durations("etl", session) == {"t": [("cpu-large", 10.0, HISTORY_RUNS)]}
        assert gb._durations("never-ran", session) == {}


def test_a_try_resumed_from_deferral_counts_its_run_after_the_trigger_not_its_wait() -> None:
    """Airflow keeps a resumed try's first start date, so its ``duration`` counts the hour it
    waited in the triggerer. was: a deferrable task of 2 s of work looked like 3,600 s (and the
    run's critical path and its pool's expected finishes with it)"""
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    from airflow_drl_executor.graph_builder import GraphBuilder

    engine = _history_db()
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO dag_run (dag_id, run_id) VALUES ('etl', 'r1'), ('etl', 'r2')"))
        rows = [  # (run, task, queued, start, end, duration) as Airflow 3.3 leaves them
            ("r1", "plain", "2026-12-06 01:59:50.000000", "2026-12-06 02:00:00.000000", "2026-12-06 02:00:10.000000", 10.0),
            # queued, started, deferred at 02:00:01, trigger fired, queued again, done 2 s after
            ("r1", "wait", "2026-12-06 03:00:00.000000", "2026-12-06 02:00:00.000000", "2026-12-06 03:00:02.000000", 3602.0),
            ("r2", "wait", "2026-12-06 05:00:00.000000", "2026-12-06 04:00:00.000000", "2026-12-06 05:00:04.000000", 3604.0),
            ("r2", "plain", None, None, None, 30.0),  # written by an older Airflow: no dates
            # ended in the triggerer (end_from_trigger): its slot time is not recorded, its
            # next_method stays set
            ("r1", "sensor", "2026-12-06 01:59:00.000000", "2026-12-06 02:00:00.000000", "2026-12-06 03:00:00.000000",
             3600.0),
        ]
        for run, task, queued, start, end, seconds in rows:
            conn.execute(text("INSERT INTO task_instance VALUES ('etl', :r, :t, 'cpu-small', 'success', :s, "
                              ":start, :end, :q, :m, -1, 1)"), {"r": run, "t": task, "s": seconds, "start": start,
                                                                "end": end, "q": queued,
                                                                "m": "execute_complete" if task == "sensor" else None})
        # Airflow logs every start of a try: r2's resumed run waited 3 s in its pool's Celery queue
        # (05:00:00 queued, 05:00:03 started, 05:00:04 done); r1's log rows were cleaned away
        conn.execute(text("INSERT INTO log (dttm, dag_id, task_id, run_id, map_index, try_number, event) VALUES "
                          "('2026-12-06 04:00:00.000000', 'etl', 'wait', 'r2', -1, 1, 'running'), "
                          "('2026-12-06 05:00:03.000000', 'etl', 'wait', 'r2', -1, 1, 'running'), "
                          "('2026-12-06 05:00:03.500000', 'etl', 'wait', 'r2', -1, 1, 'success')"))
    gb = GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)
    with Session(engine) as session:
        got = gb._durations("etl", session)
    assert got["plain"] == [("cpu-small", 20.0, 2)]
    # r1: 2 s from its last queueing (no log row), r2: 1 s from its logged start (was 4 s from
    # its queueing: the wait in the Celery queue counted as run time)
    assert got["wait"] == [("cpu-small", pytest.approx(1.5), 2)]
    assert "sensor" not in got, "ended in the triggerer: no history (was: 3,600 s)"


def test_observed_durations_are_brought_back_to_speed_one_and_replace_the_hint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """was: the raw wall time of whichever pool ran it, taken as seconds at speed 1 (a GPU task
    that took 2 s on the gpu pool, speed 1.5 x affinity 8, looked like 2 s on a speed-1 CPU), and
    a declared duration_s hint outranked what was observed"""
    from airflow_drl_executor.config import packaged_catalogue
    from airflow_drl_executor.graph_builder import GraphBuilder, ReadyInstance, _Structure
    from policy.catalogue import load_catalogue

    catalogue = load_catalogue(packaged_catalogue())
    gb = GraphBuilder(pool_names=catalogue.names, default_queue="default", default_duration_s=60, history_ttl_s=300,
                      vm_classes={p.name: p.vm_class for p in catalogue.pools})
    structure = _Structure(task_ids=("etl", "new", "train"), edges=(), queues=("default",) * 3,
                           hints=({"duration_s": 500}, {"duration_s": 500}, {"kind": "gpu_train"}))
    history = {"train": [("gpu", 2.0, 3), ("cpu-small", 24.0, 1)], "etl": [("cpu-large", 10.0, 1), ("default", 5.0, 1)]}
    monkeypatch.setattr(gb, "structure", lambda vid, session: structure)
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: history)
    _no_db(monkeypatch, gb)
    graph = gb.build([ReadyInstance("d", "r", "etl", 1, "v")], None).graphs["d/r"]  # type: ignore[arg-type]
    nodes = {t.task_id: t for t in graph.tasks}
    assert nodes["train"].duration_s == pytest.approx((3 * 2.0 * 1.5 * 8 + 24.0) / 4)
    assert nodes["etl"].duration_s == pytest.approx((10.0 * 2 + 5.0) / 2), "a queue not in the catalogue: speed 1"
    assert nodes["new"].duration_s == 500.0, "no history yet: the hint"


def test_the_graph_cache_is_bounded_in_nodes_and_keeps_the_batchs_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """was: at most 4,096 graphs whatever their size (4,096 runs of 5,000 tasks: ~5 GB)"""
    from airflow_drl_executor import graph_builder as gbm
    from airflow_drl_executor.graph_builder import GraphBuilder, ReadyInstance, _Structure

    monkeypatch.setattr(gbm, "MAX_CACHED_NODES", 2500)
    gb = GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)
    ids = tuple(f"t{i}" for i in range(1000))
    big = _Structure(task_ids=ids, edges=(), hints=tuple({} for _ in ids), queues=tuple("default" for _ in ids))
    monkeypatch.setattr(gb, "structure", lambda vid, session: big)
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: {})
    _no_db(monkeypatch, gb)
    for i in range(6):
        gb.build([ReadyInstance("etl", f"r{i}", "t1", 1, "v1")], None)  # type: ignore[arg-type]
        assert gb._cached_nodes <= 2500 and (f"etl/r{i}", "v1") in gb._graphs
    assert [k[0] for k in gb._graphs] == ["etl/r4", "etl/r5"], "the oldest go first"
    batch = gb.build([ReadyInstance("etl", f"r{i}", "t1", 1, "v1") for i in range(4)], None)  # type: ignore[arg-type]
    assert len(batch.graphs) == 4 and {k[0] for k in gb._graphs} == {f"etl/r{i}" for i in range(4)}
    assert gb._cached_nodes == 4000, "a batch's own runs are never evicted, even over the bound"


def test_tasks_queued_to_the_executor_but_not_sent_are_not_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the simulator a task is running once dispatched; in Airflow "queued" also covers the
    tasks the executor holds, or did not offer for want of a slot: those are not running.
    was: only the batch's own ready tasks were taken out"""
    from airflow_drl_executor.graph_builder import GraphBuilder, ReadyInstance, _Structure
    gb = GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)
    ids = ("a", "held", "sent", "waiting")
    structure = _Structure(task_ids=ids, edges=(), hints=tuple({} for _ in ids), queues=("default",) * 4)
    monkeypatch.setattr(gb, "structure", lambda vid, session: structure)
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: {})
    _no_db(monkeypatch, gb, [("etl/r1", t, -1, "queued") for t in ("a", "held", "waiting")]
           + [("etl/r1", "sent", -1, "running")], {"etl/r1": 0.0})
    batch = gb.build([ReadyInstance("etl", "r1", "a", 1, "v")], None,  # type: ignore[arg-type]
                     not_sent=[("etl/r1", "held"), ("etl/r1", "waiting"), ("etl/r2", "held")])
    assert batch.progress[0].running == ("sent",)


def _try_columns() -> list[Any]:
    """A try's identity columns as Airflow names them (one DAG run, one try, unless given)."""
    from sqlalchemy import Column, Integer, String

    return [Column("dag_id", String(250), default="etl"), Column("task_id", String(250), default="t"),
            Column("run_id", String(250), default="r1"), Column("map_index", Integer, default=-1),
            Column("try_number", Integer, default=1)]


def test_started_reads_the_start_of_the_running_ones_only() -> None:
    import datetime as dt
    import uuid

    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import Column, DateTime, MetaData, String, Table, create_engine, insert
    from sqlalchemy.orm import Session

    from airflow_drl_executor.graph_builder import GraphBuilder

    engine = create_engine("sqlite://")
    meta = MetaData()
    table = Table("task_instance", meta, Column("id", TaskInstance.__table__.c.id.type),
                  Column("state", String(20)), Column("start_date", DateTime(timezone=True)),
                  Column("queued_dttm", DateTime(timezone=True)), *_try_columns())
    log = Table("log", meta, Column("dttm", DateTime(timezone=True)), Column("event", String(30)), *_try_columns())
    meta.create_all(engine)
    run, wait, done, resumed = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    t0 = dt.datetime(2026, 12, 6, 2, 0, tzinfo=dt.UTC)
    later = t0 + dt.timedelta(hours=1)
    with engine.begin() as conn:
        conn.execute(insert(table), [{"id": run, "state": "running", "start_date": t0, "queued_dttm": t0, "task_id": "a"},
                                     {"id": wait, "state": "queued", "start_date": None, "queued_dttm": t0,
                                      "task_id": "b"},
                                     {"id": done, "state": "success", "start_date": t0, "queued_dttm": t0,
                                      "task_id": "c"},
                                     # back from the triggerer: Airflow keeps its first start date
                                     {"id": resumed, "state": "running", "start_date": t0, "queued_dttm": later,
                                      "task_id": "wait"}])
        conn.execute(insert(log), [{"dttm": later + dt.timedelta(seconds=30), "event": "running", "task_id": "wait"}])
    gb = GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)
    with Session(engine) as session:
        got = gb.started(session, [str(run), str(wait), str(done), str(resumed), str(uuid.uuid4())])
    assert sorted(got) == sorted([str(run), str(resumed)])
    assert got[str(run)] == pytest.approx(t0.timestamp(), abs=1.0)
    # was: its first start, an hour ago: the ledger took its slot to be freeing any moment; its
    # worker took it 30 s after it was queued again (Airflow's log)
    assert got[str(resumed)] == pytest.approx(later.timestamp() + 30.0, abs=1.0)


def test_a_mapped_task_group_is_joined_instance_by_instance() -> None:
    """Inside a mapped task group Airflow runs step[k] after simulate[k] only. was: every instance
    of simulate before every instance of step (440 edges in all here, where Airflow has 60): a ready
    step[3] showed 19 unfinished parents, a state the simulator never makes"""
    from airflow.sdk import DAG, task, task_group

    from airflow_drl_executor.graph_builder import _same_mapped_group, expand_mapped
    from policy.schema import TaskNode

    with DAG("mtg", schedule=None) as dag:
        @task
        def split() -> list[int]:
            return [1, 2]

        @task
        def simulate(x: int) -> int:
            return x

        @task
        def step(x: int) -> int:
            return x

        @task
        def aggregate(xs: list[int]) -> None:
            pass

        @task_group
        def group(x: int) -> int:
            return step(simulate(x))

        aggregate(group.expand(x=split()))
    from airflow.serialization.serialized_objects import DagSerialization

    serialized = DagSerialization.from_dict(DagSerialization.to_dict(dag))  # what structure() reads
    ops = sorted(serialized.tasks, key=lambda t: t.task_id)
    ids = [t.task_id for t in ops]
    index = {t: i for i, t in enumerate(ids)}
    edges = sorted((index[t.task_id], index[d]) for t in ops for d in t.downstream_task_ids)
    paired = frozenset((u, v) for u, v in edges if _same_mapped_group(ops[u], ops[v]))
    assert [(ids[u], ids[v]) for u, v in sorted(paired)] == [("group.simulate", "group.step")]
    nodes = [TaskNode(t) for t in ids]
    expansion = {"group.simulate": tuple(range(20)), "group.step": tuple(range(20))}
    tasks, out = expand_mapped(nodes, edges, expansion, paired=paired)
    names = [t.task_id for t in tasks]
    pairs = {(names[u], names[v]) for u, v in out}
    assert ("group.simulate[3]", "group.step[3]") in pairs and ("group.simulate[3]", "group.step[4]") not in pairs
    assert sum(1 for a, b in pairs if b == "group.step[3]") == 1
    assert sum(1 for a, b in pairs if b == "aggregate") == 20, "leaving the group: every instance"
    assert len(out) == 60, "split -> 20 simulate, 20 pairs, 20 step -> aggregate (was 440)"


@pytest.mark.parametrize(("try_number", "max_tries", "retries", "sent"), [
    (1, 2, 2, 1),  # a first try
    (3, 2, 2, 3),  # its second retry
    (2, 1, 0, 1),  # cleared after its only try (a clear sets max_tries = try number + retries)
    (5, 7, 3, 1), (6, 7, 3, 2),  # cleared after four tries, then its first retry
    (2, -1, 0, 2), (2, 1, None, 2),  # max_tries never set, retries unknown: the try number
    (2, 1, 4, 2),  # retries raised in a later DAG version: never below 1, never above the try
])
def test_a_cleared_task_reaches_the_policy_as_a_first_try(try_number: int, max_tries: int, retries: int | None,
                                                          sent: int) -> None:
    from airflow_drl_executor.graph_builder import attempt

    assert attempt(try_number, max_tries, retries) == sent


def test_the_ready_task_carries_its_try_since_the_last_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    """was: ``try_number`` as Airflow counts it, clears included: a task a user cleared and
    re-ran reached the policy with ``retry`` = 1, as a task that had failed"""
    from airflow_drl_executor.graph_builder import GraphBuilder, ReadyInstance, _Structure

    gb = GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)
    ids = ("cleared", "retried")
    structure = _Structure(task_ids=ids, edges=(), hints=({}, {}), queues=("default",) * 2, retries=(0, 2))
    monkeypatch.setattr(gb, "structure", lambda vid, session: structure)
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: {})
    _no_db(monkeypatch, gb, max_tries={("etl/r1", "cleared"): 1, ("etl/r1", "retried"): 2})
    batch = gb.build([ReadyInstance("etl", "r1", "cleared", 2, "v"), ReadyInstance("etl", "r1", "retried", 2, "v")],
                     None)  # type: ignore[arg-type]
    assert {t.task_id: t.try_number for t in batch.ready} == {"cleared": 1, "retried": 2}


def _inst(queue: str, try_number: int = 1) -> Any:
    from airflow_drl_executor.graph_builder import ReadyInstance

    return ReadyInstance("etl", "r1", "t", try_number, "v", queue=queue)


@pytest.mark.parametrize(("queue", "try_number", "attempt", "last", "pin"), [
    ("cpu-large", 1, 1, None, True),  # a mutation hook set it: never placed by the executor
    ("default", 1, 1, None, False), ("vpn_queue", 1, 1, None, False),  # not a pool
    ("cpu-large", 1, 1, (1, "cpu-large", False), False),  # a resumed deferral / a sensor's next poke
    ("cpu-large", 2, 2, (1, "cpu-large", False), False),  # a retry keeps the executor's free choice
    ("cpu-large", 2, 2, (1, "cpu-large", True), True),  # a retry of a pinned try
    ("cpu-large", 2, 1, (1, "cpu-small", False), True),  # cleared: Airflow ran the hook again
    ("cpu-large", 2, 1, (1, "cpu-large", False), False),  # cleared while running: the queue is kept
    ("cpu-large", 2, 2, (1, "cpu-small", True), False),  # a retry whose queue changed: not the pin
])
def test_a_task_instance_queue_set_outside_the_dag_is_a_pin(queue: str, try_number: int, attempt: int,
                                                             last: tuple | None, pin: bool) -> None:
    from airflow_drl_executor.graph_builder import queue_pin
    from airflow_drl_executor.traces import LastPlacement

    placed = LastPlacement(*last) if last is not None else None
    assert queue_pin(_inst(queue, try_number), attempt, placed, POOLS, "default") is pin


def test_a_mutation_hooks_pin_is_in_the_batchs_graph_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """was: a pin was read from the DAG only, so a task a task_instance_mutation_hook queued on
    a pool could be placed anywhere"""
    from airflow_drl_executor.graph_builder import GraphBuilder, _Structure

    gb = GraphBuilder(pool_names=POOLS, default_queue="default", default_duration_s=60, history_ttl_s=300)
    structure = _Structure(task_ids=("t", "u"), edges=((0, 1),), hints=({}, {}), queues=("default",) * 2)
    monkeypatch.setattr(gb, "structure", lambda vid, session: structure)
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: {})
    _no_db(monkeypatch, gb)
    batch = gb.build([_inst("cpu-large")], None, placed_before={})  # type: ignore[arg-type]
    assert [t.pool for t in batch.graphs["etl/r1"].tasks] == ["cpu-large", None]
    assert batch.queue_pins == {("etl/r1", "t"): "cpu-large"}
    cached = gb._graphs[("etl/r1", "v")][1]
    assert [t.pool for t in cached.tasks] == [None, None], "the cached graph stays the DAG's"
    assert batch.graphs["etl/r1"].digest != cached.digest, "sent again, not referenced"
    unpinned = gb.build([_inst("cpu-large")], None, placed_before=None)  # type: ignore[arg-type]
    assert unpinned.queue_pins == {} and unpinned.graphs["etl/r1"].tasks[0].pool is None, "no traces: no pin"


def test_another_schedulers_task_is_expected_to_take_its_time_on_that_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its mean on that pool; else its mean elsewhere brought to that pool's speed (was: the raw
    mean of a faster or slower pool) for its kind (was: every task converted as the default kind,
    from the DAG version it runs); else its declared duration (hint or default) at that speed"""
    from airflow_drl_executor.config import packaged_catalogue
    from airflow_drl_executor.graph_builder import GraphBuilder
    from policy.catalogue import load_catalogue

    catalogue = load_catalogue(packaged_catalogue())
    gb = GraphBuilder(pool_names=catalogue.names, default_queue="default", default_duration_s=60, history_ttl_s=300,
                      vm_classes={p.name: p.vm_class for p in catalogue.pools})
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: {"t": [("cpu-large", 10.0, 3)],
                                                                   "u": [("cpu-small", 30.0, 1)]})
    large, small = (gb.vm_classes[p].speed_for("default") for p in ("cpu-large", "cpu-small"))
    assert gb.expected_run_s("d", "t", "cpu-large", None) == pytest.approx(10.0)  # type: ignore[arg-type]
    assert gb.expected_run_s("d", "t", "cpu-small", None) == pytest.approx(10.0 * large / small)  # type: ignore[arg-type]
    assert gb.expected_run_s("d", "new", "cpu-small", None) == pytest.approx(60.0 / small)  # type: ignore[arg-type]
    from airflow_drl_executor.graph_builder import _Structure

    structure = _Structure(task_ids=("fit", "new", "t"), edges=(), queues=("default",) * 3,
                           hints=({"kind": "gpu_train"}, {"duration_s": 120, "kind": "gpu_train"}, {}))
    monkeypatch.setattr(gb, "structure", lambda version_id, session: structure)
    monkeypatch.setattr(gb, "_durations", lambda dag_id, session: {"fit": [("gpu", 10.0, 2)]})
    gpu, cpu = gb.vm_classes["gpu"].speed_for("gpu_train"), gb.vm_classes["cpu-large"].speed_for("gpu_train")
    assert gpu / cpu > 5, "the demo catalogue's GPU affinity"
    # 10 s on the GPU pool is gpu / cpu x 10 s on a CPU pool for a gpu_train task; as a task of
    # the default kind it was 1.5 / 2 x 10 s
    assert gb.expected_run_s("d", "fit", "cpu-large", None, "v1") == pytest.approx(10.0 * gpu / cpu)  # type: ignore[arg-type]
    assert gb.expected_run_s("d", "new", "gpu", None, "v1") == pytest.approx(120.0 / gpu)  # type: ignore[arg-type]
    assert gb.expected_run_s("d", "gone", "gpu", None, "v1") == pytest.approx(60.0 / gb.vm_classes["gpu"].speed_for(
        "default")), "a task not in that version: default"  # type: ignore[arg-type]
    read: list[str] = []

    def unreadable(version_id, session):  # type: ignore[no-untyped-def]
        read.append(version_id)
        raise ValueError("Unsure how to deserialize version 3")  # a newer Airflow's DAG, mid-upgrade

    monkeypatch.setattr(gb, "structure", unreadable)
    for _ in range(2):  # was: the error went up to _place, every task on the fallback, every heartbeat
        assert gb.expected_run_s("d", "fit", "cpu-large", None, "v2") == pytest.approx(  # type: ignore[arg-type]
            10.0 * gb.vm_classes["gpu"].speed_for("default") / gb.vm_classes["cpu-large"].speed_for("default"))
    assert read == ["v2"], "read once"
    from sqlalchemy.exc import OperationalError

    def db_down(version_id, session):  # type: ignore[no-untyped-def]
        raise OperationalError("SELECT", {}, Exception("server closed the connection"))

    monkeypatch.setattr(gb, "structure", db_down)
    with pytest.raises(OperationalError):  # the DB's error, as any other this heartbeat: not "unreadable"
        gb.expected_run_s("d", "fit", "cpu-large", None, "v9")  # type: ignore[arg-type]
    assert not gb._unreadable.get("v9")
    monkeypatch.setattr(gb, "structure", lambda version_id, session: structure)
    assert gb.expected_run_s("d", "fit", "gpu", None, "v3") == pytest.approx(10.0), "its history there: not read"  # type: ignore[arg-type]
    assert read == ["v2"]
