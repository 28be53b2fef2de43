"""A simulator bench in which every greedy request is decided by both decode steps (docs/server.md).

    python scripts/step_kernel_sim_check.py bench --workflows wfcommons:rnaseq:200:3 \\
        --pools policy/catalogues/gpu-affinity.yaml --load 0.85 --duration-noise 0.3 --dag-runs 30 \\
        --seeds 2 --policies drl --seed 0 --checkpoint docs/exp-ledger/checkpoints/s41 --max-wait-s 60

Runs ``drl-trainer`` with the arguments given, after wrapping the GNN placer's one-request
decode: each greedy request is decided with the numpy steps and, on a copy of its features, with
the compiled steps; the numpy decision is used (so the bench's numbers are the numpy steps'),
and at exit it prints how many requests (and rows) the two decided differently.
"""

from __future__ import annotations

import atexit
import copy
import sys
from typing import Any

import policy.gnn as gnn
from trainer.cli import main

_decode = gnn.GNNPlacer._decode_features
_seen = {"requests": 0, "rows": 0, "different": 0}


def _both(self: gnn.GNNPlacer, fb: Any, temp: float, *, record: bool = False) -> gnn.Decoded:
    if record or temp > 0:
        return _decode(self, fb, temp, record=record)
    other = copy.deepcopy(fb)
    self.step_kernel = "numpy"
    a = _decode(self, fb, temp)
    self.step_kernel = "compiled"
    b = _decode(self, other, temp)
    _seen["requests"] += 1
    _seen["rows"] += fb.num_ready
    _seen["different"] += a.actions.tolist() != b.actions.tolist() or a.placed_order != b.placed_order
    return a


if __name__ == "__main__":
    gnn.GNNPlacer._decode_features = _both  # type: ignore[method-assign]
    atexit.register(lambda: print(f"{_seen['requests']} requests ({_seen['rows']} rows), "
                                  f"{_seen['different']} decided differently by the two steps", file=sys.stderr))
    sys.exit(main(sys.argv[1:]))
