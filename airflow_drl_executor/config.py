"""The ``[drl_executor]`` section of airflow.cfg, read once when the executor starts.

Every option is declared (description, type, default) in :mod:`airflow_drl_executor.provider`;
:data:`OPTIONS` below is that declaration's single source, and :meth:`ExecutorConfig.from_conf`
validates each value where it enters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit

from policy.holds import default_hold_s
from policy.transport import check_ca_cert, check_url, redacted_url

SECTION = "drl_executor"


def packaged_catalogue(name: str = "demo") -> str:
    """Path of a pool catalogue shipped with the package (``policy/catalogues/NAME.yaml``)."""
    return str(resources.files("policy") / "catalogues" / f"{name}.yaml")


#: options whose value is a secret (a password in the URL): Airflow masks them in logs and reads
#: them from ``AIRFLOW__DRL_EXECUTOR__REDIS_URL_CMD`` / ``_SECRET`` too (found by review: those were
#: ignored, and the executor quietly placed every task by the fallback on the default URL)
SENSITIVE = frozenset({"redis_url"})

#: option -> (type, default, description); the provider metadata is generated from this.
OPTIONS: dict[str, tuple[str, str | None, str]] = {
    "redis_url": (
        "string",
        "redis://127.0.0.1:6379/0",
        "Redis URL of the placement queues (redis:// or rediss://, with password or ACL user).",
    ),
    "redis_ca_cert": (
        "string",
        None,
        "CA bundle (PEM file) that verifies the Redis server's certificate when redis_url is "
        "rediss:// (a private CA). Default: the system's trust store. Refused with redis://.",
    ),
    "key_prefix": ("string", "drl", "Prefix of every Redis key the executor and the policy server use."),
    "catalogue": (
        "string",
        None,
        "Path of the pool catalogue YAML (worker pools = Celery queues, their VM classes and slots). "
        "Default: the demo catalogue shipped in policy/catalogues/demo.yaml.",
    ),
    "decision_timeout_ms": (
        "integer",
        "200",
        "How long one batched placement request may wait for the policy server before the executor "
        "places the batch itself with the fallback heuristic. Bounds the scheduler loop's extra delay.",
    ),
    "server_stale_after_s": (
        "integer",
        "15",
        "A policy server whose heartbeat is older than this is considered dead: the executor falls "
        "back at once instead of waiting for the timeout.",
    ),
    "reconnect_backoff_max_s": (
        "integer",
        "5",
        "Upper bound of the exponential back-off between Redis reconnection attempts (while it "
        "runs, every batch is placed by the fallback heuristic, so a long cap keeps falling back "
        "long after Redis is back).",
    ),
    "max_request_bytes": (
        "integer",
        "8388608",
        "Largest placement request the executor sends, in bytes: the policy servers' "
        "--max-request-bytes (default 8 MiB), which refuses a larger one. Runs whose graphs do not "
        "fit are placed by the fallback heuristic instead of waiting for that refusal.",
    ),
    "max_wait_s": (
        "float",
        "60",
        "Longest time a task may be kept back when the policy chooses to wait for a better pool "
        "(late binding) while a pool that could run it has a free slot; after it, the fallback "
        "heuristic places the task. Time when every pool that fits the task is full does not count "
        "(max_hold_s bounds that).",
    ),
    "max_hold_s": (
        "float",
        None,
        "Longest time a task may be kept back in all, free slot or not; after it, the fallback "
        "heuristic places the task. Must be below [scheduler] task_queued_timeout (a held task is "
        "queued in Airflow) and at least max_wait_s. Default: half of task_queued_timeout (300 s "
        "with its default), at least max_wait_s; max_hold_s = max_wait_s is the single bound of "
        "earlier versions.",
    ),
    "default_duration_s": (
        "float",
        "60",
        "Expected duration of a task with no history and no executor_config hint (seconds at speed 1).",
    ),
    "history_ttl_s": (
        "integer",
        "300",
        "How long per-DAG duration history read from the metadata database is cached.",
    ),
    "pool_check_interval_s": (
        "float",
        "30",
        "How often the executor asks the Celery workers which queues they consume (a remote-control "
        "broadcast in a background thread). A pool with no live worker is marked down: the policy "
        "sends it only tasks no other pool may run. 0 turns the check off (every pool counts as up).",
    ),
    "pool_check_timeout_s": (
        "float",
        "2",
        "How long one such broadcast waits for the workers' answers.",
    ),
    "record_traces": (
        "boolean",
        "True",
        "Record every placement in the drl_placement table (training traces and the UI's placements page).",
    ),
    "spool_dir": (
        "string",
        None,
        "Directory where placement rows the metadata database refuses (a failover) wait on local disk "
        "until it takes them. A scheduler that dies meanwhile leaves them to the next DRLExecutor "
        "started with the same directory, whose adoption reads them to know those tasks were sent to "
        "Celery. Keep it on a volume that outlives the scheduler's container. "
        "Default: $AIRFLOW_HOME/drl_executor/spool.",
    ),
}


class ConfLike(Protocol):
    def get(self, section: str, key: str, fallback: Any = ...) -> Any: ...


#: query parameters of a Redis URL that would lift the client's deadline (see ``__post_init__``)
_DEADLINE_PARAMS = frozenset({"socket_timeout", "socket_connect_timeout"})


@dataclass(frozen=True)
class ExecutorConfig:
    """Validated ``[drl_executor]`` options (see :data:`OPTIONS` for each one's meaning)."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_ca_cert: str = ""
    key_prefix: str = "drl"
    catalogue: str = ""
    decision_timeout_ms: int = 200
    server_stale_after_s: int = 15
    reconnect_backoff_max_s: int = 5
    max_request_bytes: int = 8 * 1024 * 1024
    max_wait_s: float = 60.0
    max_hold_s: float | None = None
    default_duration_s: float = 60.0
    history_ttl_s: int = 300
    pool_check_interval_s: float = 30.0
    pool_check_timeout_s: float = 2.0
    record_traces: bool = True
    spool_dir: str = ""

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"[{SECTION}] redis_url must start with redis://, rediss:// or unix://, "
                             f"got {redacted_url(self.redis_url)!r}")
        try:
            check_url(self.redis_url)
        except ValueError as exc:
            raise ValueError(f"[{SECTION}] redis_url: {exc}") from None
        # redis-py lets the URL's query win over the client's own timeouts (found by review: with
        # ?socket_timeout=30 a hung Redis held the scheduler loop 30 s a heartbeat)
        lifted = sorted({k for k, _ in parse_qsl(urlsplit(self.redis_url).query)} & _DEADLINE_PARAMS)
        if lifted:
            raise ValueError(f"[{SECTION}] redis_url: leave out {', '.join(lifted)}: decision_timeout_ms sets how"
                             " long a Redis command may hold the scheduler loop")
        try:
            check_ca_cert(self.redis_url, self.redis_ca_cert)
        except ValueError as exc:
            raise ValueError(f"[{SECTION}] redis_ca_cert: {exc}") from None
        # what the policy server takes as --prefix too (found by review: a trailing newline from a
        # Helm block scalar was taken here, and no server could ever serve those keys)
        if not self.key_prefix or ":" in self.key_prefix or any(c.isspace() for c in self.key_prefix):
            raise ValueError(f"[{SECTION}] key_prefix must be non-empty without ':' or whitespace, "
                             f"got {self.key_prefix!r}")
        if not 1 <= self.decision_timeout_ms <= 10_000:
            raise ValueError(f"[{SECTION}] decision_timeout_ms must be in 1..10000, got {self.decision_timeout_ms}")
        if self.server_stale_after_s <= 0 or self.reconnect_backoff_max_s <= 0:
            raise ValueError(f"[{SECTION}] server_stale_after_s and reconnect_backoff_max_s must be > 0")
        if not 1024 <= self.max_request_bytes <= 512 * 1024 * 1024:  # the server's floor; Redis's value cap
            raise ValueError(f"[{SECTION}] max_request_bytes must be in 1024..536870912, got {self.max_request_bytes}")
        if self.max_wait_s < 0:
            raise ValueError(f"[{SECTION}] max_wait_s must be >= 0, got {self.max_wait_s}")
        if self.max_hold_s is not None and self.max_hold_s < self.max_wait_s:
            raise ValueError(f"[{SECTION}] max_hold_s ({self.max_hold_s:g}) must be at least max_wait_s "
                             f"({self.max_wait_s:g})")
        if self.default_duration_s <= 0:
            raise ValueError(f"[{SECTION}] default_duration_s must be > 0, got {self.default_duration_s}")
        if self.pool_check_interval_s < 0:
            raise ValueError(f"[{SECTION}] pool_check_interval_s must be >= 0, got {self.pool_check_interval_s}")
        if not 0 < self.pool_check_timeout_s <= 60:
            raise ValueError(f"[{SECTION}] pool_check_timeout_s must be in (0, 60], got {self.pool_check_timeout_s}")
        if self.history_ttl_s < 0:
            raise ValueError(f"[{SECTION}] history_ttl_s must be >= 0, got {self.history_ttl_s}")

    @classmethod
    def from_conf(cls, conf: ConfLike) -> ExecutorConfig:
        """Read and validate the section from Airflow's config (an ``ExecutorConf`` or ``conf``)."""
        values: dict[str, Any] = {}
        for key, (kind, default, _) in OPTIONS.items():
            raw = conf.get(SECTION, key, fallback=default)
            if raw is None or raw == "":
                continue
            try:
                if kind == "integer":
                    values[key] = int(raw)
                elif kind == "float":
                    values[key] = float(raw)
                    if not math.isfinite(values[key]):  # NaN passes every comparison check below
                        raise ValueError(f"not a finite number: {raw!r}")
                elif kind == "boolean":
                    values[key] = _to_bool(raw)
                else:
                    values[key] = str(raw)
            except ValueError as exc:
                raise ValueError(f"[{SECTION}] {key}: expected {kind}, got {raw!r}") from exc
        if not values.get("catalogue"):
            values["catalogue"] = packaged_catalogue()
        return cls(**values)


def hold_bound(cfg: ExecutorConfig, queued_timeout: float) -> float:
    """The longest a task may be held in all (``max_hold_s``, or its default from ``[scheduler]
    task_queued_timeout``), checked below that timeout: the scheduler takes a task queued that
    long for stuck and re-queues or fails it."""
    hold = cfg.max_hold_s if cfg.max_hold_s is not None else default_hold_s(cfg.max_wait_s, queued_timeout)
    name = "max_hold_s" if cfg.max_hold_s is not None or hold > cfg.max_wait_s else "max_wait_s"
    if hold >= queued_timeout:
        raise ValueError(f"[{SECTION}] {name} ({hold:g}) must be below [scheduler] task_queued_timeout "
                         f"({queued_timeout:g}): a task held that long is taken for stuck in queued")
    return hold


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {raw!r}")
