"""The server's between-batch garbage collection: collect what is new, freeze the survivors."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from policy.config import ConfigError, ServerConfig
from policy.server import PolicyServer


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture()
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_collect_then_freeze_keeps_survivors_out_of_later_scans(unfrozen: None) -> None:
    server = PolicyServer(ServerConfig(gc_freeze_s=1.0, gc_full_s=0))
    kept = Cycle()  # reachable: survives, then is frozen
    garbage = weakref.ref(Cycle())  # unreachable at once: only a collection frees it
    assert garbage() is not None
    server._collect_and_freeze(now=0.0)
    assert garbage() is None  # collected before the freeze
    assert gc.get_freeze_count() > 0 and not any(o is kept for o in gc.get_objects())
    assert server._next_freeze == 1.0
    assert server.metrics.gc_pause._sum.get() > 0  # type: ignore[attr-defined]


def test_a_cycle_among_frozen_objects_waits_for_the_full_collection(unfrozen: None) -> None:
    server = PolicyServer(ServerConfig(gc_freeze_s=1.0, gc_full_s=60.0))
    cycle = Cycle()
    server._collect_and_freeze(now=0.0)  # reachable now: frozen
    ref = weakref.ref(cycle)
    del cycle  # garbage, but frozen: the next freeze's collection does not see it
    server._collect_and_freeze(now=1.0)
    assert ref() is not None
    due = server._next_full_gc
    server._collect_and_freeze(now=due)  # unfreezes everything, collects it all, freezes again
    assert ref() is None
    assert server._next_full_gc == due + 60.0


def test_gc_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match="gc_freeze_s"):
        ServerConfig(gc_freeze_s=-1)
    with pytest.raises(ConfigError, match="gc_full_s"):
        ServerConfig(gc_full_s=-1)
