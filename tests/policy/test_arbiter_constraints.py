"""The arbiter and the fallback heuristic under review: the breaker's count, sampling, hard
constraints when a pin cannot be honoured.

Each test failed on the code before its fix; its docstring says what an operator saw.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Mapping

import pytest
from test_arbiter import POOLS

from policy.arbiter import Arbiter, ArbiterConfig
from policy.placement import EarliestFinishPlacer
from policy.schema import (
    Decision,
    PlacementRequest,
    PoolState,
    ReadyTask,
    RunGraph,
    TaskNode,
)

GRAPH = RunGraph(
    run_key="r",
    tasks=(*(TaskNode(f"t{i}") for i in range(6)), TaskNode("heavy", cpus=8, memory_gb=32)),
    edges=(),
)


def req(*task_ids: str, pools: tuple[PoolState, ...] = POOLS, graph: RunGraph = GRAPH) -> PlacementRequest:
    return PlacementRequest(request_id="q", ready=tuple(ReadyTask(graph.run_key, t) for t in task_ids),
                            pools=pools, runs=(graph,))


class Fixed:
    """A placer that always answers ``pool``."""

    name = "fixed"
    version = "1"

    def __init__(self, pool: str) -> None:
        self.pool = pool

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        return [Decision(r.run_key, r.task_id, self.pool, "?", 1.0, "fixed") for r in request.ready]


class Scored(Fixed):
    """A scoring placer with the same logits for every ready task."""

    def __init__(self, scores: Mapping[str, float]) -> None:
        super().__init__("big")
        self.scores = dict(scores)

    def pool_scores(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Mapping[str, float]]:
        return [dict(self.scores) for _ in request.ready]


def arbiter(**kw: float) -> tuple[Arbiter, Counter[str]]:
    seen: Counter[str] = Counter()
    a = Arbiter(ArbiterConfig(**kw), on_fallback=lambda reason, n: seen.update({reason: n}))  # type: ignore[arg-type]
    return a, seen


# --- arbiter -------------------------------------------------------------------------------------


def test_breaker_places_only_the_next_n_decisions_by_the_fallback() -> None:
    """The breaker is documented as "the next ``skew_fallback_n`` decisions are made by the
    fallback heuristic" (arbiter.py docstring, docs/server.md). An operator with
    ``--skew-fallback-n 2`` whose executor sends a batch of 5 ready tasks when the breaker trips
    sees all 5 placed by the heuristic, ``drl_policy_fallbacks_total{reason="load_skew"}`` go up by
    5, and each of the 5 reasons say "eft for 2 more decisions". Expected: exactly 2 decisions (in
    ready order) by the fallback, counted as 2; the other 3 are the placer's."""
    skewed = (replace(POOLS[0], busy=4, queued=3), POOLS[1], POOLS[2])
    a, seen = arbiter(skew_threshold=0.5, skew_fallback_n=2)
    out = a.decide(Fixed("big"), req("t0", "t1", "t2", "t3", "t4", pools=skewed), {"r": GRAPH})
    assert len(out) == 5
    by_breaker = [d.task_id for d in out if "load-skew breaker" in d.reason]
    assert by_breaker == ["t0", "t1"], [d.reason for d in out]
    assert [d.reason for d in out[2:]] == ["fixed"] * 3
    assert seen == {"load_skew": 2}
    assert a.breaker_left == 0


def test_sampling_replaces_a_proposal_of_only_infeasible_pools_instead_of_dropping_the_task() -> None:
    """With ``--temperature 1`` a scoring placer whose logits for a task name only pools that
    cannot hold it (here: ``small`` for a task asking 8 CPUs) has its proposal silently dropped by
    ``_sample``: the task gets no decision, so the executor keeps it back as if the policy chose
    to wait, offers it again (same result) and only after ``max_wait_s`` places it by its own
    fallback, marked as a policy-server failure. The code's own comment says "_enforce fills it in
    with the fallback", and the greedy path replaces an infeasible proposal with the heuristic's
    decision. Expected: a decision for the task, on a pool that can hold it, from the fallback."""
    a, seen = arbiter(temperature=1.0, seed=0)
    out = a.decide(Scored({"small": 1.0}), req("heavy"), {"r": GRAPH})
    assert [d.task_id for d in out] == ["heavy"], "the task was left without a decision"
    assert out[0].pool in ("big", "gpu") and "eft:" in out[0].reason


def test_a_tiny_positive_temperature_is_near_greedy_not_a_placer_failure() -> None:
    """``ServerConfig`` accepts any temperature >= 0; a very small one (here 1e-310, a subnormal)
    should behave like greedy. ``_sample`` divides the logits by the temperature before it
    subtracts their maximum, so they overflow to inf, ``inf - inf`` is NaN, ``rng.choice`` raises
    "Probabilities contain NaN" and every request is answered by the heuristic (here: big) with the reason
    "fixed failed (ValueError: ...)", counted as placer_error. Expected: the highest-scored
    feasible pool (gpu), no fallback."""
    a, seen = arbiter(temperature=1e-310, seed=0)
    out = a.decide(Scored({"small": 0.0, "big": 0.5, "gpu": 1.0}), req("t0"), {"r": GRAPH})
    assert [d.pool for d in out] == ["gpu"], out[0].reason
    assert "failed" not in out[0].reason and not seen


# A task pinned to a pool that cannot hold it (or to no pool of the request), and memory-bound:
# "wide" has the most CPUs but too little memory, "deep" has the memory.
WIDE = PoolState("wide", "w", slots=4, cpus=32, memory_gb=16)
DEEP = PoolState("deep", "d", slots=4, cpus=4, memory_gb=128)
PIN_POOLS = (POOLS[0], WIDE, DEEP)
PIN_GRAPH = RunGraph("p", (TaskNode("onsmall", cpus=1, memory_gb=100, pool="small"),
                           TaskNode("nowhere", cpus=1, memory_gb=100, pool="nowhere")), ())


@pytest.mark.parametrize("task_id", ["onsmall", "nowhere"])
def test_heuristic_places_a_task_off_an_unhonourable_pin_on_a_pool_that_can_hold_it(task_id: str) -> None:
    """A task asking 100 GB pinned to a pool too small for it (or to a pool not in the catalogue)
    is "placed off its pin", as the reason says. ``EarliestFinishPlacer`` then takes "the largest
    live pool" by (cpus, memory, gpus) and sends it to ``wide`` (32 CPUs, 16 GB): the operator sees
    the task OOM on a box that cannot hold it, with a reason implying it went where it fits, while
    ``deep`` (128 GB) could run it. Expected: ``deep``, the only pool whose resources fit."""
    request = req(task_id, pools=PIN_POOLS, graph=PIN_GRAPH)
    (d,) = EarliestFinishPlacer().place(request, {"p": PIN_GRAPH})
    assert d.pool == "deep", d.reason
    assert "placed off its pin" in d.reason


def test_arbiter_refuses_a_pool_that_cannot_hold_a_task_whose_pin_cannot_be_honoured() -> None:
    """The arbiter must refuse a decision on a pool that "cannot hold the task (resources)".
    For a pinned task no pool is ``feasible`` (the pin fails every other pool), so ``violation``
    accepts any live pool, as if nothing could hold the task: a model sending a 100 GB task to a
    16 GB pool passes unchallenged while a 128 GB pool exists. Expected: the decision is replaced
    by the heuristic's, on ``deep``, and counted as infeasible."""
    a, seen = arbiter()
    out = a.decide(Fixed("wide"), req("onsmall", pools=PIN_POOLS, graph=PIN_GRAPH), {"p": PIN_GRAPH})
    assert [d.pool for d in out] == ["deep"], out[0].reason
    assert "cannot hold" in out[0].reason
    assert seen == {"infeasible": 1}
