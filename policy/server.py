"""``drl-policy serve``: answer placement requests from Redis, one micro-batch at a time.

Protocol (fixed by :mod:`policy.transport` and :mod:`policy.schema`): clients ``XADD`` a JSON
:class:`~policy.schema.PlacementRequest` under the field ``payload`` to ``Keys.requests``; the
server replicas read that stream through the consumer group ``Keys.group`` and answer each request
by ``RPUSH`` of a JSON :class:`~policy.schema.PlacementReply` to ``Keys.reply(request_id)`` plus
``EXPIRE`` (one MULTI per batch), then ``XACK`` and ``XDEL`` the entries.

Choices worth knowing:

- The group is created with ``MKSTREAM`` at id ``0``, not ``$``: requests the executor sent before
  the first replica came up are still served if their deadline allows (older ones are dropped
  unanswered by the deadline check, which is cheap).
- Entries are deleted once answered, so the stream holds only unanswered requests (full graphs
  can be large; ``MAXLEN ~`` on the client side bounds the rest).
- A request is dropped without a reply once ``deadline_ms`` have passed since Redis added it (its
  entry id is Redis's clock in milliseconds; the replica tracks Redis's clock by ``TIME``): the
  client has already fallen back and would not read it. No two hosts' clocks are compared.
- A replica takes over entries another replica read but has not acknowledged (it crashed, or is
  stuck) with ``XCLAIM`` once they are ``claim_idle_ms`` old (an idle replica wakes for the sweep),
  so a crashed replica's requests are still answered within the executor's deadline; an entry
  taken over once is left to a replica whose heartbeat is fresh. Exactly one reply per request: replies,
  ``XACK`` and ``XDEL`` go in one Lua script that answers only the entries this replica still owns
  (``XPENDING ... consumer``), so a slow replica whose entries were taken over drops its answers.
- A graph sent in full is kept in the replica's :class:`~policy.graph_cache.GraphCache` and, by
  the same script, in the shared graph store (``Keys.graph``, TTL ``graph_store_ttl_s``): a
  :class:`~policy.schema.RunRef` read by another replica is resolved from there (``GETEX``), not
  bounced back to the client as ``unknown_graph``. Every full graph is stored, cached here or not
  (after Redis restarts empty, the resend is the store's only refill), and a reference resolved
  from the local cache refreshes the stored entry's TTL (``EXPIRE``, in the same script).
- A stream or group deleted under the replica (``FLUSHALL``, a restart without persistence) is
  recreated at once (``NOGROUP``, ``UNBLOCKED``, ``no such key``), not taken for a lost Redis.
- Heartbeats older than ``heartbeat_prune_s`` (replicas that crashed) are removed from
  ``Keys.heartbeat``, and their consumers from the group once nothing is pending for them.
- Losing Redis is not fatal: the loop reconnects with capped, jittered exponential backoff.
- SIGTERM/SIGINT finish the batch in hand, acknowledge it, and exit 0.
- Requests are micro-batched: one read takes everything queued (up to ``batch_max``), and with
  ``batch_wait_ms > 0`` the server waits that long for the batch to fill. A placer with
  ``place_many`` (:class:`~policy.arbiter.BatchPlacer`, the GNN) decides the whole batch in one
  call, one model call per phase; any other placer is called per request.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import logging
import math
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Mapping, Sequence

import redis

from policy.arbiter import Arbiter, ArbiterConfig
from policy.catalogue import Catalogue, load_catalogue
from policy.config import ConfigError, ServerConfig, add_config_arguments
from policy.errors import CheckpointError, PolicyError, SchemaError
from policy.features import run_features
from policy.graph import view
from policy.graph_cache import GraphCache
from policy.metrics import MetricsServer, ServerMetrics
from policy.placement import EarliestFinishPlacer, Placer
from policy.registry import LoadedModel, Loader, ModelRegistry, ensure_active, gnn_loader
from policy.schema import (
    Decision,
    PlacementReply,
    PlacementRequest,
    RunGraph,
    RunRef,
    _finite,
    dumps,
    loads_json,
)
from policy.transport import PAYLOAD_FIELD, REPLY_TTL_S, Keys, heartbeat_age, tls_options

log = logging.getLogger(__name__)

_PAYLOAD = PAYLOAD_FIELD.encode()
#: request ids we will answer: a reply key is built from them
_REQUEST_ID = re.compile(rb'"request_id"\s*:\s*"([A-Za-z0-9_.:@/+=-]{1,200})"')
_MAX_REQUEST_ID = 200
#: while waiting for a micro-batch to fill (``batch_wait_ms``), seconds between non-blocking reads
_BATCH_POLL_S = 0.0005
#: a request's deadline when it names none, ms
_DEFAULT_DEADLINE_MS = 250.0
#: Redis errors that mean the stream, and so the group, was deleted under us (FLUSHALL, DEL, a
#: restart without persistence): XREADGROUP/XAUTOCLAIM answer NOGROUP, a read blocked at that
#: moment is woken with UNBLOCKED, XINFO answers 'no such key'. Recreate the group; Redis is there.
_GROUP_GONE = ("NOGROUP", "UNBLOCKED", "no such key")

#: Write this replica's heartbeat into the replicas' hash, first replacing a key of another type
#: there (found by review: HSET's WRONGTYPE read as a lost Redis, and every replica reconnected for
#: ever; the key is the replicas' own). One script, so replicas that find it so at once do not
#: delete each other's beats. KEYS[1]: the hash; ARGV: consumer, beat. Returns the type it
#: replaced, "" when it was a hash or absent.
_HEARTBEAT_LUA = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'hash' and kind ~= 'none' then redis.call('DEL', KEYS[1]) else kind = '' end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return kind
"""

#: Store the batch's full graphs and refresh the TTL of those it named by reference, then reply
#: to, acknowledge and delete the entries this replica still owns; returns the ids of those it no
#: longer owns (another replica took them over).
#: KEYS[1]: the request stream. ARGV: group, consumer, reply TTL, graph TTL, number of graphs G,
#: G (key, graph JSON) pairs, number of references R, R keys, then (entry id, reply key, reply
#: JSON) triples ('' key: no reply).
_REPLY_LUA = """
local stream, group, me = KEYS[1], ARGV[1], ARGV[2]
local reply_ttl, graph_ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local i = 6
for _ = 1, tonumber(ARGV[5]) do
  redis.call('SET', ARGV[i], ARGV[i + 1], 'NX', 'EX', graph_ttl)
  i = i + 2
end
local refs = tonumber(ARGV[i])
i = i + 1
for _ = 1, refs do
  redis.call('EXPIRE', ARGV[i], graph_ttl)
  i = i + 1
end
local lost = {}
while i <= #ARGV do
  local id, key = ARGV[i], ARGV[i + 1]
  if #redis.call('XPENDING', stream, group, id, id, 1, me) > 0 then
    if key ~= '' then
      -- pcall: a key of another type there (not ours) is left alone, its entry acknowledged unanswered
      local pushed = redis.pcall('RPUSH', key, ARGV[i + 2])
      if type(pushed) ~= 'table' or not pushed.err then
        redis.call('EXPIRE', key, reply_ttl)
      end
    end
    redis.call('XACK', stream, group, id)
    redis.call('XDEL', stream, id)
  else
    lost[#lost + 1] = id
  end
  i = i + 3
end
return lost
"""


class RequestRejected(PolicyError):
    """A request that gets an error reply: ``code`` is the reply's ``error_code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Job:
    """One stream entry on its way through a batch."""

    entry_id: bytes
    read_at: float
    #: when Redis added the entry, on Redis's clock (ms; None: not a Redis entry id)
    entry_ms: int | None = None
    request_id: str | None = None
    request: PlacementRequest | None = None
    graphs: dict[str, RunGraph] | None = None
    reply: PlacementReply | None = None
    late: bool = False
    #: the payload's ``created_at`` and ``deadline_ms`` as read (None: not parsed): an error reply
    #: is dropped past the deadline too (found by review: only a parsed request's was)
    created_at: Any = None
    deadline_ms: Any = None


class PolicyServer:
    """One replica: read a batch, decide, reply, acknowledge; repeat until :meth:`stop`.

    ``placer`` forces a placer (tests, benchmarks); otherwise ``config.placer`` chooses, and with a
    registry folder the model it names is loaded (``loader``, default the GNN) and hot-reloaded.
    Usable in-process: ``threading.Thread(target=server.serve_forever).start(); ...; server.stop()``.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        placer: Placer | None = None,
        loader: Loader | None = None,
    ) -> None:
        self.config = config
        self.keys = Keys(config.prefix)
        self.metrics = ServerMetrics()
        #: while a batch is handled, the runs the cache dropped meanwhile (see :meth:`handle`)
        self._dropped: set[tuple[str, str]] | None = None
        self.cache = GraphCache(
            max_entries=config.graph_cache_entries,
            max_bytes=config.graph_cache_bytes,
            ttl_s=config.graph_cache_ttl_s,
            on_drop=self._forget_run,
        )
        self.arbiter = Arbiter(
            ArbiterConfig(
                temperature=config.temperature,
                seed=config.seed,
                skew_threshold=config.skew_threshold,
                skew_fallback_n=config.skew_fallback_n,
            ),
            on_fallback=lambda reason, n: self.metrics.fallbacks.labels(reason=reason).inc(n),
        )
        self.catalogue: Catalogue | None = load_catalogue(config.catalogue) if config.catalogue else None
        self.registry: ModelRegistry | None = None
        self.placer: Placer = placer or EarliestFinishPlacer()
        self.device = "cpu"
        self.checkpoint = ""
        if placer is None and config.placer != "eft" and config.registry:
            _torch_threads(config.torch_threads)
            _check_device(config.device)
            gnn_kwargs: dict[str, Any] = {"temperature": config.temperature, "seed": config.seed,
                                          "hold_ratio": config.hold_ratio, "step_kernel": config.step_kernel}
            if config.cp_gate is not None:  # unset: as the checkpoint was trained
                gnn_kwargs["cp_gate"] = config.cp_gate
            if config.cp_gate_scope is not None:
                gnn_kwargs["cp_gate_scope"] = config.cp_gate_scope
            self.registry = ModelRegistry(
                config.registry,
                loader=loader or functools.partial(gnn_loader, **gnn_kwargs),
                device=config.device,
                poll_s=config.registry_poll_s,
                on_failure=lambda reason: self.metrics.model_load_failures.inc(),
            )
            root = Path(config.registry)
            if not root.is_dir() and not root.parent.is_dir():
                # found by review: a typo in a parent folder made a tree of new folders, seeded with
                # the packaged model, served for ever while the fine-tune promoted into the real one
                raise ConfigError(f"registry: {root}: neither it nor its parent folder exists (a typo? the "
                                  "server makes the registry folder itself, not a tree of folders)")
            try:
                ensure_active(config.registry, objective=config.objective)
                model = self.registry.load_now()
            except CheckpointError as exc:
                if config.placer == "gnn":
                    raise
                log.error("no model (%s); serving the %s heuristic until the registry names one "
                          "that loads", exc, self.placer.name)
                self.metrics.model_load_failures.inc()
                model = None
            if model is None and config.placer == "gnn":
                raise CheckpointError(f"{self.registry.manifest}: no active checkpoint")
            if model is not None:
                self._swap(model)
        elif placer is None and config.placer != "eft":  # no registry: nothing learned to serve
            log.warning("no --registry: serving the %s heuristic, not a trained policy", self.placer.name)
        self.metrics.set_model(self.version, self.device)
        self._stop = threading.Event()
        self._redis: redis.Redis | None = None
        self._ready = False
        self.connected = False
        #: Redis's clock minus ours, seconds (None until measured: deadlines then use created_at)
        self._clock_offset: float | None = None
        #: the batch's full graphs, for the shared store (SET NX, with the replies)
        self._store_graphs: dict[tuple[str, str], RunGraph] = {}
        #: store keys of the graphs the batch named by reference and found in the local cache
        self._touch_graphs: set[str] = set()
        self._reply_script: Any = None
        self._heartbeat_script: Any = None
        #: the last Redis failure logged, until connected again (each new one is a warning)
        self._redis_error = ""
        self._next_claim = 0.0
        self._next_heartbeat = 0.0
        self._next_prune = 0.0
        self._next_freeze = 0.0
        self._next_full_gc = time.monotonic() + config.gc_full_s
        self._rng = random.Random(config.seed)
        self.started_at = time.time()
        self.batches = 0
        self.handled = 0
        self._pool_labels: set[str] = set()  # the pool names decision metrics are labelled with
        self._housekeeping_logged_at = -math.inf

    # --- life cycle --------------------------------------------------------------------------

    @property
    def version(self) -> str:
        return f"{self.placer.name}:{self.placer.version}"

    def stop(self) -> None:
        """Ask the loop to finish the batch in hand and return (safe from a signal handler)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def serve_forever(self) -> int:
        """Serve until :meth:`stop`; returns the process exit status (0)."""
        log.info("serving %s on %s (prefix %r, consumer %s, device %s, cp_gate %s, scope %s)", self.version,
                 self.config.safe_redis_url, self.config.prefix, self.config.consumer, self.device,
                 getattr(self.placer, "cp_gate", None), getattr(self.placer, "cp_gate_scope", None))
        # Start-up objects (modules, catalogue, model) live for the whole process: keep them out
        # of the cyclic collector's scans, which otherwise show up as tail latency.
        gc.collect()
        gc.freeze()
        delay = self.config.reconnect_base_s
        try:
            while not self._stop.is_set():
                try:
                    if not self._ready:
                        self._connect()
                    self.step()
                    delay = self.config.reconnect_base_s
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self._lost(f"{type(exc).__name__}: {exc}", delay)
                    delay = min(self.config.reconnect_max_s, delay * 2)
                except redis.ResponseError as exc:
                    if any(s in str(exc) for s in _GROUP_GONE):
                        log.warning("consumer group vanished (%s); recreating it", exc)
                        self._drop_connection()
                        continue
                    self._lost(f"Redis error: {exc}", delay)
                    delay = min(self.config.reconnect_max_s, delay * 2)
        finally:
            # also on a crash: a heartbeat left behind would count a dead replica as live until pruned
            self._goodbye()
        log.info("stopped after %d requests in %d batches", self.handled, self.batches)
        return 0

    def _lost(self, why: str, delay: float) -> None:
        if self.connected:
            log.warning("lost Redis at %s (%s); reconnecting", self.config.safe_redis_url, why)
        elif why != self._redis_error:  # a first failure (a wrong password at start-up), or a new one
            log.warning("cannot use Redis at %s (%s); retrying with back-off", self.config.safe_redis_url, why)
        else:
            log.debug("Redis still unavailable (%s)", why)
        self._redis_error = why
        self.metrics.reconnects.inc()
        self.connected = False
        self._drop_connection()
        self._stop.wait(delay * (0.5 + self._rng.random() / 2))

    def _drop_connection(self) -> None:
        """Close the client; the next iteration connects again and (re)creates the group."""
        self._ready = False
        if self._redis is not None:
            try:
                self._redis.close()
            except redis.RedisError:
                pass
            self._redis = None

    def _new_client(self, connect_timeout_s: float, timeout_s: float) -> redis.Redis:
        """A client of the configured Redis (TLS options, keepalive but on a unix socket)."""
        kwargs: dict[str, Any] = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": timeout_s}
        if not self.config.redis_url.startswith("unix://"):  # found by review: a unix socket
            kwargs["socket_keepalive"] = True  # connection refuses it: every unix:// server crashed
        kwargs.update(tls_options(self.config.redis_url, self.config.redis_ca_cert))
        return redis.Redis.from_url(self.config.redis_url, **kwargs)

    def _connect(self) -> None:
        r = self._new_client(2.0, self.config.block_ms / 1000 + 5.0)
        r.ping()
        try:
            r.xgroup_create(self.keys.requests, self.keys.group, id="0", mkstream=True)
            log.info("created consumer group %s on %s", self.keys.group, self.keys.requests)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._redis = r
        self._reply_script = r.register_script(_REPLY_LUA)
        self._heartbeat_script = r.register_script(_HEARTBEAT_LUA)
        self._sync_clock(r)
        self._ready = True
        self.connected = True
        self._redis_error = ""
        self._next_heartbeat = 0.0
        log.info("connected to %s", self.config.safe_redis_url)

    def _sync_clock(self, r: redis.Redis) -> None:
        """Measure Redis's clock against ours (``TIME``, half the round trip taken off)."""
        t0 = time.time()
        sec, usec = r.time()
        t1 = time.time()
        self._clock_offset = sec + usec / 1e6 - (t0 + t1) / 2

    def redis_now(self) -> float:
        """Redis's clock now, epoch seconds (ours until it has been measured)."""
        return time.time() + (self._clock_offset or 0.0)

    def _goodbye(self) -> None:
        if self.registry is not None:
            self.registry.wait_idle(5.0)
        r = self._redis
        if r is None:  # stopped while reconnecting: one short try, so executors stop waiting on it
            try:
                r = self._new_client(1.0, 1.0)
            except (redis.RedisError, ValueError) as exc:
                log.debug("cleanup on exit skipped: %s", exc)
                return
        try:
            r.hdel(self.keys.heartbeat, self.config.consumer)
            for c in r.xinfo_consumers(self.keys.requests, self.keys.group):
                if _text(c["name"]) == self.config.consumer and c["pending"] == 0:
                    r.xgroup_delconsumer(self.keys.requests, self.keys.group, self.config.consumer)
        except redis.RedisError as exc:
            log.debug("cleanup on exit skipped: %s", exc)
        finally:
            r.close()
            self._redis = None

    # --- one iteration -----------------------------------------------------------------------

    def step(self) -> int:
        """Read one batch (blocking up to ``block_ms``), answer it; returns the entries handled."""
        r = self._redis
        assert r is not None
        self._between_batches(r)
        now = time.monotonic()
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        if now >= self._next_claim:
            self._next_claim = now + self.config.claim_interval_s
            entries = self._claim(r)
        if not entries:
            # an idle replica wakes for its next sweep: a crashed replica's requests are taken over
            # within claim_interval_s, not block_ms (found by review: up to 300 ms, past the deadline)
            # and for its next heartbeat (found by review: block_ms 5000 with heartbeat_s 0.2 left a
            # live idle replica's heartbeat 5 s old, taken for dead after 0.6 s)
            wake = min(self._next_claim, self._next_heartbeat)
            block = min(self.config.block_ms, max(1, math.ceil((wake - time.monotonic()) * 1000)))
            entries = self._read(r, self.config.batch_max, block)
        # when each entry was read (found by review: stamped in handle(), after the batch wait,
        # so request_seconds and server_ms left out the up to batch_wait_ms a request waited)
        read_at = dict.fromkeys((eid for eid, _ in entries), time.perf_counter())
        if entries and self.config.batch_wait_ms > 0:
            # Poll without BLOCK: Redis times a blocked read out on its cron tick (every 100 ms at
            # the default hz 10), so "BLOCK 2" on an idle stream returns after ~100 ms, not 2.
            until = time.monotonic() + self.config.batch_wait_ms / 1000
            while len(entries) < self.config.batch_max:
                more = self._read(r, self.config.batch_max - len(entries), None)
                if more:
                    entries.extend(more)
                    read_at.update(dict.fromkeys((eid for eid, _ in more), time.perf_counter()))
                    continue
                left = until - time.monotonic()
                if left <= 0 or self._stop.is_set():  # found by review: stop() made this loop spin on Redis
                    break
                self._stop.wait(min(left, _BATCH_POLL_S))
        if not entries:
            return 0
        jobs = self.handle(entries, read_at)
        try:
            self._reply(r, jobs)
        except redis.RedisError:
            raise
        except Exception:  # noqa: BLE001 - a reply that cannot be written must not kill the replica
            # nor, left pending, each replica that takes the entries over (found by review: a
            # request id redis-py could not encode did that); the clients time out into their fallback
            log.exception("cannot write the replies of a batch of %d: its entries are dropped unanswered", len(jobs))
            ids = [j.entry_id for j in jobs]
            r.xack(self.keys.requests, self.keys.group, *ids)
            r.xdel(self.keys.requests, *ids)
        return len(jobs)

    def _read(self, r: redis.Redis, count: int, block_ms: int | None) -> list[tuple[bytes, dict[bytes, bytes]]]:
        got: Any = r.xreadgroup(self.keys.group, self.config.consumer, {self.keys.requests: ">"},
                           count=count, block=block_ms)
        if not got:
            return []
        return list(got[0][1])

    def _claim(self, r: redis.Redis) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Entries pending over ``claim_idle_ms`` (a crashed or stuck replica's), taken over. One
        taken over before, from a replica whose heartbeat is fresh, is left to it (found by review:
        a batch slower than claim_idle_ms went back and forth between two live replicas, each
        answer thrown away as taken over, until its deadline dropped it)."""
        me = self.config.consumer
        pend: Any = r.xpending_range(self.keys.requests, self.keys.group, min="-", max="+",
                                     count=4 * self.config.batch_max, idle=self.config.claim_idle_ms)
        owners = [(_text(p["consumer"]), p) for p in pend]
        again = sorted({c for c, p in owners if p["times_delivered"] >= 2 and c != me})
        live: set[str] = set()
        if again:
            now = self.redis_now()
            beats: Any = r.hmget(self.keys.heartbeat, again)
            live = {c for c, b in zip(again, beats, strict=True)
                    if b is not None and heartbeat_age(b, now) <= 3 * self.config.heartbeat_s}
        ids = [p["message_id"] for c, p in owners
               if not (p["times_delivered"] >= 2 and c in live)][:self.config.batch_max]
        if not ids:
            return []
        res: Any = r.xclaim(self.keys.requests, self.keys.group, me, min_idle_time=self.config.claim_idle_ms,
                            message_ids=ids)
        claimed = [(eid, fields) for eid, fields in res if fields is not None]
        if claimed:
            self.metrics.claimed.inc(len(claimed))
            log.warning("claimed %d pending requests from a silent replica", len(claimed))
        return claimed

    def _between_batches(self, r: redis.Redis) -> None:
        """Hot reload and housekeeping, never in the middle of a batch."""
        if self.registry is not None:
            model = self.registry.poll()
            if model is not None:
                self._swap(model)
                self.metrics.model_swaps.inc()
                self.metrics.set_model(self.version, self.device)
        now = time.monotonic()
        self._collect_and_freeze(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_s
            self._housekeeping(r)

    def _housekeeping(self, r: redis.Redis) -> None:
        """Every ``heartbeat_s``: this replica's heartbeat first, the graph cache's TTL, then
        pruning the dead replicas' heartbeats and the queue depth gauges: these read what others
        wrote in Redis, and what they cannot read is logged (at most once a minute), never the end
        of the replica (found by review: a heartbeat field or group named in bytes that are not
        UTF-8, or a heartbeat of "[" x 100,000, raised out of here and every replica went down)."""
        self._sync_clock(r)
        beat = json.dumps({"ts": self.redis_now(), "version": self.version, "device": self.device,
                           "objective": self.objective(), "objective_given": self._objective_given(),
                           "pid": os.getpid(), "handled": self.handled})
        was = _text(self._heartbeat_script(keys=[self.keys.heartbeat], args=[self.config.consumer, beat]))
        if was:
            log.warning("replaced %s, a %s, with the replicas' hash of heartbeats (the executors take a "
                        "server without one for dead)", self.keys.heartbeat, was)
        self.cache.expire()
        self.metrics.graph_cache_entries.set(len(self.cache))
        self.metrics.graph_cache_bytes.set(self.cache.bytes)
        try:
            now = time.monotonic()
            if now >= self._next_prune:
                self._next_prune = now + self.config.heartbeat_prune_s / 3
                self._prune_heartbeats(r)
            for g in r.xinfo_groups(self.keys.requests):
                if _text(g["name"]) == self.keys.group:
                    self.metrics.pending.set(g.get("pending") or 0)
                    self.metrics.queue_depth.set(g.get("lag") or 0)
        except redis.RedisError:
            raise  # serve_forever's: reconnect, or recreate a vanished group
        except Exception:  # noqa: BLE001 - what others wrote in Redis must not end the replica
            if time.monotonic() - self._housekeeping_logged_at >= 60.0:
                self._housekeeping_logged_at = time.monotonic()
                log.exception("pruning heartbeats or reading the queue depth failed; serving on")

    def _prune_heartbeats(self, r: redis.Redis) -> None:
        """Remove the heartbeats of replicas silent for ``heartbeat_prune_s`` (they crashed: a
        replica that stops cleanly removes its own), and their consumers once none of their
        entries is pending (the live replicas claim those first)."""
        limit = self.config.heartbeat_prune_s
        now = self.redis_now()
        beats: Any = r.hgetall(self.keys.heartbeat)
        dead = {k for k, v in beats.items() if heartbeat_age(v, now) > limit and _text(k) != self.config.consumer}
        if dead:
            r.hdel(self.keys.heartbeat, *dead)  # the raw names: one that is not UTF-8 goes too
            log.info("removed the heartbeats of %d silent replica(s): %s", len(dead),
                     ", ".join(sorted(_text(k) for k in dead)))
        live = {_text(k) for k in beats if k not in dead}
        for c in r.xinfo_consumers(self.keys.requests, self.keys.group):
            name = _text(c["name"])
            if name not in live and name != self.config.consumer and c["pending"] == 0 \
                    and c["idle"] > limit * 1000:
                r.xgroup_delconsumer(self.keys.requests, self.keys.group, c["name"])

    def _forget_run(self, key: tuple[str, str]) -> None:
        """A graph left the cache: drop what was derived from it, so the cache's bounds hold for
        the whole of a run's memory (see :mod:`policy.graph_cache`); during a batch, again after
        it, unless the batch cached the run again (its decision derives it anew)."""
        if self._dropped is not None:
            self._dropped.add(key)
        self._forget_derived(key)

    def _forget_derived(self, key: tuple[str, str]) -> None:
        view.discard(key)
        run_features.discard(key)
        forget = getattr(self.placer, "forget_run", None)
        if forget is not None:
            forget(key)

    def _collect_and_freeze(self, now: float) -> None:
        """When due (every ``gc_freeze_s``; never if 0): collect what was made since the last
        freeze, then freeze the survivors (the graphs cached meanwhile, mostly): later collections
        scan only newer objects, so a full collection costs what the last interval made instead of
        the whole graph cache. Objects frozen still die by reference counting; a cycle formed
        among them waits for the next full collection (every ``gc_full_s``)."""
        if self.config.gc_freeze_s <= 0 or now < self._next_freeze:
            return
        self._next_freeze = now + self.config.gc_freeze_s
        if self.config.gc_full_s > 0 and now >= self._next_full_gc:
            self._next_full_gc = now + self.config.gc_full_s
            gc.unfreeze()
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.metrics.gc_pause.observe(time.perf_counter() - t0)

    def _swap(self, model: LoadedModel) -> None:
        old = self.version
        self.placer = model.placer
        self.device = model.device
        self.checkpoint = model.checkpoint
        log.info("model swapped: %s -> %s (%s, sha256 %s..., %s)", old, self.version,
                 model.checkpoint, model.sha256[:12], model.device)

    # --- the batch, without Redis (unit-testable) --------------------------------------------

    def handle(self, entries: Sequence[tuple[bytes, Mapping[bytes, bytes]]],
               read_at: Mapping[bytes, float] | None = None) -> list[_Job]:
        """Decode, resolve, decide and build replies for a batch of stream entries (``read_at``:
        when each was read off the stream, ``time.perf_counter()``; now if not given)."""
        self._dropped = set()  # runs the cache drops while this batch is handled
        try:
            return self._handle(entries, read_at or {})
        finally:
            # found by review: a run the cache dropped while the batch was resolved had its view,
            # features and embeddings rebuilt by the decision after on_drop had fired, and they
            # outlived it in the memos, outside the byte bound
            dropped, self._dropped = self._dropped, None
            for key in dropped:
                if not self.cache.holds(key):
                    self._forget_derived(key)

    def _handle(self, entries: Sequence[tuple[bytes, Mapping[bytes, bytes]]],
                read_at: Mapping[bytes, float]) -> list[_Job]:
        now = time.perf_counter()
        jobs: list[_Job] = []
        self._store_graphs = {}
        self._touch_graphs = set()
        for entry_id, fields in entries:
            job = _Job(entry_id=entry_id, read_at=read_at.get(entry_id, now), entry_ms=_entry_ms(entry_id))
            jobs.append(job)
            try:
                self._decode(job, fields)
                if job.request is not None and not job.late:
                    job.graphs = self._resolve(job.request)
            except RequestRejected as exc:
                job.reply = self._error(job, exc.code, str(exc))
            except Exception as exc:  # noqa: BLE001 - a bad request never kills the server
                log.exception("request %s (entry %s) failed while decoding", job.request_id, entry_id)
                job.reply = self._error(job, "internal", f"{type(exc).__name__}: {exc}")
        todo = [(j, j.request, j.graphs) for j in jobs
                if j.reply is None and not j.late and j.request is not None and j.graphs is not None]
        # One call for the batch: a placer with place_many (the GNN) runs its model once per
        # phase for all requests; results and errors come back per request.
        results = self.arbiter.decide_many(self.placer, [(req, graphs) for _, req, graphs in todo])
        decided_at = time.perf_counter()
        for (job, req, _), res in zip(todo, results, strict=True):
            if isinstance(res, Exception):  # the fallback heuristic itself failed
                log.error("request %s failed while deciding: %s: %s", job.request_id,
                          type(res).__name__, res, exc_info=res)
                job.reply = self._error(job, "internal", f"{type(res).__name__}: {res}")
                continue
            job.reply = PlacementReply(
                request_id=req.request_id,
                decisions=tuple(res),
                policy=self.placer.name,
                policy_version=self.placer.version,
                server_ms=(decided_at - job.read_at) * 1e3,
            )
        self.batches += 1
        self.metrics.batch_size.observe(len(jobs))
        return jobs

    def _decode(self, job: _Job, fields: Mapping[bytes, bytes]) -> None:
        raw = fields.get(_PAYLOAD)
        if raw is None:
            raise RequestRejected("bad_request", f"stream entry has no {PAYLOAD_FIELD!r} field")
        m = _REQUEST_ID.search(raw, 0, 64 * 1024) if len(raw) > self.config.max_request_bytes else None
        if m is not None:
            job.request_id = m.group(1).decode()
        try:
            obj = loads_json(raw, max_bytes=self.config.max_request_bytes)
        except SchemaError as exc:
            if job.request_id is None:
                m = _REQUEST_ID.search(raw, 0, 64 * 1024)
                job.request_id = m.group(1).decode() if m else None
            raise RequestRejected("bad_request", str(exc)) from exc
        rid = obj.get("request_id")
        if isinstance(rid, str) and 0 < len(rid) <= _MAX_REQUEST_ID:
            job.request_id = rid
        job.created_at, job.deadline_ms = obj.get("created_at"), obj.get("deadline_ms")
        if self._is_late(job, job.created_at, job.deadline_ms):
            job.late = True
            return
        try:
            req = PlacementRequest.from_json(obj)
        except SchemaError as exc:
            raise RequestRejected("bad_request", str(exc)) from exc
        if len(req.request_id) > _MAX_REQUEST_ID:
            raise RequestRejected("bad_request", f"request_id longer than {_MAX_REQUEST_ID} characters")
        if not req.pools:
            if self.catalogue is None:
                raise RequestRejected("bad_request", "request.pools: empty, and the server has no catalogue")
            req = dataclasses.replace(req, pools=self.catalogue.states())
        job.request = req

    def _is_late(self, job: _Job, created_at: Any, deadline_ms: Any) -> bool:
        """Past its deadline: ``deadline_ms`` after Redis added the entry, on Redis's clock (a
        request without ``created_at`` has none). Until Redis's clock is known (the batch did not
        come from Redis: tests, tools) the deadline counts from ``created_at`` on our clock."""
        if not isinstance(created_at, (int, float)) or isinstance(created_at, bool) or created_at <= 0:
            return False
        if not isinstance(deadline_ms, (int, float)) or isinstance(deadline_ms, bool):
            deadline_ms = _DEFAULT_DEADLINE_MS
        if not _finite(deadline_ms) or deadline_ms < 0 or not _finite(created_at):
            return False  # the schema refuses it: a bad_request reply (found by review: -1000 was late, dropped)
        if self._clock_offset is not None and job.entry_ms is not None:
            return self.redis_now() * 1000 > job.entry_ms + deadline_ms
        return time.time() > created_at + deadline_ms / 1000

    def _resolve(self, req: PlacementRequest) -> dict[str, RunGraph]:
        """The full graph of every run with a ready task: from the request or the cache."""
        graphs: dict[str, RunGraph] = {}
        missing: list[str] = []
        for run in req.runs:
            if isinstance(run, RunGraph):
                try:
                    view(run)  # rejects cycles before the graph is cached
                except SchemaError as exc:
                    raise RequestRejected("bad_request", str(exc)) from exc
                # Stored even when this replica caches it already: the client sends a full graph
                # only when it believes the servers lack it (a new run, or a resend after an
                # error), e.g. after Redis restarted empty. Then only the store tells another
                # replica; SET NX of a graph already there costs one lookup.
                self._store_graphs[(run.run_key, run.digest)] = run
                self.cache.put(run)
                graphs[run.run_key] = run
            elif isinstance(run, RunRef):
                entry = self.cache.get(run.run_key, run.digest)
                if entry is not None:
                    # a run served mostly from this cache for longer than the store's TTL must
                    # keep its store entry for the other replicas (GETEX refreshes it there)
                    self._touch_graphs.add(self.keys.graph(run.run_key, run.digest))
                graph = entry.graph if entry is not None else self._stored_graph(run)
                if graph is None:
                    missing.append(f"{run.run_key}@{run.digest}")
                else:
                    graphs[run.run_key] = graph
        for ready in req.ready:
            if ready.run_key in graphs:
                continue
            latest = self.cache.get(ready.run_key)
            if latest is None:
                missing.append(ready.run_key)
            else:
                graphs[ready.run_key] = latest.graph
        if missing:
            raise RequestRejected(
                "unknown_graph",
                f"no cached graph for {', '.join(sorted(set(missing)))}: resend the full graph",
            )
        for ready in req.ready:
            if ready.task_id not in view(graphs[ready.run_key]).index:
                raise RequestRejected(
                    "bad_request", f"ready task {ready.task_id!r} is not in run {ready.run_key!r}"
                )
        return graphs

    def _store_ttl(self) -> int:
        """The graph store's TTL in whole seconds, at least 1, for writes and reads alike (found
        by review: a read with EX int(0.5) = 0 was refused by Redis: every reference missed)."""
        return max(1, math.ceil(self.config.graph_store_ttl_s))

    def _stored_graph(self, ref: RunRef) -> RunGraph | None:
        """The graph ``ref`` names from the shared store (another replica was sent it), cached
        here from now on; None when it is not there (or the store is off, or unreachable)."""
        r = self._redis
        if r is None or self.config.graph_store_ttl_s <= 0:
            return None
        try:
            raw: Any = r.getex(self.keys.graph(ref.run_key, ref.digest), ex=self._store_ttl())
        except redis.RedisError as exc:
            log.warning("graph store unavailable (%s): %s answered unknown_graph", exc, ref.run_key)
            return None
        if raw is None:
            return None
        try:
            graph = RunGraph.from_json(loads_json(raw, max_bytes=self.config.max_request_bytes))
            if graph.run_key != ref.run_key or graph.digest != ref.digest:
                # checked before view(), which memoises what it is given (found by review: a
                # mismatching entry's view stayed outside the cache's bound)
                raise SchemaError(f"it holds {graph.run_key}@{graph.digest}")
            view(graph)
        except SchemaError as exc:  # not what a replica wrote: ask the client for the graph instead
            log.warning("graph store entry of %s@%s refused (deleted): %s", ref.run_key, ref.digest, exc)
            try:  # found by review: kept (SET NX), the full resend never replaced it, and every other
                # replica answered unknown_graph for that run while it was referenced
                r.delete(self.keys.graph(ref.run_key, ref.digest))
            except redis.RedisError:
                pass
            return None
        self.cache.put(graph)
        self.metrics.graph_store_hits.inc()
        return graph

    def _error(self, job: _Job, code: str, message: str) -> PlacementReply | None:
        log.warning("request %s (entry %s): %s: %s", job.request_id, job.entry_id.decode(), code,
                    message[:300])
        if job.request_id is None:
            self.metrics.requests.labels(outcome=code).inc()  # its only outcome
            return None  # nobody to answer: acknowledged and dropped
        # counted under its code by _reply once written, as "ok" is (found by review: counted here
        # too, a reply dropped late or taken over was one request with two outcomes)
        return PlacementReply(request_id=job.request_id, policy=self.placer.name,
                              policy_version=self.placer.version, error_code=code,
                              error=message[:2000])

    def _reply(self, r: redis.Redis, jobs: Sequence[_Job]) -> None:
        """One script call (:data:`_REPLY_LUA`): the batch's full graphs into the shared store
        (and a fresh TTL for those it referenced), then the replies to, and the acknowledgement
        of, the entries this replica still owns."""
        args: list[Any] = [self.keys.group, self.config.consumer, REPLY_TTL_S, self._store_ttl()]
        store_on = self.config.graph_store_ttl_s > 0
        stored = list(self._store_graphs.values()) if store_on else []
        args.append(len(stored))
        for g in stored:
            args += [self.keys.graph(g.run_key, g.digest), json.dumps(g.to_json(), separators=(",", ":"))]
        touched = sorted(self._touch_graphs) if store_on else []
        args.append(len(touched))
        args += touched
        answered: list[_Job] = []
        late = 0
        for job in jobs:
            if job.reply is not None and not job.late and self._is_late(job, job.created_at, job.deadline_ms):
                job.late = True
            if job.late:
                late += 1
                log.debug("request %s dropped: past its deadline", job.request_id)
                args += [job.entry_id, "", ""]
            elif job.reply is None:
                args += [job.entry_id, "", ""]
            else:
                try:  # each reply on its own (found by review: one that could not be encoded, a
                    # placer's numpy score, dropped its whole batch unanswered)
                    payload = dumps(job.reply)
                except Exception as exc:  # noqa: BLE001 - an internal error reply in its place
                    log.exception("request %s: its reply cannot be encoded", job.request_id)
                    reply = self._error(job, "internal", f"the reply cannot be encoded: {type(exc).__name__}")
                    assert reply is not None  # a request with an id: it had a reply
                    job.reply = reply
                    payload = dumps(reply)
                args += [job.entry_id, self.keys.reply(job.reply.request_id), payload]
                answered.append(job)
        lost = set(self._reply_script(keys=[self.keys.requests], args=args))
        done = time.perf_counter()
        if late:
            self.metrics.requests.labels(outcome="dropped_late").inc(late)
        if lost:  # another replica claimed them meanwhile and answers them (or has)
            self.metrics.requests.labels(outcome="taken_over").inc(len(lost))
            log.warning("%d request(s) of this batch were taken over by another replica; not answered "
                        "twice", len(lost))
        now = self.redis_now()
        for job in answered:
            assert job.reply is not None
            if job.entry_id in lost:
                continue
            self.metrics.request_latency.observe(done - job.read_at)
            if job.reply.ok:
                self.metrics.requests.labels(outcome="ok").inc()
                self._count_decisions(job.reply.decisions)
                if job.entry_ms is not None:
                    self.metrics.request_age.observe(max(0.0, now - job.entry_ms / 1000))
            else:
                self.metrics.requests.labels(outcome=job.reply.error_code or "internal").inc()
        self.handled += len(jobs) - len(lost)

    def _count_decisions(self, decisions: Sequence[Decision]) -> None:
        counts: dict[str, int] = {}
        for d in decisions:
            counts[d.pool] = counts.get(d.pool, 0) + 1
        for pool, n in counts.items():
            self.metrics.decisions.labels(pool=self._pool_label(pool), policy_version=self.version).inc(n)

    def _pool_label(self, pool: str) -> str:
        """``pool`` as a metrics label: the first :data:`_MAX_POOL_LABELS` pool names of at most
        :data:`_MAX_POOL_LABEL_LEN` characters this replica decided on, any other ``"other"``
        (found by review: pool names are the requests', and 200 requests naming long new pools
        left a 40 MB /metrics page, never freed)."""
        if pool in self._pool_labels:
            return pool
        if len(pool) <= _MAX_POOL_LABEL_LEN and len(self._pool_labels) < _MAX_POOL_LABELS:
            self._pool_labels.add(pool)
            return pool
        return "other"

    # --- health ------------------------------------------------------------------------------

    def objective(self) -> str | None:
        """What the registry's manifest says the deployment optimises (None: no registry, the
        heuristic; ``unknown`` when the manifest does not say a valid one)."""
        return self.registry.objective() if self.registry is not None else None

    def _objective_given(self) -> str | None:
        """``--objective`` (what this replica seeds an empty registry for; None without a registry):
        reported beside the registry's, so replicas started for another objective are seen."""
        return self.config.objective if self.registry is not None else None  # None: not given

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.connected else "redis_unavailable",
            "model": self.placer.name,
            "version": self.version,
            "checkpoint": self.checkpoint,
            "device": self.device,
            "objective": self.objective(),
            "objective_given": self._objective_given(),
            "cp_gate": getattr(self.placer, "cp_gate", None),  # the GNN's premium gate (None: no GNN)
            "cp_gate_scope": getattr(self.placer, "cp_gate_scope", None),
            "consumer": self.config.consumer,
            "prefix": self.config.prefix,
            "uptime_s": round(time.time() - self.started_at, 3),
            "handled": self.handled,
            "graph_cache_entries": len(self.cache),
        }


#: distinct pool names a replica labels its decision metrics with (the schema's MAX_POOLS per request)
_MAX_POOL_LABELS = 256
_MAX_POOL_LABEL_LEN = 128


def _text(value: bytes | str) -> str:
    """A name from a Redis reply (bytes: the client does not decode responses); bytes that are not
    UTF-8 are replaced (a consumer or group someone else named so crashed every replica's
    housekeeping: found by review). For comparing and logging: Redis is given the raw name."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _entry_ms(entry_id: bytes) -> int | None:
    """The milliseconds part of a stream entry id (``<ms>-<seq>``): when Redis added it."""
    ms, _, _ = entry_id.partition(b"-")
    return int(ms) if ms.isdigit() else None


def _torch_threads(n: int) -> None:
    """Intra-op threads of the model (:attr:`ServerConfig.torch_threads`; 0 leaves torch's
    default). Imports torch, so it runs only for a model placer (``eft`` never loads torch)."""
    if n > 0:
        import torch

        torch.set_num_threads(n)


def _check_device(spec: str) -> None:
    """Refuse a CUDA device torch cannot use here (found by review: ``cuda:7`` on a host without it
    failed at the model's load, counted as a bad checkpoint, and ``--placer auto`` served the
    heuristic with /health "ok")."""
    if not spec.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"device: {spec!r}, but torch sees no CUDA device here (a CPU build of torch, or no "
                          "GPU); use auto or cpu")
    index = int(spec.split(":", 1)[1]) if ":" in spec else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device: {spec!r}, but this host has {torch.cuda.device_count()} CUDA device(s)")


# --- the subcommand ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config = ServerConfig.from_sources(vars(args))
        server = PolicyServer(config)
    except PolicyError as exc:
        log.error("cannot start: %s", exc)
        return 2
    metrics_http: MetricsServer | None = None
    if config.metrics_port:
        try:
            metrics_http = MetricsServer(server.metrics, server.health, config.metrics_host,
                                         config.metrics_port).start()
        except OSError as exc:
            log.error("cannot open the metrics port %s:%d: %s", config.metrics_host,
                      config.metrics_port, exc)
            return 2

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("%s: finishing the current batch, then exiting", signal.Signals(signum).name)
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return server.serve_forever()
    finally:
        if metrics_http is not None:
            metrics_http.stop()
