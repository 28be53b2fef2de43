"""Fixtures of the policy tests: a real, private redis-server, flushed between tests.

The server starts once per session on a free loopback port with a random password (never 6379)
and stops at the end; every test that asks for ``redis_url`` gets an empty database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import redis

from policy.bench import PrivateRedis, start_redis
from policy.config import ServerConfig
from policy.server import PolicyServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[PrivateRedis]:
    try:
        srv = start_redis()
    except RuntimeError as exc:  # the harness installs redis-server; say so loudly if it did not
        pytest.fail(f"cannot start a private redis-server: {exc}")
    yield srv
    srv.stop()


@pytest.fixture
def redis_url(redis_server: PrivateRedis) -> Iterator[str]:
    r = redis_server.client()
    r.flushall()
    yield redis_server.url
    r.flushall()
    r.close()


@pytest.fixture
def rclient(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


class RunningServer:
    """A :class:`PolicyServer` serving in a background thread."""

    def __init__(self, server: PolicyServer) -> None:
        self.server = server
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, name=f"server-{server.config.consumer}",
                                       daemon=True)

    def _run(self) -> None:
        self.exit_code = self.server.serve_forever()

    def start(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.connected, "server did not connect to Redis"
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        self.server.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"
        return self.exit_code


@pytest.fixture
def start_server(redis_url: str) -> Iterator[Callable[..., RunningServer]]:
    """``start_server(consumer="a", placer=..., **config_overrides)`` -> a running server."""
    running: list[RunningServer] = []

    def make(consumer: str = "replica-a", placer=None, loader=None, **overrides) -> RunningServer:
        base = ServerConfig(redis_url=redis_url, prefix="t", consumer=consumer, block_ms=50,
                            heartbeat_s=0.2, claim_interval_s=0.1, reconnect_base_s=0.05,
                            reconnect_max_s=0.4)
        config = replace(base, **overrides)
        rs = RunningServer(PolicyServer(config, placer=placer, loader=loader)).start()
        running.append(rs)
        return rs

    yield make
    for rs in running:
        if rs.thread.is_alive():
            rs.stop()
