"""DRLExecutor: a CeleryExecutor that asks a placement policy which worker pool runs each task.

For every batch of ready workloads the scheduler hands over, the executor builds ONE placement
request (the runs' task graphs, their progress, the ready tasks and the pools' state), sends it to
the policy server over Redis, sets each task instance's queue to the chosen pool (in the workload
that travels to Celery, and in ``task_instance.queue`` so the UI shows it), dispatches through the
Celery provider, and records the placement as a training trace. When the server does not answer
within ``decision_timeout_ms`` the executor places the batch itself with the
:class:`~policy.placement.EarliestFinishPlacer` and marks each decision as a fallback, with the
reason. No policy failure ever fails a task or stalls the scheduler loop past that deadline.

A reply may leave a ready task out: the policy chose to *wait* for a better pool (late binding,
as in the simulator it was trained in). The executor then keeps that workload back (it stays in
the executor's queue and is offered again at the next heartbeat) for at most ``max_wait_s`` of
time while a pool that could run it has a free slot, and ``max_hold_s`` in all
(``policy/holds.py``); after that it is placed by the fallback heuristic, and the reason says so.

The module stays light (no torch, no Redis connection at import); options are read once in
``__init__`` from ``[drl_executor]``.
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from airflow.providers.celery.executors.celery_executor import CeleryExecutor
from sqlalchemy import inspect
from sqlalchemy.exc import SQLAlchemyError

from airflow_drl_executor import metrics, traces
from airflow_drl_executor.client import PlacementClient, PlacementUnavailable
from airflow_drl_executor.config import ExecutorConfig, hold_bound
from airflow_drl_executor.graph_builder import (
    GraphBuilder,
    ReadyInstance,
    drl_hints,
    lenient_node,
    node_id,
    uuid_text,
)
from airflow_drl_executor.ledger import Ledger
from airflow_drl_executor.liveness import PoolWatch, celery_inspector
from airflow_drl_executor.spool import Spool
from airflow_drl_executor.spool import default_dir as spool_default_dir
from policy.catalogue import Catalogue, load_catalogue
from policy.errors import PolicyError
from policy.graph import view
from policy.holds import HoldClocks, slot_free_for
from policy.lru import LRU
from policy.placement import EarliestFinishPlacer, feasible
from policy.schema import Decision, PlacementRequest, PoolState, ReadyTask, RunGraph, RunProgress, TaskNode
from policy.transport import redacted_url

if TYPE_CHECKING:
    from airflow.executors import workloads

log = logging.getLogger(__name__)

#: trace rows kept for the next heartbeat while the metadata DB refuses them (a few hundred bytes
#: each; 10,000 is minutes of a busy scheduler's placements)
_UNWRITTEN_MAX = 10_000
#: transactions one heartbeat may spend looking for the rows the DB refuses for their content
#: (halving: a few per such row; the rest is written at the next heartbeat)
_WRITE_EACH_BUDGET = 64
#: task instances whose last queue this executor remembers writing (a few MB at most)
_WROTE_MAX = 50_000


def _breaks(d: Decision, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> bool:
    """Whether the policy's decision ``d`` puts its task on a pool its hard constraints rule out
    (resources, pinning, a pool down while another fits) when some pool satisfies them (found by
    review: a GPU task the server sent to a CPU pool, from a stale catalogue or a masking bug, was
    dispatched there and recorded as the policy's choice)."""
    graph = graphs.get(d.run_key)
    i = view(graph).index.get(d.task_id) if graph is not None else None
    if graph is None or i is None:
        return False
    ok = feasible(graph.tasks[i], request.pools)
    return bool(ok) and d.pool not in {p.name for p in ok}


class DRLExecutor(CeleryExecutor):
    """Celery executor with learned, per-task pool placement (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.drl_config = ExecutorConfig.from_conf(self.conf)
        queued_timeout = float(self.conf.get("scheduler", "task_queued_timeout", fallback="600") or 600)
        self.max_hold_s = hold_bound(self.drl_config, queued_timeout)  # the scheduler would requeue or fail it
        self.catalogue: Catalogue = load_catalogue(self.drl_config.catalogue)
        self.default_queue = str(self.conf.get("operators", "default_queue", fallback="default"))
        self.fallback_placer = EarliestFinishPlacer(fallback=True)
        self.graph_builder = GraphBuilder(
            pool_names=self.catalogue.names,
            default_queue=self.default_queue,
            default_duration_s=self.drl_config.default_duration_s,
            history_ttl_s=self.drl_config.history_ttl_s,
            vm_classes={p.name: p.vm_class for p in self.catalogue.pools},
        )
        self._client: PlacementClient | None = None
        self._pool_watch: PoolWatch | None = None
        #: what this executor sent to each pool, in order, with each task's expected run time
        self.ledger = Ledger()
        #: the hold clock of each task the policy keeps back (policy/holds.py: max_wait_s counts
        #: the time a pool that fits it had a free slot, max_hold_s all of it), by task key
        self._holds = HoldClocks(self.drl_config.max_wait_s, self.max_hold_s)
        self._open_slots: int | None = None  # of the heartbeat being processed
        #: task instances running on each pool per the metadata DB (every scheduler's), and the
        #: start (epoch s) of those of this executor's tasks in flight that run, as last read
        self._running_in_db: dict[str, int] | None = None
        #: pool -> expected finishes of the tasks running there that another scheduler sent
        self._others: dict[str, list[float]] = {}
        self._others_finish: dict[tuple[str, str], float] = {}  # (ti id, queueing) -> expected finish
        self._started: dict[str, float] | None = None
        self._traces_ready = False
        #: trace rows the metadata DB refused, written with the next ones (module _UNWRITTEN_MAX)
        self._unwritten: list[dict[str, Any]] = []
        #: the same rows on local disk, for the next scheduler if this one dies (started by start())
        self._spool: Spool | None = None
        self._spool_stale = False  # the rows changed since the spool's last save
        self._maybe_written = False  # some of the rows may be in the DB already (traces.not_written)
        #: (Celery id, request id) of the rows of publishes that did not go the DB has not marked not
        #: sent yet (a retry of the same try keeps its Celery id: only that request's row is marked)
        self._unmark: set[tuple[str, str]] = set()
        #: (dag id, run id, task id, map index) -> (the queue this executor last wrote for it,
        #: whether that placement was pinned): its own choice, known without the trace rows (found
        #: by review: when a publish that did not go took its row back, the choice was read as a
        #: mutation hook's pin)
        self._wrote: LRU[tuple[str, str, str, int], tuple[str, bool]] = LRU(_WROTE_MAX)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        super().start()
        cfg = self.drl_config
        self._client = PlacementClient(
            cfg.redis_url,
            prefix=cfg.key_prefix,
            ca_cert=cfg.redis_ca_cert or None,
            timeout_ms=cfg.decision_timeout_ms,
            stale_after_s=cfg.server_stale_after_s,
            backoff_max_s=cfg.reconnect_backoff_max_s,
            max_request_bytes=cfg.max_request_bytes,
        )
        if cfg.record_traces:
            self._open_spool()
        if cfg.pool_check_interval_s > 0:
            self._pool_watch = PoolWatch(celery_inspector(self.celery_app, cfg.pool_check_timeout_s),
                                         self.catalogue.names, interval_s=cfg.pool_check_interval_s,
                                         answer_s=cfg.pool_check_timeout_s)
            self._pool_watch.start()
        self.log.info(
            "DRLExecutor: pools %s from %s; policy server at %s (prefix %r, deadline %d ms); "
            "pool liveness every %g s",
            ", ".join(self.catalogue.names), self.catalogue.source, redacted_url(cfg.redis_url),
            cfg.key_prefix, cfg.decision_timeout_ms, cfg.pool_check_interval_s,
        )
        self._warn_limits()
        if self.default_queue not in self.catalogue.names:
            self.log.info("DRLExecutor: [operators] default_queue %r is not one of the pools: every task is "
                          "placed on a pool, and a callback for that queue runs on a live CPU pool",
                          self.default_queue)

    def _warn_limits(self) -> None:
        """Say so in the scheduler's log when Airflow's limits are below the catalogue's worker
        slots: the scheduler then hands the policy only part of a wide run's ready tasks
        (``airflow drl-executor check``'s ``limits`` line reads default_pool's slots too)."""
        from airflow_drl_executor.check import below, core_limits, worker_slots

        slots = worker_slots(self.catalogue)
        low = below(core_limits(self.conf, parallelism=self.parallelism), slots)
        if low:
            self.log.warning("DRLExecutor: %s below the catalogue's %d worker slots: raise them, or the policy "
                             "sees only part of each run's ready tasks (README, \"Airflow's concurrency limits\")",
                             ", ".join(f"{k} {v}" for k, v in low.items()), slots)

    def sync(self) -> None:
        self._flush_traces()  # those the DB refused, at every heartbeat until it takes them
        super().sync()
        self._apply_unmarks()  # once a heartbeat, not before every publish (found by review)
        live = self._pool_watch.live_workers() if self._pool_watch is not None else None
        down = sum(not _up(spec, live) for spec in self.catalogue.pools)
        metrics.gauges(held=self._held_count(), pools_down=down,
                       unwritten=len(self._unwritten))
        self._keep()  # a save the disk refused earlier (nothing when the spool is up to date)

    def end(self, synchronous: bool = False) -> None:
        self._flush_traces()
        if self._pool_watch is not None:
            self._pool_watch.stop()
        if self._client is not None:
            self._client.close()
        super().end(synchronous=synchronous)  # syncs: may flush again
        if self._spool is not None:  # rows still unwritten stay in its file for the next executor
            self._spool.close()
            self._spool = None  # (found by review: used after its lock went, by the sync above)

    def change_state(self, key: Any, state: Any, info: Any = None, remove_running: bool = True) -> None:
        super().change_state(key, state, info, remove_running=remove_running)
        if key not in self.running:
            self.ledger.drop(key)

    def try_adopt_task_instances(self, tis: Sequence[Any]) -> Sequence[Any]:
        """Celery's adoption, less the queued task instances this executor never sent (held for a
        better pool, or not yet placed, when the old scheduler stopped): Celery would watch those
        as PENDING until ``task_queued_timeout``. They are put back to ``scheduled`` in the same
        try, as the scheduler itself reschedules a task stuck in queued, and are queued and placed
        again at once (handed back instead, the scheduler would reset them to a new try: one
        retry lost to every restart, found by review). What is adopted enters the ledger, so its
        pools are not seen as idle."""
        never_sent = self._never_sent(tis)
        if never_sent:
            self.log.info("DRLExecutor: %d queued task instance(s) of the previous scheduler were never "
                          "sent to Celery: scheduled again in the same try", len(never_sent))
            _reschedule([ti for ti in tis if id(ti) in never_sent])
        keep = [ti for ti in tis if id(ti) not in never_sent]
        not_adopted = list(super().try_adopt_task_instances(keep)) if keep else []
        now = time.time()
        adopted = [ti for ti in keep if self._ti_key(ti) in self.running and ti.queue in self.catalogue.names]
        expected = self._expected_runs(adopted)
        for ti in adopted:
            run_s = expected.get(id(ti)) or self._run_s(self.catalogue.pool(ti.queue).state(), None)
            started = getattr(ti, "start_date", None)  # a running try: its finish from its start
            self.ledger.add(self._ti_key(ti), ti.queue, str(ti.id), run_s,
                            min(started.timestamp(), now) if started is not None else now)
        return not_adopted

    def _expected_runs(self, tis: Sequence[Any]) -> dict[int, float]:
        """``id(ti) -> expected seconds`` of adopted tries from their DAGs' history, as another
        scheduler's tasks are charged (found by review: every adopted task was charged the default
        duration, and a pool running a 1-hour task looked free 40 s after a restart); none when the
        history cannot be read (the default then)."""
        from airflow.utils.session import create_session

        if not tis:
            return {}
        try:
            with create_session(scoped=False) as session:
                return {id(ti): self.graph_builder.expected_run_s(
                    ti.dag_id, ti.task_id, ti.queue, session,
                    str(ti.dag_version_id) if ti.dag_version_id is not None else None) for ti in tis}
        except SQLAlchemyError as exc:
            self.log.warning("DRLExecutor: the adopted tasks' history cannot be read (%s): charged %gs each",
                             exc, self.drl_config.default_duration_s)
            return {}

    def _never_sent(self, tis: Sequence[Any]) -> set[int]:
        """``id()`` of the QUEUED ``tis`` this executor never sent: no placement recorded with
        their Celery task id (``external_executor_id``, assigned when the scheduler queues a try,
        so a reschedule or a sensor's next poke in the same try gets a new one); none when traces
        are off or cannot be read (then Celery's adoption decides, as without this executor)."""
        from airflow.utils.session import create_session
        from airflow.utils.state import TaskInstanceState

        # a task routed to a queue of its own was sent unplaced, with no placement row: Celery's
        # adoption decides for it (found by review: it was rescheduled while Celery held its message)
        queued = [ti for ti in tis if ti.state == TaskInstanceState.QUEUED and not self._routed_elsewhere(ti)]
        if not queued or not self.drl_config.record_traces:
            return set()
        # rows not in the DB yet: a dead scheduler's on this host (its spool), or this one's
        self._adopt_spooled()
        self._flush_traces()
        unwritten = {str(row["celery_id"]) for row in self._unwritten if row.get("celery_id")}
        unsent = set(self._unmark)
        if self._spool is not None:  # a live executor's too (one whose children hold its lock)
            unwritten |= self._spool.celery_ids()
            unsent |= self._spool.unsent_pairs()
        try:
            # a session of its own (every DB access of this executor): create_session() hands back
            # the thread's scoped session, here the scheduler's adoption session, and would commit
            # and close it (found by review: the TIs came back detached, adoption raised
            # DetachedInstanceError and the scheduler exited, at every restart)
            with create_session(scoped=False) as session:
                conn = session.connection()
                if not inspect(conn).has_table(traces.placements.name):
                    return set()
                sent = traces.sent_celery_ids(conn, [str(ti.external_executor_id) for ti in queued
                                                     if ti.external_executor_id], unsent=unsent)
        except SQLAlchemyError as exc:
            self.log.warning("DRLExecutor: cannot read placements to adopt tasks: %s", exc)
            return set()
        sent |= unwritten
        return {id(ti) for ti in queued if not ti.external_executor_id or str(ti.external_executor_id) not in sent}

    # --- placement -------------------------------------------------------------------------------

    def _held_count(self) -> int:
        return sum(1 for key in self.queued_tasks if key in self._holds)

    @property
    def slots_available(self) -> int:
        """Airflow's count without the tasks held for a better pool: the scheduler queues new
        task instances by it (found by review: two held tasks of parallelism 4 with two running
        kept every other ready task unqueued for up to max_wait_s). What is sent stays within
        the open slots (:meth:`_place`'s budget)."""
        return int(super().slots_available) + self._held_count()

    @property
    def slots_occupied(self) -> int:
        """Airflow's count without the tasks held for a better pool (see :attr:`slots_available`)."""
        return int(super().slots_occupied) - self._held_count()

    def _get_workloads_to_schedule(self, open_slots: int) -> list[tuple[Any, Any]]:
        """The base selection, with the tasks held for a better pool not counted against the open
        slots: they would otherwise take those slots at every heartbeat and keep every other ready
        task from being offered until they are placed (up to ``max_wait_s``). :meth:`_place`
        still dispatches at most ``open_slots``, callbacks first; callbacks past ``open_slots`` stay
        queued (found by review: the widened selection let them past ``parallelism``)."""
        held = self._held_count()
        self._open_slots = open_slots
        chosen = super()._get_workloads_to_schedule(open_slots + held)
        callbacks = [i for i, (key, _) in enumerate(chosen) if key in self.queued_callbacks]
        if len(callbacks) > open_slots:
            extra = set(callbacks[max(open_slots, 0):])
            chosen = [item for i, item in enumerate(chosen) if i not in extra]
        return chosen

    def _process_workloads(self, workload_items: Sequence[workloads.All]) -> None:
        from airflow.executors.workloads import ExecuteCallback, ExecuteTask

        tasks = [w for w in workload_items if isinstance(w, ExecuteTask)]
        stale = self._stale(tasks)
        if stale:
            tasks = [w for w in tasks if id(w) not in stale]
            workload_items = [w for w in workload_items if id(w) not in stale]
        callbacks = [w for w in workload_items if isinstance(w, ExecuteCallback)]
        if callbacks:
            self._route_callbacks(callbacks)
        records: list[tuple[Any, traces.PlacementRecord]] = []
        budget, self._open_slots = self._open_slots, None
        if tasks:
            budget = None if budget is None else budget - (len(workload_items) - len(tasks))
            if budget is not None and budget <= 0:  # only held tasks, no slot: no request this heartbeat
                held = {id(w) for w in tasks}
            else:
                records, held = self._place(tasks, budget=budget)
            if held:
                workload_items = [w for w in workload_items if id(w) not in held]
        # A placement whose Celery id the scheduler pre-assigned (external_executor_id, the id
        # apply_async is given) is written before the publish: a scheduler that dies between the
        # publish and the write would leave a sent task without its row, and the next one's
        # adoption would send it again (found by review). Unsent, its row is marked so below.
        early = (self._record_before_send(records, {self._key(w): w for w in tasks})
                 if records and self.drl_config.record_traces else {})
        if workload_items:
            super()._process_workloads(workload_items)
        from airflow.utils.state import TaskInstanceState

        # Only what Celery accepted was placed: a publish that timed out is retried (and placed
        # anew) at the next heartbeat (its key stays queued), one that failed fails the task;
        # neither leaves a trace. Not "in running": a resumed deferral (or a sensor's next poke)
        # can be queued before sync() has seen its previous message end, its key still running
        # (found by review: a timed-out publish was recorded, with the previous message's id).
        sent = [(key, rec) for key, rec in records
                if key in self.running and key not in self.queued_tasks
                and self.event_buffer.get(key, (None,))[0] != TaskInstanceState.FAILED]
        accepted = {key for key, _ in sent}
        for key in accepted:  # a task whose publish failed keeps its hold clock (found by review: it
            self._holds.forget(key)  # was held again from zero, max_wait_s per timeout)
        metrics.sent(rec for _, rec in sent)
        for key, _ in records:
            if key not in accepted:
                self.ledger.drop(key)
        if early:
            self._unrecord([celery_id for key, celery_id in early.items() if key not in accepted],
                           records[0][1].request_id)
        late = [(key, rec) for key, rec in sent if key not in early]
        if late and self.drl_config.record_traces:
            self._record(late)

    def _route_callbacks(self, callbacks: Sequence[Any]) -> None:
        """Send each callback (Airflow 3.2+: deadline and DAG callbacks run by the executor) to
        its own queue when that is one of our pools, else to the live CPU pool with the most free
        slots: Celery sends it to ``[operators] default_queue`` or ``data["queue"]``, a queue no
        pool worker consumes unless the catalogue names it, where it would wait forever."""
        names = set(self.catalogue.names)
        target = ""
        for w in callbacks:
            queue = w.callback.data.get("queue", self.default_queue)
            if queue in names:
                continue
            if not target:
                target = _callback_pool(self.pool_states())
            self.log.info("DRLExecutor: callback %s: queue %r is not one of the pools: sent to %s",
                          w.callback.key, queue, target)
            w.callback.data = {**w.callback.data, "queue": target}

    def _key(self, workload: Any) -> Any:
        return self._ti_key(workload.ti)

    def _ti_key(self, ti: Any) -> Any:
        """The key of ``ti`` in ``running``/``queued_tasks`` (as CeleryExecutor computes it)."""
        return self.get_task_key(ti) if self.supports_task_instance_uuid else ti.key

    def pool_states(self) -> tuple[PoolState, ...]:
        """The catalogue's pools with their load as the policy was trained to read it (see
        :mod:`airflow_drl_executor.ledger`): ``busy`` the slots running tasks (the task instances
        running there per the metadata DB, other schedulers' too), ``queued`` the tasks this
        executor sent that have not started, the expected finish of each, and how far each pool
        may grow; with the pool liveness check on, each pool's live Celery workers (a pool that
        must have a worker and has none is down; one that may scale to zero is not)."""
        live = self._pool_watch.live_workers() if self._pool_watch is not None else None
        states = []
        for spec in self.catalogue.pools:
            workers = spec.workers if live is None else live.get(spec.name, 0)
            states.append(spec.state(workers=workers, up=_up(spec, live)))
        loads = self.ledger.loads({st.name: st.slots for st in states}, time.time(), alive=self.running,
                                  started=self._started, running_there=self._running_in_db, others=self._others)
        out = []
        for spec, st in zip(self.catalogue.pools, states, strict=True):
            load = loads[st.name]
            top = spec.ceiling_slots
            out.append(replace(st, busy=load.busy, queued=load.queued, free_at=load.free_at, boot_s=spec.boot_delay_s,
                               # a pool that is down grows no more than it runs (as in the simulator)
                               max_slots=top if st.up and spec.elastic and top > st.slots else None))
        return tuple(out)

    def _starts(self, session: Any) -> dict[str, float]:
        """The start of each of this executor's tasks in flight that runs: a try starts once, so
        only those not yet seen running are asked about (was: every task in flight, every
        heartbeat: a quarter of a heartbeat's time with 2,000 in flight)."""
        flying = self.ledger.in_flight(self.running)
        alive = set(flying)
        known = {i: t for i, t in (self._started or {}).items() if i in alive}
        unknown = [i for i in flying if i not in known]
        if unknown:
            known.update(self.graph_builder.started(session, unknown))
        return known

    def _placed_before(self, session: Any, ready: Sequence[ReadyInstance]
                       ) -> dict[tuple[str, str], traces.LastPlacement] | None:
        """The latest placement of each ready instance queued on a pool (a pool its DAG may not
        pin it to: a mutation hook's pin, or this executor's earlier choice; see
        :func:`graph_builder.queue_pin`); None without placement traces (no queue is then read
        as a pin: an earlier choice could not be told from a hook's)."""
        if not self.drl_config.record_traces:
            return None
        names = set(self.catalogue.names) - {self.default_queue}
        on_pool = [i for i in ready if i.queue in names]
        out: dict[tuple[str, str], traces.LastPlacement] = {}
        unknown = {}
        for i in on_pool:  # what this executor wrote there itself, it knows (trace row or not)
            wrote = self._wrote.get(_instance(i))
            if wrote is not None and wrote[0] == i.queue:
                out[(i.run_key, i.node)] = traces.LastPlacement(i.try_number, wrote[0], wrote[1])
            else:
                unknown[_instance(i)] = (i.run_key, i.node)
        if not unknown:
            return out
        try:
            with session.begin_nested():  # a failed read must not abort the heartbeat's transaction
                conn = session.connection()
                if not inspect(conn).has_table(traces.placements.name):
                    return out  # nothing placed yet (the table comes with the first trace)
                found = traces.last_placements(conn, list(unknown))
        except SQLAlchemyError as exc:
            self.log.warning("DRLExecutor: cannot read earlier placements (queues not read as pins): %s", exc)
            return None
        return {**out, **{unknown[k]: last for k, last in found.items()}}

    def _others_running(self, session: Any) -> dict[str, list[float]]:
        """Each pool's running tasks that another scheduler sent (Airflow HA), as their expected
        finishes: start + their task's expected run time there. Read only when the DB shows more
        running than this executor's own started tasks (never with one scheduler: what a restart
        adopts is in the ledger), first in total (no pass over the ledger), then per pool."""
        in_db = self._running_in_db or {}
        if sum(in_db.values()) <= len(self._started or {}):
            return {}
        mine = self.ledger.started_by_pool(self._started or {}, self.running)
        if not any(n > mine.get(pool, 0) for pool, n in in_db.items()):
            return {}
        ours = set(self.ledger.in_flight(self.running))
        theirs = {(ti_id, queued): pool for ti_id, pool, queued in self.graph_builder.running_ids(session)
                  if ti_id not in ours}
        # a running try's expected finish is computed once per queueing (found by review: every
        # running row, its log rows and its history, at every heartbeat, a cost growing with the
        # tasks running; a resumed deferral or next poke keeps its id, not its queueing)
        cache = {k: f for k, f in self._others_finish.items() if k in theirs}
        new = {k[0]: k for k in theirs if k not in cache}
        if new:
            for ti_id, dag_id, task_id, pool, start, version in self.graph_builder.running_rows(session, list(new)):
                cache[new[ti_id]] = start + self.graph_builder.expected_run_s(dag_id, task_id, pool, session, version)
        self._others_finish = cache
        out: dict[str, list[float]] = {}
        for k, finish in cache.items():
            out.setdefault(theirs[k], []).append(finish)
        return out

    def _run_s(self, pool: PoolState, task: TaskNode | None) -> float:
        """Expected run time of ``task`` on ``pool`` (seconds)."""
        duration = task.duration_s if task is not None else self.drl_config.default_duration_s
        return duration / max(pool.speed_for(task.kind if task is not None else ""), 1e-3)

    def _stale(self, tasks: Sequence[Any]) -> set[int]:
        """The ``id()`` of the workloads not to send, dropped from the queue: a try superseded by
        a later try of its task instance queued here (a clear while it was held: found by review,
        both tries were sent), and a held task whose task instance left ``queued`` meanwhile (marked
        success or failed in the UI: found by review, sent once max_wait_s had passed). Plain
        Celery sends at once; only a hold opens these windows."""
        newest: dict[tuple[Any, ...], int] = {}
        for w in tasks:
            inst = (w.ti.dag_id, w.ti.run_id, w.ti.task_id, _map_index(w.ti))
            newest[inst] = max(newest.get(inst, w.ti.try_number), w.ti.try_number)
        stale = [w for w in tasks
                 if w.ti.try_number < newest[(w.ti.dag_id, w.ti.run_id, w.ti.task_id, _map_index(w.ti))]]
        superseded = {id(w) for w in stale}
        held = [w for w in tasks if self._key(w) in self._holds and id(w) not in superseded]
        if held:
            from airflow.utils.session import create_session

            try:
                with create_session(scoped=False) as session:
                    left = self.graph_builder.not_queued(session, [w.ti.id for w in held])
            except SQLAlchemyError as exc:
                self.log.warning("DRLExecutor: cannot check the state of held tasks: %s", exc)
                left = set()
            stale += [w for w in held if uuid_text(w.ti.id) in left]
        for w in stale:
            key = self._key(w)
            self.log.info("DRLExecutor: %s/%s/%s try %s: no longer queued (cleared or set meanwhile): not sent",
                          w.ti.dag_id, w.ti.run_id, w.ti.task_id, w.ti.try_number)
            self.queued_tasks.pop(key, None)
            self._holds.forget(key)
        return {id(w) for w in stale}

    def _with_held(self, ready_tasks: Sequence[ReadyTask], ready: Sequence[ReadyInstance],
                   tasks: Sequence[Any]) -> list[ReadyTask]:
        """``ready_tasks`` with how long this executor has held each (``ReadyTask.held_s``, an
        input of the policy: a task held long for its size should not wait longer)."""
        now = time.monotonic()
        held: dict[tuple[str, str], float] = {}
        for inst, w in zip(ready, tasks, strict=True):
            since = self._holds.since(self._key(w))
            if since is not None:
                key = (inst.run_key, inst.node)
                held[key] = max(held.get(key, 0.0), now - since)
        return [replace(t, held_s=held[t.key]) if t.key in held else t for t in ready_tasks]

    def _place(self, tasks: Sequence[Any], budget: int | None = None
               ) -> tuple[list[tuple[Any, traces.PlacementRecord]], set[int]]:
        """Place ``tasks`` (in priority order), dispatching at most ``budget`` of them: their trace
        records, and the ``id()`` of the workloads kept back (to wait for a better pool, or for
        want of a slot: those are offered again at the next heartbeat)."""
        from airflow.utils.session import create_session

        started = time.perf_counter()
        request_id = uuid.uuid4().hex
        self.ledger.keep(self.running)  # revoked, adopted or lost: not in flight here
        elsewhere = [w for w in tasks if self._routed_elsewhere(w.ti)]
        late: set[int] = set()
        if elsewhere:  # sent to their own queue as they are; the open slots go in priority order
            theirs = {id(w) for w in elsewhere}
            if budget is not None:
                remaining, mine = budget, 0
                clock = time.monotonic()
                for w in tasks:
                    key = self._key(w)
                    if id(w) not in theirs and key in self._holds and not self._holds.overdue(key, clock):
                        continue  # held for a better pool: no slot spent on it ahead of theirs (found
                        # by review: a held task kept a task of its own queue back for max_wait_s);
                        # one whose hold is over is placed now and takes its turn by priority (found
                        # by review: skipped for good, lower-priority tasks of their own queue
                        # took every open slot until task_queued_timeout failed it)
                    if remaining > 0:
                        remaining -= 1
                        mine += id(w) not in theirs
                    elif id(w) in theirs:
                        late.add(id(w))
                budget = mine
            tasks = [w for w in tasks if id(w) not in theirs]
            for w in elsewhere:
                self.log.debug("DRLExecutor: %s/%s/%s: queue %r is not one of the pools: sent there, not placed",
                               w.ti.dag_id, w.ti.run_id, w.ti.task_id, w.ti.queue)
            if not tasks:
                return [], late
        ready = [
            ReadyInstance(
                dag_id=w.ti.dag_id, run_id=w.ti.run_id, task_id=w.ti.task_id, map_index=_map_index(w.ti),
                try_number=w.ti.try_number, dag_version_id=str(w.ti.dag_version_id),
                queue=str(w.ti.queue),
            )
            for w in tasks
        ]
        pools: tuple[PoolState, ...] | None = None  # read after the DB (the pools' load is in it)
        graphs: dict[str, RunGraph] = {}
        policy, version = self.fallback_placer.name, self.fallback_placer.version
        decisions: dict[tuple[str, str], Decision] = {}
        asked: set[tuple[str, str]] = set()
        ignored: dict[tuple[str, str], str] = {}
        pinned: dict[tuple[str, str], str] = {}
        failed: dict[str, str] = {}
        unplaced = ""  # why the executor places the tasks the request does not hold itself
        try:
            with create_session(scoped=False) as session:
                self._running_in_db = self.graph_builder.running_by_pool(session)
                self._started = self._starts(session)
                self._others = self._others_running(session)
                placed_before = self._placed_before(session, ready)
                batch = self.graph_builder.build(ready, session, not_sent=self._not_sent(),
                                                 placed_before=placed_before)
            pools = self.pool_states()
            graphs, ignored, failed = batch.graphs, batch.ignored, batch.failed
            pinned = batch.queue_pins
            ready_tasks = self._with_held(batch.ready, ready, tasks)
            asked = {t.key for t in ready_tasks}
            unplaced = "fallback: the task is not in its run's graph (of the newest DAG version in the batch)"
            if ready_tasks:
                request = PlacementRequest(request_id=request_id, ready=tuple(ready_tasks), pools=pools,
                                           progress=tuple(batch.progress), created_at=time.time())
                decisions, policy, version = self._decide(request, graphs)
        except (PolicyError, SQLAlchemyError) as exc:
            self.log.warning("DRLExecutor: cannot build placement request %s: %s", request_id, exc)
            decisions, asked, unplaced = {}, set(), f"fallback: cannot build the request: {exc}"
        except Exception as exc:  # noqa: BLE001 - no placement failure may stop the scheduler loop
            self.log.exception("DRLExecutor: placement request %s failed", request_id)
            decisions, asked = {}, set()
            unplaced = f"fallback: placement failed: {type(exc).__name__}: {exc}"
        if pools is None:  # the request could not be built: the fallback places with what is known
            pools = self.pool_states()
        if failed:
            self.log.warning("DRLExecutor: request %s: fallback for the runs whose graph cannot be built: %s",
                             request_id, "; ".join(f"{k}: {v}" for k, v in failed.items()))
        alone = [(inst, w, f"fallback: cannot build the graph of its run: {failed[inst.run_key]}"
                  if inst.run_key in failed else unplaced)
                 for inst, w in zip(ready, tasks, strict=True) if (inst.run_key, inst.node) not in asked]
        stand_ins: dict[tuple[str, str], TaskNode] = {}
        unsure: set[tuple[str, str]] = set()
        if alone:
            own, stand_ins, unsure = self._place_alone(alone, pools)
            decisions.update(own)
        for key, why in ignored.items():
            if key in decisions:
                decisions[key] = _noting(decisions[key], why)
        for key, pool in pinned.items():
            if key in decisions:
                decisions[key] = replace(decisions[key], reason=f"{decisions[key].reason}; pinned to {pool} by its "
                                         "task instance's queue (set outside the DAG: a task_instance_mutation_hook)")
        decision_ms = (time.perf_counter() - started) * 1000.0

        records = []
        held: set[int] = set()
        now = time.monotonic()
        if len(self._holds) > len(tasks):  # forget tasks no longer queued here
            self._holds.keep_only(self.queued_tasks)
        kept: list[tuple[Any, TaskNode | None]] = []  # held by the policy: their clocks, after the loop
        placed: list[Any] = []
        planner = self.ledger.planner({p.name: p.slots for p in pools}, time.time())
        airflow_pools = self._airflow_pools([w for inst, w in zip(ready, tasks, strict=True)
                                             if (inst.run_key, inst.node) not in decisions])
        for inst, w in zip(ready, tasks, strict=True):
            key = self._key(w)
            decision = decisions.get((inst.run_key, inst.node))
            waited = self._holds.held_s(key, now)
            if budget is not None and len(placed) >= budget:
                if decision is None:  # the policy waits: its clock runs as for any held task
                    kept.append((key, _node(graphs, inst)))
                held.add(id(w))  # no slot left this heartbeat: offered again at the next
                continue
            if decision is None:
                # a held task would keep its slot of an Airflow pool (queued is an executing state
                # there): a rate-limit pool would idle while its task waits for a better worker pool
                airflow_pool = airflow_pools.get(uuid_text(w.ti.id))
                bound = self._holds.overdue(key, now)
                if bound is None and airflow_pool is None:
                    kept.append((key, _node(graphs, inst)))
                    held.add(id(w))
                    continue
                why = (f"not held: a held task keeps its slot of Airflow pool {airflow_pool!r}"
                       if airflow_pool is not None else
                       f"held {waited:.0f}s in all (max_hold_s), placing now" if bound == "max_hold" else
                       f"waited {self._holds.waited_s(key, now):.0f}s for a better pool while one had a free "
                       f"slot (max_wait_s), placing now")
                decision = self._fallback([ReadyTask(inst.run_key, inst.node)], pools, graphs, why
                                          )[(inst.run_key, inst.node)]
                decision = _noting(decision, ignored.get((inst.run_key, inst.node)))
            placed.append(w)
            w.ti.queue = decision.pool
            features: dict[str, Any] = {}
            node = _node(graphs, inst) or stand_ins.get((inst.run_key, inst.node))  # placed alone: a stand-in
            if (inst.run_key, inst.node) in unsure:
                self._wrote.discard(_instance(inst))
            else:
                self._wrote.put(_instance(inst), (decision.pool, node is not None and node.pool == decision.pool))
            if node is not None:
                features = node.to_json()
            pool_state = next((p for p in pools if p.name == decision.pool), None)
            if pool_state is not None:
                run_s = self._run_s(pool_state, node)
                self.ledger.add(key, decision.pool, str(w.ti.id), run_s, planner.start(decision.pool, run_s))
                if self._started:  # a resumed deferral or a sensor's next poke: same ti id, not started yet
                    self._started.pop(str(w.ti.id), None)
            records.append((key, traces.PlacementRecord(
                ti_id=str(w.ti.id), dag_id=inst.dag_id, run_id=inst.run_id, task_id=inst.task_id,
                map_index=inst.map_index,
                try_number=inst.try_number, pool=decision.pool, vm_class=decision.vm_class,
                score=decision.score, reason=decision.reason, fallback=decision.fallback,
                policy=policy, policy_version=version, request_id=request_id,
                decision_ms=decision_ms, features=features, waited_s=waited,
            )))
            self.log.info(
                "placed %s/%s/%s try %d on %s (%s)%s: %s", inst.dag_id, inst.run_id, inst.node,
                inst.try_number, decision.pool, decision.vm_class, " [fallback]" if decision.fallback else "",
                decision.reason,
            )
        taken = Counter(w.ti.queue for w in placed)
        for key, node in kept:  # whether a pool that fits it still has a free slot after this heartbeat's
            self._holds.hold(key, now, node is not None and slot_free_for(node, pools, taken))  # placements
        if held:
            self.log.debug("DRLExecutor: request %s: %d task(s) wait for a better pool", request_id, len(held))
        if placed:
            self._set_queues(placed)
        metrics.placement_step(decision_ms)
        return records, held | late

    def _airflow_pools(self, undecided: Sequence[Any]) -> dict[str, str]:
        """ti id -> the Airflow pool of each of these tasks (the ones the policy would hold) not in
        the default one, from the metadata DB (a workload does not carry it); read only when the
        policy left some task undecided. Unreadable: none (they may be held, as before)."""
        from airflow.utils.session import create_session

        if not undecided:
            return {}
        try:
            with create_session(scoped=False) as session:
                return self.graph_builder.airflow_pools(session, [w.ti.id for w in undecided])
        except SQLAlchemyError as exc:
            self.log.warning("DRLExecutor: cannot read the Airflow pools of held tasks: %s", exc)
            return {}

    def _routed_elsewhere(self, ti: Any) -> bool:
        """A task whose queue is neither one of the pools nor the default queue was sent there on
        purpose (its author, or a ``task_instance_mutation_hook``, routed it to workers of its
        own): it goes there, unplaced (found by review: it was placed on a pool like any task)."""
        queue = str(getattr(ti, "queue", "") or self.default_queue)
        return queue not in self.catalogue.names and queue != self.default_queue

    def _not_sent(self) -> set[tuple[str, str]]:
        """(run key, task id) of every task queued to this executor and not sent to Celery (held,
        or not offered for want of a slot): not running, as in the simulator the policy learnt in."""
        return {(f"{w.ti.dag_id}/{w.ti.run_id}", node_id(w.ti.task_id, _map_index(w.ti)))
                for w in self.queued_tasks.values() if getattr(w, "ti", None) is not None}

    def _place_alone(self, alone: Sequence[tuple[ReadyInstance, Any, str]], pools: tuple[PoolState, ...]
                     ) -> tuple[dict[tuple[str, str], Decision], dict[tuple[str, str], TaskNode],
                                set[tuple[str, str]]]:
        """Place tasks without their run's graph: each as a node built from its workload's own
        ``executor_config`` hints, queue and priority, by the fallback heuristic in one pass (so
        that the hard constraints hold and the batch spreads over the pools); each reason says why
        (``alone``: instance, workload, why) and names the hints it ignored. Also the nodes to
        record, and the tasks whose queue it could not tell. A pin read from the task instance's
        queue (a DAG's, a mutation hook's, or this executor's own earlier choice: without the
        graph it knows only what it remembers writing) is honoured but recorded as a pin only when
        it remembers one there (found by review: one heartbeat's DB error made the executor's own
        choice a pin for every later try; then, the other way, a known hook pin forgotten)."""
        nodes: dict[tuple[str, str], TaskNode] = {}
        recorded: dict[tuple[str, str], TaskNode] = {}  # the node a placement's trace records
        unsure: set[tuple[str, str]] = set()  # whether its queue was a pin, it cannot tell
        why: dict[tuple[str, str], str] = {}
        for inst, w, reason in alone:
            key = (inst.run_key, inst.node)
            if key in nodes:
                continue
            wrote = self._wrote.get(_instance(inst))  # its queue is this executor's own choice: no pin
            queue = self.default_queue if wrote is not None and wrote == (w.ti.queue, False) else str(w.ti.queue)
            hints = drl_hints(getattr(w.ti, "executor_config", None))
            nodes[key], wrong = lenient_node(  # in the batch's (priority) order: graph_builder.task_node
                inst.node, hints, queue, duration_s=self.drl_config.default_duration_s,
                pool_names=self.catalogue.names, default_queue=self.default_queue)
            why[key] = reason + "".join(f"; ignored: {p}" for p in wrong)
            if "pool" not in hints and wrote != (str(w.ti.queue), True):
                # a pin read from the queue alone: honoured here, not recorded as one (it may be an
                # earlier choice of this executor's), nor remembered either way
                recorded[key] = replace(nodes[key], pool=None)
                unsure.add(key)
        by_run: dict[str, list[TaskNode]] = {}
        for (run_key, _), node in nodes.items():
            by_run.setdefault(run_key, []).append(node)
        graphs = {k: RunGraph(run_key=k, tasks=tuple(v), edges=()) for k, v in by_run.items()}
        sub = PlacementRequest(request_id="alone", ready=tuple(ReadyTask(*key) for key in nodes), pools=pools,
                               created_at=time.time())  # the clock of the pools' free_at
        placed = {(d.run_key, d.task_id): replace(d, reason=f"{why[(d.run_key, d.task_id)]}: {d.reason}",
                                                   fallback=True)
                  for d in self.fallback_placer.place(sub, graphs)}
        return placed, {**nodes, **recorded}, unsure

    def _fallback(self, ready: Sequence[ReadyTask], pools: tuple[PoolState, ...],
                  graphs: Mapping[str, RunGraph], why: str, progress: tuple[RunProgress, ...] = ()
                  ) -> dict[tuple[str, str], Decision]:
        """The fallback heuristic's decisions for ``ready``, marked as fallback with ``why``."""
        # on the clock of the pools' expected finishes (free_at), which EFT reads against it (at 0,
        # the default, every busy slot would look ~56 years away)
        sub = PlacementRequest(request_id="fallback", ready=tuple(ready), pools=pools, progress=progress,
                               created_at=time.time())
        return {(d.run_key, d.task_id): replace(d, reason=f"fallback ({why}): {d.reason}", fallback=True)
                for d in self.fallback_placer.place(sub, graphs)}

    def _decide(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]
                ) -> tuple[dict[tuple[str, str], Decision], str, str]:
        """Ask the server. Without an answer, or for a pool not in the catalogue, the fallback
        decides; a task the server's answer leaves out waits (no entry in the result)."""
        assert self._client is not None, "DRLExecutor.start() was not called"
        decided: dict[tuple[str, str], Decision] = {}
        policy, version = self.fallback_placer.name, self.fallback_placer.version
        missing: list[ReadyTask] = []
        try:
            reply = self._client.place(request, graphs)
            policy, version = reply.policy, reply.policy_version
            names = set(self.catalogue.names)
            wrong = {(d.run_key, d.task_id): ("a pool not in the catalogue" if d.pool not in names else
                                              "a pool that breaks the task's hard constraints")
                     for d in reply.decisions if d.pool not in names or _breaks(d, request, graphs)}
            for d in reply.decisions:
                if (d.run_key, d.task_id) not in wrong:
                    decided[(d.run_key, d.task_id)] = d
            missing = [t for t in request.ready if t.key in wrong]
            why = "policy chose " + " and ".join(sorted(set(wrong.values())))
        except PlacementUnavailable as exc:
            missing, why = list(request.ready), exc.reason
        if missing:
            self.log.warning("DRLExecutor: request %s: fallback for %d task(s): %s",
                             request.request_id, len(missing), why)
            decided.update(self._fallback(missing, request.pools, graphs, why, request.progress))
        return decided, policy, version

    def _set_queues(self, tasks: Sequence[Any]) -> None:
        """Write each chosen queue to ``task_instance.queue`` (one UPDATE per pool)."""
        from airflow.models.taskinstance import TaskInstance
        from airflow.utils.session import create_session
        from sqlalchemy import update

        by_pool: dict[str, list[Any]] = {}
        for w in tasks:
            by_pool.setdefault(w.ti.queue, []).append(w.ti.id)
        try:
            with create_session(scoped=False) as session:
                for pool, ids in by_pool.items():
                    session.execute(
                        update(TaskInstance).where(TaskInstance.id.in_(ids)).values(queue=pool)
                        .execution_options(synchronize_session=False)
                    )
        except SQLAlchemyError as exc:
            self.log.error("DRLExecutor: could not record queues of %d task(s) in the DB: %s", len(tasks), exc)

    def _record_before_send(self, records: Sequence[tuple[Any, traces.PlacementRecord]],
                            by_key: Mapping[Any, Any]) -> dict[Any, str]:
        """Write the placements whose workload (``by_key``) carries its pre-assigned Celery id;
        key -> that id."""
        now = datetime.datetime.now(datetime.UTC)
        early: dict[Any, str] = {}
        for key, rec in records:
            workload = by_key.get(key)
            celery_id = getattr(getattr(workload, "ti", None), "external_executor_id", None)
            if celery_id:
                early[key] = str(celery_id)
                self._unwritten.append(_with_celery_id(rec, str(celery_id)).row(now))
                self._spool_stale = True
        if early:
            self._flush_traces()
        return early

    def _unrecord(self, celery_ids: Sequence[str], request_id: str) -> None:
        """Mark the rows written before a publish that did not go (timed out: placed anew at the
        next heartbeat; failed: the task fails) as not sent (:func:`traces.not_sent`)."""
        if not celery_ids:
            return
        gone = set(celery_ids)
        for row in self._unwritten:
            if row.get("celery_id") in gone:
                row.update(celery_id=None, reason=str(row.get("reason", "")) + traces.NOT_SENT)
        # the rows and the pending marks saved together before the DB is tried (found by review:
        # a scheduler killed while that try waited left a cleared row on disk without its mark)
        self._unmark |= {(c, request_id) for c in gone}
        self._spool_stale = True
        self._keep()
        self._apply_unmarks()

    def _apply_unmarks(self) -> None:
        """Mark as not sent the rows of the publishes that did not go; those the DB refuses are
        tried again at the next heartbeat (was: once: adoption after a restart then watched such a
        task as sent, until ``task_queued_timeout``)."""
        from airflow.utils.session import create_session

        if not self._unmark:
            return
        try:
            with create_session(scoped=False) as session:
                traces.not_sent(session.connection(), self._unmark)
        except SQLAlchemyError as exc:
            self.log.warning("DRLExecutor: cannot mark the placements of %d unsent task(s), retried at the next "
                             "heartbeat: %s", len(self._unmark), exc)
            return
        self._unmark = set()
        self._spool_stale = True  # its unsent file goes
        self._keep()

    def _record(self, records: Sequence[tuple[Any, traces.PlacementRecord]]) -> None:
        now = datetime.datetime.now(datetime.UTC)
        for key, rec in records:
            result = self.workloads.get(key)
            celery_id = getattr(result, "task_id", None)
            self._unwritten.append((rec if celery_id is None else _with_celery_id(rec, str(celery_id))).row(now))
            self._spool_stale = True
        self._flush_traces()

    def _flush_traces(self) -> None:
        """Write the trace rows not written yet. A row the DB refuses (a failover, a full disk) is
        kept and retried at the next heartbeat, up to :data:`_UNWRITTEN_MAX` rows, the oldest lost
        past that: the traces are what a restarted scheduler's adoption reads to tell a task sent to
        Celery from one never sent, and a sent task without its row would be rescheduled while Celery
        still runs it (found by review: one DB error lost the rows for good). A refusal for a row's
        content (:func:`_refused_for_content`) is not an outage: the rows it refuses are found by
        halving the batch (:meth:`_write_each`) and set aside in the spool's rejected file (found
        by review: one such row was retried for ever and kept every later row out of the DB, across
        restarts with the spool)."""
        from airflow.utils.session import create_session

        if not self._unwritten:
            return
        try:
            with create_session(scoped=False) as session:
                conn = session.connection()
                if not self._traces_ready:
                    traces.ensure_schema(conn.engine)
                    self._traces_ready = True
                self._insert(conn, self._unwritten)
        except _WRITE_ERRORS as exc:
            if _refused_for_content(exc):
                self._write_each()
                return
            self._maybe_written = True  # a commit whose answer was lost went through
            lost = len(self._unwritten) - _UNWRITTEN_MAX
            if lost > 0:
                del self._unwritten[:lost]
                self._spool_stale = True
                self.log.error("DRLExecutor: lost %d placement trace(s), the oldest not written: %s", lost, exc)
            self.log.warning("DRLExecutor: %d placement trace(s) not written, retried at the next heartbeat: %s",
                             len(self._unwritten), exc)
            self._keep()
            return
        self._unwritten.clear()
        self._maybe_written = False
        self._spool_stale = True
        self._keep()

    def _insert(self, conn: Any, rows: list[dict[str, Any]]) -> None:
        """Insert ``rows``, those already in the table left out while some may be there."""
        traces.write_rows(conn, traces.not_written(conn, rows) if self._maybe_written else rows)

    def _write_each(self) -> None:
        """Write the unwritten rows, halving a batch the DB refuses for its content until the rows it
        refuses are found (a few transactions per such row, not one per row: found by review,
        10,000 rows took 15 s of the scheduler loop one by one); those are logged and set aside,
        and from the first refusal of another kind (the DB went away) the rest are kept."""
        from airflow.utils.session import create_session

        pending = [list(self._unwritten)]
        kept: list[dict[str, Any]] = []
        refused: list[dict[str, Any]] = []
        budget = _WRITE_EACH_BUDGET  # transactions this heartbeat: the rest waits for the next
        while pending:
            if budget <= 0:
                kept = [row for rest in pending for row in rest]
                break
            budget -= 1
            chunk = pending.pop(0)
            try:
                with create_session(scoped=False) as session:
                    conn = session.connection()
                    self._insert(conn, chunk)
            except _WRITE_ERRORS as exc:
                if not _refused_for_content(exc):
                    kept = chunk + [row for rest in pending for row in rest]
                    self.log.warning("DRLExecutor: %d placement trace(s) not written, retried at the next heartbeat: "
                                     "%s", len(kept), exc)
                    break
                if len(chunk) > 1:
                    pending[:0] = [chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]]
                    continue
                refused.append(chunk[0])
                self.log.error("DRLExecutor: the metadata DB refuses the placement of %s/%s/%s try %s (set aside "
                               "in the spool's rejected file): %s", chunk[0].get("dag_id"), chunk[0].get("run_id"),
                               chunk[0].get("task_id"), chunk[0].get("try_number"), exc)
        self._unwritten = kept
        self._maybe_written = bool(kept)
        self._spool_stale = True
        if refused and self._spool is not None:
            try:
                self._spool.reject(refused)
            except OSError as exc:
                self.log.error("DRLExecutor: cannot keep the %d refused placement(s) in %s: %s", len(refused),
                               self._spool.rejected, exc)
        self._keep()

    def _keep(self) -> None:
        """Save the unwritten rows to this executor's spool if they changed since the last save
        (none: its file goes); once saved, the files of dead executors whose rows these include are
        deleted."""
        if self._spool is None or not self._spool_stale:
            return
        try:
            self._spool.save(self._unwritten, self._unmark)
        except OSError as exc:  # the dead executors' files stay until then
            self.log.error("DRLExecutor: %d unwritten placement(s) not saved to %s either (kept in memory): %s",
                           len(self._unwritten), self._spool.dir, exc)
            return
        self._spool_stale = False
        self._spool.release()

    def _open_spool(self) -> None:
        """This executor's spool (module :mod:`.spool`), and the rows dead executors left there."""
        where = self.drl_config.spool_dir or spool_default_dir()
        try:
            self._spool = Spool(where)
        except OSError as exc:  # rows the DB refuses then wait in memory only
            self.log.error("DRLExecutor: no spool for unwritten placements in %s: %s", where, exc)
            return
        self._adopt_spooled()

    def _adopt_spooled(self) -> None:
        """Take over the rows a dead executor left in the spool directory: written with this one's,
        so a restarted scheduler's adoption knows those tasks were sent (module :mod:`.spool`)."""
        if self._spool is None:
            return
        rows, unsent = self._spool.adopt_orphans()
        self._unwritten = rows + self._unwritten
        self._unmark |= unsent
        self._spool_stale = True
        self._maybe_written = self._maybe_written or bool(rows)  # a dead one's written rows, file not gone
        self._keep()
        if rows:
            self.log.warning("DRLExecutor: %d placement(s) a stopped scheduler could not write taken over from %s",
                             len(rows), self._spool.dir)
            self._flush_traces()


def _up(spec: Any, live: Mapping[str, int] | None) -> bool:
    """Whether a catalogue pool is up: with the liveness check on (``live``: its live Celery
    workers), a pool that must have a worker has one; one that may scale to zero always is."""
    return live is None or live.get(spec.name, 0) > 0 or spec.floor == 0


#: what a database driver raises, unwrapped by SQLAlchemy, for a value it cannot send (psycopg2: a
#: NUL in a string is a ValueError; sqlite3: an integer past 64 bits an OverflowError): found by
#: review, they went up through the heartbeat and out of the scheduler
_DRIVER_VALUE_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, OverflowError)
#: what a trace write may raise: the database's refusals and those
_WRITE_ERRORS: tuple[type[Exception], ...] = (SQLAlchemyError, *_DRIVER_VALUE_ERRORS)


def _refused_for_content(exc: Exception) -> bool:
    """Whether the DB refused a write for what a row holds (a constraint, a value its column cannot
    take, a value the driver cannot send), not for being unreachable or misconfigured."""
    from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError

    if isinstance(exc, _DRIVER_VALUE_ERRORS) or isinstance(exc, DataError | IntegrityError):
        return True
    return isinstance(exc, StatementError) and not isinstance(exc, DBAPIError)


def _reschedule(tis: Sequence[Any]) -> None:
    """Put these queued task instances back to ``scheduled`` in the same try (what the scheduler's
    ``_reschedule_stuck_task`` writes); the scheduler's session commits it."""
    from airflow.utils.state import TaskInstanceState

    now = datetime.datetime.now(datetime.UTC)
    for ti in tis:
        ti.state = TaskInstanceState.SCHEDULED
        ti.queued_dttm = None
        ti.queued_by_job_id = None
        ti.external_executor_id = None
        ti.scheduled_dttm = now


def _node(graphs: Mapping[str, RunGraph], inst: ReadyInstance) -> TaskNode | None:
    """The node of ``inst`` in its run's graph (None: not in it)."""
    graph = graphs.get(inst.run_key)
    at = view(graph).index.get(inst.node) if graph is not None else None
    return graph.tasks[at] if graph is not None and at is not None else None


def _map_index(ti: Any) -> int:
    """A task instance's map index (-1: not mapped)."""
    m = getattr(ti, "map_index", None)
    return -1 if m is None else int(m)


def _instance(inst: ReadyInstance) -> tuple[str, str, str, int]:
    """A task instance's name across its tries (Airflow gives each try a new id)."""
    return (inst.dag_id, inst.run_id, inst.task_id, inst.map_index)


def _with_celery_id(rec: traces.PlacementRecord, celery_id: str) -> traces.PlacementRecord:
    return replace(rec, celery_id=celery_id)


def _noting(decision: Decision, ignored: str | None) -> Decision:
    """``decision`` with the task's ignored hints (if any) at the end of its reason."""
    return decision if not ignored else replace(decision, reason=f"{decision.reason}; ignored: {ignored}")


def _callback_pool(pools: Sequence[PoolState]) -> str:
    """The pool a callback runs on: up, no GPU when one without is up, most free slots, cheapest."""
    live = [p for p in pools if p.up] or list(pools)
    cpu = [p for p in live if p.gpus == 0] or live
    return min(cpu, key=lambda p: (-p.free_slots, p.price_per_hour, p.name)).name
