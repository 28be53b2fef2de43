"""Experiment: a stricter guard on the GNN's "stop" (hold the rest of the batch), measured by the bench.

    python scripts/stop_guard_probe.py --ratio R -- <drl-trainer bench arguments>

Today stop is refused while some remaining task's *best* pool (earliest finish) has a free slot
(:func:`policy.batch_decoder.best_pool_free`). This probe refuses it while some remaining task has
*any* feasible pool with a free slot whose estimated finish is within ``R`` x its best (``R`` >= 8
makes the policy work-conserving: the GPU-affinity catalogue's largest speed ratio is 8), then runs
``drl-trainer bench`` with that rule in place of the shipped one. An experiment, not a setting:
nothing in the product uses it.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import policy.batch_decoder
import policy.gnn
from trainer.cli import main as trainer_main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ratio", type=float, required=True)
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then drl-trainer bench arguments")
    args = ap.parse_args()
    limit = math.log(args.ratio)

    def guard(d: Any, fit: Any) -> Any:  # same inputs as best_pool_free; column 2 = log finish ratio
        return (fit & (d[..., 3] > 0.5) & (d[..., 2] <= limit)).any(-1).any(-1)

    policy.gnn.best_pool_free = guard  # type: ignore[assignment]
    policy.batch_decoder.best_pool_free = guard  # type: ignore[assignment]
    rest = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    return trainer_main(["bench", *rest])


if __name__ == "__main__":
    sys.exit(main())
