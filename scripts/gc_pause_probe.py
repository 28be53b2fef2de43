"""The policy server's latency with DAG runs turning over, with and without its between-batch
collect-and-freeze (``gc_freeze_s``), in one process without Redis (docs/server.md).

    python scripts/gc_pause_probe.py --registry DIR [--requests 40000] [--skip 30000]
        [--new-run-every 20] [--freeze-s 0 1.0]

For each ``--freeze-s`` value: a fresh :class:`~policy.server.PolicyServer` (GNN from the
registry, CPU, default graph cache) handles ``--requests`` single-request batches of 16 ready
tasks of a 200-task run, a new run (its full graph) every ``--new-run-every`` requests and a
reference to the current one otherwise, and runs its between-batch collection when due, as
``serve_forever`` does. Prints p50 / p99 / p99.9 / max milliseconds of (the between-batch work +
``handle``) over the requests after ``--skip`` (once the graph cache is full: 256 MiB of
estimated run cost is ~1,400 runs of 200 tasks), how many took over 20 ms, and how many objects
the garbage collector scans at the end (made since start-up, or since the last freeze).
"""

from __future__ import annotations

import argparse
import gc
import time
import uuid

import numpy as np

from policy.bench import DEFAULT_CATALOGUE, layered_dag
from policy.catalogue import load_catalogue
from policy.config import ServerConfig
from policy.schema import PlacementRequest, ReadyTask, RunEntry, RunGraph, RunRef, dumps
from policy.server import PolicyServer


def measure(registry: str, freeze_s: float, requests: int, skip: int, every: int, seed: int) -> str:
    server = PolicyServer(ServerConfig(placer="gnn", registry=registry, device="cpu", gc_freeze_s=freeze_s))
    catalogue = load_catalogue(str(DEFAULT_CATALOGUE))
    rng = np.random.default_rng(seed)
    base = layered_dag(200, "probe", rng)
    payloads: list[bytes] = []
    graph = base
    for k in range(requests):
        run: RunEntry
        if k % every == 0:
            graph = RunGraph(run_key=f"probe/{k // every}", tasks=base.tasks, edges=base.edges, digest=base.digest)
            run = graph
        else:
            run = RunRef(graph.run_key, graph.digest)
        picks = rng.choice(len(base.tasks), 16, replace=False)
        payloads.append(dumps(PlacementRequest(
            request_id=uuid.uuid4().hex, pools=catalogue.states(), runs=(run,), deadline_ms=60_000,
            created_at=time.time() + 3600,  # never late, however long the probe runs
            ready=tuple(ReadyTask(graph.run_key, base.tasks[int(i)].task_id) for i in picks))))
    gc.collect()
    gc.freeze()  # as serve_forever does at start
    ms: list[float] = []
    for raw in payloads:
        t0 = time.perf_counter()
        server._collect_and_freeze(time.monotonic())  # between batches, when due, as serve_forever
        jobs = server.handle([(b"0-0", {b"payload": raw})])
        ms.append((time.perf_counter() - t0) * 1e3)
        reply = jobs[0].reply
        if reply is None or not reply.ok:
            raise SystemExit(f"request failed: {reply}")
    tracked = len(gc.get_objects())  # objects the collector scans (frozen ones left out)
    gc.unfreeze()
    a = np.array(ms[skip:])
    return (f"gc_freeze_s={freeze_s:g}: {requests} requests, cache {len(server.cache)} runs; over the last {len(a)}: "
            f"p50 {np.percentile(a, 50):.2f} p99 {np.percentile(a, 99):.2f} p99.9 {np.percentile(a, 99.9):.1f} "
            f"max {a.max():.1f} ms, {(a > 20).sum()} over 20 ms; {tracked:,} objects left to scan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--registry", required=True, help="model registry naming the checkpoint")
    ap.add_argument("--requests", type=int, default=40_000)
    ap.add_argument("--skip", type=int, default=30_000, help="requests left out while the cache fills")
    ap.add_argument("--new-run-every", type=int, default=20)
    ap.add_argument("--freeze-s", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for f in args.freeze_s:
        print(measure(args.registry, f, args.requests, args.skip, args.new_run_every, args.seed), flush=True)


if __name__ == "__main__":
    main()
