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


def test_on_drop_hears_every_eviction_and_expiry_but_not_a_refresh() -> None:
    clock = Clock()
    dropped: list[tuple[str, str]] = []
    cache = GraphCache(max_entries=2, ttl_s=10, clock=clock, on_drop=dropped.append)
    a, b, c = graph("a"), graph("b"), graph("c")
    cache.put(a)
    cache.put(b)
    cache.put(a)  # a refresh, not a drop
    assert dropped == []
    cache.put(c)  # over the entry bound: b, the least recently used, goes
    assert dropped == [("b", b.digest)]
    clock.t = 11
    assert cache.expire() == 2
    assert sorted(dropped[1:]) == [("a", a.digest), ("c", c.digest)]


def test_the_server_forgets_what_it_derived_from_a_dropped_graph() -> None:
    """Views, run features and GNN embeddings live in their own memos: when the graph cache drops
    a run, the server drops them too, or the memos would keep graphs the byte bound evicted."""
    import torch
    from server_helpers import request

    from policy.config import ServerConfig
    from policy.features import run_features
    from policy.gnn import GNNPlacer
    from policy.graph import view
    from policy.model import ModelConfig, PlacementGNN
    from policy.schema import dumps
    from policy.server import PolicyServer

    torch.manual_seed(0)
    placer = GNNPlacer(PlacementGNN(ModelConfig()))
    server = PolicyServer(ServerConfig(graph_cache_entries=2), placer=placer)
    runs = [layered(30, f"forget/{k}") for k in range(3)]
    for g in runs:
        jobs = server.handle([(b"1-0", {b"payload": dumps(request([g], [(g.run_key, "t000000")]))})])
        assert jobs[0].reply is not None and jobs[0].reply.ok
    gone, kept = [(g.run_key, g.digest) for g in (runs[0], runs[2])]
    assert gone not in view and gone not in run_features and gone not in placer._embed
    assert kept in view and kept in run_features and kept in placer._embed


def layered(n: int, run_key: str) -> RunGraph:
    """~2 parents per task, 7-character task ids: the shape estimate_bytes is calibrated on."""
    tasks = tuple(TaskNode(task_id=f"t{i:06d}", duration_s=1.0 + i % 7, cpus=1.0 + i % 3) for i in range(n))
    edges = tuple((p, i) for i in range(1, n) for p in {i // 2, (i - 1) // 3})
    return RunGraph(run_key=run_key, tasks=tasks, edges=edges)


@pytest.mark.parametrize("n", [50, 200, 1000])
def test_estimate_covers_what_a_cached_run_costs(n: int) -> None:
    """The byte bound is only a bound if the estimate is near what a run really holds in a GNN
    server: the graph parsed from JSON, its view, its run features and its node embeddings
    (hidden 32, float32: torch's memory is not traced, so counted from the shape)."""
    import json
    import tracemalloc

    from policy.features import run_features
    from policy.graph import view

    runs = 20
    blob = json.dumps(layered(n, "r").to_json())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [RunGraph.from_json(json.loads(blob.replace('"r"', f'"est/{n}/{k}"', 1))) for k in range(runs)]
        derived = [(view(g), run_features(g)) for g in kept]
        held = (tracemalloc.get_traced_memory()[0] - before) / runs
    finally:
        tracemalloc.stop()
    for g in kept:
        view.discard((g.run_key, g.digest))
        run_features.discard((g.run_key, g.digest))
    assert len(derived) == runs
    held += n * 32 * 4  # the GNN's node embeddings [n, hidden]
    assert 0.8 <= estimate_bytes(kept[0]) / held <= 1.25, (estimate_bytes(kept[0]), held)


def test_bad_bounds() -> None:
    with pytest.raises(ValueError, match="entries=0"):
        GraphCache(max_entries=0)


def test_long_strings_count_against_the_memory_bound() -> None:
    """Found by review: a 1 MB kind per task and a 0.5 MB run key were not in the estimate, so the byte
    bound held 430 MiB of graphs as a few hundred KiB."""
    big = RunGraph("r" * 500_000, tuple(TaskNode(f"t{i}", kind="k" * 100_000, pool="p" * 1000) for i in range(3)), ())
    assert estimate_bytes(big) >= 500_000 + 3 * 101_000
    cache = GraphCache(max_bytes=1_000_000)
    cache.put(big)
    cache.put(RunGraph("other", big.tasks, ()))
    assert cache.bytes <= 1_000_000 and len(cache) == 1
