"""The per-run graph cache: keys, TTL, entry and memory bounds."""

from __future__ import annotations

import pytest

from policy.graph_cache import GraphCache, estimate_bytes
from policy.schema import RunGraph, TaskNode


def graph(run_key: str, n: int = 3, duration: float = 1.0) -> RunGraph:
    tasks = tuple(TaskNode(task_id=f"t{i}", duration_s=duration) for i in range(n))
    return RunGraph(run_key=run_key, tasks=tasks, edges=())


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_get_by_digest_and_latest() -> None:
    cache = GraphCache()
    g1, g2 = graph("r", duration=1.0), graph("r", duration=2.0)
    cache.put(g1)
    cache.put(g2)
    assert cache.get("r", g1.digest).graph is g1  # type: ignore[union-attr]
    assert cache.get("r").graph is g2  # type: ignore[union-attr]
    assert cache.get("r", "nope") is None and cache.get("other") is None


def test_ttl_counts_from_last_use() -> None:
    clock = Clock()
    cache = GraphCache(ttl_s=10, clock=clock)
    g = graph("r")
    cache.put(g)
    clock.t = 8
    assert cache.get("r", g.digest) is not None  # refreshes
    clock.t = 17
    assert cache.get("r", g.digest) is not None
    clock.t = 27.5
    assert cache.get("r", g.digest) is None
    assert len(cache) == 0 and cache.bytes == 0


def test_expire_sweeps() -> None:
    clock = Clock()
    cache = GraphCache(ttl_s=5, clock=clock)
    cache.put(graph("a"))
    clock.t = 3
    cache.put(graph("b"))
    clock.t = 6
    assert cache.expire() == 1 and cache.get("b") is not None and cache.get("a") is None


def test_entry_bound_evicts_least_recently_used() -> None:
    cache = GraphCache(max_entries=2)
    a, b, c = graph("a"), graph("b"), graph("c")
    cache.put(a)
    cache.put(b)
    cache.get("a")
    cache.put(c)
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert cache.evictions == 1


def test_memory_bound() -> None:
    big = graph("big", n=100)
    cache = GraphCache(max_bytes=estimate_bytes(big) + estimate_bytes(graph("x")) + 10)
    cache.put(graph("x"))
    cache.put(big)
    assert len(cache) == 2
    cache.put(graph("y"))
    assert cache.get("x") is None and cache.bytes <= cache.max_bytes
    # a single graph over the bound is still kept (the request needs it), alone
    huge = graph("huge", n=10_000)
    cache.put(huge)
    assert len(cache) == 1 and cache.get("huge") is not None


def test_memo_travels_with_the_entry() -> None:
    cache = GraphCache()
    g = graph("r")
    cache.put(g).memo["emb"] = 42
    assert cache.get("r", g.digest).memo["emb"] == 42  # type: ignore[union-attr]


def test_bad_bounds() -> None:
    with pytest.raises(ValueError, match="entries=0"):
        GraphCache(max_entries=0)
