"""Fixtures of the Airflow-side tests: a private redis-server and an in-process policy server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from policy.bench import PrivateRedis, start_redis
from policy.config import ServerConfig
from policy.server import PolicyServer


@pytest.fixture(scope="module")
def private_redis() -> Iterator[PrivateRedis]:
    srv = start_redis()
    yield srv
    srv.stop()


@pytest.fixture
def redis_url(private_redis: PrivateRedis) -> str:
    private_redis.client().flushall()
    return private_redis.url


@pytest.fixture
def policy_server(redis_url: str) -> Iterator[Callable[..., PolicyServer]]:
    """``policy_server(**config)`` starts a server thread on the test Redis (prefix ``t``)."""
    started: list[tuple[PolicyServer, threading.Thread]] = []

    def start(**overrides: object) -> PolicyServer:
        config = ServerConfig(redis_url=redis_url, prefix="t", consumer=f"c{len(started)}", block_ms=20,
                              heartbeat_s=0.2, **overrides)  # type: ignore[arg-type]
        server = PolicyServer(config)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        end = time.monotonic() + 10
        while not server.connected and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.1)  # first heartbeat
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.stop()
        thread.join(10)
