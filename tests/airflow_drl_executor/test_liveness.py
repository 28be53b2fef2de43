"""Pool liveness: which pools have a live Celery worker (airflow_drl_executor/liveness.py).

The watch's bookkeeping with a fake broadcast, then the real thing: Celery worker processes on a
real redis-server answering the executor's ``active_queues`` broadcast, one of them stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery

from airflow_drl_executor.executor import DRLExecutor
from airflow_drl_executor.liveness import PoolWatch, Replies, celery_inspector

POOLS = ("cpu-small", "cpu-large", "gpu")


def _replies(*workers: tuple[str, ...]) -> Replies:
    return {f"w{i}@h": [{"name": q, "exchange": {}} for q in queues] for i, queues in enumerate(workers)}


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _watch(answers: list[Replies | Exception], clock: Clock | None = None) -> PoolWatch:
    def ask() -> Replies:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a
    return PoolWatch(ask, POOLS, interval_s=10, clock=clock or Clock())


def test_live_workers_per_pool_from_the_workers_answers() -> None:
    watch = _watch([_replies(("cpu-small",), ("cpu-small", "gpu"), ("default",))])
    assert watch.live_workers() is None, "nothing is known before the first answer"
    assert watch.check() == {"cpu-small": 2, "cpu-large": 0, "gpu": 1}
    assert watch.live_workers() == {"cpu-small": 2, "cpu-large": 0, "gpu": 1}


def test_no_answer_a_failed_broadcast_or_a_stale_answer_is_unknown(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    watch = _watch([_replies(("gpu",)), ConnectionError("broker gone"), None, None], clock)
    watch.check()
    with caplog.at_level(logging.WARNING, logger="airflow_drl_executor.liveness"):
        assert watch.check() is None
        clock.t += 29
        assert watch.live_workers() == {"cpu-small": 0, "cpu-large": 0, "gpu": 1}, "the last answer holds a while"
        assert watch.check() is None
        clock.t += 2
        assert watch.live_workers() is None, "older than three intervals: unknown, not down"
        watch.check()
    blind = [r.getMessage() for r in caplog.records if "liveness unknown" in r.getMessage()]
    assert len(blind) == 1 and "ConnectionError: broker gone" in blind[0], "said once, with the cause"


def test_queues_workers_consume_that_are_no_pool_are_named_once(caplog: pytest.LogCaptureFixture) -> None:
    """was: ignored without a word: a pool misspelled in the catalogue ('cpu_small') looked like a
    pool without workers, and nothing pointed at the queue its workers did consume"""
    watch = _watch([_replies(("cpu_small",), ("cpu-large", "vpn"), ("gpu",))] * 2 + [_replies(("gpu", "vpn"))])
    with caplog.at_level(logging.INFO, logger="airflow_drl_executor.liveness"):
        for _ in range(3):
            watch.check()
    named = [r.getMessage() for r in caplog.records if "not pools of the catalogue" in r.getMessage()]
    assert named == ["DRLExecutor: Celery workers consume queues that are not pools of the catalogue: "
                     "cpu_small, vpn (tasks routed there are sent unplaced)",
                     "DRLExecutor: Celery workers consume queues that are not pools of the catalogue: "
                     "vpn (tasks routed there are sent unplaced)"], "once per change"


def test_a_pool_going_down_and_coming_back_is_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    watch = _watch([_replies(("gpu",), ("cpu-small",), ("cpu-large",)), _replies(("cpu-small",), ("cpu-large",)),
                    _replies(("cpu-small",), ("cpu-large",)), _replies(("gpu",), ("cpu-small",), ("cpu-large",))])
    with caplog.at_level(logging.INFO, logger="airflow_drl_executor.liveness"):
        for _ in range(4):
            watch.check()
    said = [r.getMessage() for r in caplog.records]
    assert sum("'gpu': pool marked down" in m for m in said) == 1
    assert sum("pool 'gpu' is back: 1 live worker" in m for m in said) == 1
    assert said[0] == "DRLExecutor: pool liveness: cpu-small 1 live worker(s), cpu-large 1 live worker(s), gpu 1 live worker(s)"
    assert not any("cpu-" in m for m in said[1:]), "the pools that stayed up are not mentioned again"


def test_a_malformed_answer_does_not_end_the_watch() -> None:
    answers: list[Replies | Exception] = [{"w@h": 5}, _replies(("gpu",))]  # type: ignore[list-item]
    watch = PoolWatch(lambda: answers.pop(0) if len(answers) > 1 else answers[0], POOLS, interval_s=0.05)
    watch.start()
    try:
        end = time.monotonic() + 5
        while watch.live_workers() is None and time.monotonic() < end:
            time.sleep(0.02)
    finally:
        watch.stop()
    assert watch.live_workers() == {"cpu-small": 0, "cpu-large": 0, "gpu": 1}


def test_the_executor_marks_a_pool_without_workers_down_and_sizes_the_others() -> None:
    ex = DRLExecutor()
    ex._pool_watch = _watch([_replies(("cpu-small",), ("cpu-small",), ("cpu-large",))])
    assert all(p.up for p in ex.pool_states()), "unknown: the catalogue's pools, all up"
    ex._pool_watch.check()
    pools = {p.name: p for p in ex.pool_states()}
    spec = {p.name: p for p in ex.catalogue.pools}
    assert not pools["gpu"].up and pools["gpu"].slots == 0
    assert pools["cpu-small"].up and pools["cpu-small"].slots == 2 * spec["cpu-small"].slots_per_worker
    assert pools["cpu-large"].up and pools["cpu-large"].slots == spec["cpu-large"].slots
    assert all(p.max_slots is None for p in pools.values()), "a fixed pool with a worker gone cannot grow"


def test_an_elastic_pool_marked_down_cannot_grow() -> None:
    """was: max_slots of its catalogue (16 for cpu-small): the policy saw room to boot workers on
    a pool no worker consumes, where the simulator it learnt in says none"""
    from policy.catalogue import load_catalogue

    ex = DRLExecutor()
    ex.catalogue = load_catalogue(Path(__file__).resolve().parents[2] / "policy/catalogues/gpu-affinity.yaml")
    ex._pool_watch = _watch([_replies(("cpu-large",), ("gpu",))])
    ex._pool_watch.check()
    pools = {p.name: p for p in ex.pool_states()}
    assert not pools["cpu-small"].up and pools["cpu-small"].max_slots is None
    assert pools["gpu"].up and pools["gpu"].max_slots == 4, "one worker of two: room to grow"


# --- real Celery workers on a real redis-server ----------------------------------------------------

APP = "from celery import Celery\napp = Celery('liveness', broker={url!r})\n"


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    (tmp_path / "liveapp.py").write_text(APP.format(url=redis_url))
    procs: list[subprocess.Popen[bytes]] = []

    def start(queue: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "liveapp", "worker", "-Q", queue, "-n", f"{queue}@%h",
             "--pool", "solo", "--without-mingle", "--without-gossip", "--loglevel", "WARNING"],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _until(watch: PoolWatch, ok: Callable[[dict[str, int]], bool], timeout: float = 30) -> dict[str, int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        live = watch.check()
        if live is not None and ok(live):
            return live
        time.sleep(0.2)
    raise AssertionError(f"the workers' answers never satisfied the test; last: {watch.live_workers()}")


def test_real_workers_answer_and_a_stopped_one_takes_its_pool_down(
        redis_url: str, workers: Callable[[str], subprocess.Popen[bytes]]) -> None:
    app = Celery("executor-side", broker=redis_url)
    watch = PoolWatch(celery_inspector(app, timeout_s=0.5), POOLS, interval_s=30)
    gpu = workers("gpu")
    workers("cpu-small")
    assert _until(watch, lambda live: live["gpu"] == 1 and live["cpu-small"] == 1) == {
        "cpu-small": 1, "cpu-large": 0, "gpu": 1}
    os.killpg(gpu.pid, signal.SIGKILL)  # a crash: nothing said goodbye
    gpu.wait(30)
    assert _until(watch, lambda live: live["gpu"] == 0)["cpu-small"] == 1


def test_a_broker_that_never_answers_does_not_hold_the_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a broker that accepts and never answers held the broadcast (kombu's ping) for
    ever, and the pool watch's only thread with it: no pool was checked again."""
    import threading

    import airflow_drl_executor.liveness as liveness

    monkeypatch.setattr(liveness, "BROADCAST_GRACE_S", 0.2)
    release = threading.Event()
    calls: list[int] = []

    class SilentBroker:
        def connection_for_write(self) -> object:
            calls.append(1)
            release.wait(30)
            raise ConnectionError("gave up")

    ask = celery_inspector(SilentBroker(), timeout_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer within"):
        ask()
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(TimeoutError, match="has not returned yet"):  # no second thread while one hangs
        ask()
    assert len(calls) == 1
    watch = PoolWatch(ask, ["cpu"], interval_s=0.05)
    assert watch.check() is None  # learned nothing; the watch goes on
    # a broadcast hung for good is tried again after RETRY_HUNG_S, leaving at most MAX_HUNG threads
    monkeypatch.setattr(liveness, "RETRY_HUNG_S", 0.0)
    for _ in range(5):
        with pytest.raises(TimeoutError):
            ask()
    assert len(calls) == liveness.MAX_HUNG
    release.set()
    time.sleep(0.1)
    with pytest.raises(ConnectionError):  # the hung calls ended: the next one runs again
        ask()
    assert len(calls) == liveness.MAX_HUNG + 1
