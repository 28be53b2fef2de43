"""``drl-policy registry``: what a model registry serves, and changing it by hand.

    drl-policy registry show     --registry DIR                 # JSON: active, last good, serving, history
    drl-policy registry activate --registry DIR CHECKPOINT [--note TEXT] [--no-check]
    drl-policy registry rollback --registry DIR [--note TEXT]   # the checkpoint active before this one

``activate`` takes ``CHECKPOINT`` as a path from the current directory (``active.json`` takes paths
relative to the registry: writing ``policy/checkpoints/default`` there by hand names
``DIR/policy/checkpoints/default``). It loads the checkpoint as a server would (its hash, the
loader's schema and shape checks, a probe request) and refuses, leaving the registry as it was, one
that would be refused; the manifest then pins its sha256, so a later change of its files is
refused by the servers too. A checkpoint inside the registry is named relative to it (a registry
volume mounted at other paths on other hosts names the same files). The servers pick the change
up at their next poll (``--registry-poll-s``), between two batches.

``rollback`` activates the most recent checkpoint of ``<registry>/history.jsonl`` other than the
active one, with the same checks (a second rollback goes back again, as ``cd -`` does). Every
activation, the nightly fine-tune's too, is appended to that history.

Writers hold the registry's activation lock (the fine-tune's promotion takes it too). Exit status:
0 done, 1 refused (the reason on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from policy.errors import CheckpointError
from policy.registry import (
    LAST_GOOD,
    MANIFEST,
    ModelRegistry,
    activate,
    activation_lock,
    checkpoint_sha256,
    history,
)

#: history entries ``show`` prints (the newest)
SHOW_HISTORY = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="what the registry names, what a server would serve, the history")
    act = actions.add_parser("activate", help="check a checkpoint, then make it the active one")
    back = actions.add_parser("rollback", help="activate the checkpoint that was active before this one")
    for p in (show, act, back):
        p.add_argument("--registry", required=True, help="the model registry folder")
    act.add_argument("checkpoint", help="checkpoint folder, as a path from the current directory")
    for p in (act, back):
        p.add_argument("--note", default="", help="a note kept in active.json and the history")
        p.add_argument("--device", default="cpu", help="device to load the checkpoint on to check it")
    act.add_argument("--no-check", action="store_true",
                     help="do not load it first (its sha256 is still pinned)")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def show(root: Path) -> dict[str, Any]:
    """The registry's state, as ``drl-policy registry show`` prints it."""
    doc: dict[str, Any] = {"registry": str(root), "active": _read(root / MANIFEST),
                           "last_good": _read(root / LAST_GOOD)}
    try:
        serving = ModelRegistry(root).serving_checkpoint()
        doc["serving"] = {"checkpoint": str(serving.path), "sha256": serving.sha256, "named_by": serving.source}
    except CheckpointError as exc:
        doc["serving"] = {"error": str(exc)}
    doc["history"] = history(root)[-SHOW_HISTORY:]
    return doc


def activate_checked(root: Path, checkpoint: Path, *, note: str = "", check: bool = True,
                     device: str = "cpu") -> dict[str, Any]:
    """Check ``checkpoint`` (unless ``check`` is false) and name it in ``root``'s manifest with its
    sha256; raises :class:`CheckpointError` (the registry untouched) when it would be refused."""
    checkpoint = checkpoint.absolute()
    if not (checkpoint / "manifest.json").is_file():
        raise CheckpointError(f"{checkpoint}: not a checkpoint folder (no manifest.json there)")
    try:
        sha = checkpoint_sha256(checkpoint)
    except OSError as exc:
        raise CheckpointError(f"{checkpoint}: cannot read: {exc}") from exc
    version = ""
    if check:
        model = ModelRegistry(root, device=device).check(checkpoint, sha)
        version = model.version
    try:
        named: Path = checkpoint.relative_to(root.absolute())
    except ValueError:
        named = checkpoint
    with activation_lock(root):
        if checkpoint_sha256(checkpoint) != sha:  # changed while it was being checked
            raise CheckpointError(f"{checkpoint}: its files changed while it was being checked; not activated")
        activate(root, named, sha256=sha, note=note)
    return {"checkpoint": str(named), "sha256": sha, "version": version, "checked": check}


def rollback(root: Path, *, note: str = "", device: str = "cpu") -> dict[str, Any]:
    """Activate (checked) the newest checkpoint of the history other than the active one."""
    active = _read(root / MANIFEST)
    now = (active.get("checkpoint"), active.get("sha256", "")) if isinstance(active, dict) else None
    for entry in reversed(history(root)):
        if (entry["checkpoint"], entry.get("sha256", "")) == now:
            continue
        path = Path(entry["checkpoint"])
        path = path if path.is_absolute() else root / path
        sha = entry.get("sha256", "")
        if sha and path.exists() and checkpoint_sha256(path) != sha:
            raise CheckpointError(f"{path}: the previous checkpoint's files changed since it was active "
                                  f"(sha256 {sha[:12]}... recorded); not rolled back")
        why = note or f"rollback from {now[0] if now else 'nothing'}"
        return activate_checked(root, path, note=why, device=device)
    raise CheckpointError(f"{root / 'history.jsonl'}: no earlier checkpoint to roll back to")


def run(args: argparse.Namespace) -> int:
    root = Path(args.registry)
    try:
        if args.action == "show":
            if not root.is_dir():
                raise CheckpointError(f"{root}: no such registry folder")
            doc: dict[str, Any] = show(root)
        elif args.action == "activate":
            doc = activate_checked(root, Path(args.checkpoint), note=args.note, check=not args.no_check,
                                   device=args.device)
        else:
            doc = rollback(root, note=args.note, device=args.device)
    except CheckpointError as exc:
        print(f"drl-policy registry {args.action}: refused: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2))
    return 0
