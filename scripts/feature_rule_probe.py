"""How good is the best list-scheduling rule that can be written over the policy's own features?

    python scripts/feature_rule_probe.py [--hold | --reserve] [--workflows SPEC ...] [--seeds 0 1]

The rule ("feature SRPT+EFT") decodes a request the way :class:`policy.gnn.GNNPlacer` does, one
(task, pool) pair at a time with the pair features recomputed after each choice, but scores the
pairs with a fixed formula instead of the GNN: the run with the least expected work left first
(``log_run_work_left``), each task to its earliest-finish pool (``finish_ratio`` = 0). With
``--hold`` a task whose earliest-finish pool has no free slot is held (``has_free_slot``), as
``srpt+eft`` holds it for its ledger's reserved slot; without it every task is sent. With
``--reserve`` every task is decided, but one given a pool with no free slot is not sent: it
reserves the slot (later choices see the backlog) and waits, as ``srpt+eft`` does (the GNN's
``reserve_busy`` decoding). It sees only
what the GNN sees, so it tells how much of the baselines' edge comes from information the
features do not carry (``srpt+eft`` keeps a ledger of its own sends' expected finish times and
knows the catalogue's growth limits and boot delays). Prints mean JCT per stream against
``srpt+eft`` and the default checkpoint on the same streams (GPU-affinity cluster, load 0.85,
duration noise 0.3, 30 DAG runs per stream).
"""

from __future__ import annotations

import argparse
import glob
from typing import Mapping

import numpy as np

from policy.catalogue import load_catalogue
from policy.features import DYNAMIC_PAIR_COLUMNS, PAIR_FEATURES, READY_FEATURES, PairDynamics, featurize, reserves
from policy.placement import Placer
from policy.schema import Decision, PlacementRequest, RunGraph
from trainer.baselines import make_placer
from trainer.train import Args, make_stream, settings_from, simulate

#: the feature columns the rule reads (the pair ones among the decode-dependent columns)
_WORK_LEFT = READY_FEATURES.index("log_run_work_left")
_FINISH_RATIO = DYNAMIC_PAIR_COLUMNS.index(PAIR_FEATURES.index("finish_ratio"))
_FREE = DYNAMIC_PAIR_COLUMNS.index(PAIR_FEATURES.index("has_free_slot"))


class FeatureRule:
    """The rule of the module docstring as a :class:`~policy.placement.Placer`."""

    name = "feature-srpt+eft"
    version = "probe"

    def __init__(self, hold: bool, reserve: bool = False) -> None:
        self.hold = hold
        self.reserve = reserve

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        if not request.ready:
            return []
        fb = featurize(request, graphs, pairs=False)
        key = fb.ready_x[:, _WORK_LEFT].astype(np.float64)
        remaining = [int(i) for i in fb.order]
        dynamics = PairDynamics(fb.pairs)  # the GNN decoder's backlog-aware pair columns
        idle = not any(p.busy + p.queued for p in fb.pools)
        out: list[Decision] = []
        while remaining:
            rows = np.array(remaining)
            d = dynamics(rows)
            # feasible pools (all of them for a task none can hold) with the earliest finish
            earliest = fb.pairs.ref[rows] & (d[..., _FINISH_RATIO] <= 0.0)
            if self.hold and not (idle and not out):
                earliest &= d[..., _FREE] > 0.5
            # least work left first; rows are in decode order, so argmax breaks ties by critical path
            score = np.where(earliest, -key[rows, None], -np.inf)
            if not np.isfinite(score.max()):
                break  # every remaining task waits for a busy earliest-finish pool
            i, j = np.unravel_index(int(np.argmax(score)), score.shape)
            r, pool = int(rows[i]), fb.pools[j]
            t = fb.ready[r]
            if not (self.reserve and reserves(d[i, j, _FREE] > 0.5, fb.pairs.top[j])):
                out.append(Decision(t.run_key, t.task_id, pool.name, pool.vm_class, reason=self.name))
            dynamics.place(int(j))
            remaining.remove(r)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workflows", action="append", help="a setting (repeat); default: the held-out families")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--hold", action="store_true")
    p.add_argument("--reserve", action="store_true", help="reserve busy pools instead of sending")
    p.add_argument("--checkpoint", default="policy/checkpoints/default")
    a = p.parse_args()
    cat = load_catalogue("policy/catalogues/gpu-affinity.yaml")
    args = Args()
    args.load, args.duration_noise = 0.85, 0.3
    epi = ",".join(sorted(glob.glob("../shared/workflows/wfinstances/*epigenomics*.json")))
    specs = a.workflows or [s for s in (epi, "wfcommons:bwa:200:3", "wfcommons:soykb:200:3") if s]
    for spec in specs:
        setting = settings_from(spec, 1)[0]
        for seed in a.seeds:
            jobs = make_stream(setting, cat, 30, seed, args)
            found: list[tuple[str, float]] = []
            for name in ("srpt+eft", "rule", "drl"):
                placer: Placer = (FeatureRule(a.hold, a.reserve) if name == "rule"
                                  else make_placer(name, cat, seed, checkpoint=a.checkpoint))
                found.append((name, simulate(cat, jobs, placer, seed, args)["mean_jct_s"]))
            ref = found[0][1]
            label = "epigenomics traces" if spec == epi else spec
            print(f"{label} seed {seed}: " + ", ".join(
                f"{n} {j:.0f} s ({j / ref:.3f})" for n, j in found), flush=True)


if __name__ == "__main__":
    main()
