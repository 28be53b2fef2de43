"""Tiny hand-made placement requests shared by the GNN policy tests (issue 4)."""

from __future__ import annotations

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
