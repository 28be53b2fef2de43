"""The server's per-run graph cache: a DAG run's task graph is sent once, later requests refer to it.

Entries are keyed by ``(run_key, digest)`` (a run whose graph changed gets a new digest and a new
entry), live ``ttl_s`` seconds after their last use, and are evicted least recently used first
when the cache holds more than ``max_entries`` graphs or more than ``max_bytes`` of estimated
size. What the server derives from a graph (its :class:`~policy.graph.GraphView`, the GNN's
run features and node embeddings) is memoised elsewhere by the same key; ``on_drop`` is called
with the key of every entry evicted or expired, so the server forgets those too and the byte
bound holds for everything a cached run costs (:func:`estimate_bytes` counts it all).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from policy.schema import RunGraph


def estimate_bytes(graph: RunGraph) -> int:
    """A cheap estimate of the memory one cached run costs a GNN server: the parsed graph, its
    :class:`~policy.graph.GraphView`, its run features and node embeddings (objects, not JSON).
    Calibrated against tracemalloc on layered graphs of 50 to 1,000 tasks (~2 edges per task,
    7-character task ids; 178 KiB measured at 200 tasks), chains, and runs of up to 64 parents
    a task (~720 bytes a task, ~140 an edge); ``tests/policy/test_graph_cache.py`` keeps it
    within 0.8-1.25 x of what is measured. The embeddings counted are one model's: an ensemble's
    members add ~128 bytes a task each (a 2-model default: ~15% more than this at 2 edges a task)."""
    # every string counts (found by review: a 1 MB kind or run key per task was not counted, and
    # the cache's byte bound held a few hundred KiB of estimate for 430 MiB); an edge costs ~140
    # bytes (found by review: 80 put runs of 64 parents a task at 0.6 x their cost)
    return (1024 + len(graph.run_key) + 140 * len(graph.edges)
            + sum(720 + len(t.task_id) + len(t.kind) + len(t.pool or "") for t in graph.tasks))


@dataclass
class CachedGraph:
    graph: RunGraph
    size: int
    expires_at: float


class GraphCache:
    """LRU + TTL cache of :class:`RunGraph` by ``(run_key, digest)``; not thread-safe."""

    def __init__(
        self,
        *,
        max_entries: int = 4096,
        max_bytes: int = 256 * 1024 * 1024,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        on_drop: Callable[[tuple[str, str]], None] | None = None,
    ) -> None:
        if max_entries < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError(
                f"graph cache bounds must be positive: entries={max_entries} bytes={max_bytes} ttl={ttl_s}"
            )
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._on_drop = on_drop
        self._entries: OrderedDict[tuple[str, str], CachedGraph] = OrderedDict()
        self._latest: dict[str, str] = {}
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return self.get(*key) is not None

    def holds(self, key: tuple[str, str]) -> bool:
        """Whether ``key`` has an entry (expired or not), without using it (``in`` refreshes it)."""
        return key in self._entries

    def put(self, graph: RunGraph) -> CachedGraph:
        """Insert (or refresh) ``graph``; returns its entry."""
        key = (graph.run_key, graph.digest)
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None:
            entry.expires_at = now + self.ttl_s
            self._entries.move_to_end(key)
        else:
            entry = CachedGraph(graph=graph, size=estimate_bytes(graph), expires_at=now + self.ttl_s)
            self._entries[key] = entry
            self.bytes += entry.size
        self._latest[graph.run_key] = graph.digest
        self._evict(now)
        return entry

    def get(self, run_key: str, digest: str | None = None) -> CachedGraph | None:
        """The entry of ``run_key`` at ``digest`` (None: the latest one sent), or None if absent."""
        if digest is None:
            digest = self._latest.get(run_key)
            if digest is None:
                return None
        key = (run_key, digest)
        entry = self._entries.get(key)
        if entry is None:
            return None
        now = self._clock()
        if entry.expires_at <= now:
            self._drop(key)
            return None
        entry.expires_at = now + self.ttl_s
        self._entries.move_to_end(key)
        return entry

    def expire(self) -> int:
        """Drop every expired entry now; returns how many."""
        now = self._clock()
        dead = [k for k, e in self._entries.items() if e.expires_at <= now]
        for k in dead:
            self._drop(k)
        return len(dead)

    def _evict(self, now: float) -> None:
        # Oldest-used first; an expired head goes regardless of the bounds.
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            over = len(self._entries) > self.max_entries or self.bytes > self.max_bytes
            if not over and entry.expires_at > now:
                break
            if len(self._entries) == 1 and not entry.expires_at <= now:
                break  # never evict the graph just inserted, even when it alone exceeds max_bytes
            self._drop(key)
            self.evictions += 1

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.size
        if self._latest.get(key[0]) == key[1]:
            del self._latest[key[0]]
        if self._on_drop is not None:
            self._on_drop(key)
