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
``--row-bias K`` gives every member a row bias of weight ``K`` (a prior on SRPT's run order,
docs/policy.md, "An SRPT prior on the default's members").
``--evaluate`` scores the ensemble as ``drl-trainer train`` scores a checkpoint at its end (the
first member's training and held-out settings, evaluation streams, teachers and baselines, read
from its manifest) and records it as the ensemble's ``evaluation``, so the figures of the
ensemble and of its first member are on the same streams.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from policy.catalogue import PACKAGED_CATALOGUES, load_catalogue
from policy.checkpoint import Checkpoint, load_checkpoint, save_ensemble
from policy.errors import CheckpointError, SchemaError, WorkloadError
from trainer.options import nearest_existing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", help="two or more checkpoint folders (the first decides settings)")
    parser.add_argument("--out", required=True, help="folder to write the ensemble checkpoint to")
    parser.add_argument("--name", default="ensemble", help="name prefix of the ensemble's version")
    parser.add_argument("--row-bias", type=float, default=None, metavar="K",
                        help="give every member a row bias of weight K (a prior on SRPT's run order, added to "
                             "every pair logit of a row: K x run_work_left_ratio; negative: the run with the "
                             "least work left first; at most 256 either way), its other weights unchanged")
    parser.add_argument("--evaluate", action="store_true",
                        help="score the ensemble on its first member's training and held-out settings, as "
                             "drl-trainer train does at its end, and record it in the manifest")


def evaluation_of(members: Sequence[Checkpoint]) -> dict[str, Any]:
    """The ensemble of ``members`` scored as ``drl-trainer train`` scored its first member."""
    import torch

    from trainer.train import Args, final_evaluation, settings_from

    training = members[0].manifest.get("training") or {}
    if not training.get("workflows"):
        raise SystemExit(f"{members[0].path}: its manifest names no training settings to evaluate on")
    fields = {f.name for f in dataclasses.fields(Args)}
    args = Args(**{k: v for k, v in training.items() if k in fields})
    try:
        settings = settings_from(args.workflows, args.seed)
        heldout = settings_from(args.heldout, args.seed + 1) if args.heldout else []
    except (WorkloadError, SchemaError) as exc:
        # found by review: a workflow path recorded on another checkout was a traceback
        raise WorkloadError(f"{members[0].path}: the workflows its manifest records: {exc}") from None
    teachers = training.get("teachers") or {}
    for s in settings:
        s.teacher = teachers.get(s.name) or "srpt+eft"
    torch.set_num_threads(max(1, args.threads))
    pools = Path(args.pools)
    if not pools.exists() and (PACKAGED_CATALOGUES / pools.name).exists():  # recorded on another checkout
        pools = PACKAGED_CATALOGUES / pools.name
    return final_evaluation(members[0].model, settings, heldout, load_catalogue(pools), args,
                            members=[c.model for c in members[1:]])


def with_row_bias(c: Checkpoint, k: float) -> Checkpoint:
    """``c`` with a row bias of weight ``k`` (:meth:`policy.model.PlacementGNN.with_row_bias`); its
    version says so (``+row<k>``) and its training record keeps the weight (``row_bias_prior``)."""
    try:
        model = c.model.with_row_bias(k)
    except (ValueError, CheckpointError) as exc:
        raise SystemExit(f"error: {c.path}: {exc}") from None
    manifest = {**c.manifest, "version": f"{c.version}+row{k:g}",
                "training": {**(c.manifest.get("training") or {}), "row_bias_prior": k}}
    return Checkpoint(model.eval(), manifest, c.path)


def _check_members(members: Sequence[Checkpoint], out: Path) -> None:
    """Refuse what :func:`~policy.checkpoint.save_ensemble` would refuse before any work is done,
    and an ``out`` that would overwrite a member or is a file (found by review: ``--evaluate``
    scored for minutes an ensemble then refused; ``--row-bias`` let an ensemble through as a
    member, keeping only its first model; ``--out A`` wrote the ensemble over member A)."""
    if len(members) < 2:
        raise CheckpointError(f"an ensemble needs two or more checkpoints, got {len(members)}")
    nested = [str(c.path) for c in members if c.members]
    if nested:
        raise CheckpointError(f"an ensemble's members must be single models, and {', '.join(nested)} is an "
                              "ensemble (name its own members)")
    target = out.resolve()
    clash = [str(c.path) for c in members if Path(c.path).resolve() == target]
    if clash:
        raise CheckpointError(f"--out {out}: that is member {clash[0]}; write the ensemble elsewhere")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: a file is there; an ensemble is a folder")
    above = nearest_existing(out.absolute())
    if above is not None and not above.is_dir():  # found by review: a traceback after the members loaded
        raise CheckpointError(f"--out {out}: {above} is a file, not a folder to write the ensemble in")
    seen: dict[str, str] = {}
    for c in members:  # found by review: `ensemble A A` wrote "2 members: gnn-x, gnn-x"
        if c.version in seen:
            raise CheckpointError(f"{c.path} and {seen[c.version]} are the same model ({c.version}); an "
                                  "ensemble's members are different models")
        seen[c.version] = str(c.path)


def run(args: argparse.Namespace) -> int:
    members = [load_checkpoint(p) for p in args.checkpoints]
    _check_members(members, Path(args.out))
    if args.row_bias is not None:
        members = [with_row_bias(c, args.row_bias) for c in members]
    evaluation = evaluation_of(members) if args.evaluate else None
    extra = ["--row-bias", f"{args.row_bias:g}"] if args.row_bias is not None else []
    path = save_ensemble(members, args.out, name=args.name, evaluation=evaluation,
                         command=shlex.join(["drl-trainer", "ensemble", *args.checkpoints, "--out", args.out,
                                             "--name", args.name, *extra, *(["--evaluate"] if args.evaluate else [])]))
    print(f"wrote {path.parent} ({len(members)} members: {', '.join(c.version for c in members)})")
    return 0
