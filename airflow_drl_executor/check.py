"""``airflow drl-executor check``: is this deployment's DRLExecutor set up to place tasks?

Run it where the scheduler runs, with the scheduler's ``airflow.cfg`` and environment. Each check
says ``ok``, ``warn`` (works, degraded or not yet in use) or ``fail`` (placements will not use the
learned policy, or the executor will not start), with what it found:

- ``config``: ``[drl_executor]`` parses and validates, ``max_wait_s`` is below
  ``[scheduler] task_queued_timeout``, the pool catalogue loads (what the executor does at start).
- ``executor``: ``[core] executor`` names DRLExecutor (warn: this deployment does not use it).
- ``redis``: the policy servers' Redis answers ``PING`` with this URL, password and TLS settings.
- ``policy servers``: the replicas with a fresh heartbeat (``server_stale_after_s``), each with
  its model version and device; none means every placement falls back to the heuristic.
- ``round trip``: a small probe request (two tasks of a probe DAG run, this catalogue's pools) is
  placed by a server within ``decision_timeout_ms``, on pools of this catalogue: the prefix, the
  wire schema and the server's catalogue agree with the executor's. It is a real request: the
  servers count it in their metrics; nothing is dispatched and no trace is written.
- ``workers``: the live Celery workers of each pool's queue (Celery's ``active_queues``
  broadcast, as the executor's pool liveness check asks; warn for a pool none consumes).
- ``traces``: the ``drl_placement`` table in the metadata database (rows, the newest); warn when
  it is not there yet (the executor creates it at its first placement).
- ``spool``: the spool directory is writable, and how many placement rows wait there for the
  database.

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

from airflow_drl_executor.config import redacted_url

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Finding:
    check: str
    status: str
    detail: str


def check_config(conf: Any) -> tuple[Finding, Any, Any]:
    """``(finding, ExecutorConfig or None, Catalogue or None)``."""
    from airflow_drl_executor.config import SECTION, ExecutorConfig
    from policy.catalogue import load_catalogue

    try:
        cfg = ExecutorConfig.from_conf(conf)
        queued_timeout = float(conf.get("scheduler", "task_queued_timeout", fallback="600") or 600)
        if cfg.max_wait_s >= queued_timeout:
            raise ValueError(f"[{SECTION}] max_wait_s ({cfg.max_wait_s:g}) must be below [scheduler] "
                             f"task_queued_timeout ({queued_timeout:g})")
        catalogue = load_catalogue(cfg.catalogue)
    except Exception as exc:  # noqa: BLE001 - whatever stops the executor's __init__ is the finding
        return Finding("config", FAIL, f"{type(exc).__name__}: {exc}"), None, None
    pools = ", ".join(f"{p.name} ({p.vm_class.name}, {p.workers} worker(s))" for p in catalogue.pools)
    return Finding("config", OK, f"[{SECTION}] valid; catalogue {catalogue.source}: {pools}"), cfg, catalogue


def check_executor(conf: Any) -> Finding:
    name = str(conf.get("core", "executor", fallback="") or "")
    if "DRLExecutor" in name:
        return Finding("executor", OK, f"[core] executor = {name}")
    return Finding("executor", WARN, f"[core] executor = {name or '(unset)'}: DRLExecutor is not in use here")


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
        return Finding("redis", FAIL, f"{url}: {type(exc).__name__}: {exc}"), None
    return Finding("redis", OK, f"{url} answered PING in {ms:.1f} ms"), r


def check_servers(cfg: Any, r: Any) -> Finding:
    from policy.transport import Keys, heartbeat_ts

    keys = Keys(cfg.key_prefix)
    try:
        beats = r.hgetall(keys.heartbeat)
        sec, usec = r.time()
    except Exception as exc:  # noqa: BLE001
        return Finding("policy servers", FAIL, f"cannot read {keys.heartbeat}: {type(exc).__name__}: {exc}")
    now = sec + usec / 1e6
    live: list[str] = []
    stale: list[str] = []
    for consumer, raw in sorted(beats.items()):
        name = consumer.decode(errors="replace") if isinstance(consumer, bytes) else str(consumer)
        try:
            doc = json.loads(raw)
        except (ValueError, TypeError):
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        age = now - heartbeat_ts(raw)
        text = f"{name} {doc.get('version', '?')} on {doc.get('device', '?')} ({age:.1f} s ago)"
        (live if age <= cfg.server_stale_after_s else stale).append(text)
    if not live:
        why = f"stale: {'; '.join(stale)}" if stale else f"no heartbeat on {keys.heartbeat}"
        return Finding("policy servers", FAIL, f"none live ({why}): every placement falls back to the "
                                               f"heuristic; prefix {cfg.key_prefix!r}")
    extra = f"; stale: {'; '.join(stale)}" if stale else ""
    return Finding("policy servers", OK, f"{len(live)} live: {'; '.join(live)}{extra}")


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

    client = PlacementClient(cfg.redis_url, prefix=cfg.key_prefix, ca_cert=cfg.redis_ca_cert or None,
                             timeout_ms=cfg.decision_timeout_ms, stale_after_s=cfg.server_stale_after_s,
                             backoff_max_s=cfg.reconnect_backoff_max_s)
    request, graphs = probe_request(catalogue)
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
                                           f"{', '.join(foreign)}, not a pool of this catalogue: the "
                                           "servers read another catalogue")
    placed = "; ".join(f"{d.task_id} -> {d.pool} ({d.reason[:160]})" if d.reason else f"{d.task_id} -> {d.pool}"
                       for d in reply.decisions) or "held (wait for a better pool)"
    return Finding("round trip", OK, f"{reply.policy} {reply.policy_version} answered in {ms:.1f} ms: {placed}")


def check_workers(catalogue: Any, ask: Callable[[], Any]) -> Finding:
    try:
        replies = ask()
    except Exception as exc:  # noqa: BLE001
        return Finding("workers", WARN, f"the Celery broadcast failed: {type(exc).__name__}: {exc}")
    if not replies:
        return Finding("workers", WARN, "no Celery worker answered: every pool counts as the catalogue says")
    count = dict.fromkeys(catalogue.names, 0)
    for queues in replies.values():
        for name in {q.get("name") for q in queues or () if isinstance(q, dict)}:
            if name in count:
                count[name] += 1
    text = ", ".join(f"{p} {n}" for p, n in count.items())
    empty = [p for p, n in count.items() if n == 0]
    if empty:
        return Finding("workers", WARN, f"live workers per pool: {text}; no worker consumes "
                                        f"{', '.join(empty)}: marked down (only tasks no other pool may run go there)")
    return Finding("workers", OK, f"live workers per pool: {text}")


def check_traces() -> Finding:
    from sqlalchemy import func, inspect, select

    from airflow_drl_executor import traces

    try:
        from airflow.utils.session import create_session

        with create_session(scoped=False) as session:
            conn = session.connection()
            if not inspect(conn).has_table(traces.placements.name):
                return Finding("traces", WARN, f"no {traces.placements.name} table yet: the executor makes it "
                                               "at its first placement")
            col = traces.placements.c
            n, newest = conn.execute(select(func.count(), func.max(col.decided_at))).one()
    except Exception as exc:  # noqa: BLE001
        return Finding("traces", FAIL, f"the metadata database: {type(exc).__name__}: {exc}")
    when = newest.isoformat(timespec="seconds") if newest is not None else "none yet"
    return Finding("traces", OK, f"{traces.placements.name}: {n} placement(s), the newest {when}")


def check_spool(cfg: Any) -> Finding:
    from airflow_drl_executor.spool import default_dir

    if not cfg.record_traces:
        return Finding("spool", OK, "record_traces is off: no spool")
    where = Path(cfg.spool_dir) if cfg.spool_dir else default_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".check."):
            pass
    except OSError as exc:
        return Finding("spool", FAIL, f"{where}: not writable ({exc}): rows the database refuses would be "
                                      "kept in memory only")
    waiting = 0
    for path in where.glob("*.jsonl"):
        if path.name.endswith(".rejected.jsonl"):
            continue
        try:
            waiting += sum(1 for line in path.read_bytes().splitlines() if line.strip())
        except OSError:
            continue
    if waiting:
        return Finding("spool", WARN, f"{where}: {waiting} placement row(s) wait for the database")
    return Finding("spool", OK, f"{where}: writable, nothing waiting")


def run_checks(conf: Any, *, workers: Callable[[], Any] | None = None, database: bool = True,
               timeout_s: float = 2.0) -> list[Finding]:
    """Every check, in order (later ones need what earlier ones found). ``workers`` asks Celery's
    workers which queues they consume (default: the Celery executor's app); ``database``: check
    the trace table (needs Airflow's metadata database configured)."""
    found, cfg, catalogue = check_config(conf)
    out = [found, check_executor(conf)]
    if cfg is None:
        return out
    redis_found, r = check_redis(cfg, timeout_s)
    out.append(redis_found)
    if r is not None:
        out.append(check_servers(cfg, r))
        r.close()
        if out[-1].status == OK:
            out.append(check_round_trip(cfg, catalogue))
    if workers is None:
        from airflow.providers.celery.executors.celery_executor import app

        from airflow_drl_executor.liveness import celery_inspector

        workers = celery_inspector(app, cfg.pool_check_timeout_s)
    out.append(check_workers(catalogue, workers))
    if database:
        out.append(check_traces())
    out.append(check_spool(cfg))
    return out


def render(findings: list[Finding]) -> str:
    width = max(len(f.check) for f in findings)
    return "\n".join(f"{f.check:<{width}}  {f.status:<4}  {f.detail}" for f in findings)


def command(args: Any) -> None:
    """The ``airflow drl-executor check`` action."""
    from airflow.configuration import conf

    findings = run_checks(conf, timeout_s=args.timeout)
    if args.output == "json":
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        print(render(findings))
    sys.stdout.flush()
    if any(f.status == FAIL for f in findings):
        sys.exit(1)
