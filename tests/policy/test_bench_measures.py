"""``drl-policy bench``'s figures and clean-up (policy/bench.py): each test failed on the code before
its fix (found by review: figures that came out wrong or misleading, a bench that hung or left its
processes).

Most tests drive :func:`policy.bench.run_case` with a fake :class:`policy.bench.Client` (no Redis,
no server: the replies are made up), so what they check is the bench's bookkeeping, not timings.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from policy import bench
from policy.catalogue import load_catalogue
from policy.cli import main
from policy.schema import Decision, PlacementReply, ReadyTask, RunGraph
from policy.transport import DEFAULT_PREFIX, Keys

CATALOGUE = load_catalogue(bench.DEFAULT_CATALOGUE)
DURATION_S = 0.3


def _fake_client(decide: Any, fail_after: int | None = None) -> type:
    """A stand-in for :class:`bench.Client`: ``decide(ready)`` picks the ready tasks it places
    (the rest are held); with ``fail_after``, every ask after that many raises ConnectionError."""

    class FakeClient:
        def __init__(self, r: Any, keys: Keys) -> None:
            self.sent: set[tuple[str, str]] = set()
            self.calls = 0

        def ask(self, graphs: list[RunGraph], ready: list[ReadyTask], pools: Any,
                deadline_ms: float = 1000.0) -> PlacementReply:
            self.calls += 1
            if fail_after is not None and self.calls > fail_after:
                raise redis.ConnectionError("Connection reset by peer")
            time.sleep(0.002)  # a round trip of sorts: keeps the number of requests modest
            decisions = tuple(Decision(t.run_key, t.task_id, "p", "small") for t in decide(ready))
            return PlacementReply("x", decisions=decisions, server_ms=0.5)

    return FakeClient


def _case(monkeypatch: pytest.MonkeyPatch, client: type, dag_tasks: int, ready: int,
          clients: int = 1) -> bench.CaseResult:
    monkeypatch.setattr(bench, "Client", client)
    return bench.run_case("redis://127.0.0.1:1/0", Keys("t"), CATALOGUE, dag_tasks, ready, clients,
                          DURATION_S, seed=0, device="cpu")


def test_decisions_per_s_counts_the_decisions_returned_not_the_ready_tasks_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """decisions_per_s is ``good replies x ready_tasks / wall``, but a reply may place fewer tasks
    than it was asked about (late binding: the policy holds the rest, which the bench itself
    accepts as a good reply), so for a policy that holds tasks the figure counts ready tasks, not
    decisions. Here every reply places 1 of 8 ready tasks: decisions/s must be about
    requests / duration, not 8 times that."""
    res = _case(monkeypatch, _fake_client(lambda ready: ready[:1]), dag_tasks=50, ready=8)
    assert res.errors == 0 and res.requests > 0
    # 1 decision per good reply over at least the case's duration (a 2x margin for the wall time)
    assert res.decisions_per_s <= 2 * res.requests / DURATION_S, (res.decisions_per_s, res.requests)


def test_decisions_per_s_counts_the_ready_tasks_actually_sent_when_ready_exceeds_the_dag(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client asks about ``min(ready_tasks, dag_tasks)`` tasks per request (bench.py's
    ``picks``), but decisions_per_s multiplies the good replies by ``ready_tasks``: the default
    grid's ``--dag-sizes 50 --ready 64`` row overstates decisions/s by 64/50. Here a 5-task DAG
    with ``--ready 64``: every reply places all 5 tasks it was asked about, so decisions/s must be
    about 5 x requests / duration, not 64 x."""
    res = _case(monkeypatch, _fake_client(lambda ready: ready), dag_tasks=5, ready=64)
    assert res.errors == 0 and res.requests > 0
    assert res.decisions_per_s <= 2 * 5 * res.requests / DURATION_S, (res.decisions_per_s, res.requests)


def test_a_client_that_fails_before_the_start_does_not_hang_the_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_client`` handles only TimeoutError; any other exception of its warm-up request (Redis
    gone: ConnectionError; a reply that is not valid: SchemaError) ends its thread before it
    reaches the start barrier, and ``run_case``'s ``start.wait()`` (no timeout) then waits forever:
    the bench hangs instead of failing. Expected: run_case returns (errors counted) or raises."""
    monkeypatch.setattr(bench, "Client", _fake_client(lambda ready: ready, fail_after=0))
    outcome: list[object] = []

    def go() -> None:
        try:
            outcome.append(bench.run_case("redis://127.0.0.1:1/0", Keys("t"), CATALOGUE, 20, 2, 1,
                                          DURATION_S, seed=0, device="cpu"))
        except Exception as exc:  # noqa: BLE001 - raising is an acceptable outcome
            outcome.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and outcome, "run_case hung on the start barrier after a client failed"


def test_a_client_whose_connection_breaks_is_not_reported_as_a_clean_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-timeout error in the measured loop (here redis.ConnectionError from the third
    request on) kills the client's thread, and ``_clients`` keeps its placeholder result
    ``([], [], 0, 0, [])``: the requests it got through and its error are lost, and the case
    reports ``errors == 0`` with no requests as if nothing went wrong. Expected: the error is
    counted (errors > 0) or run_case raises."""
    monkeypatch.setattr(bench, "Client", _fake_client(lambda ready: ready, fail_after=3))
    try:
        res = bench.run_case("redis://127.0.0.1:1/0", Keys("t"), CATALOGUE, 20, 2, 1, DURATION_S,
                             seed=0, device="cpu")
    except Exception:  # noqa: BLE001 - surfacing the failure is fine
        return
    assert res.errors > 0, f"a broken client reported as a clean case: {res}"


def test_redis_mode_measures_the_servers_default_prefix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--prefix`` defaults to ``drlbench<pid>``, a fresh prefix meant for the private stack, also
    with ``--redis``: ``drl-policy bench --redis URL`` then waits for heartbeats on a prefix no
    running server uses (a server's default is ``drl``) and fails after 30 s, so "measures the
    server(s) already running there" never works without repeating the prefix. Expected: with
    ``--redis`` and no ``--prefix`` the bench uses the servers' default prefix."""
    seen: list[Keys] = []

    class Stop(Exception):
        pass

    def fake_wait(r: Any, keys: Keys, *args: Any, **kwargs: Any) -> None:
        seen.append(keys)
        raise Stop

    monkeypatch.setattr(bench, "wait_for_server", fake_wait)
    with pytest.raises(Stop):
        main(["--log-level", "WARNING", "bench", "--redis", "redis://127.0.0.1:1/0", "--dag-sizes", "5",
              "--ready", "1", "--clients", "1", "--duration", "0.1", "--out", str(tmp_path / "b.json")])
    assert seen and seen[0].prefix == DEFAULT_PREFIX, seen


def test_a_case_with_no_good_reply_still_writes_valid_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A case whose every request failed has p50/p99/mean/max/server percentiles of NaN, and
    ``_run`` writes them with ``json.dumps`` (allow_nan): the file holds bare ``NaN``, which is not
    JSON (jq and other strict readers refuse the whole file, all the other cases with it).
    Expected: the written file is strict JSON (e.g. null for a figure that does not exist)."""
    monkeypatch.setattr(bench, "wait_for_server", lambda *a, **k: None)
    monkeypatch.setattr(bench, "_server_device", lambda *a, **k: "cpu")

    def no_replies(url: str, keys: Keys, catalogue: Any, dag: int, ready: int, clients: int, *a: Any,
                   **k: Any) -> bench.CaseResult:
        nan = float("nan")
        return bench.CaseResult(dag_tasks=dag, ready_tasks=ready, clients=clients, requests=0, p50_ms=nan,
                                p99_ms=nan, mean_ms=nan, decisions_per_s=0.0, errors=7, device="cpu")

    monkeypatch.setattr(bench, "run_case", no_replies)
    out = tmp_path / "b.json"
    assert main(["--log-level", "WARNING", "bench", "--redis", "redis://127.0.0.1:1/0", "--dag-sizes", "5",
                 "--ready", "1", "--clients", "1", "--duration", "0.1", "--out", str(out)]) == 0

    def refuse(const: str) -> None:
        raise ValueError(f"not JSON: {const}")

    doc = json.loads(out.read_text(), parse_constant=refuse)
    assert doc["cases"][0]["errors"] == 7


def test_the_timeline_labels_each_interval_by_its_end() -> None:
    """``_timeline`` rounds each interval's end to 0.1 s, so with ``--rss-every 0.25`` (accepted)
    the intervals ending at 0.25 and 0.75 s are labelled 0.2 and 0.8, and with 0.05 two intervals
    share a label: the timeline's times are not the intervals' ends its docstring promises.
    Expected: the ends themselves (0.25, 0.5, 0.75, 1.0)."""
    done = [10.1, 10.3, 10.6, 10.9]
    got = bench._timeline(done, 10.0, 1.0, 0.25)
    assert [end for end, _ in got] == [0.25, 0.5, 0.75, 1.0], got
    assert all(math.isclose(rate, 4.0) for _, rate in got), got


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_start_redis_stops_its_redis_server_when_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``start_redis`` starts redis-server, then pings it until it answers; an exception other than
    ConnectionError there (Ctrl-C: KeyboardInterrupt) leaves it, since nothing stops the process
    (and the exit-status branch leaves its temporary folder): the redis-server keeps running
    after the bench has gone. Expected: the process is stopped before the exception propagates."""
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        return proc

    def interrupted(self: bench.PrivateRedis) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    monkeypatch.setattr(bench.PrivateRedis, "client", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            bench.start_redis()
        assert len(started) == 1
        try:
            started[0].wait(5)
        except subprocess.TimeoutExpired:
            pytest.fail("redis-server left running after start_redis was interrupted")
    finally:
        for proc in started:  # the redis-server this test started, by its own handle
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            args = list(proc.args)  # type: ignore[arg-type]
            shutil.rmtree(args[args.index("--dir") + 1], ignore_errors=True)
