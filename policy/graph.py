"""Static analysis of one run's task graph: topological order, children, critical-path ranks.

Computed once per :class:`~policy.schema.RunGraph` and cached by digest (graphs are immutable),
so per-decision work is a lookup. Pure Python: the executor uses it for its fallback placement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from policy.errors import SchemaError
from policy.lru import LRU
from policy.schema import RunGraph


@dataclass(frozen=True)
class GraphView:
    """Derived structure of a :class:`RunGraph`.

    ``rank[i]`` is the upward rank of task ``i``: its expected duration plus the longest path of
    expected durations below it (HEFT's rank_u at speed 1.0), so ``max(rank)`` is the critical path.
    """

    graph: RunGraph
    order: tuple[int, ...]
    parents: tuple[tuple[int, ...], ...]
    children: tuple[tuple[int, ...], ...]
    rank: tuple[float, ...]
    index: dict[str, int]

    @property
    def critical_path_s(self) -> float:
        return max(self.rank, default=0.0)

    @property
    def total_work_s(self) -> float:
        return sum(t.duration_s for t in self.graph.tasks)


def check_dag(graph: RunGraph) -> None:
    """Raise :class:`SchemaError` when ``graph`` has a cycle (its view is built, not kept)."""
    _build(graph)


def _build(graph: RunGraph) -> GraphView:
    n = len(graph.tasks)
    parents: list[list[int]] = [[] for _ in range(n)]
    children: list[list[int]] = [[] for _ in range(n)]
    for p, c in graph.edges:
        parents[c].append(p)
        children[p].append(c)
    indeg = [len(ps) for ps in parents]
    order = [i for i in range(n) if indeg[i] == 0]
    head = 0
    while head < len(order):
        i = order[head]
        head += 1
        for c in children[i]:
            indeg[c] -= 1
            if indeg[c] == 0:
                order.append(c)
    if len(order) != n:
        raise SchemaError(f"run {graph.run_key!r}: the task graph has a cycle")
    rank = [0.0] * n
    for i in reversed(order):
        below = max((rank[c] for c in children[i]), default=0.0)
        rank[i] = graph.tasks[i].duration_s + below
    return GraphView(
        graph=graph,
        order=tuple(order),
        parents=tuple(tuple(p) for p in parents),
        children=tuple(tuple(c) for c in children),
        rank=tuple(rank),
        index=graph.index(),
    )


T = TypeVar("T")


class GraphMemo(Generic[T]):
    """Something derived from a run graph, memoised by ``(run_key, digest)`` with LRU eviction
    (graphs are immutable, so the digest identifies the content)."""

    def __init__(self, build: Callable[[RunGraph], T], size: int) -> None:
        self._build = build
        self._entries: LRU[tuple[str, str], T] = LRU(size)

    def __call__(self, graph: RunGraph) -> T:
        key = (graph.run_key, graph.digest)
        hit = self._entries.get(key)
        return hit if hit is not None else self._entries.put(key, self._build(graph))

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._entries

    def discard(self, key: tuple[str, str]) -> None:
        """Forget the ``(run_key, digest)`` entry (the server's graph cache dropped that graph)."""
        self._entries.discard(key)


#: The :class:`GraphView` of a graph, cached.
view: GraphMemo[GraphView] = GraphMemo(_build, 4096)
