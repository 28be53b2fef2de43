"""``drl-policy``: the policy server's command line (``serve``, ``bench``, ``registry``).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this module only dispatches, so ``--help`` stays fast and imports nothing heavy.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = {
    "serve": ("policy.server", "serve placement requests from Redis"),
    "bench": ("policy.bench", "measure round-trip latency and throughput through a real Redis"),
    "registry": ("policy.registry_cli", "show the model registry; activate a checked checkpoint; roll back"),
}


def build_parser(
    prog: str, subcommands: dict[str, tuple[str, str]], description: str, argv: list[str] | None = None
) -> argparse.ArgumentParser:
    """A parser whose chosen subcommand's module (only) is imported to declare its arguments."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--log-level", type=_log_level, default="INFO",
                        help="logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    args = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in args if a in subcommands), None)
    for name, (module, help_text) in subcommands.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(module).add_arguments(sp)
    return parser


def _log_level(text: str) -> str:
    """An argparse type: a level name ``logging`` knows (found by review: ``--log-level verbose``
    was a traceback from ``logging.basicConfig``)."""
    if not isinstance(logging.getLevelName(text.upper()), int):
        raise argparse.ArgumentTypeError(f"unknown level {text!r}; one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return text


def dispatch(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    code: int = importlib.import_module(args._module).run(args)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("drl-policy", SUBCOMMANDS, "The GNN placement policy server.", argv)
    return dispatch(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
