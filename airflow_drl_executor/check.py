"""``airflow drl-executor check``: is this deployment's DRLExecutor set up to place tasks?

Run it where the scheduler runs, with the scheduler's ``airflow.cfg`` and environment
(``--team T``: the executor of team T, its options read as the executor reads them). Each check
says ``ok``, ``warn`` (works, degraded or not in use) or ``fail`` (placements will not use the
learned policy, or the executor will not start), with what it found:

- ``config``: ``[drl_executor]`` parses and validates, ``max_wait_s`` is below
  ``[scheduler] task_queued_timeout``, the pool catalogue loads (what the executor does at start).
- ``executor``: ``[core] executor`` as Airflow parses it names a DRLExecutor class that imports
  (fail when an entry does not import), as the default executor (warn when another is the default
  or none is DRLExecutor).
- ``limits``: Airflow's concurrency limits against the catalogue's worker slots (every pool at
  its ``max_workers``): ``[core] max_active_tasks_per_dag`` (per DAG run), ``default_pool``'s slots
  and each active DAG's own ``max_active_tasks`` (read from the metadata database) and ``[core]
  parallelism``. A held task is queued in Airflow
  and counts against the first two; below the slots, the policy never sees most of a wide run's
  ready tasks, or the executor cannot fill the pools (warn; README, "Airflow's concurrency limits").
- ``redis``: the policy servers' Redis answers ``PING`` with this URL, password and TLS settings.
- ``policy servers``: the replicas with a fresh heartbeat (``server_stale_after_s``), each with
  its model version, the objective its registry names and its device; none means every placement
  falls back to the heuristic; replicas of different objectives are a warning.
- ``round trip``: a small probe request (two tasks of a probe DAG run, this catalogue's pools) is
  placed by a server within ``decision_timeout_ms``: the prefix and the wire schema agree with the
  executor's. It is a real request: the servers count it in their metrics; nothing is dispatched
  and no trace is written.
- ``workers``: the live Celery workers of each pool's queue (Celery's ``active_queues``
  broadcast, through a Celery app built as the executor builds its own, bounded in time), and the
  pools the executor would mark down (warn); ``celery`` fails when no such app can be built.
- ``traces``: the ``drl_placement`` table in the metadata database (rows, the newest; bounded in
  time); warn when it is not there yet (the executor creates it at its first placement).
- ``spool``: the spool directory is writable, and how many placement rows and not-sent marks wait
  there for the database (warn).

Exit status 1 when any check fails, else 0. ``--output json`` prints the findings as a list.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from policy.transport import redacted_url, scrubbed

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Finding:
    check: str
    status: str
    detail: str


def check_config(conf: Any) -> tuple[Finding, Any, Any]:
    """``(finding, ExecutorConfig or None, Catalogue or None)``."""
    from airflow_drl_executor.config import SECTION, ExecutorConfig, hold_bound
    from policy.catalogue import load_catalogue

    try:
        cfg = ExecutorConfig.from_conf(conf)
        queued_timeout = float(conf.get("scheduler", "task_queued_timeout", fallback="600") or 600)
        max_hold_s = hold_bound(cfg, queued_timeout)
        catalogue = load_catalogue(cfg.catalogue)
    except Exception as exc:  # noqa: BLE001 - whatever stops the executor's __init__ is the finding
        return Finding("config", FAIL, f"{type(exc).__name__}: {exc}"), None, None
    pools = ", ".join(f"{p.name} ({p.vm_class.name}, {p.workers} worker(s))" for p in catalogue.pools)
    # max_hold_s is derived from the scheduler's timeout when unset: say what the executor will use
    holds = (f"holds: max_wait_s {cfg.max_wait_s:g} s with a free slot, max_hold_s {max_hold_s:g} s in all "
             f"(task_queued_timeout {queued_timeout:g} s)")
    return (Finding("config", OK, f"[{SECTION}] valid; {holds}; catalogue {catalogue.source}: {pools}"),
            cfg, catalogue)


def worker_slots(catalogue: Any) -> int:
    """The catalogue's slots with every pool at its ``max_workers``."""
    return sum(p.ceiling_slots for p in catalogue.pools)


def core_limits(conf: Any, parallelism: int | None = None) -> dict[str, int]:
    """``[core] max_active_tasks_per_dag`` and ``parallelism`` (``parallelism`` given: that one;
    left out when 0, Airflow's "no limit"); ``ValueError`` when one is not an integer."""
    try:
        limits = {"[core] max_active_tasks_per_dag": int(conf.get("core", "max_active_tasks_per_dag", fallback="16")),
                  "[core] parallelism": int(conf.get("core", "parallelism", fallback="32") if parallelism is None
                                            else parallelism)}
    except TypeError as exc:
        raise ValueError(str(exc)) from exc
    if limits["[core] parallelism"] == 0:
        del limits["[core] parallelism"]
    return limits


def below(limits: dict[str, int], slots: int) -> dict[str, int]:
    """The limits under ``slots`` (a negative one, as a pool's -1, is no limit)."""
    return {k: v for k, v in limits.items() if 0 <= v < slots}


def check_limits(conf: Any, catalogue: Any,
                 read_db: Callable[[], tuple[int | None, dict[str, int]]] | None) -> Finding:
    """Airflow's limits on what its scheduler hands the executor against the catalogue's slots.
    ``read_db``: ``(default_pool's slots or None, {dag_id: max_active_tasks} of the DAGs that are
    neither paused nor stale)`` from the metadata database (None: not read)."""
    slots = worker_slots(catalogue)
    try:
        limits = core_limits(conf)
    except ValueError as exc:
        return Finding("limits", FAIL, f"[core] settings: {exc}")
    dags: dict[str, int] = {}
    unread = "default_pool and DAGs not read"
    if read_db is not None:
        try:
            n, dags = read_db()
        except Exception as exc:  # noqa: BLE001 - the database is its own finding (traces)
            unread = f"default_pool and DAGs not read ({type(exc).__name__}: {exc})"
        else:
            unread = "no default_pool in the metadata database" if n is None else ""
            if n is not None:
                limits["default_pool slots"] = n
    low = below(limits, slots)
    narrow = sorted(below(dags, slots), key=lambda d: (dags[d], d))
    text = ", ".join(f"{k} {v}" for k, v in limits.items()) + (f" ({unread})" if unread else "")
    if not low and not narrow:
        return Finding("limits", OK, f"{text}: none below the catalogue's {slots} worker slots"
                                     + (f" ({len(dags)} active DAG(s) read)" if read_db is not None else ""))
    parts = list(low)
    if narrow:
        shown = ", ".join(f"{d} ({dags[d]})" for d in narrow[:5])
        more = f" and {len(narrow) - 5} more" if len(narrow) > 5 else ""
        parts.append(f"the max_active_tasks of DAG(s) {shown}{more}")
    names = ", ".join(parts)
    return Finding("limits", WARN, f"{text}: {names} below the catalogue's {slots} worker slots (every pool at "
                                   f"max_workers). A task held for a better pool is queued in Airflow and counts "
                                   f"against its run's max_active_tasks and default_pool: raise {names} to at "
                                   f"least {slots}, better a few times that, so the policy sees the ready tasks "
                                   f"of wide runs and the pools can fill (README, \"Airflow's concurrency "
                                   f"limits\")")


def airflow_limits(timeout_s: float) -> Callable[[], tuple[int | None, dict[str, int]]]:
    """Reads ``default_pool``'s slots and each active DAG's ``max_active_tasks`` (its own or
    ``max_active_tasks_per_dag``, as the dag processor wrote it) from the metadata database,
    bounded in time."""
    from airflow_drl_executor.liveness import run_within

    def read() -> tuple[int | None, dict[str, int]]:
        from airflow.models.dag import DagModel
        from airflow.models.pool import Pool
        from airflow.utils.session import create_session
        from sqlalchemy import select

        with create_session(scoped=False) as session:
            pool = Pool.get_default_pool(session=session)
            rows = session.execute(select(DagModel.dag_id, DagModel.max_active_tasks)
                                   .where(~DagModel.is_paused, ~DagModel.is_stale)).all()
            return (None if pool is None else int(pool.slots),
                    {str(d): int(m) for d, m in rows if m is not None})

    return lambda: run_within(read, timeout_s, "airflow-limits")


def _label(name: Any) -> str:
    """An executor entry as ``[core] executor`` spells it (``alias:module.path``)."""
    alias, path = getattr(name, "alias", None), getattr(name, "module_path", str(name))
    return f"{alias}:{path}" if alias and alias != path else str(path)


def check_executor(names: Callable[[], list[Any]], team: str | None = None) -> Finding:
    """``[core] executor`` as Airflow's ExecutorLoader reads it: an entry whose class is (a subclass
    of) DRLExecutor, and whether it is the default one (of ``team``'s executors)."""
    from airflow.executors.executor_loader import ExecutorLoader

    from airflow_drl_executor.executor import DRLExecutor

    try:
        mine = [n for n in names() if getattr(n, "team_name", None) == team]
    except Exception as exc:  # noqa: BLE001 - Airflow refuses the setting: the scheduler would too
        return Finding("executor", FAIL, f"[core] executor: {type(exc).__name__}: {exc}")
    if not mine:
        return Finding("executor", WARN, f"[core] executor names no executor{f' for team {team}' if team else ''}")
    for i, name in enumerate(mine):
        try:
            cls, _ = ExecutorLoader.import_executor_cls(name)
        except Exception as exc:  # noqa: BLE001 - the scheduler would not start
            return Finding("executor", FAIL, f"[core] executor {name.module_path!r}: {type(exc).__name__}: {exc}")
        if isinstance(cls, type) and issubclass(cls, DRLExecutor):
            if i == 0:
                return Finding("executor", OK, f"[core] executor: {_label(name)} is the default executor")
            return Finding("executor", WARN, f"[core] executor: {_label(name)} is configured, but {_label(mine[0])} "
                                             "is the default: only tasks that name it run through DRLExecutor")
    listed = ", ".join(_label(n) for n in mine)
    return Finding("executor", WARN, f"[core] executor: {listed}: DRLExecutor is not in use here")


def check_redis(cfg: Any, timeout_s: float) -> tuple[Finding, Any]:
    """``(finding, a connected redis client or None)``."""
    import redis

    from policy.transport import tls_options

    url = redacted_url(cfg.redis_url)
    try:
        r = redis.Redis.from_url(cfg.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 **tls_options(cfg.redis_url, cfg.redis_ca_cert or None))
        t0 = time.perf_counter()
        r.ping()
        ms = (time.perf_counter() - t0) * 1e3
    except Exception as exc:  # noqa: BLE001 - a wrong password, TLS, DNS, refused: all are the finding
        return Finding("redis", FAIL, f"{url}: {scrubbed(f'{type(exc).__name__}: {exc}', cfg.redis_url)}"), None
    return Finding("redis", OK, f"{url} answered PING in {ms:.1f} ms"), r


def _printable(text: str) -> str:
    """``text`` encodable as UTF-8 (found by review: a heartbeat's JSON may hold an escaped lone
    surrogate, which no page or terminal can print: HTTP 500 for the whole placements page)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def check_servers(cfg: Any, r: Any) -> Finding:
    """The policy servers' heartbeats on ``r``: live, stale, and whether they agree."""
    found = _servers(cfg, r)
    # every part of the detail comes from a heartbeat someone wrote (found by review: only each
    # server's own line was made printable; its objective in a warning gave HTTP 500)
    return Finding(found.check, found.status, _printable(found.detail))


def _servers(cfg: Any, r: Any) -> Finding:
    from policy.registry import UNKNOWN_OBJECTIVE
    from policy.transport import Keys, heartbeat_age

    keys = Keys(cfg.key_prefix)
    try:
        beats = r.hgetall(keys.heartbeat)
        sec, usec = r.time()
    except Exception as exc:  # noqa: BLE001
        return Finding("policy servers", FAIL, f"cannot read {keys.heartbeat}: {type(exc).__name__}: {exc}")
    now = sec + usec / 1e6
    live: list[str] = []
    stale: list[str] = []
    objectives: set[str] = set()
    misconfigured: list[str] = []
    for consumer, raw in sorted(beats.items()):
        name = consumer.decode(errors="replace") if isinstance(consumer, bytes) else str(consumer)
        try:
            doc = json.loads(raw)
        except (ValueError, TypeError, RecursionError):  # "[[[[...": as heartbeat_ts reads it
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        age = heartbeat_age(raw, now)
        objective = doc.get("objective")  # None: a heuristic-only server, or one older than objectives
        aim = f" for {objective}" if objective else ""
        text = f"{name} {doc.get('version', '?')}{aim} on {doc.get('device', '?')} ({age:.1f} s ago)"
        (live if age <= cfg.server_stale_after_s else stale).append(text)
        if objective and age <= cfg.server_stale_after_s:
            objectives.add(str(objective))
            given = doc.get("objective_given")
            if given and given != objective:
                misconfigured.append(f"{name} was started with --objective {given}")
    if not live:
        why = f"stale: {'; '.join(stale)}" if stale else f"no heartbeat on {keys.heartbeat}"
        return Finding("policy servers", FAIL, f"none live ({why}): every placement falls back to the "
                                               f"heuristic; prefix {cfg.key_prefix!r}")
    extra = f"; stale: {'; '.join(stale)}" if stale else ""
    detail = f"{len(live)} live: {'; '.join(live)}{extra}"
    if UNKNOWN_OBJECTIVE in objectives:
        return Finding("policy servers", WARN, f"{detail}: a registry's active.json does not say a valid "
                                               "objective (`drl-policy registry show`)")
    if len(objectives) > 1:
        return Finding("policy servers", WARN, f"{detail}: the replicas serve registries of different "
                                               f"objectives ({', '.join(sorted(objectives))})")
    if misconfigured:
        return Finding("policy servers", WARN, f"{detail}: {'; '.join(misconfigured)}, not its registry's "
                                               "objective (`drl-policy registry activate --objective` "
                                               "switches the registry; or change the servers' setting)")
    return Finding("policy servers", OK, detail)


def probe_request(catalogue: Any) -> tuple[Any, dict[str, Any]]:
    """A two-task request on a probe DAG run, on ``catalogue``'s pools as the catalogue says."""
    from policy.schema import PlacementRequest, ReadyTask, RunGraph, RunProgress, TaskNode

    run = f"drl-executor-check/{uuid.uuid4().hex[:8]}"
    graph = RunGraph(run, (TaskNode("extract", duration_s=30), TaskNode("load", duration_s=10)), ((0, 1),))
    request = PlacementRequest(uuid.uuid4().hex, (ReadyTask(run, "extract"),), catalogue.states(),
                               runs=(graph,), progress=(RunProgress(run),), created_at=time.time())
    return request, {run: graph}


def check_round_trip(cfg: Any, catalogue: Any) -> Finding:
    from airflow_drl_executor.client import PlacementClient, PlacementUnavailable

    request, graphs = probe_request(catalogue)
    try:  # the client too, as the executor makes it (found by review: built outside, its errors escaped)
        client = PlacementClient(cfg.redis_url, prefix=cfg.key_prefix, ca_cert=cfg.redis_ca_cert or None,
                                 timeout_ms=cfg.decision_timeout_ms, stale_after_s=cfg.server_stale_after_s,
                                 backoff_max_s=cfg.reconnect_backoff_max_s, max_request_bytes=cfg.max_request_bytes)
    except Exception as exc:  # noqa: BLE001
        return Finding("round trip", FAIL, f"cannot make the executor's client: {type(exc).__name__}: {exc}")
    try:
        t0 = time.perf_counter()
        reply = client.place(request, graphs)
        ms = (time.perf_counter() - t0) * 1e3
    except PlacementUnavailable as exc:
        return Finding("round trip", FAIL, f"no placement within {cfg.decision_timeout_ms} ms: {exc.reason}")
    except Exception as exc:  # noqa: BLE001
        return Finding("round trip", FAIL, f"{type(exc).__name__}: {exc}")
    finally:
        client.close()
    names = set(catalogue.names)
    foreign = sorted({d.pool for d in reply.decisions} - names)
    if foreign:
        return Finding("round trip", FAIL, f"{reply.policy} {reply.policy_version} placed the probe on "
                                           f"{', '.join(foreign)}, not a pool of the request")
    asked = {r.key for r in request.ready}
    stray = sorted(f"{d.run_key}/{d.task_id}" for d in reply.decisions if (d.run_key, d.task_id) not in asked)
    if stray:  # found by review: a server answering for other tasks passed as OK
        return Finding("round trip", FAIL, f"{reply.policy} {reply.policy_version} answered for "
                                           f"{_printable(', '.join(stray))}, not the probe's ready task")
    placed = "; ".join(f"{d.task_id} -> {d.pool} ({d.reason[:160]})" if d.reason else f"{d.task_id} -> {d.pool}"
                       for d in reply.decisions) or "held (wait for a better pool)"
    return Finding("round trip", OK, f"{reply.policy} {reply.policy_version} answered in {ms:.1f} ms: {placed}")


def check_workers(cfg: Any, catalogue: Any, ask: Callable[[], Any] | None) -> Finding:
    """Live Celery workers per pool, and which pools the executor would mark down (``_up``)."""
    from airflow_drl_executor.executor import _up
    from airflow_drl_executor.liveness import live_per_pool

    if cfg.pool_check_interval_s <= 0:
        return Finding("workers", OK, "pool_check_interval_s is 0: no liveness check, every pool counts as the "
                                      "catalogue says")
    if ask is None:
        return Finding("workers", WARN, "no Celery app to ask (see the message above)")
    try:
        replies = ask()
    except Exception as exc:  # noqa: BLE001
        return Finding("workers", WARN, f"the Celery broadcast failed: {type(exc).__name__}: {exc}: every pool "
                                        "counts as the catalogue says")
    if not replies:
        return Finding("workers", WARN, "no Celery worker answered: every pool counts as the catalogue says")
    count, _ = live_per_pool(replies, catalogue.names)
    text = ", ".join(f"{p} {n}" for p, n in count.items())
    down = [spec.name for spec in catalogue.pools if not _up(spec, count)]
    if down:
        return Finding("workers", WARN, f"live workers per pool: {text}; marked down: {', '.join(down)} (only "
                                        "tasks no other pool may run go there)")
    return Finding("workers", OK, f"live workers per pool: {text} (a pool that may scale to zero counts as up)")


def check_traces(timeout_s: float) -> Finding:
    from airflow_drl_executor import traces
    from airflow_drl_executor.liveness import run_within

    def read() -> tuple[int, Any] | None:
        from airflow.utils.session import create_session
        from sqlalchemy import func, inspect, select

        with create_session(scoped=False) as session:
            conn = session.connection()
            if not inspect(conn).has_table(traces.placements.name):
                return None
            col = traces.placements.c
            n, newest = conn.execute(select(func.count(), func.max(col.decided_at))).one()
            return int(n), newest

    try:  # bounded: a database that accepts and never answers held the command for ever (found by review)
        got = run_within(read, timeout_s, "trace-table")
    except Exception as exc:  # noqa: BLE001
        return Finding("traces", FAIL, f"the metadata database: {type(exc).__name__}: {exc}")
    if got is None:
        return Finding("traces", WARN, f"no {traces.placements.name} table yet: the executor makes it at its "
                                       "first placement")
    n, newest = got
    when = newest.isoformat(timespec="seconds") if newest is not None else "none yet"
    return Finding("traces", OK, f"{traces.placements.name}: {n} placement(s), the newest {when}")


def check_spool(cfg: Any) -> Finding:
    from airflow_drl_executor.spool import default_dir, waiting

    if not cfg.record_traces:
        return Finding("spool", OK, "record_traces is off: no spool")
    where = Path(cfg.spool_dir) if cfg.spool_dir else default_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".check."):
            pass
    except OSError as exc:  # the executor logs it and keeps such rows in memory only
        return Finding("spool", WARN, f"{where}: not writable ({exc}): rows the database refuses would be "
                                      "kept in memory only")
    rows, marks = waiting(where)
    if rows or marks:
        return Finding("spool", WARN, f"{where}: {rows} placement row(s) and {marks} not-sent mark(s) wait for "
                                      "the database")
    return Finding("spool", OK, f"{where}: writable, nothing waiting")


def run_checks(conf: Any, *, workers: Callable[[], Any] | None = None, database: bool = True,
               timeout_s: float = 2.0, team: str | None = None,
               executor_names: Callable[[], list[Any]] | None = None) -> list[Finding]:
    """Every check, in order (later ones need what earlier ones found). ``conf``: the executor's
    configuration (``ExecutorConf(team)``, as the executor reads it). ``workers`` asks Celery's
    workers which queues they consume (default: a Celery app built from ``conf`` as the executor
    builds its own); ``database``: check the trace table; ``executor_names``: Airflow's parsed
    ``[core] executor`` (default: ExecutorLoader's)."""
    if executor_names is None:
        from airflow.executors.executor_loader import ExecutorLoader

        def executor_names() -> list[Any]:
            return ExecutorLoader.get_executor_names(validate_teams=False)

    found, cfg, catalogue = check_config(conf)
    out = [found, check_executor(executor_names, team)]
    if cfg is None:
        return out
    out.append(check_limits(conf, catalogue, airflow_limits(max(timeout_s, 5.0)) if database else None))
    redis_found, r = check_redis(cfg, timeout_s)
    out.append(redis_found)
    if r is not None:
        out.append(check_servers(cfg, r))
        r.close()
        if out[-1].status == OK:
            out.append(check_round_trip(cfg, catalogue))
    if workers is None and cfg.pool_check_interval_s > 0:
        try:
            from airflow.providers.celery.executors.celery_executor_utils import create_celery_app

            from airflow_drl_executor.liveness import celery_inspector

            workers = celery_inspector(create_celery_app(conf), cfg.pool_check_timeout_s)
        except Exception as exc:  # noqa: BLE001 - [celery] settings the executor could not use either
            out.append(Finding("celery", FAIL, f"cannot build the Celery app: {type(exc).__name__}: {exc}"))
    out.append(check_workers(cfg, catalogue, workers))
    if database:
        out.append(check_traces(max(timeout_s, 5.0)))
    out.append(check_spool(cfg))
    return out


def render(findings: list[Finding]) -> str:
    width = max(len(f.check) for f in findings)
    return "\n".join(f"{f.check:<{width}}  {f.status:<4}  {f.detail}" for f in findings)


def command(args: Any) -> None:
    """The ``airflow drl-executor check`` action."""
    from airflow.executors.base_executor import ExecutorConf

    findings = run_checks(ExecutorConf(args.team or None), timeout_s=args.timeout, team=args.team or None)
    if args.output == "json":
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        print(render(findings))
    sys.stdout.flush()
    if any(f.status == FAIL for f in findings):
        sys.exit(1)
