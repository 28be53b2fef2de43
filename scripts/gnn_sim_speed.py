"""How fast the GNN placer decides inside the simulator: one stream, one thread, one line.

    python scripts/gnn_sim_speed.py --workflows wfcommons:montage:1000:2 --runs 4 --seed 5

Prints the wall time of the simulation, the decisions, the placer's decisions per second
(``SimResult.placer_s``) and the mean JCT, so two commits can be compared on the same stream
(same seed, same decisions expected unless the policy changed).
"""

from __future__ import annotations

import argparse
import time

import torch

from policy.catalogue import load_catalogue
from policy.checkpoint import load_checkpoint
from policy.gnn import GNNPlacer
from trainer.simulator import SimConfig, Simulator
from trainer.train import Args, make_stream, settings_from


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workflows", default="wfcommons:montage:1000:2")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--checkpoint", default="policy/checkpoints/default")
    p.add_argument("--pools", default="policy/catalogues/gpu-affinity.yaml")
    a = p.parse_args()
    torch.set_num_threads(1)
    args = Args()
    args.load, args.duration_noise = 0.85, 0.3
    cat = load_catalogue(a.pools)
    jobs = make_stream(settings_from(a.workflows, 1)[0], cat, a.runs, a.seed, args)
    placer = GNNPlacer(load_checkpoint(a.checkpoint).model, version="speed", seed=0)
    t = time.perf_counter()
    res = Simulator(cat, jobs, placer, seed=a.seed, config=SimConfig(duration_noise=args.duration_noise)).run()
    wall = time.perf_counter() - t
    jct = sum(j.jct_s for j in res.jobs) / max(len(res.jobs), 1)
    print(f"wall {wall:.1f} s, decisions {res.decisions}, requests {res.requests}, "
          f"{res.decisions / max(res.placer_s, 1e-9):.0f} decisions/s in the placer, mean JCT {jct:.1f} s")


if __name__ == "__main__":
    main()
