"""The server's settings and the shared dispatcher refuse what a replica cannot run with, at start,
in one line (found by review, 2026-12-06): a NaN or infinite interval, a device torch refuses, an
empty metrics host, a registry path whose parent is missing, an unknown ``--log-level``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from server_helpers import ask, chain, request

from policy.config import ConfigError, ServerConfig
from policy.transport import Keys

ROOT = Path(__file__).resolve().parents[2]
#: a Redis nobody listens on: a replica given it starts and retries (it does not exit by itself)
NO_REDIS = "redis://127.0.0.1:1/0"


# --- drl-policy / drl-trainer: the shared dispatcher ---------------------------------------------


@pytest.mark.parametrize("module, argv", [
    ("policy.cli", ["registry", "show", "--registry", "/nonexistent-registry"]),
    ("trainer.cli", ["ensemble", "--out", "/nonexistent-out", "/nonexistent-a", "/nonexistent-b"]),
])
def test_an_unknown_log_level_is_a_usage_error_not_a_traceback(module: str, argv: list[str]) -> None:
    """``--log-level verbose`` (or ``--log-level 10``, or a typo of WARNING) is accepted by the
    parser and then passed to ``logging.basicConfig``, which raises ``ValueError: Unknown level:
    'VERBOSE'``: both ``drl-policy`` and ``drl-trainer`` print a Python traceback. The flag has no
    ``choices``/type check (policy/cli.py, ``build_parser`` / ``dispatch``)."""
    proc = subprocess.run([sys.executable, "-m", module, "--log-level", "verbose", *argv],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "Traceback" not in proc.stderr, proc.stderr[-600:]
    assert proc.returncode == 2
    assert "--log-level" in proc.stderr and "verbose" in proc.stderr


# --- drl-policy serve: ServerConfig from flags and DRL_POLICY_* ----------------------------------


@pytest.mark.parametrize("name", [
    "registry_poll_s", "claim_interval_s", "graph_cache_ttl_s", "graph_store_ttl_s", "temperature",
    "gc_freeze_s", "gc_full_s", "heartbeat_s", "heartbeat_prune_s", "reconnect_base_s", "reconnect_max_s",
])
def test_a_nan_setting_is_refused(name: str) -> None:
    """``DRL_POLICY_<NAME>=nan`` (or ``--<name> nan``) passes every range check of
    ``ServerConfig.__post_init__`` (policy/config.py: ``value < lo`` and ``value <= 0`` are False for
    NaN) and the replica starts with the setting silently broken: ``heartbeat_s=nan`` writes one
    heartbeat and never another (``now >= nan`` is never true), so the other replicas prune it and
    the executors take the replica for dead; ``claim_interval_s=nan`` never claims a crashed
    replica's entries again; ``heartbeat_prune_s=nan`` never prunes; ``gc_freeze_s=nan`` runs a
    full ``gc.collect()`` at every batch; ``temperature=nan`` is silently greedy;
    ``graph_store_ttl_s=nan`` fails every reply batch (``int(nan)``)."""
    with pytest.raises(ConfigError, match=name):
        ServerConfig.from_sources(env={f"DRL_POLICY_{name.upper()}": "nan"})


@pytest.mark.parametrize("env", [
    {"DRL_POLICY_GRAPH_STORE_TTL_S": "inf"},
    {"DRL_POLICY_HEARTBEAT_S": "inf", "DRL_POLICY_HEARTBEAT_PRUNE_S": "inf"},
])
def test_an_infinite_interval_that_breaks_the_replica_is_refused(env: dict[str, str]) -> None:
    """``graph_store_ttl_s=inf`` is accepted (``inf < 0`` is False) but ``_reply`` computes
    ``int(self.config.graph_store_ttl_s)`` for every batch: ``OverflowError``, every request is
    dropped unanswered (policy/server.py ``_reply``). ``heartbeat_s=inf`` with
    ``heartbeat_prune_s=inf`` passes the ``prune < 3 x heartbeat`` check (``inf < inf`` is False):
    one heartbeat, then none, so executors and the other replicas see a dead replica."""
    with pytest.raises(ConfigError):
        ServerConfig.from_sources(env=env)


def test_serve_refuses_an_infinite_graph_store_ttl_instead_of_dropping_every_request(redis_url: str) -> None:
    """End to end: ``DRL_POLICY_GRAPH_STORE_TTL_S=inf drl-policy serve`` starts, logs nothing wrong
    at start, and then every request it reads is dropped unanswered ("cannot write the replies of a
    batch of 1: its entries are dropped unanswered", ``OverflowError: cannot convert float infinity
    to integer`` in the log): the executor falls back on every decision. It should exit 2 at start
    naming graph_store_ttl_s."""
    proc = subprocess.Popen([sys.executable, "-m", "policy.cli", "--log-level", "WARNING", "serve", "--redis",
                             redis_url, "--prefix", "t", "--placer", "eft"], cwd=ROOT, text=True,
                            env={**os.environ, "DRL_POLICY_GRAPH_STORE_TTL_S": "inf"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        try:
            proc.wait(timeout=8)
        except subprocess.TimeoutExpired:
            pass
        reply = None
        if proc.poll() is None:  # it started: what becomes of a request
            r = redis.Redis.from_url(redis_url, socket_timeout=10)
            graph = chain("run1")
            try:
                reply = ask(r, request([graph], [("run1", "t0")]), timeout_s=4, keys=Keys("t"))
            finally:
                r.close()
    finally:
        if proc.poll() is None:
            proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert proc.returncode == 2 and "graph_store_ttl_s" in out, (
        f"the replica started (reply to a request: {reply}); its log:\n{out[-800:]}")


def test_a_device_string_torch_refuses_is_refused_at_start() -> None:
    """``--device cuda:abc`` (or ``cuda:``) passes the check ``device.startswith("cuda:")``
    (policy/config.py); torch refuses it only when the model loads, and with the default
    ``--placer auto`` the replica then serves the EFT heuristic instead of the model (an ERROR line
    "no model (... Invalid device string: 'cuda:abc')"), so a typo in one setting silently
    replaces the trained policy."""
    for device in ("cuda:abc", "cuda:"):
        with pytest.raises(ConfigError, match="device"):
            ServerConfig(device=device)


def test_an_empty_metrics_host_does_not_open_the_metrics_port_on_every_interface() -> None:
    """``--metrics-host ""`` (say ``--metrics-host "$METRICS_HOST"`` with the variable unset) is
    taken as given: ``ThreadingHTTPServer(("", port))`` binds every interface, exposing /metrics
    and /health (consumer, prefix, checkpoint path) beyond the default 127.0.0.1. The same empty
    value in ``DRL_POLICY_METRICS_HOST`` is read as unset (127.0.0.1): one value, two meanings
    (policy/config.py: ``from_sources`` skips empty env values only; ``__post_init__`` has no check)."""
    assert ServerConfig.from_sources(env={"DRL_POLICY_METRICS_HOST": ""}).metrics_host == "127.0.0.1"
    with pytest.raises(ConfigError, match="metrics_host"):
        ServerConfig.from_sources(cli={"metrics_host": ""}, env={})


def test_serve_does_not_make_a_tree_of_folders_for_a_mistyped_registry(tmp_path: Path) -> None:
    """``drl-policy serve --registry /var/lib/drl/regsitry/x`` (a typo in a parent folder) creates
    the whole path (``ensure_active`` -> ``copy_packaged``/``activate``: ``mkdir(parents=True)``,
    policy/registry.py) and seeds it with the packaged checkpoint: the replica serves the packaged
    default for ever while the nightly fine-tune promotes into the real registry, and nothing says
    so beyond an INFO line. ``drl-policy registry activate --create`` refuses exactly this ("its
    parent must exist: a typo there is not made a tree of new folders"); the server should too."""
    registry = tmp_path / "no" / "such" / "registry"
    proc = subprocess.Popen([sys.executable, "-m", "policy.cli", "--log-level", "WARNING", "serve", "--redis",
                             NO_REDIS, "--placer", "auto", "--registry", str(registry)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline and not (registry / "active.json").exists():
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert not (tmp_path / "no").exists(), f"made {sorted(str(p) for p in (tmp_path / 'no').rglob('*'))[:4]}"
    assert proc.returncode == 2, out[-600:]


def test_a_redis_url_that_does_not_parse_is_refused_without_its_password() -> None:
    """Found by review: a password holding ``/`` unencoded made redis-py raise "Port could not be
    cast to integer value as '<password>'" at the first connection: a traceback with the password
    in it, in every replica's log."""
    proc = subprocess.run([sys.executable, "-m", "policy.cli", "--log-level", "WARNING", "serve", "--redis",
                           "redis://:Zq8s3cr3tPw/xTail@127.0.0.1:1/0", "--placer", "eft"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "redis_url" in proc.stderr and "percent-encode" in proc.stderr, proc.stderr
    assert "Zq8s3cr3tPw" not in proc.stderr and "xTail" not in proc.stderr and "Traceback" not in proc.stderr

