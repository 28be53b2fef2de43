"""Tiny hand-made placement requests shared by the GNN policy tests (issue 4)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from policy.catalogue import load_catalogue
from policy.schema import PlacementRequest, ReadyTask, RunGraph, RunProgress, TaskNode

ROOT = Path(__file__).resolve().parents[2]
GPU_CATALOGUE = ROOT / "policy" / "catalogues" / "gpu-affinity.yaml"


def diamond() -> RunGraph:
    """a -> (b, c) -> d, with c a GPU training task."""
    tasks = (
        TaskNode("a", duration_s=10.0),
        TaskNode("b", duration_s=20.0),
        TaskNode("c", duration_s=80.0, kind="gpu_train", gpus=1.0),
        TaskNode("d", duration_s=5.0),
    )
    return RunGraph("dag/diamond", tasks, ((0, 1), (0, 2), (1, 3), (2, 3)))


def random_dag(n: int, seed: int = 0, run_key: str = "dag/random") -> RunGraph:
    rng = np.random.default_rng(seed)
    tasks = tuple(
        TaskNode(
            f"t{i}",
            duration_s=float(rng.uniform(5, 100)),
            kind="gpu_train" if i % 7 == 0 else "default",
        )
        for i in range(n)
    )
    edges = tuple(
        (int(p), j) for j in range(1, n) for p in rng.choice(j, size=min(j, 2), replace=False)
    )
    return RunGraph(run_key, tasks, edges)


def diamond_request(busy_gpu: int = 0) -> tuple[PlacementRequest, dict[str, RunGraph]]:
    """b and c ready (a finished), on the GPU-affinity cluster."""
    g = diamond()
    pools = load_catalogue(GPU_CATALOGUE).states()
    pools = tuple(p if p.name != "gpu" else type(p)(**{**p.__dict__, "busy": busy_gpu}) for p in pools)
    req = PlacementRequest(
        "req-1",
        ready=(ReadyTask(g.run_key, "b"), ReadyTask(g.run_key, "c")),
        pools=pools,
        runs=(g,),
        progress=(RunProgress(g.run_key, finished=("a",), age_s=12.0),),
    )
    return req, {g.run_key: g}


def big_request(n: int = 200, ready: int = 16, seed: int = 0) -> tuple[PlacementRequest, dict[str, RunGraph]]:
    g = random_dag(n, seed)
    req = PlacementRequest(
        "req-big",
        ready=tuple(ReadyTask(g.run_key, f"t{i}") for i in range(ready)),
        pools=load_catalogue(GPU_CATALOGUE).states(),
        runs=(g,),
        progress=(RunProgress(g.run_key),),
    )
    return req, {g.run_key: g}


def mixed_requests(seed: int = 0) -> list[tuple[PlacementRequest, dict[str, RunGraph]]]:
    """Requests of different shapes for the batched decoder: sizes 4 to 1,000 tasks, 0 to 64
    ready rows, two runs in one request, pinned tasks, a task no pool can hold, a pool down,
    busy pools (so stop is allowed), and a request with fewer pools than the others."""
    rng = np.random.default_rng(seed)
    pools = load_catalogue(GPU_CATALOGUE).states()
    busy = tuple(replace(p, busy=p.slots, queued=int(rng.integers(0, 6))) for p in pools)
    # what a ledger knows (feature schema 3): expected finish times, and room to grow on the first
    busy = tuple(replace(p, free_at=tuple(np.sort(rng.random(p.busy + p.queued) * 300.0).tolist()),
                         max_slots=p.slots + 2 if j == 0 else None, boot_s=45.0) for j, p in enumerate(busy))
    out = [diamond_request(), diamond_request(busy_gpu=2)]
    for k, (n, ready, pool_set) in enumerate(
        [(200, 16, pools), (60, 12, busy), (1000, 64, busy), (30, 3, pools[:2]), (120, 40, busy),
         (50, 1, busy), (80, 20, (replace(busy[0], up=False), *busy[1:]))]
    ):
        g = random_dag(n, seed + k, run_key=f"dag/mixed-{k}")
        tasks = list(g.tasks)
        tasks[1] = replace(tasks[1], pool=pool_set[-1].name)  # pinned
        tasks[2] = replace(tasks[2], cpus=1e4)  # no pool can hold it
        g = RunGraph(g.run_key, tuple(tasks), g.edges)
        picks = rng.choice(n, size=ready, replace=False)
        picks[: min(ready, 2)] = [1, 2][: min(ready, 2)]
        req = PlacementRequest(
            f"req-mixed-{k}",
            ready=tuple(ReadyTask(g.run_key, f"t{i}") for i in picks),
            pools=pool_set,
            runs=(g,),
            progress=(RunProgress(g.run_key, age_s=float(10 * k)),),
        )
        out.append((req, {g.run_key: g}))
    # two runs in one request, and a request with no ready task
    (r1, g1), (r2, g2) = out[2], out[3]
    out.append((replace(r1, request_id="req-two-runs", ready=r1.ready[:5] + r2.ready[:5],
                        pools=r2.pools, runs=r1.runs + r2.runs), {**g1, **g2}))
    out.append((replace(r1, request_id="req-empty", ready=()), g1))
    return out
