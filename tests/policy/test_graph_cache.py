"""The per-run graph cache: keys, TTL, entry and memory bounds."""

from __future__ import annotations

import pytest
from server_helpers import request

from policy.config import ServerConfig
from policy.features import run_features
from policy.graph import view
from policy.graph_cache import GraphCache, estimate_bytes
from policy.schema import RunGraph, TaskNode, dumps


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


def dense(n: int, k: int, run_key: str) -> RunGraph:
    """Every task's ``k`` predecessors are its parents (the schema allows 64 edges a task)."""
    tasks = tuple(TaskNode(task_id=f"t{i:06d}", duration_s=1.0 + i % 7) for i in range(n))
    return RunGraph(run_key, tasks, tuple((p, i) for i in range(1, n) for p in range(max(0, i - k), i)))


@pytest.mark.parametrize(("n", "parents"), [(50, 0), (200, 0), (1000, 0), (1000, 16), (1000, 64)])
def test_estimate_covers_what_a_cached_run_costs(n: int, parents: int) -> None:
    """The byte bound is only a bound if the estimate is near what a run really holds in a GNN
    server: the graph parsed from JSON, its view, its run features and its node embeddings
    (hidden 32, float32: torch's memory is not traced, so counted from the shape). Layered runs
    (``parents`` 0) and runs of 16 or 64 parents a task (found by review: an edge was counted at 80
    bytes for ~140, so those runs were estimated at 0.6-0.7 x their cost)."""
    import json
    import tracemalloc

    runs = 20 if not parents else 3
    blob = json.dumps((dense(n, parents, "r") if parents else layered(n, "r")).to_json())
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


# --- found by review (2026-12-06): what a dropped run leaves behind ---


def gnn_placer(members: int = 0):  # type: ignore[no-untyped-def]
    import torch

    from policy.gnn import GNNPlacer
    from policy.model import ModelConfig, PlacementGNN

    torch.manual_seed(0)
    placer = GNNPlacer(PlacementGNN(ModelConfig()), step_kernel="numpy")
    if members:
        placer.with_members([(f"m{i}", PlacementGNN(ModelConfig())) for i in range(members)])
    return placer


def _entry(i: int, g: RunGraph) -> tuple[bytes, dict[bytes, bytes]]:
    return (f"{i}-0".encode(), {b"payload": dumps(request([g], [(g.run_key, "t000000")]))})


def test_a_graph_evicted_during_a_batch_leaves_its_derived_state_behind() -> None:
    """The cache drops a graph (and the server its view, run features and embeddings) while the
    batch that uses it is still being resolved; the placer then decides the batch and rebuilds all
    three for the dropped run, and nothing ever drops them again (``on_drop`` has fired). Whenever
    a batch (or one request) carries more runs than the cache's bounds admit, their derived state
    escapes the byte bound and lives on in the memos' own LRUs (4,096 / 1,024 / 512 entries): the
    very leak docs/server.md says was fixed."""
    from policy.server import PolicyServer

    placer = gnn_placer()
    server = PolicyServer(ServerConfig(graph_cache_entries=1), placer=placer)
    a, b = layered(30, "review1/batch/a"), layered(30, "review1/batch/b")
    jobs = server.handle([_entry(1, a), _entry(2, b)])  # one micro-batch of two requests
    assert all(j.reply is not None and j.reply.ok for j in jobs)
    gone = (a.run_key, a.digest)
    assert server.cache.get(*gone) is None  # the cache dropped a: its bound is one graph
    leaked = [name for name, memo in (("view", view), ("run_features", run_features), ("embeddings", placer._embed))
              if gone in memo]
    assert leaked == [], f"derived state of the dropped run {gone} outlives it in: {leaked}"


def test_an_ensembles_members_keep_the_embeddings_of_dropped_runs() -> None:
    """``GNNPlacer.forget_run`` discards the run's embeddings from its own LRU only, not from its
    ensemble members' (``with_members``; the packaged default checkpoint is a two-model ensemble):
    every member keeps the embeddings of each run the cache dropped, up to 512 runs each, beyond
    the byte bound (``clear_cache`` recurses into the members, ``forget_run`` does not)."""
    from policy.server import PolicyServer

    placer = gnn_placer(members=1)
    server = PolicyServer(ServerConfig(graph_cache_entries=1), placer=placer)
    a, b = layered(30, "review1/ensemble/a"), layered(30, "review1/ensemble/b")
    for i, g in enumerate((a, b)):  # one batch each: b's put drops a between batches
        jobs = server.handle([_entry(i + 1, g)])
        assert jobs[0].reply is not None and jobs[0].reply.ok
    gone = (a.run_key, a.digest)
    assert gone not in placer._embed  # the placer's own embeddings were forgotten
    assert gone not in placer.members[0]._embed, "the ensemble member still holds the dropped run's embeddings"


def test_cached_embeddings_keep_their_whole_batchs_tensor_alive() -> None:
    """``GNNPlacer._embeddings_many`` encodes the batch's new runs in one forward and caches each
    run's rows as ``h.split(sizes)``: views that share the batch's storage. A small run cached
    beside a large one keeps the large one's embeddings (GPU memory on a GPU) alive after
    ``forget_run`` dropped it, for as long as the small run stays cached; the byte bound counts
    each run's own rows only."""
    from server_helpers import CATALOGUE

    from policy.schema import PlacementRequest, ReadyTask

    placer = gnn_placer()
    small, large = layered(3, "review1/split/small"), layered(3000, "review1/split/large")
    reqs = [PlacementRequest(request_id=f"r{i}", ready=(ReadyTask(g.run_key, "t000000"),),
                             pools=CATALOGUE.states(), runs=(g,)) for i, g in enumerate((small, large))]
    placer.place_many(reqs, [{small.run_key: small}, {large.run_key: large}])
    placer.forget_run((large.run_key, large.digest))
    hit = placer._embed.get((small.run_key, small.digest))
    assert hit is not None
    h = hit[0]
    own = h.numel() * h.element_size()
    held = h.untyped_storage().nbytes()
    assert held <= 2 * own, f"a 3-task run's cached embeddings hold {held} bytes ({own} its own)"
