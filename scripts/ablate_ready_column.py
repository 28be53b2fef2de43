"""Decode a checkpoint with one ready-feature column held at a constant: does it lean on it?

    python scripts/ablate_ready_column.py COLUMN VALUE bench [drl-trainer bench arguments...]

Replaces column ``COLUMN`` (a name in ``policy.features.READY_FEATURES``) of every request's
``ready_x`` by ``VALUE`` in the GNN placer's featurization, then runs the ``drl-trainer``
subcommand that follows (``bench`` with ``--policies drl --checkpoint CK``, one process: no
``--jobs``). A probe for docs/policy.md ("How long a task has been held: feature schema 6"),
not a decoder option.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import policy.gnn as gnn
from policy.features import READY_FEATURES, FeatureBatch


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in READY_FEATURES:
        print(__doc__, file=sys.stderr)
        return 2
    col, value = READY_FEATURES.index(argv[0]), float(argv[1])
    featurize = gnn.featurize

    def held_constant(*args: Any, **kwargs: Any) -> FeatureBatch:
        fb = featurize(*args, **kwargs)
        x = fb.ready_x.copy()
        x[:, col] = value
        return replace(fb, ready_x=x)

    gnn.featurize = held_constant  # type: ignore[assignment]
    from trainer.cli import main as trainer_main

    return trainer_main(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
