"""The policy server's settings, metrics and health endpoint at their limits (found by review, each
failed on the code before its fix)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import yaml
from server_helpers import KEYS, chain, request, send_raw

from policy.config import ConfigError, ServerConfig
from policy.metrics import MetricsServer, ServerMetrics
from policy.schema import dumps
from policy.server import PolicyServer

ROOT = Path(__file__).resolve().parents[2]


def _server(redis_url: str, **overrides) -> PolicyServer:  # type: ignore[no-untyped-def]
    base = ServerConfig(redis_url=redis_url, prefix=KEYS.prefix, consumer="me", block_ms=50,
                        heartbeat_s=0.2, claim_interval_s=0.1, reconnect_base_s=0.05,
                        reconnect_max_s=0.4)
    return PolicyServer(replace(base, **overrides))


def _outcomes(server: PolicyServer) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in server.metrics.requests.collect() for s in m.samples
            if s.name == "drl_policy_requests_total"}


def _bad_request_payload(request_id: str) -> str:
    """A request that decodes far enough to be checked against its deadline, then fails the schema."""
    doc = json.loads(dumps(request([chain("b")], [("b", "t0")], deadline_ms=500, request_id=request_id)))
    doc["pools"] = "not a list"
    return json.dumps(doc)


# --- metrics ---------------------------------------------------------------------------------------


@pytest.mark.integration
def test_an_error_reply_dropped_past_its_deadline_is_one_request_in_requests_total(
        redis_url: str, rclient: redis.Redis) -> None:
    """``drl_policy_requests_total{outcome}`` is "Requests by outcome": one outcome per request.
    An error reply is counted under its code when it is built (``PolicyServer._error``,
    policy/server.py) and then, when the request's deadline passed while the batch was handled,
    counted again as ``dropped_late`` by ``_reply``: one request, two outcomes (a slow batch of
    bad requests doubles the request rate on the dashboard and shows error replies that were never
    sent). Fix: count the error code in ``_reply``, with ``ok``, once it is known to be sent."""
    server = _server(redis_url)
    server._connect()
    try:
        send_raw(rclient, _bad_request_payload("bad"))
        entries = server._read(server._redis, 10, None)  # type: ignore[arg-type]
        jobs = server.handle(entries)
        assert jobs[0].reply is not None and jobs[0].reply.error_code == "bad_request"
        server._clock_offset = (server._clock_offset or 0.0) + 5.0  # the batch took 5 s on Redis's clock
        server._reply(server._redis, jobs)  # type: ignore[arg-type]
    finally:
        server._goodbye()
    assert not rclient.exists(KEYS.reply("bad"))
    outcomes = _outcomes(server)
    assert sum(outcomes.values()) == 1, f"one request counted under {outcomes}"


@pytest.mark.integration
def test_an_error_reply_taken_over_by_another_replica_is_one_request_in_requests_total(
        redis_url: str, rclient: redis.Redis) -> None:
    """As above, for a request another replica took over before this one answered it: ``ok`` is
    counted only for replies this replica wrote, but an error reply was already counted under its
    code when built, and ``_reply`` adds ``taken_over``: two outcomes for one request on this
    replica (and a third on the replica that answers it)."""
    server = _server(redis_url)
    server._connect()
    try:
        # read by another consumer: pending for it, not for this replica ("me")
        pipe = rclient.pipeline(transaction=True)
        pipe.xadd(KEYS.requests, {"payload": _bad_request_payload("taken")})
        pipe.xreadgroup(KEYS.group, "other", {KEYS.requests: ">"}, count=1)
        _, got = pipe.execute()
        entries = list(got[0][1])
        jobs = server.handle(entries)
        assert jobs[0].reply is not None and jobs[0].reply.error_code == "bad_request"
        server._reply(server._redis, jobs)  # type: ignore[arg-type]
    finally:
        server._goodbye()
    assert not rclient.exists(KEYS.reply("taken"))
    outcomes = _outcomes(server)
    assert outcomes.get("taken_over") == 1
    assert sum(outcomes.values()) == 1, f"one request counted under {outcomes}"


# --- settings --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, overrides, harm", [
    ("block_ms", {"block_ms": 10**13},
     "socket timeout block_ms/1000 + 5 s: OverflowError from sock.settimeout at the first "
     "connection ends serve_forever (a traceback, /health then down)"),
    ("reconnect_base_s", {"reconnect_base_s": 1e11, "reconnect_max_s": 1e11},
     "the first Redis loss: Event.wait(5e10) raises OverflowError out of serve_forever"),
    ("claim_idle_ms", {"claim_idle_ms": 2**63},
     "XPENDING IDLE out of range: every claim sweep is a ResponseError, the replica reconnects for "
     "ever, answers nothing, and /health says redis_unavailable"),
    ("batch_max", {"batch_max": 2**62},
     "XPENDING COUNT 4 x batch_max out of range: reconnect loop, nothing answered, /health blames Redis"),
    ("graph_store_ttl_s", {"graph_store_ttl_s": 1e17},
     "SET ... EX out of range in the reply script: every batch fails, the replica reconnects for "
     "ever and answers nothing"),
    ("torch_threads", {"torch_threads": 2**31},
     "torch.set_num_threads raises ValueError (not a PolicyError) in PolicyServer.__init__: "
     "`drl-policy serve` prints a traceback instead of 'cannot start: torch_threads ...'"),
])
def test_a_huge_setting_the_replica_cannot_run_with_is_refused_at_start(
        name: str, overrides: dict[str, object], harm: str) -> None:
    """``ServerConfig.__post_init__`` (policy/config.py) has lower bounds only (``batch_max >= 1``,
    ``block_ms >= 1``, ``reconnect_*_s > 0``, ...), so a value that is too large for Redis, the
    socket layer or torch is accepted and breaks the replica later. docs/server.md: a value the
    server cannot run with ends it at start with one line naming the setting. Fix: upper bounds
    (e.g. intervals and TTLs within threading.TIMEOUT_MAX / Redis's 64-bit ms, counts within
    what XPENDING/XREADGROUP take, torch_threads within a C int)."""
    with pytest.raises(ConfigError, match=name):
        ServerConfig(**overrides)  # type: ignore[arg-type]
    del harm  # documented in the parameter list


def test_every_flag_reads_its_documented_environment_variable() -> None:
    """README ("every flag also reads ``DRL_POLICY_<NAME>``"): the Redis URL's flag is ``--redis``,
    so a deployer sets ``DRL_POLICY_REDIS=redis://:pw@redis.internal:6379/0``. ``from_sources``
    (policy/config.py) reads only ``DRL_POLICY_<FIELD>`` (``DRL_POLICY_REDIS_URL``) and ignores
    every other ``DRL_POLICY_*`` variable without a word, so the replica connects to the default
    127.0.0.1:6379 and retries for ever. Fix: read ``DRL_POLICY_REDIS`` too (the flag's name), or
    refuse an unknown ``DRL_POLICY_*`` variable naming it (a typo such as
    ``DRL_POLICY_METRICS_PORTS`` is silently ignored the same way)."""
    env = {"DRL_POLICY_REDIS": "redis://:pw@redis.internal:6379/0"}
    try:
        cfg = ServerConfig.from_sources(env=env)
    except ConfigError as exc:
        assert "DRL_POLICY_REDIS" in str(exc)
        return
    assert cfg.redis_url == env["DRL_POLICY_REDIS"], f"DRL_POLICY_REDIS ignored: serving {cfg.safe_redis_url}"


def test_a_cuda_device_this_host_does_not_have_is_refused_at_start(tmp_path: Path) -> None:
    """``--device cuda:7`` (or ``cuda`` on a host without a GPU, or a CPU build of torch) passes the
    syntactic check of ``ServerConfig`` (policy/config.py); with the default ``--placer auto`` the
    model then fails to load ("cannot load: AssertionError: Torch not compiled with CUDA
    enabled"), the failure is blamed on the checkpoint and counted in
    ``drl_policy_model_load_failures_total``, and the replica serves the EFT heuristic with
    /health "ok". A typo in one setting silently replaces the trained policy, the case the
    existing ``cuda:abc`` check was added for. Fix: in ``PolicyServer.__init__`` (torch is
    imported there anyway for a model placer) refuse a CUDA device torch cannot use, with a
    ConfigError naming ``device``."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this host has a cuda:7")
    config = ServerConfig(redis_url="redis://127.0.0.1:1/0", placer="auto", registry=str(tmp_path / "reg"),
                          device="cuda:7")
    try:
        server = PolicyServer(config)
    except ConfigError as exc:
        assert "device" in str(exc) and "cuda:7" in str(exc)
        return
    pytest.fail(f"started with --device cuda:7 on a host without it, serving {server.version} "
                f"(model load failures counted: {server.metrics.model_load_failures._value.get():g})")


# --- the HTTP endpoint -----------------------------------------------------------------------------


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv6_metrics_host_is_served() -> None:
    """``--metrics-host`` is "Address the metrics endpoint binds to", but ``MetricsServer``
    (policy/metrics.py) builds a ``ThreadingHTTPServer``, whose address family is AF_INET: ``::1``
    or ``::`` (an IPv6-only pod, a dual-stack bind) fails with "[Errno -9] Address family for
    hostname not supported" and `drl-policy serve` exits 2. Fix: pick the family from
    ``socket.getaddrinfo(host, port)`` (a ThreadingHTTPServer subclass with ``address_family =
    AF_INET6``), as ``python -m http.server --bind ::`` does."""
    try:
        http = MetricsServer(ServerMetrics(), lambda: {"status": "ok"}, "::1", 0).start()
    except OSError as exc:
        pytest.fail(f"--metrics-host ::1 refused: {exc}")
    try:
        with urllib.request.urlopen(f"http://[::1]:{http.port}/health", timeout=5) as resp:
            assert resp.status == 200
    except urllib.error.URLError as exc:  # pragma: no cover - only with the fix in and a failure
        pytest.fail(f"/health over IPv6: {exc}")
    finally:
        http.stop()


# --- the deployment ------------------------------------------------------------------------------


def test_the_compose_file_keeps_the_redis_password_out_of_the_policy_servers_command_line() -> None:
    """docker-compose.yaml runs the policy server as ``serve --redis
    redis://:${REDIS_PASSWORD}@redis:6379/0 ...``: the password is in the process's argv, which
    every user of the host reads (``ps aux``, /proc/<pid>/cmdline: containers' processes are the
    host's), as it is in ``docker inspect``'s Cmd. The server masks it in its logs, but its own
    command line gives it away. The server reads the same setting from ``DRL_POLICY_REDIS_URL``
    (policy/config.py), which only the process's user can read. Fix: ``environment:
    {DRL_POLICY_REDIS_URL: "redis://:${REDIS_PASSWORD:-change-me}@redis:6379/0", ...}`` and no
    ``--redis`` in ``command``."""
    compose = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
    cmd = compose["services"]["policy-server"]["command"]
    words = cmd if isinstance(cmd, list) else str(cmd).split()
    leaking = [w for w in words if "PASSWORD" in w or ("@" in w and "://" in w)]
    assert not leaking, f"the Redis password is on the policy server's command line: {leaking}"
