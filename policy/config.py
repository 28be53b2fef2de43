"""Configuration of the policy server (``drl-policy serve``): one dataclass, validated where it enters.

Every field can come from the command line (``--batch-max 64``) or from the environment
(``DRL_POLICY_BATCH_MAX=64``); the command line wins. Nothing is read at import time.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import math
import os
import re
import socket
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping
from urllib.parse import urlsplit

from policy.errors import PolicyError
from policy.features import HOLD_RATIO, check_gate_scope, check_hold_ratio, check_premium_ratio
from policy.registry import OBJECTIVES
from policy.transport import DEFAULT_PREFIX, check_ca_cert, check_url, redacted_url

ENV_PREFIX = "DRL_POLICY_"
PLACERS = ("auto", "eft", "gnn")
DEVICES = ("auto", "cpu", "cuda")
#: the GNN placer's one-request steps (policy.gnn.step_kernel_choice)
STEP_KERNELS = ("auto", "compiled", "numpy")
#: field types read as floats from the command line and the environment
_FLOAT_KINDS = ("float", "float | None")
#: the float settings that may be infinite (the rest must be finite numbers)
_MAY_BE_INF = ("hold_ratio", "cp_gate")


class ConfigError(PolicyError, ValueError):
    """A server setting is out of range; the message names the setting and the value."""


def _default_consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


#: the largest value each setting may take: waits within a day (ms) or ~115 days (s), far inside
#: what sockets, threading waits and Redis's expiries take; counts and sizes within what Redis
#: commands, a Redis string (512 MiB) and a thread pool take
_UPPER_BOUNDS: dict[str, float] = {
    **dict.fromkeys(("block_ms", "claim_idle_ms", "batch_wait_ms"), 86_400_000),
    **dict.fromkeys(("registry_poll_s", "claim_interval_s", "graph_cache_ttl_s", "heartbeat_s", "heartbeat_prune_s",
                     "reconnect_base_s", "reconnect_max_s", "gc_freeze_s", "gc_full_s", "graph_store_ttl_s"), 1e7),
    "batch_max": 100_000, "graph_cache_entries": 10_000_000, "graph_cache_bytes": 2**40,
    "max_request_bytes": 512 * 1024 * 1024, "torch_threads": 1024, "skew_fallback_n": 10**9,
}


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one policy server replica."""

    #: Redis URL: ``redis://[[user]:password@]host:port/db`` or ``rediss://`` for TLS.
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Key prefix shared with the executor (one per deployment), see :mod:`policy.transport`.
    prefix: str = DEFAULT_PREFIX
    #: This replica's consumer name in the group (unique per replica; default ``host-pid``).
    consumer: str = field(default_factory=_default_consumer)
    #: CA bundle (PEM) that verifies the Redis server's certificate of a ``rediss://`` URL
    #: (None: the system's trust store); refused with a ``redis://`` URL.
    redis_ca_cert: str | None = None
    #: ``eft`` (the earliest-finish heuristic), ``gnn`` (the model named by the registry) or
    #: ``auto`` (the model when the registry names one that loads, else ``eft``).
    placer: str = "auto"
    #: Folder of the model registry (holds ``active.json`` naming the active checkpoint).
    registry: str | None = None
    #: Seconds between checks of the registry manifest for a new active checkpoint.
    registry_poll_s: float = 2.0
    #: What the deployment optimises (mean_jct, p95_jct, sla_violation_rate, cost; unset: mean_jct
    #: for an empty registry): an empty registry is seeded for it with its packaged checkpoint
    #: (``policy.registry.PACKAGED_CHECKPOINTS``), and the nightly fine-tune trains for the
    #: registry's. A registry with a manifest keeps its own, with a warning when it
    #: is not this (``drl-policy registry activate --objective`` changes it).
    objective: str | None = None
    #: Torch device for the model: ``auto`` (CUDA when available), ``cpu`` or ``cuda[:N]``.
    device: str = "auto"
    #: Torch intra-op threads of this replica's model (0: torch's default, one per core). One
    #: suits a server: its model calls are small, and a second thread only waits for a busy core
    #: (44 ms instead of 2.6 ms per request on a loaded 2-core host); run replicas for more cores.
    torch_threads: int = 1
    #: Pool catalogue YAML; used for requests that carry no pool states.
    catalogue: str | None = None
    #: Most requests handled in one batch (one model call, one Redis round trip for replies).
    batch_max: int = 64
    #: Milliseconds to wait for a batch to fill after its first request (0: take what is queued).
    batch_wait_ms: int = 0
    #: Milliseconds one XREADGROUP blocks when idle (bounds the reaction time to SIGTERM).
    block_ms: int = 200
    #: Largest request payload accepted, in bytes; larger ones get a ``bad_request`` reply.
    max_request_bytes: int = 8 * 1024 * 1024
    #: Pending entries idle longer than this (ms) are claimed from a replica that crashed or is
    #: stuck (XCLAIM); below the executor's decision deadline (200 ms) so they are still
    #: answered in time. Safe against a merely slow replica: only the owner at reply time answers.
    claim_idle_ms: int = 100
    #: Seconds between sweeps for other replicas' idle entries (XPENDING + XCLAIM).
    claim_interval_s: float = 0.05
    #: Most graphs kept in the per-run graph cache ...
    graph_cache_entries: int = 4096
    #: ... and the bound on their estimated size in bytes: the graphs and what the server derives
    #: from them (views, run features, GNN embeddings; ``policy.graph_cache.estimate_bytes``,
    #: ~184 KiB for a 200-task run).
    graph_cache_bytes: int = 256 * 1024 * 1024
    #: Seconds a cached graph lives after its last use.
    graph_cache_ttl_s: float = 3600.0
    #: Seconds a graph lives in the shared graph store (``Keys.graph``) after it was last read
    #: there, so any replica resolves a RunRef another was sent in full (0: no shared store; each
    #: replica then asks the client for graphs it was not sent). Redis holds ~one JSON graph per
    #: run in flight (~30 KB for 200 tasks).
    graph_store_ttl_s: float = 3600.0
    #: Sampling temperature over pool scores (0: greedy, the production default).
    temperature: float = 0.0
    #: Seed of the sampling generator (used only when temperature > 0).
    seed: int = 0
    #: The GNN's stop guard: a hold is refused while a ready task has a free feasible pool whose
    #: estimated finish is within this factor of its best (inf: work-conserving; 1: refused only
    #: while its best pool is free, the rule before the work-conserving stop).
    hold_ratio: float = HOLD_RATIO
    #: The GNN's premium gate, a hard constraint after the policy: a task off its run's
    #: remaining critical path may not take a pool priced more than this factor x its cheapest
    #: feasible pool per unit of its work (``cost-cp``'s rule; 0: off; unset: as the checkpoint
    #: was trained, ``training.cp_gate`` in its manifest).
    cp_gate: float | None = None
    #: Which tasks the premium gate applies to: off-cp (those off their run's critical path,
    #: ``cost-cp``'s rule) or all (every task: no task boots a premium worker or keeps one billed;
    #: unset: as the checkpoint was trained, ``training.cp_gate_scope``, off-cp if absent).
    cp_gate_scope: str | None = None
    #: The GNN's one-request greedy steps: auto (compiled with numba where it is installed),
    #: compiled, or numpy.
    step_kernel: str = "auto"
    #: Load-skew breaker: trip when the utilisation spread of live pools exceeds this (0-1] ...
    skew_threshold: float = 0.75
    #: ... then place the next N decisions with the fallback heuristic (0 disables the breaker).
    skew_fallback_n: int = 32
    #: Seconds between collections of the objects made since the last one, after which the
    #: survivors are frozen (``gc.freeze``) out of later collections: a full collection otherwise
    #: rescans every cached graph (up to ~200 ms with a full cache of 200-task runs). 0: Python's own GC.
    gc_freeze_s: float = 1.0
    #: Seconds between full collections of everything, frozen objects included (reclaims any cycle
    #: that formed among frozen objects; one full-cache pause per interval). 0: never.
    gc_full_s: float = 3600.0
    #: Seconds between heartbeats written to ``Keys.heartbeat``.
    heartbeat_s: float = 2.0
    #: Heartbeats older than this (seconds) are removed: replicas that crashed (one that stops
    #: cleanly removes its own), with their consumers once nothing is pending for them.
    heartbeat_prune_s: float = 60.0
    #: Reconnect backoff after losing Redis: first delay in seconds (doubling, jittered) ...
    reconnect_base_s: float = 0.1
    #: ... and its cap in seconds.
    reconnect_max_s: float = 5.0
    #: Port of the Prometheus ``/metrics`` and ``/health`` HTTP endpoint (0: disabled).
    metrics_port: int = 0
    #: Address the metrics endpoint binds to.
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        scheme = urlsplit(self.redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"redis_url: scheme must be redis, rediss or unix, got {scheme!r}")
        try:
            check_url(self.redis_url)
        except ValueError as exc:
            raise ConfigError(f"redis_url: {exc}") from None
        try:
            check_ca_cert(self.redis_url, self.redis_ca_cert)
        except ValueError as exc:
            raise ConfigError(f"redis_ca_cert: {exc}") from None
        if not self.prefix or ":" in self.prefix or any(c.isspace() for c in self.prefix):
            # what the executor takes as [drl_executor] key_prefix too: no ':' or whitespace
            raise ConfigError(f"prefix: expected a non-empty word without ':', got {self.prefix!r}")
        if not self.consumer:
            raise ConfigError("consumer: must not be empty")
        if self.placer not in PLACERS:
            raise ConfigError(f"placer: expected one of {PLACERS}, got {self.placer!r}")
        if self.objective is not None and self.objective not in OBJECTIVES:
            raise ConfigError(f"objective: expected one of {OBJECTIVES}, got {self.objective!r}")
        if self.placer == "gnn" and not self.registry:
            raise ConfigError("placer: 'gnn' needs a registry folder (--registry)")
        # found by review: "cuda:abc" passed, and torch refused it only at load, so a replica with
        # --placer auto served the heuristic in place of the model
        if not (self.device in DEVICES or re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError(f"device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            # found by review: NaN passed every range check below (heartbeat_s=nan: one heartbeat,
            # then none; graph_store_ttl_s=inf: every reply batch failed in int(inf)); only the
            # ratios may be infinite (hold_ratio: off)
            if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and f.name not in _MAY_BE_INF)):
                raise ConfigError(f"{f.name}: must be a finite number, got {value!r}")
        if not self.metrics_host:  # found by review: "" bound every interface (unset in the environment: the default)
            raise ConfigError("metrics_host: must not be empty (0.0.0.0 for every interface)")
        for name, lo in (
            ("batch_max", 1), ("block_ms", 1), ("max_request_bytes", 1024), ("claim_idle_ms", 1),
            ("graph_cache_entries", 1), ("graph_cache_bytes", 1024), ("batch_wait_ms", 0),
            ("skew_fallback_n", 0), ("metrics_port", 0), ("seed", 0), ("torch_threads", 0),
            ("gc_freeze_s", 0), ("gc_full_s", 0), ("graph_store_ttl_s", 0),
        ):
            value = getattr(self, name)
            if value < lo:
                raise ConfigError(f"{name}: must be >= {lo}, got {value!r}")
        for name in ("registry_poll_s", "claim_interval_s", "graph_cache_ttl_s", "heartbeat_s",
                     "heartbeat_prune_s", "reconnect_base_s", "reconnect_max_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        # found by review: only lower bounds, so a value too large for the socket layer, Redis or
        # torch (block_ms=10**13, claim_idle_ms=2**63, graph_store_ttl_s=1e17, torch_threads=2**31)
        # was taken and broke the replica later: a traceback, or reconnecting for ever
        for name, hi in _UPPER_BOUNDS.items():
            if getattr(self, name) > hi:
                raise ConfigError(f"{name}: must be <= {hi:g}, got {getattr(self, name)!r}")
        if self.heartbeat_prune_s < 3 * self.heartbeat_s:
            raise ConfigError(f"heartbeat_prune_s: {self.heartbeat_prune_s} would remove live replicas' "
                              f"heartbeats (at least 3 x heartbeat_s {self.heartbeat_s})")
        if self.reconnect_max_s < self.reconnect_base_s:
            raise ConfigError(
                f"reconnect_max_s: {self.reconnect_max_s} is below reconnect_base_s {self.reconnect_base_s}"
            )
        if self.temperature < 0:
            raise ConfigError(f"temperature: must be >= 0, got {self.temperature!r}")
        try:
            check_hold_ratio(self.hold_ratio)
        except ValueError as exc:
            raise ConfigError(f"hold_ratio: {exc}") from None
        try:
            if self.cp_gate is not None:
                check_premium_ratio(self.cp_gate, "cp_gate")
            if self.cp_gate_scope is not None:
                check_gate_scope(self.cp_gate_scope)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.step_kernel not in STEP_KERNELS:
            raise ConfigError(f"step_kernel: expected one of {STEP_KERNELS}, got {self.step_kernel!r}")
        if self.step_kernel == "compiled" and importlib.util.find_spec("numba") is None:
            raise ConfigError("step_kernel: 'compiled' needs numba (in the policy extra); 'auto' falls back to numpy")
        if not 0 < self.skew_threshold <= 1:
            raise ConfigError(f"skew_threshold: must be in (0, 1], got {self.skew_threshold!r}")
        if self.metrics_port > 65535:
            raise ConfigError(f"metrics_port: must be <= 65535, got {self.metrics_port}")

    @property
    def safe_redis_url(self) -> str:
        """The Redis URL without its user, password and secret query parameters, for logs."""
        return redacted_url(self.redis_url)

    @classmethod
    def from_sources(
        cls, cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Build from environment variables overridden by CLI values (None = not given)."""
        env = os.environ if env is None else env
        known = {ENV_PREFIX + f.name.upper() for f in fields(cls)}
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
        if unknown:  # found by review: DRL_POLICY_REDIS (the flag's name) was ignored without a word,
            # and the replica connected to 127.0.0.1:6379 for ever
            near = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            raise ConfigError(f"{unknown[0]}: not a setting of the policy server"
                              + (f" (did you mean {near[0]}?)" if near else "")
                              + f"; the variables are {ENV_PREFIX}<setting>, e.g. {ENV_PREFIX}REDIS_URL for --redis")
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _coerce(f.name, f.type, raw, cls)
            if cli is not None and cli.get(f.name) is not None:
                values[f.name] = cli[f.name]
        return cls(**values)


def _coerce(name: str, type_name: Any, raw: str, cls: type) -> Any:
    kind = str(type_name)
    try:
        if kind == "int":
            return int(raw)
        if kind in _FLOAT_KINDS:
            return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}: expected a {kind}, got {raw!r}") from exc
    return raw


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per :class:`ServerConfig` field; unset flags fall back to env / defaults."""
    docs = field_docs(ServerConfig)
    for f in fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "redis_url":
            flag = "--redis"
        kind = str(f.type)
        typ: Any = int if kind == "int" else float if kind in _FLOAT_KINDS else str
        default = f.default if f.default is not MISSING else "host-pid"
        help_text = f"{docs.get(f.name, '')} (env {ENV_PREFIX}{f.name.upper()}; default: {default})"
        parser.add_argument(flag, dest=f.name, type=typ, default=None,
                            help=help_text.replace("%", "%%"))


def field_docs(cls: type) -> dict[str, str]:
    """Each dataclass field's ``#:`` comment in ``cls``'s source, for ``--help``; a comment covers
    the fields after it up to the next comment (``#: offered load and duration noise`` documents
    both). Without the source (a frozen build) flags keep their defaults only."""
    import inspect

    names = {f.name for f in fields(cls)}
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    block: list[str] = []
    in_comment = False
    for line in lines:
        text = line.strip()
        if text.startswith("#:"):
            block = [*block, text[2:].strip()] if in_comment else [text[2:].strip()]
            in_comment = True
            continue
        in_comment = False
        name = text.split(":", 1)[0].strip()
        if name in names and block:
            docs[name] = " ".join(block)
    return docs
