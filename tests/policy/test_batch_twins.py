"""The batched decoder (place_many) against the one-request decoder (place) where two pools are
identical: their logits differ in the last bits by how the pool encoder was batched."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gnn_helpers import GPU_CATALOGUE, ROOT, random_dag

from policy.catalogue import load_catalogue
from policy.gnn import GNNPlacer
from policy.schema import Decision, PlacementRequest, ReadyTask, RunGraph, RunProgress

DEFAULT = ROOT / "policy" / "checkpoints" / "default"


def _twin_pool_requests(seed: int, n_req: int = 6) -> list[tuple[PlacementRequest, dict[str, RunGraph]]]:
    """``n_req`` requests on the GPU-affinity catalogue plus a second queue on each VM class
    (``<name>-b``: the same VM class, slots and load, another Celery queue), 10 ready tasks of
    a 40-task run each, the pools' loads drawn per request (seeded)."""
    rng = np.random.default_rng(seed)
    base = load_catalogue(GPU_CATALOGUE).states()
    out = []
    for k in range(n_req):
        loads = [replace(p, busy=int(rng.integers(0, p.slots + 1))) for p in base]
        pools = tuple(loads) + tuple(replace(p, name=p.name + "-b") for p in loads)
        g = random_dag(40, seed=seed * 10 + k, run_key=f"dag/twin-{seed}-{k}")
        picks = rng.choice(40, size=10, replace=False)
        req = PlacementRequest(f"r{k}", tuple(ReadyTask(g.run_key, f"t{i}") for i in picks), pools, runs=(g,),
                               progress=(RunProgress(g.run_key),))
        out.append((req, {g.run_key: g}))
    return out


def _keys(decisions: list[list[Decision]]) -> list[list[tuple[str, str, str, str]]]:
    return [[(d.run_key, d.task_id, d.pool, d.vm_class) for d in x] for x in decisions]


@pytest.mark.parametrize("seed", [0, 1])
def test_two_identical_queues_are_decided_alike_alone_and_batched(seed: int) -> None:
    """Two queues on the same VM class with the same load (``cpu-small`` and ``cpu-small-b``)
    give every task the same features on both, so their logits tie exactly in the model's
    maths; the float32 rounding of the pool encoder (``_pool_parts`` on ``[1, P]`` alone,
    ``decode_greedy``'s ``pool_side`` on ``[k, P]`` batched) makes one twin a few 1e-7 higher,
    and which one depends on the batch. A user sees the same request sent to ``cpu-small`` when
    decided alone (``place``) and to ``cpu-small-b`` when micro-batched with others
    (``place_many``), and the reasons' runner-up flip with it. Expected: ``place_many`` gives
    exactly ``place``'s pools for every request (a pool tie, like a row tie under
    ``TIE_TOLERANCE``, broken by pool order, not by rounding)."""
    items = _twin_pool_requests(seed)
    requests, graphs = [r for r, _ in items], [g for _, g in items]
    alone = GNNPlacer.from_checkpoint(DEFAULT, explain=False)
    single = [alone.place(r, g) for r, g in items]
    assert sum(len(x) for x in single) > 30  # most tasks are sent, so the twins' choice matters
    batched = GNNPlacer.from_checkpoint(DEFAULT, explain=False).place_many(requests, graphs)
    assert _keys(batched) == _keys(single)
    assert [d.score for x in batched for d in x] == pytest.approx([d.score for x in single for d in x], abs=1e-5)
