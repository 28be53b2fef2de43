"""The deployment check's policy-server and round-trip findings (airflow_drl_executor/check.py),
which the placements page shows too (plugin._serving): odd heartbeats in Redis and odd replies
are reported, never crash the command or the page (found by review). A fake Redis and a fake
client, no Airflow needed."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from airflow_drl_executor.check import check_servers

CFG = SimpleNamespace(key_prefix="t", server_stale_after_s=30.0)


class FakeRedis:
    def __init__(self, beats: dict[bytes, bytes]) -> None:
        self.beats = beats

    def hgetall(self, key: str) -> dict[bytes, bytes]:
        return self.beats

    def time(self) -> tuple[int, int]:
        t = time.time()
        return int(t), int((t % 1) * 1e6)


def _beat(**doc: Any) -> bytes:
    return json.dumps({"ts": time.time(), "version": "drl:v", "device": "cpu", **doc}).encode()


def test_a_deeply_nested_heartbeat_is_reported_not_raised() -> None:
    """heartbeat_ts catches RecursionError for "[[[[...", check_servers' own json.loads does not:
    the check command died, and _serving (not guarded) gave HTTP 500 for the placements page."""
    beats = {b"good": _beat(), b"odd": b"[" * 100_000 + b"]" * 100_000}
    found = check_servers(CFG, FakeRedis(beats))
    assert "good" in found.detail


@pytest.mark.parametrize("docs", [
    {b"a": {"objective": "mean_jct", "objective_given": "\ud800"}},
    {b"a": {"objective": "mean_jct"}, b"b": {"objective": "\ud800"}},
], ids=["objective_given", "objectives"])
def test_every_detail_is_printable_whatever_a_heartbeat_holds(docs: dict[bytes, dict[str, str]]) -> None:
    """_printable was applied to each server's line only: a JSON-escaped lone surrogate in
    ``objective_given`` or in an ``objective`` that differs from another replica's reached the
    warning's detail, which neither the page (HTTP 500) nor a UTF-8 terminal can write."""
    beats = {name: _beat(**doc) for name, doc in docs.items()}  # stamped now, not at collection
    found = check_servers(CFG, FakeRedis(beats))
    assert found.status == "warn", found
    found.detail.encode("utf-8")


class _FakeClient:
    """Stands in for PlacementClient in check_round_trip: answers with ``decide(request)``."""

    decide: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _FakeClient.decide is None:
            raise ValueError("Invalid value for 'db' in connection URL.")

    def place(self, request: Any, graphs: Any) -> Any:
        return _FakeClient.decide(request)

    def close(self) -> None:
        pass


def _round_trip(monkeypatch: pytest.MonkeyPatch, decide: Any) -> Any:
    from airflow_drl_executor import client as client_mod
    from airflow_drl_executor.check import check_round_trip
    from airflow_drl_executor.config import ExecutorConfig, packaged_catalogue
    from policy.catalogue import load_catalogue

    monkeypatch.setattr(client_mod, "PlacementClient", _FakeClient)
    monkeypatch.setattr(_FakeClient, "decide", decide)
    return check_round_trip(ExecutorConfig(), load_catalogue(packaged_catalogue()))


def test_the_round_trip_fails_when_the_server_answers_for_other_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: only the pools were checked, so decisions for tasks the probe never asked
    about (a server answering another request) passed as OK."""
    from policy.schema import Decision, PlacementReply

    def decide(request: Any) -> PlacementReply:
        pool = request.pools[0]
        return PlacementReply(request.request_id, (Decision("other/run", "x", pool.name, pool.vm_class),),
                              policy="gnn", policy_version="v")

    found = _round_trip(monkeypatch, decide)
    assert found.status == "fail" and "other/run/x" in found.detail, found


def test_the_round_trip_reports_a_client_it_cannot_make(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: the client was made outside the check's try, so its error escaped the check."""
    found = _round_trip(monkeypatch, None)
    assert found.status == "fail" and "cannot make the executor's client" in found.detail, found
