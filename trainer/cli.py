"""``drl-trainer``: the scheduling lab's command line (``bench``, ``train``, ``explain``, ...).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``.
Bad input found past the parser (an unreadable or malformed catalogue, a missing or tampered
checkpoint, a ``--workflows`` spec naming a malformed WfFormat file, a missing path or an unknown
recipe) is one line on stderr, ``drl-trainer: error: ...``, and exit code 2, as argparse's own.
"""

from __future__ import annotations

import sys

from policy.cli import build_parser, dispatch
from policy.errors import CatalogueError, CheckpointError, SchemaError, WorkloadError

SUBCOMMANDS = {
    "bench": ("trainer.bench", "simulate policies on workloads and report metrics against lower bounds"),
    "train": ("trainer.train", "train the GNN placement policy in the simulator"),
    "makespan": ("trainer.makespan", "each DAG alone on an idle cluster: makespan against the makespan bound"),
    "ensemble": ("trainer.ensemble", "write several checkpoints as one ensemble checkpoint (mean logits)"),
    "explain": ("trainer.explain", "explain one placement decision of a checkpoint"),
    "finetune": ("trainer.finetune", "fine-tune the policy on recorded traces and promote it if it wins"),
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("drl-trainer", SUBCOMMANDS, "Simulator, baselines, training and evaluation.", argv)
    try:
        return dispatch(parser, argv)
    except (CatalogueError, CheckpointError, SchemaError, WorkloadError) as exc:  # SchemaError: ReplayError too
        # the message names the file and the field; a traceback would only bury it
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
