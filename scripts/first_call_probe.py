"""Time the default checkpoint's first place() calls in a new process (one torch thread): the
first pays the set-up the registry's probe request now absorbs at load (docs/server.md).

    python scripts/first_call_probe.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "policy"))

from gnn_helpers import big_request  # noqa: E402

from policy.registry import gnn_loader  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    placer = gnn_loader(REPO / "policy" / "checkpoints" / "default", "cpu")
    for i in range(5):
        req, graphs = big_request(200, 16, seed=i)
        t0 = time.perf_counter()
        placer.place(req, graphs)
        print(f"call {i}: {(time.perf_counter() - t0) * 1e3:.1f} ms (200-task run, 16 ready)")


if __name__ == "__main__":
    main()
