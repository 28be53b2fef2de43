"""A bounded least-recently-used map: the one eviction rule behind every cache of the policy side
(graph views and run features by digest, GNN run embeddings, GNN pool parts)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``size`` entries; :meth:`get` refreshes an entry, :meth:`put` evicts the oldest."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"LRU size must be >= 1, got {size!r}")
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return hit

    def put(self, key: K, value: V) -> V:
        self._entries[key] = value
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def discard(self, key: K) -> None:
        """Forget ``key`` if present."""
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries
