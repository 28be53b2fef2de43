"""The bounded LRU map behind the policy side's caches (policy/lru.py)."""

from __future__ import annotations

import pytest

from policy.lru import LRU


def test_evicts_the_least_recently_used() -> None:
    lru: LRU[str, int] = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # refreshes a: b is now the oldest
    lru.put("c", 3)
    assert lru.get("b") is None and lru.get("a") == 1 and lru.get("c") == 3
    assert len(lru) == 2
    lru.clear()
    assert len(lru) == 0 and lru.get("a") is None
    with pytest.raises(ValueError, match="size"):
        LRU(0)
