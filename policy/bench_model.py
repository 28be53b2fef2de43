"""Inference latency of the GNN policy on one CPU core (issue 4's 2 ms goal), model only.

    python -m policy.bench_model [--checkpoint policy/checkpoints/default] [--tasks 200] [--ready 16]
        [--batch 8 64] [--device auto]

Prints the figures and a JSON line. Three numbers per setting, median over ``--repeat`` calls:

* ``forward_ms``: one forward pass of the model over a decision batch (task encoder over the
  whole run, pool encoder, all (ready task, pool) logits): "model only" (an ensemble's: one
  pass of its fused model, :func:`policy.model.fuse_models`, as the placer runs it).
* ``place_ms``: :meth:`GNNPlacer.place` with the run's embeddings cached (the steady state of a
  server: a run's graph is encoded once), featurization, sequential decode and reason strings.
* ``place_cold_ms``: the same with the embedding cache cleared (first request of a run).

With ``--batch S``, also :meth:`GNNPlacer.place_many` over ``S`` requests of ``S`` different runs
(embeddings cached), as the server calls it for a micro-batch: ``batch_ms`` per call and
``rows_per_s`` (ready rows decided per second, placed or held). Issue 5's server figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch

from policy.catalogue import load_catalogue
from policy.features import featurize
from policy.gnn import GNNPlacer
from policy.model import ModelConfig, PlacementGNN, collate
from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, RunProgress, TaskNode


def synthetic_run(n: int, seed: int) -> RunGraph:
    """A random layered DAG of ``n`` tasks (each task has up to 2 parents), 1 in 7 a GPU task."""
    rng = np.random.default_rng(seed)
    tasks = tuple(
        TaskNode(f"t{i}", duration_s=float(rng.uniform(5, 100)),
                 kind="gpu_train" if i % 7 == 0 else "default")
        for i in range(n)
    )
    edges = tuple((int(p), j) for j in range(1, n) for p in rng.choice(j, size=min(j, 2), replace=False))
    return RunGraph(f"bench/run-{n}", tasks, edges)


def _median_ms(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(max(3, repeat // 10)):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _bench_one(placer: GNNPlacer, pools: tuple[PoolState, ...], n: int, ready: int,
               repeat: int) -> dict[str, object]:
    g = synthetic_run(n, seed=n)
    req = PlacementRequest("bench", ready=tuple(ReadyTask(g.run_key, f"t{i}") for i in range(ready)),
                           pools=pools, runs=(g,), progress=(RunProgress(g.run_key),))
    graphs = {g.run_key: g}
    dec = placer.decode(req, graphs)
    bt = collate([featurize(req, graphs, assigned=dec.actions.tolist(), boot_floor=placer.boot_floor)], placer.device)

    def forward() -> None:
        with torch.inference_mode():
            placer.net(bt)  # an ensemble's fused model: every member in one pass
        if placer.device.type == "cuda":
            torch.cuda.synchronize(placer.device)  # time the work, not its launch

    def cold() -> None:
        placer.clear_embeddings()  # not clear_cache: an ensemble's would be fused again
        placer.place(req, graphs)

    return {
        "tasks": n,
        "ready": ready,
        "pools": len(pools),
        "policy_version": placer.version,
        "device": str(placer.device),
        "forward_ms": round(_median_ms(forward, repeat), 3),
        "place_ms": round(_median_ms(lambda: placer.place(req, graphs), repeat), 3),
        "place_cold_ms": round(_median_ms(cold, repeat), 3),
    }


def _bench_batch(placer: GNNPlacer, pools: tuple[PoolState, ...], n: int, ready: int, size: int,
                 repeat: int) -> dict[str, object]:
    runs = [synthetic_run(n, seed=n + k) for k in range(size)]
    runs = [RunGraph(f"{g.run_key}/{k}", g.tasks, g.edges) for k, g in enumerate(runs)]
    reqs = [PlacementRequest(f"bench-{k}", ready=tuple(ReadyTask(g.run_key, f"t{i}") for i in range(ready)),
                             pools=pools, runs=(g,), progress=(RunProgress(g.run_key),))
            for k, g in enumerate(runs)]
    graphs = [{g.run_key: g} for g in runs]
    ms = _median_ms(lambda: placer.place_many(reqs, graphs), repeat)
    return {"tasks": n, "ready": ready, "batch": size, "pools": len(pools), "device": str(placer.device),
            "backend": placer.batch_backend or "auto", "policy_version": placer.version, "batch_ms": round(ms, 3),
            "rows_per_s": round(size * ready / ms * 1e3, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m policy.bench_model", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory (default: untrained model)")
    parser.add_argument("--catalogue", default="policy/catalogues/gpu-affinity.yaml")
    parser.add_argument("--tasks", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--ready", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1 core)")
    parser.add_argument("--batch", type=int, nargs="*", default=[],
                        help="also time place_many over this many requests (e.g. 8 64)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto (cuda when available)")
    parser.add_argument("--backend", choices=["numpy", "torch"], default=None,
                        help="force place_many's decoding steps onto numpy (host) or torch (device) "
                             "arrays (default: by batch size, policy.batch_decoder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.checkpoint:
        placer = GNNPlacer.from_checkpoint(args.checkpoint, device=device)
    else:
        torch.manual_seed(0)
        placer = GNNPlacer(PlacementGNN(ModelConfig()), device=device)
    placer.batch_backend = args.backend
    pools = load_catalogue(args.catalogue).states()
    results = []
    for n in args.tasks:
        row = _bench_one(placer, pools, n, args.ready, args.repeat)
        row["threads"] = args.threads
        results.append(row)
        print(f"{n:>6} tasks, {args.ready} ready, {len(pools)} pools, {args.threads} thread(s): "
              f"forward {row['forward_ms']:.3f} ms | place (cached run) {row['place_ms']:.3f} ms | "
              f"place (cold run) {row['place_cold_ms']:.3f} ms (median of {args.repeat})")
        for size in args.batch:
            b = _bench_batch(placer, pools, n, args.ready, size, max(10, args.repeat // 10))
            results.append(b)
            print(f"{n:>6} tasks, {args.ready} ready, batch of {size} on {device}: place_many "
                  f"{b['batch_ms']:.3f} ms, {b['rows_per_s']:.0f} rows/s")
    print(json.dumps({"bench": "policy.bench_model", "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
