"""Metrics and health over HTTP, and the server's configuration."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import redis
from server_helpers import ask, chain, request

from policy.config import ConfigError, ServerConfig
from policy.metrics import MetricsServer
from policy.placement import EarliestFinishPlacer

pytestmark = pytest.mark.integration


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_metrics_and_health_endpoints(start_server, rclient: redis.Redis) -> None:
    rs = start_server()
    http = MetricsServer(rs.server.metrics, rs.server.health, "127.0.0.1", 0).start()
    try:
        for i in range(3):
            assert ask(rclient, request([chain("m")], [("m", f"t{i}")])).ok  # type: ignore[union-attr]
        code, body = _get(f"http://127.0.0.1:{http.port}/health")
        doc = json.loads(body)
        assert code == 200 and doc["version"] == f"eft:{EarliestFinishPlacer.version}" and doc["device"] == "cpu"
        assert doc["cp_gate"] is None  # no GNN, no gate
        # a request is counted once its reply is delivered (after the reply's push, with its
        # latency), so the client can read /metrics a moment before the third one is counted
        deadline = time.monotonic() + 5.0
        while True:
            code, body = _get(f"http://127.0.0.1:{http.port}/metrics")
            text = body.decode()
            if 'drl_policy_requests_total{outcome="ok"} 3.0' in text or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert code == 200
        assert 'drl_policy_requests_total{outcome="ok"} 3.0' in text
        assert "drl_policy_request_seconds_bucket" in text and "drl_policy_batch_requests_count" in text
        assert f'policy_version="eft:{EarliestFinishPlacer.version}"' in text
        assert f'drl_policy_model_info{{device="cpu",version="eft:{EarliestFinishPlacer.version}"}} 1.0' in text
        assert _get(f"http://127.0.0.1:{http.port}/nope")[0] == 404
        rs.server.connected = False
        assert _get(f"http://127.0.0.1:{http.port}/health")[0] == 503
    finally:
        http.stop()


def test_config_from_env_and_cli() -> None:
    env = {"DRL_POLICY_BATCH_MAX": "8", "DRL_POLICY_PREFIX": "envp", "DRL_POLICY_TEMPERATURE": "0.3"}
    cfg = ServerConfig.from_sources({"prefix": "clip", "batch_max": None}, env)
    assert (cfg.batch_max, cfg.prefix, cfg.temperature) == (8, "clip", 0.3)
    with pytest.raises(ConfigError, match="DRL_POLICY_BATCH_MAX"):
        ServerConfig.from_sources({}, {"DRL_POLICY_BATCH_MAX": "many"})
    # the GNN's stop guard: work-conserving by default, the earlier rule by setting
    assert ServerConfig().hold_ratio == float("inf")
    assert ServerConfig.from_sources({}, {"DRL_POLICY_HOLD_RATIO": "1"}).hold_ratio == 1.0
    # the premium gate: as the checkpoint was trained unless set (0 turns it off)
    assert ServerConfig().cp_gate is None
    assert ServerConfig.from_sources({}, {"DRL_POLICY_CP_GATE": "3"}).cp_gate == 3.0
    assert ServerConfig.from_sources({"cp_gate": 0.0}, {"DRL_POLICY_CP_GATE": "3"}).cp_gate == 0.0
    assert ServerConfig().cp_gate_scope is None
    assert ServerConfig.from_sources({}, {"DRL_POLICY_CP_GATE_SCOPE": "all"}).cp_gate_scope == "all"
    # the decode steps: compiled where numba is, by setting numpy
    assert ServerConfig().step_kernel == "auto"
    assert ServerConfig.from_sources({}, {"DRL_POLICY_STEP_KERNEL": "numpy"}).step_kernel == "numpy"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"redis_url": "http://x"}, "scheme"),
        ({"batch_max": 0}, "batch_max"),
        ({"placer": "magic"}, "placer"),
        ({"placer": "gnn"}, "registry"),
        ({"device": "tpu"}, "device"),
        ({"reconnect_base_s": 2.0, "reconnect_max_s": 1.0}, "reconnect_max_s"),
        ({"skew_threshold": 1.5}, "skew_threshold"),
        ({"hold_ratio": 0.5}, "hold_ratio"),
        ({"cp_gate": 0.5}, "cp_gate"),
        ({"cp_gate_scope": "critical"}, "cp_gate_scope"),
        ({"step_kernel": "fast"}, "step_kernel"),
    ],
)
def test_config_is_validated(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ServerConfig(**kwargs)  # type: ignore[arg-type]


def test_password_is_masked_in_logs() -> None:
    cfg = ServerConfig(redis_url="rediss://svc:s3cret@redis.example:6380/0")
    assert "s3cret" not in cfg.safe_redis_url and cfg.safe_redis_url.startswith("rediss://svc:***@")


@pytest.mark.integration
def test_request_seconds_counts_from_the_read_not_from_after_the_batch_wait(
    start_server, rclient: redis.Redis
) -> None:
    """``drl_policy_request_seconds`` is documented (metric help, docs/server.md) as the time from
    reading a request off the stream to pushing its reply, but ``handle`` stamps ``read_at`` after
    ``step`` has waited ``batch_wait_ms`` for the batch to fill: with ``--batch-wait-ms 200`` a
    request read at once and answered 200 ms later is observed as ~1 ms, so the histogram hides
    the very latency the setting adds (``server_ms`` in the reply likewise)."""
    rs = start_server(batch_wait_ms=200)
    g = chain("review1/wait")
    t0 = time.monotonic()
    reply = ask(rclient, request([g], [(g.run_key, "t0")]))
    waited = time.monotonic() - t0
    assert reply is not None and reply.ok and waited >= 0.2
    deadline = time.monotonic() + 5.0
    registry = rs.server.metrics.registry

    def observed_s() -> float:
        return registry.get_sample_value("drl_policy_request_seconds_sum") or 0.0

    while observed_s() == 0.0 and time.monotonic() < deadline:  # counted just after the push
        time.sleep(0.01)
    observed = observed_s()
    assert observed >= 0.19, f"request_seconds observed {observed * 1e3:.1f} ms for a request held 200 ms"
