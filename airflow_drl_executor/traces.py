"""Placement traces: one row per placed task instance try, in the Airflow metadata database.

At dispatch the executor records (ti id, try, chosen pool, VM class, score, reason, fallback flag,
policy and version, decision latency, Celery task id, the task's features); outcomes (start, end,
state, worker hostname) stay where Airflow keeps them, in ``task_instance`` /
``task_instance_history``, and :func:`outcomes_query` joins the two. These rows are the nightly
fine-tuning's training data and the UI's placements page.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import sys
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from airflow.utils.sqlalchemy import UtcDateTime
from sqlalchemy import (
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    Uuid,
    bindparam,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine

from policy.schema import _finite as finite_number

log = logging.getLogger(__name__)

metadata = MetaData()

placements = Table(
    "drl_placement",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    # the type of task_instance.id (native UUID on PostgreSQL, CHAR(32) elsewhere): joined as is,
    # so that the join uses task_instance's primary key
    Column("ti_id", Uuid(as_uuid=False), nullable=False, index=True),
    Column("dag_id", String(250), nullable=False),
    Column("run_id", String(250), nullable=False),
    Column("task_id", String(250), nullable=False),
    Column("map_index", Integer, nullable=False, default=-1),
    Column("try_number", Integer, nullable=False),
    Column("pool", String(250), nullable=False),
    Column("vm_class", String(250), nullable=False),
    Column("score", Float, nullable=False),
    Column("reason", Text, nullable=False),
    Column("fallback", Boolean, nullable=False),
    Column("policy", String(100), nullable=False),
    Column("policy_version", String(100), nullable=False),
    Column("request_id", String(64), nullable=False),
    Column("decision_ms", Float, nullable=False),
    Column("waited_s", Float, nullable=False, default=0.0),
    Column("celery_id", String(64), nullable=True, index=True),
    Column("features", Text, nullable=False),
    Column("decided_at", DateTime(timezone=True), nullable=False, index=True),
    # the placements page's filters: one DAG's or one run's placements, latest first; one pool's
    # or one task's (was: a table scan for each, found by review)
    Index("ix_drl_placement_dag_run", "dag_id", "run_id"),
    Index("ix_drl_placement_pool", "pool", "id"),
    Index("ix_drl_placement_task", "task_id", "id"),
)


@dataclass(frozen=True)
class PlacementRecord:
    """One row of ``drl_placement``."""

    ti_id: str
    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    try_number: int
    pool: str
    vm_class: str
    score: float
    reason: str
    fallback: bool
    policy: str
    policy_version: str
    request_id: str
    decision_ms: float
    features: dict[str, Any]
    celery_id: str | None = None
    #: how long the policy kept the task back, waiting for a better pool
    waited_s: float = 0.0

    def row(self, decided_at: dt.datetime) -> dict[str, Any]:
        """The table's row: strings cut to their column's length, numbers finite (found by review:
        a NaN score, which SQLite stores as NULL and MySQL refuses, or a policy version over 100
        characters on PostgreSQL, made the DB refuse the row and every row written with it)."""
        row: dict[str, Any] = {
            "ti_id": self.ti_id, "dag_id": self.dag_id, "run_id": self.run_id, "task_id": self.task_id,
            "map_index": self.map_index, "try_number": self.try_number, "pool": self.pool,
            "vm_class": self.vm_class, "score": _finite(self.score), "reason": self.reason[:2000],
            "fallback": self.fallback, "policy": self.policy, "policy_version": self.policy_version,
            "request_id": self.request_id, "decision_ms": _finite(self.decision_ms), "celery_id": self.celery_id,
            "waited_s": _finite(self.waited_s),
            "features": json.dumps(self.features, sort_keys=True), "decided_at": decided_at,
        }
        for name, length in _LENGTHS.items():
            value = row[name]
            if isinstance(value, str) and len(value) > length:
                row[name] = value[:length]
        for name, value in row.items():  # PostgreSQL's text takes no NUL (psycopg2: a bare ValueError)
            if isinstance(value, str) and "\x00" in value:
                row[name] = value.replace("\x00", "\ufffd")
        return row


def _finite(x: float) -> float:
    """``x``, NaN as 0 and an infinity as the largest float of its sign."""
    x = float(x)
    if math.isnan(x):
        return 0.0
    return max(min(x, sys.float_info.max), -sys.float_info.max)


#: column -> the length of its string type
_LENGTHS: dict[str, int] = {c.name: int(c.type.length) for c in placements.columns
                            if isinstance(c.type, String) and c.type.length}


def ensure_schema(engine: Engine) -> None:
    """Create the ``drl_placement`` table if it does not exist; upgrade one of an earlier release
    (``ti_id`` as the 36-character text of the UUID, to the type of ``task_instance.id``; the
    index on ``decided_at``, which export and pruning filter on)."""
    metadata.create_all(engine, checkfirst=True)
    with engine.begin() as conn:
        _upgrade_ti_id(conn)
        _add_columns(conn)
        for index in placements.indexes:  # an index added since the table was created
            index.create(conn, checkfirst=True)


def _add_columns(conn: Connection) -> None:
    """Add the columns this release has and the table lacks, with their default (found by review:
    a table of the first release had no ``waited_s``: the placements page and every trace write
    failed on it after an upgrade)."""
    have = {c["name"] for c in inspect(conn).get_columns(placements.name)}
    for column in placements.columns:
        if column.name in have:
            continue
        default = _DEFAULTS.get(column.name)
        if isinstance(default, bool) or not isinstance(default, int | float) and not column.nullable:
            raise RuntimeError(f"{placements.name}: cannot add column {column.name} (no default to fill it with)")
        kind = column.type.compile(dialect=conn.dialect)
        fill = f"DEFAULT {default!r} NOT NULL" if isinstance(default, int | float) else "NULL"
        conn.execute(text(f"ALTER TABLE {placements.name} ADD COLUMN {column.name} {kind} {fill}"))
        log.info("%s: column %s added (%s)", placements.name, column.name, fill)


def _upgrade_ti_id(conn: Connection) -> None:
    column = next(c for c in inspect(conn).get_columns(placements.name) if c["name"] == "ti_id")
    if getattr(column["type"], "length", None) != 36:  # created by this release
        return
    name = placements.name
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"ALTER TABLE {name} ALTER COLUMN ti_id TYPE UUID USING ti_id::uuid"))
    else:  # CHAR(32) of hex digits, as SQLAlchemy's Uuid stores it; the wider column holds those
        conn.execute(text(f"UPDATE {name} SET ti_id = REPLACE(ti_id, '-', '') WHERE ti_id LIKE '%-%'"))
    log.info("drl_placement: ti_id upgraded to the type of task_instance.id (%s)", conn.dialect.name)


def write(conn: Connection, records: Sequence[PlacementRecord]) -> None:
    """Insert ``records``, decided now, in one statement."""
    now = dt.datetime.now(dt.UTC)
    write_rows(conn, [r.row(now) for r in records])


#: the columns a row written by :meth:`PlacementRecord.row` holds (all but the id)
ROW_KEYS: tuple[str, ...] = tuple(c.name for c in placements.columns if c.name != "id")
#: the range of an ``Integer`` column on every database Airflow runs on (32 bits)
_INT_RANGE = (-(2**31), 2**31 - 1)


def row_problem(row: dict[str, Any]) -> str | None:
    """Why the database could not take ``row`` as it is (a row read back from a spool file, which a
    person or another release may have written), or None. Found by review: such a row with a
    ``features`` object or a try number past 64 bits made the driver raise at every write (taken
    for an outage, or out of the scheduler's start), holding every row written with it."""
    for column in placements.columns:
        name = column.name
        if name == "id" or (name not in row and name in _DEFAULTS):
            continue
        value = row.get(name)
        kind = column.type
        if value is None:
            if not column.nullable:
                return f"{name} is missing"
        elif isinstance(kind, Boolean):
            if not isinstance(value, bool):
                return f"{name} {value!r} is not true or false"
        elif isinstance(kind, Integer):
            if isinstance(value, bool) or not isinstance(value, int) or not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
                return f"{name} {value!r} is not a 32-bit integer"
        elif isinstance(kind, Float):
            if not finite_number(value):  # (not a boolean; a 400-digit integer is not finite either)
                return f"{name} {value!r} is not a finite number"
        elif isinstance(kind, DateTime):
            if not isinstance(value, dt.datetime) or value.tzinfo is None:
                return f"{name} {value!r} is not a time with its zone"
        elif isinstance(kind, Uuid):
            try:
                uuid.UUID(str(value))
            except ValueError:
                return f"{name} {value!r} is not a UUID"
        elif not isinstance(value, str) or "\x00" in value:
            return f"{name} {value!r} is not text"
        elif name in _LENGTHS and len(value) > _LENGTHS[name]:
            return f"{name} is longer than its column's {_LENGTHS[name]} characters"
    return None


#: the scalar default of the columns that have one
_DEFAULTS: dict[str, Any] = {c.name: getattr(c.default, "arg", None) for c in placements.columns
                             if c.default is not None and c.default.is_scalar}


def write_rows(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Insert rows made by :meth:`PlacementRecord.row` in one statement, each with every column
    (a key a row lacks is its column's default, or NULL: found by review, an executemany takes its
    columns from the first row, and a first row without ``celery_id`` wrote every row of the batch
    without it)."""
    if rows:
        conn.execute(insert(placements), [{k: r[k] if k in r else _DEFAULTS.get(k) for k in ROW_KEYS} for r in rows])


def not_written(conn: Connection, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of ``rows``, those not in the table yet: a placement is one (task instance, request) pair
    (read before writing again rows whose last write may have gone through: a commit whose answer
    was lost, a dead scheduler's spool written before its file went; found by review, a second copy
    of a try's row made it the task instance's latest placement)."""
    ids = sorted({_uuid_hex(r.get("ti_id")) for r in rows})
    have: set[tuple[str, str]] = set()
    for i in range(0, len(ids), 1000):  # bounded IN lists
        chunk = [str(uuid.UUID(h)) for h in ids[i:i + 1000] if len(h) == 32]
        have.update((_uuid_hex(t), str(q)) for t, q in conn.execute(
            select(placements.c.ti_id, placements.c.request_id).where(placements.c.ti_id.in_(chunk))))
    return [r for r in rows if (_uuid_hex(r.get("ti_id")), str(r.get("request_id"))) not in have]


def _uuid_hex(value: object) -> str:
    try:
        return uuid.UUID(str(value)).hex
    except ValueError:
        return str(value)


def sent_celery_ids(conn: Connection, celery_ids: Collection[str],
                    unsent: Collection[tuple[str, str]] = ()) -> set[str]:
    """Of these Celery task ids, those with a placement recorded: the executor records a
    placement just before its publish and clears its Celery id if the publish did not go (a task
    it held, or never got to, has none; one whose scheduler died between the two is taken for sent,
    as plain Celery takes it, and waits for ``task_queued_timeout`` at worst). A row in ``unsent``
    ((Celery id, request id): its not-sent mark not written yet) does not count."""
    out: set[str] = set()
    skip = set(unsent)
    ids = sorted(set(celery_ids))
    for i in range(0, len(ids), 1000):  # bounded IN lists
        rows = conn.execute(select(placements.c.celery_id, placements.c.request_id)
                            .where(placements.c.celery_id.in_(ids[i:i + 1000])))
        out.update(str(r.celery_id) for r in rows if (str(r.celery_id), str(r.request_id)) not in skip)
    return out


#: the end of the reason of a placement whose publish did not go
NOT_SENT = " [not sent: the publish did not go]"


def not_sent(conn: Connection, rows: Collection[tuple[str, str]]) -> None:
    """Mark the placements recorded under these (Celery id, request id) pairs (written before a
    publish that did not go) as not sent: no Celery id (adoption then never takes the task for
    sent), the reason saying so. By request too: a timed-out publish is retried in the same try,
    with the same Celery id, and the retry's row must keep it (found by review). Kept, not
    deleted: the row still tells that the task instance's queue is this executor's choice (found
    by review: deleted, a restarted or another HA scheduler read that queue as a mutation hook's
    pin)."""
    by_request: dict[str, list[str]] = {}
    for celery_id, request_id in rows:
        by_request.setdefault(request_id, []).append(celery_id)
    for request_id, celery_ids in sorted(by_request.items()):
        ids = sorted(set(celery_ids))
        for i in range(0, len(ids), 1000):  # bounded IN lists
            conn.execute(placements.update()
                         .where(placements.c.request_id == request_id, placements.c.celery_id.in_(ids[i:i + 1000]))
                         .values(celery_id=None, reason=placements.c.reason + NOT_SENT))


@dataclass(frozen=True)
class LastPlacement:
    """A task instance's latest placement: which try, which pool, and whether its node was pinned
    there (the node the policy saw, as recorded, named that pool)."""

    try_number: int
    pool: str
    pinned: bool


def last_placements(conn: Connection, instances: Collection[tuple[str, str, str, int]]
                    ) -> dict[tuple[str, str, str, int], LastPlacement]:
    """The latest placement, of any try, of each of these task instances ``(dag id, run id, task
    id, map index)`` that has one. By name, not by ``ti_id``: Airflow gives every new try a new id
    (``TaskInstance.prepare_db_for_next_try``; found by review: read by id, a retry looked never
    placed, and its queue, the executor's last choice, was taken for a mutation hook's pin)."""
    wanted = set(instances)
    by_run: dict[tuple[str, str], set[str]] = {}
    for dag_id, run_id, task_id, _ in wanted:
        by_run.setdefault((dag_id, run_id), set()).add(task_id)
    c = placements.c
    out: dict[tuple[str, str, str, int], LastPlacement] = {}
    for (dag_id, run_id), tasks in sorted(by_run.items()):  # one query per run (ix_drl_placement_dag_run)
        # the latest try, and of its placements the last written: not the highest id alone (found by
        # review: a try's row written late, a dead HA scheduler's spool taken over, read as latest)
        ranked = (select(c.task_id, c.map_index, c.try_number, c.id)
                  .where(c.dag_id == dag_id, c.run_id == run_id, c.task_id.in_(sorted(tasks))))
        latest: dict[tuple[str, int], tuple[int, int]] = {}
        for task_id, map_index, try_number, row_id in conn.execute(ranked):
            name = (str(task_id), int(map_index))
            latest[name] = max(latest.get(name, (try_number, row_id)), (try_number, row_id))
        chosen = [row_id for name, (_, row_id) in latest.items() if (dag_id, run_id, *name) in wanted]
        for r in conn.execute(select(c.task_id, c.map_index, c.try_number, c.pool, c.features)
                              .where(c.id.in_(chosen))):
            key = (dag_id, run_id, str(r.task_id), int(r.map_index))
            try:
                node = json.loads(r.features)
            except (TypeError, ValueError):
                node = None
            pinned = isinstance(node, dict) and node.get("pool") == r.pool
            out[key] = LastPlacement(int(r.try_number), str(r.pool), pinned)
    return out


def prune(engine: Engine, before: dt.datetime, *, batch: int = 10_000) -> int:
    """Delete the placements decided before ``before``, ``batch`` rows per transaction (short
    locks on a busy table: the executor keeps inserting meanwhile); the number deleted."""
    deleted = 0
    while True:
        with engine.begin() as conn:
            ids = conn.execute(select(placements.c.id).where(placements.c.decided_at < before)
                               .order_by(placements.c.id).limit(batch)).scalars().all()
            if ids:
                conn.execute(placements.delete().where(placements.c.id.in_(ids)))
        if not ids:
            return deleted
        deleted += len(ids)


@dataclass(frozen=True)
class PlacementFilter:
    """Which placements to show: each field set narrows the rows to those equal to it (``None``:
    any). ``before_id`` pages back: only rows older than that placement (ids grow with time)."""

    dag_id: str | None = None
    run_id: str | None = None
    task_id: str | None = None
    pool: str | None = None
    #: True: only the fallback heuristic's placements; False: only the policy's
    fallback: bool | None = None
    before_id: int | None = None

    def __post_init__(self) -> None:
        if self.before_id is not None and self.before_id < 1:
            raise ValueError(f"before_id must be a placement id >= 1, got {self.before_id!r}")


def outcomes_query(limit: int = 500, dag_ids: Collection[str] | None = None,
                   where: PlacementFilter = PlacementFilter()) -> Any:
    """Placements joined with what happened: latest first (works on PostgreSQL and SQLite); with
    ``dag_ids``, only those DAGs' placements; ``where`` narrows them further."""
    clauses: list[str] = []
    params: list[Any] = []
    if dag_ids is not None:
        clauses.append("p.dag_id IN :dag_ids")
        # typed: an empty list renders as a typed empty set (untyped, PostgreSQL refused comparing
        # varchar with the integer NULL of SQLAlchemy's empty IN: a 500 for a user reading no DAG)
        params.append(bindparam("dag_ids", value=sorted(dag_ids), expanding=True, type_=placements.c.dag_id.type))
    for name in ("dag_id", "run_id", "task_id", "pool", "fallback"):
        value = getattr(where, name)
        if value is not None:  # the column names are ours, the values bound
            clauses.append(f"p.{name} = :f_{name}")
            params.append(bindparam(f"f_{name}", value=value, type_=placements.c[name].type))
    if where.before_id is not None:
        clauses.append("p.id < :before_id")
        params.append(bindparam("before_id", value=where.before_id))
    sql = _OUTCOMES.format(where=f"WHERE {' AND '.join(clauses)}" if clauses else "")
    # typed, so that every database gives the same values: a boolean fallback (SQLite gave 1/0)
    # and dates in UTC (SQLite gave naive text; PostgreSQL its session's time zone)
    return text(sql).bindparams(*params, limit=limit).columns(
        fallback=Boolean, decided_at=UtcDateTime, start_date=UtcDateTime, end_date=UtcDateTime)


_OUTCOMES = """
        SELECT p.id, p.dag_id, p.run_id, p.task_id, p.map_index, p.try_number, p.pool, p.vm_class,
               p.score, p.reason, p.fallback, p.policy, p.policy_version, p.decision_ms, p.waited_s,
               p.celery_id, p.decided_at,
               COALESCE(h.start_date, t.start_date) AS start_date,
               COALESCE(h.end_date, t.end_date) AS end_date,
               COALESCE(h.state, t.state) AS state,
               COALESCE(h.hostname, t.hostname) AS hostname
        FROM drl_placement p
        LEFT JOIN task_instance t
               ON t.id = p.ti_id AND t.try_number = p.try_number
        LEFT JOIN task_instance_history h
               ON h.task_instance_id = p.ti_id AND h.try_number = p.try_number
        {where}
        ORDER BY p.id DESC
        LIMIT :limit
        """
