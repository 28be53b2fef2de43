"""Time DRLExecutor._place with the metadata DB answered from memory and Redis/policy faked.

The executor's own work per scheduler heartbeat (docs/scale.md). From the repository root:
    AIRFLOW_HOME=$(mktemp -d) .venv/bin/python scripts/executor_heartbeat_bench.py SCENARIO [...]

Scenarios: single N READY | mapped N | many | ledger INFLIGHT READY | profile SCENARIO ARGS...
What is faked: create_session (a session whose execute() answers each query of the graph builder
from prebuilt rows, counting queries and rows), DBDagBag.get_dag (an in-memory DAG of plain
objects: Airflow's deserialization of the serialized DAG is NOT in the numbers), and the Redis
connection under the real PlacementClient (so dumps() of the request and parsing the reply are
in; the fake's own work, building the reply, is timed and subtracted).
"""

from __future__ import annotations

import contextlib
import cProfile
import datetime as dt
import io
import logging
import os
import pstats
import re
import statistics
import sys
import time
import types
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
logging.basicConfig(level=logging.INFO, stream=open(os.devnull, "w"))  # log lines formatted, as in a scheduler

import airflow.models.dagbag as dagbag_mod  # noqa: E402
import airflow.utils.session as session_mod  # noqa: E402
from airflow.utils.state import TaskInstanceState  # noqa: E402
from sqlalchemy.sql.dml import Update  # noqa: E402
from sqlalchemy.sql.elements import BinaryExpression  # noqa: E402

from airflow_drl_executor import graph_builder as gbm  # noqa: E402
from airflow_drl_executor.client import PlacementClient  # noqa: E402
from airflow_drl_executor.executor import DRLExecutor  # noqa: E402
from policy import graph as graph_mod  # noqa: E402
from policy.bench import layered_dag  # noqa: E402
from policy.lru import LRU  # noqa: E402
from policy.schema import Decision, PlacementReply, dumps  # noqa: E402

UTC = dt.UTC
FAKE_S = [0.0]
OUT = os.fdopen(os.dup(1), "w")  # results; stdout itself (Airflow's log lines) goes to /dev/null below
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # time spent in the fakes (subtracted)


# --- the metadata DB, in memory ------------------------------------------------------------------

class DB:
    def __init__(self) -> None:
        self.dags: dict[str, object] = {}           # version id -> fake DAG
        self.ti_rows: dict[tuple[str, str], list] = {}  # (dag_id, run_id) -> rows as SQLAlchemy gives them
        self.run_start: dict[tuple[str, str], dt.datetime] = {}
        self.running_ids: dict[uuid.UUID, dt.datetime] = {}  # ti id -> start_date
        self.history: dict[str, list] = {}          # dag_id -> (task_id, queue, avg, count) rows
        self.running_by_pool: list = []
        self.queries = 0
        self.rows = 0
        self.log: list[str] = []


def _leaves(clause):
    if isinstance(clause, BinaryExpression):
        yield clause
        return
    for c in clause.get_children():
        yield from _leaves(c)


class FakeResult:
    def __init__(self, rows):
        self._rows = rows

    def all(self):
        return self._rows

    def scalars(self):
        return FakeResult([r[0] for r in self._rows])


class FakeSession:
    def __init__(self, db: DB) -> None:
        self.db = db

    def execute(self, stmt, *a, **k):
        t0 = time.perf_counter()
        db = self.db
        db.queries += 1
        if isinstance(stmt, Update):
            db.log.append("update")
            FAKE_S[0] += time.perf_counter() - t0
            return FakeResult([])
        cols = tuple(c.name for c in stmt.selected_columns)
        if cols == ("queue", "count"):
            rows, what = db.running_by_pool, "running_by_pool"
        elif cols == ("id", "dag_id", "task_id", "run_id", "map_index", "try_number", "start_date", "queued_dttm"):
            ids = next(b.right.value for b in _leaves(stmt.whereclause) if b.left.key == "id")
            rows = [(i, "other", "t", "r", -1, 1, db.running_ids[i], None) for i in ids if i in db.running_ids]
            what = "started"
        elif cols == ("dag_id", "run_id", "task_id", "map_index", "state", "max_tries"):
            vals = [b.right.value for b in _leaves(stmt.whereclause)]
            rows = []
            for d, r in zip(vals[::2], vals[1::2], strict=True):
                rows.extend((*row, 0) for row in db.ti_rows[(d, r)])
            what = "ti_rows"
        elif cols == ("task_id", "queue", "start_date", "queued_dttm", "end_date", "run_id", "map_index",
                      "try_number"):
            rows, what = [], "resumed"  # no deferrable tasks here
        elif cols == ("dag_id", "run_id", "start_date"):
            vals = [b.right.value for b in _leaves(stmt.whereclause)]
            rows = [(d, r, db.run_start[(d, r)]) for d, r in zip(vals[::2], vals[1::2], strict=True)]
            what = "run_ages"
        elif cols == ("run_id",):
            rows, what = [(f"old{i}",) for i in range(gbm.HISTORY_RUNS)], "recent_runs"
        elif cols == ("task_id", "queue", "avg_1", "count") or cols[:2] == ("task_id", "queue"):
            dag_id = next(b.right.value for b in _leaves(stmt.whereclause) if b.left.key == "dag_id")
            rows, what = db.history.get(dag_id, []), "durations"
        else:
            raise AssertionError(f"unexpected query {cols}")
        db.rows += len(rows)
        db.log.append(f"{what}:{len(rows)}")
        FAKE_S[0] += time.perf_counter() - t0
        return FakeResult(rows)

    def connection(self):
        return self

    def commit(self):
        pass

    def rollback(self):
        pass

    def close(self):
        pass


class FakeDagBag:
    db: DB

    def __init__(self, *a, **k) -> None:
        pass

    def get_dag(self, version_id, session):
        return FakeDagBag.db.dags.get(str(version_id))


# --- Redis and the policy server, answering at once ---------------------------------------------

_RID = re.compile(rb'"request_id":"([^"]+)"')


class FakePipe:
    def __init__(self, r: FakeRedis) -> None:
        self.r, self.out = r, []

    def hgetall(self, key):
        self.out.append({b"c0": str(time.time()).encode()})

    def time(self):
        t = time.time()
        self.out.append((int(t), int((t % 1) * 1e6)))

    def delete(self, key):
        self.out.append(1)

    def xadd(self, stream, fields, **kw):
        t0 = time.perf_counter()
        payload = next(iter(fields.values()))
        self.r.payload_sizes.append(len(payload))
        self.r.last_rid = _RID.search(payload, 0, 400).group(1).decode()
        self.out.append(b"1-0")
        FAKE_S[0] += time.perf_counter() - t0

    def execute(self):
        out, self.out = self.out, []
        return out


class FakeRedis:
    def __init__(self) -> None:
        self.payload_sizes: list[int] = []
        self.request = None
        self.last_rid = ""

    def pipeline(self, transaction=False):
        return FakePipe(self)

    def blpop(self, keys, timeout=0):
        t0 = time.perf_counter()
        req = self.request
        reply = PlacementReply(self.last_rid, tuple(
            Decision(t.run_key, t.task_id, "cpu-large", "large-cpu", score=1.0, reason="policy")
            for t in req.ready), policy="gnn", policy_version="7")
        out = (keys[0], dumps(reply))
        FAKE_S[0] += time.perf_counter() - t0
        return out

    def close(self):
        pass


# --- building a scenario --------------------------------------------------------------------------

def fake_dag(graph, mapped: set[str] = frozenset()):
    """A DAG of plain objects (what structure() reads of the deserialized DAG) from a RunGraph."""
    down: dict[int, set[str]] = {i: set() for i in range(len(graph.tasks))}
    for p, c in graph.edges:
        down[p].add(graph.tasks[c].task_id)
    tasks = []
    for i, t in enumerate(graph.tasks):
        hints = {"cpus": t.cpus, "memory_gb": t.memory_gb}
        if t.kind != "default":
            hints["kind"] = t.kind
        tasks.append(types.SimpleNamespace(task_id=t.task_id, downstream_task_ids=down[i],
                                           executor_config={"drl": hints}, queue="default", priority_weight=1,
                                           retries=0, get_closest_mapped_task_group=lambda: None))
    return types.SimpleNamespace(tasks=tasks)


def mapped_graph(n_instances: int):
    """extract -> prep -> m (mapped, n instances) -> reduce -> load, plus 10 side tasks."""
    from policy.schema import RunGraph, TaskNode
    ids = ["a_extract", "b_prep", "m_map", "n_reduce", "o_load"] + [f"s{i:02d}" for i in range(10)]
    tasks = tuple(TaskNode(t, duration_s=30.0) for t in ids)
    edges = ((0, 1), (1, 2), (2, 3), (3, 4)) + tuple((0, 5 + i) for i in range(10))
    return RunGraph("x/x", tasks, edges)


class Scenario:
    """One executor, one fake DB, runs of one DAG version each, and the workloads of each heartbeat."""

    def __init__(self) -> None:
        self.db = DB()
        FakeDagBag.db = self.db
        dagbag_mod.DBDagBag = FakeDagBag
        db = self.db

        @contextlib.contextmanager
        def create_session(*a, **k):
            yield FakeSession(db)
        session_mod.create_session = create_session
        self.ex = DRLExecutor()
        self.redis = FakeRedis()
        client = PlacementClient("redis://127.0.0.1:1/0", timeout_ms=200)
        client._redis = self.redis
        orig = client.place

        def place(req, graphs):
            self.redis.request = req
            return orig(req, graphs)
        client.place = place
        self.ex._client = client
        self.rng = np.random.default_rng(7)
        self.ti_ids: dict[tuple[str, str, str, int], uuid.UUID] = {}

    def add_dag(self, dag_id: str, graph, history: bool = True) -> str:
        vid = str(uuid.uuid7()) if hasattr(uuid, "uuid7") else str(uuid.uuid1())
        self.db.dags[vid] = fake_dag(graph)
        if history:
            self.db.history[dag_id] = [(t.task_id, "cpu-small", float(t.duration_s), 5) for t in graph.tasks]
        return vid

    def add_run(self, dag_id: str, run_id: str, task_ids, states: dict, map_counts: dict[str, int] | None = None):
        """TI rows of a run: states maps (task_id, map_index) -> state (default: scheduled)."""
        rows = []
        map_counts = map_counts or {}
        for tid in task_ids:
            for m in (range(map_counts[tid]) if tid in map_counts else [-1]):
                st = states.get((tid, m), TaskInstanceState.SCHEDULED)
                rows.append((dag_id, run_id, tid, m, st.value))  # a String(20) column: plain str
                self.ti_ids[(dag_id, run_id, tid, m)] = uuid.uuid4()
        self.db.ti_rows[(dag_id, run_id)] = rows
        self.db.run_start[(dag_id, run_id)] = dt.datetime.now(UTC) - dt.timedelta(minutes=30)

    def workload(self, dag_id, run_id, tid, m, vid):
        ti = types.SimpleNamespace(
            id=self.ti_ids.get((dag_id, run_id, tid, m)) or uuid.uuid4(), dag_id=dag_id, run_id=run_id,
            task_id=tid, try_number=1, dag_version_id=vid, map_index=m, queue="default", priority_weight=1,
            key=(dag_id, tid, run_id, 1, m), executor_config={}, pool="default_pool")
        return types.SimpleNamespace(ti=ti)

    def in_flight(self, n: int, pools=("cpu-small", "cpu-large", "gpu"), running_frac: float = 0.5):
        """n tasks of another DAG this executor sent (ledger + running), some started per the DB."""
        now = time.time()
        by_pool = {p: 0 for p in pools}
        for i in range(n):
            key = ("other", f"t{i}", "r", 1, -1)
            tid = uuid.uuid4()
            pool = pools[i % len(pools)]
            self.ex.running.add(key)
            self.ex.ledger.add(key, pool, str(tid), float(self.rng.lognormal(4.5, 0.8)), now - 10)
            if i < n * running_frac:
                self.db.running_ids[tid] = dt.datetime.now(UTC) - dt.timedelta(seconds=float(self.rng.uniform(0, 100)))
                by_pool[pool] += 1
        self.db.running_by_pool = [(p, c) for p, c in by_pool.items()]

    def cold(self) -> None:
        gb = self.ex.graph_builder
        gb._graphs.clear()
        gb._cached_nodes = 0
        gb._structures = LRU(gbm.MAX_VERSIONS)
        gb._history = LRU(gbm.MAX_VERSIONS)
        graph_mod.view._entries = LRU(4096)
        self.ex._client._sent.clear()

    def call(self, tasks):
        """One _place: (ms of the executor's own work, queries, rows, request bytes)."""
        self.db.queries = self.db.rows = 0
        self.db.log = []
        self.redis.payload_sizes = []
        for w in tasks:
            self.ex.queued_tasks[w.ti.key] = w
        FAKE_S[0] = 0.0
        t0 = time.perf_counter()
        records, held = self.ex._place(tasks)
        ms = (time.perf_counter() - t0 - FAKE_S[0]) * 1000
        assert not held and len(records) == len(tasks), (len(records), held)
        assert all(not r.fallback for _, r in records), records[0][1].reason
        for w in tasks:
            self.ex.queued_tasks.pop(w.ti.key, None)
            w.ti.queue = "default"
        return ms, self.db.queries, self.db.rows, sum(self.redis.payload_sizes), list(self.db.log)


def measure(sc: Scenario, batches, cold: bool, reps: int):
    """Median ms over reps calls (batches cycled); cold: caches emptied before each call."""
    out = []
    for i in range(reps):
        if cold:
            sc.cold()
        out.append(sc.call(batches[i % len(batches)]))
    ms = [o[0] for o in out]
    last = out[-1]
    return statistics.median(ms), min(ms), last


# --- the scenarios --------------------------------------------------------------------------------

def single(n: int, ready: int, inflight: int = 64):
    sc = Scenario()
    g = layered_dag(n, "big/r1", sc.rng)
    vid = sc.add_dag("big", g)
    ids = [t.task_id for t in g.tasks]
    nb = max(1, min(4, (n - 32) // ready))  # batches of `ready` tasks, cycled
    half = max(0, min(n // 2, n - 32 - nb * ready))
    states = {(t, -1): TaskInstanceState.SUCCESS for t in ids[:half]}
    states.update({(t, -1): TaskInstanceState.RUNNING for t in ids[half:half + 32]})
    frontier = ids[half + 32: half + 32 + nb * ready]
    states.update({(t, -1): TaskInstanceState.QUEUED for t in frontier})
    sc.add_run("big", "r1", ids, states)
    sc.in_flight(inflight)
    batches = [[sc.workload("big", "r1", t, -1, vid) for t in frontier[k * ready:(k + 1) * ready]] for k in range(nb)]
    assert all(len(b) == ready for b in batches)
    return sc, batches


def mapped(n: int, ready: int = 32):
    sc = Scenario()
    g = mapped_graph(n)
    vid = sc.add_dag("mapd", g)
    ids = [t.task_id for t in g.tasks]
    states = {("a_extract", -1): TaskInstanceState.SUCCESS, ("b_prep", -1): TaskInstanceState.SUCCESS}
    states.update({("m_map", i): TaskInstanceState.SUCCESS for i in range(n // 2)})
    states.update({("m_map", i): TaskInstanceState.RUNNING for i in range(n // 2, n // 2 + 32)})
    ready_idx = list(range(n // 2 + 32, n // 2 + 32 + 4 * ready))
    states.update({("m_map", i): TaskInstanceState.QUEUED for i in ready_idx})
    sc.add_run("mapd", "r1", ids, states, map_counts={"m_map": n})
    sc.in_flight(64)
    batches = [[sc.workload("mapd", "r1", "m_map", i, vid) for i in ready_idx[k * ready:(k + 1) * ready]]
               for k in range(4)]
    return sc, batches


def many(runs: int = 50, n: int = 200, ready: int = 32):
    sc = Scenario()
    g = layered_dag(n, "etl/x", sc.rng)
    vid = sc.add_dag("etl", g)
    ids = [t.task_id for t in g.tasks]
    frontiers = {}
    for r in range(runs):
        done = int(n * r / runs)
        states = {(t, -1): TaskInstanceState.SUCCESS for t in ids[:done]}
        frontiers[r] = ids[done:done + 4]
        states.update({(t, -1): TaskInstanceState.QUEUED for t in frontiers[r]})
        sc.add_run("etl", f"r{r:02d}", ids, states)
    sc.in_flight(64)
    batches = []
    for k in range(4):  # 32 ready over 32 of the runs, a different set each heartbeat
        batches.append([sc.workload("etl", f"r{(k * 32 + j) % runs:02d}", frontiers[(k * 32 + j) % runs][k], -1, vid)
                        for j in range(ready)])
    return sc, batches


def run_scenario(name, args, reps_steady=15, reps_cold=7):
    builders = {"single": single, "mapped": mapped, "many": many,
                "ledger": lambda inflight, ready: single(1000, ready, inflight)}
    sc, batches = builders[name](*args)
    sc.cold()
    sc.call(batches[0])  # warm-up: imports, first log lines
    cold = measure(sc, batches, True, reps_cold)
    for b in batches:  # cache every run of the scenario
        sc.call(b)
    steady = measure(sc, batches, False, reps_steady)
    # pool_states alone (once per _place it runs twice)
    t = []
    for _ in range(20):
        t0 = time.perf_counter()
        sc.ex.pool_states()
        t.append((time.perf_counter() - t0) * 1000)
    return sc, batches, cold, steady, statistics.median(t)


def main(argv):
    if argv[0] == "profile":
        name, args = argv[1], [int(a) for a in argv[3:]]
        mode = argv[2]  # cold | steady
        builders = {"single": single, "mapped": mapped, "many": many,
                    "ledger": lambda inflight, ready: single(1000, ready, inflight)}
        sc, batches = builders[name](*args)
        sc.cold()
        sc.call(batches[0])
        for b in batches:
            sc.call(b)
        pr = cProfile.Profile()
        for i in range(5 if mode == "cold" else 20):
            if mode == "cold":
                sc.cold()
            b = batches[i % len(batches)]
            for w in b:
                sc.ex.queued_tasks[w.ti.key] = w
            pr.enable()
            sc.ex._place(b)
            pr.disable()
            for w in b:
                sc.ex.queued_tasks.pop(w.ti.key, None)
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s).sort_stats("tottime")
        st.print_stats(18)
        st.sort_stats("cumulative").print_stats(40)
        print(s.getvalue(), file=OUT)
        return
    if os.environ.get("NO_GC"):
        import gc
        gc.disable()
    name, args = argv[0], [int(a) for a in argv[1:]]
    sc, batches, cold, steady, ps = run_scenario(name, args)
    label = f"{name} {' '.join(map(str, args))}"
    for mode, (med, lo, (_ms, q, rows, nbytes, log)) in (("cold", cold), ("steady", steady)):
        print(f"{label:18s} {mode:6s} median {med:8.2f} ms  min {lo:8.2f}  queries {q:2d} rows {rows:6d} "
              f"request {nbytes / 1024:9.1f} KiB  | {' '.join(log)}", file=OUT)
    print(f"{label:18s} pool_states {ps:.3f} ms; ledger {len(sc.ex.ledger)}; graph cache nodes "
          f"{sc.ex.graph_builder._cached_nodes}", file=OUT)


if __name__ == "__main__":
    main(sys.argv[1:])
