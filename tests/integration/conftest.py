"""The integration harness: a whole private stack (PostgreSQL, redis-server, the policy server,
three Celery workers, Airflow api-server, scheduler, dag-processor and triggerer) in a temporary state folder
on free loopback ports, started once per session and stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from demo import Api  # noqa: E402
from localstack import Ports, Stack, StackError  # noqa: E402


def _free_port(span: int = 1) -> int:
    """A port p such that p..p+span-1 are free on 127.0.0.1 (checked now, good enough for tests)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span >= 65535:
            continue
        ok = True
        for p in range(port + 1, port + span):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise RuntimeError("no free port range")


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    # Not under /tmp/pytest-*: those folders are private to root, and PostgreSQL runs as postgres.
    state = Path(os.environ.get("DRL_TEST_STACK_DIR", str(REPO / ".stack-test")))
    ports = Ports(pg=_free_port(), redis=_free_port(), api=_free_port(), metrics=_free_port(),
                  worker_logs=_free_port(3), statsd=_free_udp_port())
    if state.exists():  # a previous session's leftovers: stop what may still run, start afresh
        Stack(state, Ports.from_env(), REPO).down()
        shutil.rmtree(state)
    st = Stack(state, ports, REPO / "policy" / "catalogues" / "demo.yaml")
    config = st.home / "config"  # the stack's cluster policy (tests/integration/test_hook_pin.py)
    config.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).with_name("airflow_local_settings.py"), config / "airflow_local_settings.py")
    try:
        st.up()
    except StackError as exc:
        st.down()
        pytest.fail(f"the test stack did not start: {exc}")
    yield st
    st.down()


@pytest.fixture(scope="session")
def api(stack: Stack) -> Api:
    return Api.login(stack)
