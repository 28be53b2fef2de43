"""Prometheus metrics and the health endpoint of one policy server replica.

``GET /metrics`` serves the Prometheus text format from a private registry (so several servers in
one test process do not collide); ``GET /health`` answers JSON with the model version, the device,
the consumer name and whether Redis is reachable (HTTP 200 when it is, 503 when not).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    """The server's metric families, registered on a private :class:`CollectorRegistry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_latency = Histogram(
            "drl_policy_request_seconds",
            "Time from reading a request off the stream to pushing its reply",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.request_age = Histogram(
            "drl_policy_request_age_seconds",
            "Age of a request when its reply is pushed (from Redis adding it, on Redis's clock)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "drl_policy_batch_requests", "Requests handled per batch", buckets=_BATCH_BUCKETS, registry=r
        )
        self.queue_depth = Gauge(
            "drl_policy_queue_depth", "Stream entries not yet delivered to the consumer group (lag)",
            registry=r,
        )
        self.pending = Gauge(
            "drl_policy_pending", "Entries delivered to the group and not yet acknowledged", registry=r
        )
        self.requests = Counter(
            "drl_policy_requests_total",
            "Requests by outcome (ok, an error code, dropped_late, or taken_over: claimed by another "
            "replica before this one answered)",
            ["outcome"], registry=r,
        )
        self.decisions = Counter(
            "drl_policy_decisions_total", "Decisions by pool and policy version",
            ["pool", "policy_version"], registry=r,
        )
        self.fallbacks = Counter(
            "drl_policy_fallbacks_total", "Decisions made by the fallback heuristic, by reason",
            ["reason"], registry=r,
        )
        self.model_load_failures = Counter(
            "drl_policy_model_load_failures_total", "Checkpoints refused by the model registry", registry=r
        )
        self.model_swaps = Counter(
            "drl_policy_model_swaps_total", "Models swapped in by hot reload", registry=r
        )
        self.claimed = Counter(
            "drl_policy_claimed_total", "Pending entries taken over from another replica (XCLAIM)",
            registry=r,
        )
        self.graph_store_hits = Counter(
            "drl_policy_graph_store_hits_total",
            "Graphs referenced by RunRef that another replica was sent, read from the shared store",
            registry=r,
        )
        self.reconnects = Counter(
            "drl_policy_redis_reconnects_total",
            "Redis failures that made the server reconnect (each failed retry of an outage counts)", registry=r
        )
        self.graph_cache_entries = Gauge(
            "drl_policy_graph_cache_entries", "Graphs in the per-run graph cache", registry=r
        )
        self.graph_cache_bytes = Gauge(
            "drl_policy_graph_cache_bytes", "Estimated memory of the per-run graph cache", registry=r
        )
        self.gc_pause = Histogram(
            "drl_policy_gc_pause_seconds",
            "Between-batch garbage collections before freezing their survivors (gc_freeze_s)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.model_info = Gauge(
            "drl_policy_model_info", "The model being served (value 1)", ["version", "device"], registry=r
        )

    def set_model(self, version: str, device: str) -> None:
        self.model_info.clear()
        self.model_info.labels(version=version, device=device).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """A small threaded HTTP server for ``/metrics`` and ``/health`` (daemon thread)."""

    def __init__(
        self, metrics: ServerMetrics, health: Callable[[], dict[str, Any]], host: str, port: int
    ) -> None:
        self.metrics = metrics
        self.health = health
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, outer.metrics.render())
                elif path in ("/health", "/healthz"):
                    doc = outer.health()
                    code = 200 if doc.get("status") == "ok" else 503
                    self._send(code, "application/json", json.dumps(doc).encode())
                else:
                    self._send(404, "text/plain", b"not found: try /metrics or /health\n")

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("metrics http: " + fmt, *args)

        # the address family of the host (found by review: ThreadingHTTPServer is IPv4 only, and
        # --metrics-host ::1 or :: ended the server at start)
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("MetricsHTTPServer", (ThreadingHTTPServer,), {"address_family": family})
        self.httpd = server_class((host, port), Handler)
        # a client that connects and sends nothing holds one thread, not for ever
        Handler.timeout = 30
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self.started_at = time.time()

    def start(self) -> MetricsServer:
        self._thread.start()
        log.info("metrics and health on http://%s:%d/metrics and /health",
                 self.httpd.server_address[0], self.port)
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
