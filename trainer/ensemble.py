"""``drl-trainer ensemble``: several checkpoints as one, their logits averaged at every step.

    drl-trainer ensemble --out runs/e3 docs/exp-ledger/checkpoints/s41 \\
        docs/exp-ledger/checkpoints/ts1 docs/exp-ledger/checkpoints/s42

writes one checkpoint directory (:func:`policy.checkpoint.save_ensemble`: one safetensors file,
one hash, the members listed in the manifest) that every loader takes as it takes one model:
``drl-trainer bench --checkpoint``, the policy server's registry, ``drl-trainer explain``. It
decodes with the first checkpoint's settings (busy pools, premium guards). Seeds of one training
command disagree most on families none of them trained on (docs/policy.md, "An ensemble of
training seeds"); the mean of their logits is a vote that no single seed's mistakes decide.
``drl-trainer bench --checkpoint A,B,C`` measures the same ensemble without writing it.
"""

from __future__ import annotations

import argparse

from policy.checkpoint import load_checkpoint, save_ensemble


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", help="two or more checkpoint folders (the first decides settings)")
    parser.add_argument("--out", required=True, help="folder to write the ensemble checkpoint to")
    parser.add_argument("--name", default="ensemble", help="name prefix of the ensemble's version")


def run(args: argparse.Namespace) -> int:
    members = [load_checkpoint(p) for p in args.checkpoints]
    path = save_ensemble(members, args.out, name=args.name)
    print(f"wrote {path.parent} ({len(members)} members: {', '.join(c.version for c in members)})")
    return 0
