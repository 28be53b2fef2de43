"""The arbiter: hard constraints after the model, temperature sampling, the load-skew breaker."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Mapping

import pytest

from policy.arbiter import Arbiter, ArbiterConfig, utilisation_spread
from policy.schema import Decision, PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode

POOLS = (
    PoolState(name="small", vm_class="s", slots=4, cpus=2, memory_gb=8),
    PoolState(name="big", vm_class="b", slots=4, cpus=16, memory_gb=64),
    PoolState(name="gpu", vm_class="g", slots=2, cpus=8, memory_gb=32, gpus=1),
)
GRAPH = RunGraph(
    run_key="r",
    tasks=(
        TaskNode("light", cpus=1),
        TaskNode("heavy", cpus=8, memory_gb=32),
        TaskNode("pinned", pool="gpu"),
        TaskNode("huge", cpus=64),
    ),
    edges=(),
)


def req(*task_ids: str, pools: tuple[PoolState, ...] = POOLS) -> PlacementRequest:
    return PlacementRequest(request_id="q", ready=tuple(ReadyTask("r", t) for t in task_ids), pools=pools,
                            runs=(GRAPH,))


class Fixed:
    """A placer that always answers ``pool`` (or nothing, or raises)."""

    name = "fixed"
    version = "1"

    def __init__(self, pool: str | None, fail: bool = False) -> None:
        self.pool, self.fail = pool, fail

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        if self.fail:
            raise RuntimeError("boom")
        if self.pool is None:
            return []
        return [Decision(r.run_key, r.task_id, self.pool, "?", 1.0, "fixed") for r in request.ready]


class Scored(Fixed):
    def pool_scores(self, request, graphs):  # type: ignore[no-untyped-def]
        return [{"small": 0.0, "big": 1.0, "gpu": 0.5} for _ in request.ready]


def arbiter(**kw: float) -> tuple[Arbiter, Counter[str]]:
    seen: Counter[str] = Counter()
    a = Arbiter(ArbiterConfig(**kw), on_fallback=lambda reason, n: seen.update({reason: n}))  # type: ignore[arg-type]
    return a, seen


def test_accepts_feasible_decisions_unchanged() -> None:
    a, seen = arbiter()
    out = a.decide(Fixed("big"), req("light", "heavy"), {"r": GRAPH})
    assert [d.pool for d in out] == ["big", "big"] and all(d.reason == "fixed" for d in out)
    assert not seen


def test_replaces_decisions_that_break_hard_constraints() -> None:
    a, seen = arbiter()
    out = a.decide(Fixed("small"), req("light", "heavy", "pinned"), {"r": GRAPH})
    assert out[0].pool == "small"
    assert out[1].pool == "big" and "cannot hold cpus=8" in out[1].reason and "eft:" in out[1].reason
    assert out[2].pool == "gpu" and "pinned to gpu" in out[2].reason
    assert seen == {"infeasible": 2}


def test_pool_down_is_refused() -> None:
    a, seen = arbiter()
    pools = (replace(POOLS[0], up=False), *POOLS[1:])
    out = a.decide(Fixed("small"), req("light", pools=pools), {"r": GRAPH})
    assert out[0].pool != "small" and "small is down" in out[0].reason
    assert seen == {"infeasible": 1}


def test_nothing_fits_keeps_a_live_choice() -> None:
    a, seen = arbiter()
    out = a.decide(Fixed("gpu"), req("huge"), {"r": GRAPH})
    assert out[0].pool == "gpu" and not seen


def test_nothing_fits_and_every_pool_down_keeps_the_placers_choice() -> None:
    """was: overruled for being down, replaced by the heuristic's choice of another down pool, and
    counted as an infeasible decision"""
    a, seen = arbiter()
    down = tuple(replace(p, up=False) for p in POOLS)
    out = a.decide(Fixed("small"), req("huge", pools=down), {"r": GRAPH})
    assert out[0].pool == "small" and out[0].reason == "fixed" and not seen


def test_no_decision_means_wait_and_a_failing_placer_falls_back() -> None:
    a, seen = arbiter()
    assert a.decide(Fixed(None), req("light"), {"r": GRAPH}) == []  # late binding: the task waits
    out = a.decide(Fixed("big", fail=True), req("light", "heavy"), {"r": GRAPH})
    assert len(out) == 2 and all("fixed failed (RuntimeError: boom)" in d.reason for d in out)
    assert seen == {"placer_error": 2}


def test_greedy_by_default_and_seeded_sampling_with_temperature() -> None:
    a, _ = arbiter()
    assert a.decide(Scored("small"), req("light"), {"r": GRAPH})[0].reason == "fixed"  # place() used
    runs = []
    for seed in (1, 1):
        s, _ = arbiter(temperature=1.0, seed=seed)
        runs.append([s.decide(Scored("x"), req("light"), {"r": GRAPH})[0].pool for _ in range(20)])
    assert runs[0] == runs[1]  # same seed, same draws
    s, _ = arbiter(temperature=1.0, seed=3)
    draws = Counter(s.decide(Scored("x"), req("light"), {"r": GRAPH})[0].pool for _ in range(300))
    assert set(draws) == {"small", "big", "gpu"} and draws["big"] > draws["small"]
    cold, _ = arbiter(temperature=0.01, seed=3)
    assert {cold.decide(Scored("x"), req("light"), {"r": GRAPH})[0].pool for _ in range(50)} == {"big"}
    # sampling never picks an infeasible pool
    s, _ = arbiter(temperature=5.0, seed=4)
    assert {s.decide(Scored("x"), req("heavy"), {"r": GRAPH})[0].pool for _ in range(100)} <= {"big", "gpu"}


def test_load_skew_breaker_trips_for_n_decisions_and_says_so() -> None:
    full = (replace(POOLS[0], busy=4), replace(POOLS[1], busy=0), POOLS[2])
    a, seen = arbiter(skew_threshold=0.5, skew_fallback_n=3)
    # A full pool beside idle ones, with nothing waiting, is not herding: the placer decides.
    assert a.decide(Fixed("small"), req("light", pools=full), {"r": GRAPH})[0].reason == "fixed"
    skewed = (replace(POOLS[0], busy=4, queued=3), replace(POOLS[1], busy=0), POOLS[2])
    assert utilisation_spread(skewed)[0] == pytest.approx(1.0)
    out = a.decide(Fixed("small"), req("light", "light", pools=skewed), {"r": GRAPH})
    assert all("load-skew breaker: utilisation spread 1.00 > 0.50" in d.reason for d in out)
    assert out[0].pool != "small"  # the heuristic avoids the full pool
    # one decision left: the next request is still covered even though the load is now even
    out = a.decide(Fixed("small"), req("light"), {"r": GRAPH})
    assert "load-skew breaker" in out[0].reason
    out = a.decide(Fixed("small"), req("light"), {"r": GRAPH})
    assert out[0].reason == "fixed"
    assert seen == {"load_skew": 3}


def test_breaker_disabled() -> None:
    skewed = (replace(POOLS[0], busy=4), *POOLS[1:])
    a, seen = arbiter(skew_fallback_n=0)
    assert a.decide(Fixed("big"), req("light", pools=skewed), {"r": GRAPH})[0].reason == "fixed"


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="temperature"):
        ArbiterConfig(temperature=-1)
    with pytest.raises(ValueError, match="skew_threshold"):
        ArbiterConfig(skew_threshold=0)


def test_a_down_pool_is_kept_for_the_tasks_only_it_may_run() -> None:
    a, seen = arbiter()
    pools = (*POOLS[:2], replace(POOLS[2], up=False))
    out = a.decide(Fixed("gpu"), req("pinned", "light", pools=pools), {"r": GRAPH})
    assert out[0].pool == "gpu" and out[0].reason == "fixed", "a pin outlasts its pool's outage"
    assert out[1].pool != "gpu" and "gpu is down" in out[1].reason
    assert seen == {"infeasible": 1}
    # and a placer that moves the pinned task off its down pool is corrected back to it
    out = a.decide(Fixed("big"), req("pinned", pools=pools), {"r": GRAPH})
    assert out[0].pool == "gpu" and "pinned to gpu" in out[0].reason
