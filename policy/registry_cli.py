"""``drl-policy registry``: what a model registry serves, and changing it by hand.

    drl-policy registry show     --registry DIR                 # JSON: active, last good, serving, history
    drl-policy registry activate --registry DIR CHECKPOINT [--objective O] [--note TEXT] [--no-check] [--create]
    drl-policy registry activate --registry DIR --objective O   # what is served now, for objective O
    drl-policy registry rollback --registry DIR [--note TEXT]   # the checkpoint active before this one

``activate`` takes ``CHECKPOINT`` as a path from the current directory (``active.json`` takes paths
relative to the registry: writing ``policy/checkpoints/default`` there by hand names
``DIR/policy/checkpoints/default``). It loads the checkpoint as a server would (its hash, the
loader's schema and shape checks, a probe request) and refuses, leaving the registry as it was, one
that would be refused; the manifest then pins its sha256, so a later change of its files is
refused by the servers too. A checkpoint inside the registry is named relative to it (a registry
volume mounted at other paths on other hosts names the same files). The servers pick the change
up at their next poll (``--registry-poll-s``), between two batches. A registry folder that does
not exist is an error (a mistyped ``--registry`` would otherwise start a registry no server
reads); ``--create`` makes it, group-writable and setgid like the files in it.

``rollback`` activates the most recent checkpoint of ``<registry>/history.jsonl`` other than the
active one (by path or by content), with the same checks, the content and the objective it had
then (a second rollback goes back again, as ``cd -`` does). Every activation, the nightly fine-tune's too, is
appended to that history. When the manifest changes while a rollback checks its checkpoint (a
promotion), the rollback writes nothing and says so.

``--objective`` (mean_jct, p95_jct, sla_violation_rate, cost) sets what the deployment optimises:
the nightly fine-tune trains and judges its candidates on it, the servers report it. Without a
CHECKPOINT it activates the checkpoint the servers serve now for that objective (in an empty
registry: the packaged one for it, copied into the registry, as a server seeds one). Every
activation without ``--objective`` keeps the objective the manifest had (a rollback: the one its
history entry recorded).

Writers hold the registry's activation lock (the fine-tune's promotion takes it too). Exit status:
0 done, 1 refused (the reason on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from policy.errors import CheckpointError
from policy.files import read_bounded
from policy.registry import (
    DEFAULT_CHECKPOINT,
    DEFAULT_OBJECTIVE,
    HISTORY,
    LAST_GOOD,
    MANIFEST,
    OBJECTIVES,
    PACKAGED_CHECKPOINTS,
    ModelRegistry,
    ObjectiveError,
    activate,
    activation_lock,
    checkpoint_sha256,
    copy_packaged,
    history,
    kept_objective,
    registry_objective,
    share_tree,
)


class RegistryChanged(CheckpointError):
    """The manifest changed between reading it and holding the activation lock."""


#: history entries ``show`` prints (the newest)
SHOW_HISTORY = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="what the registry names, what a server would serve, the history")
    act = actions.add_parser("activate", help="check a checkpoint, then make it the active one")
    back = actions.add_parser("rollback", help="activate the checkpoint that was active before this one")
    for p in (show, act, back):
        p.add_argument("--registry", required=True, help="the model registry folder")
    act.add_argument("checkpoint", nargs="?", default=None,
                     help="checkpoint folder, as a path from the current directory (none: the one served "
                          "now, for --objective)")
    act.add_argument("--objective", default=None, choices=OBJECTIVES,
                     help="what the deployment optimises (default: keep the registry's)")
    for p in (act, back):
        p.add_argument("--note", default="", help="a note kept in active.json and the history")
        p.add_argument("--device", default="cpu", help="device to load the checkpoint on to check it")
    act.add_argument("--no-check", action="store_true",
                     help="do not load it first (its sha256 is still pinned)")
    act.add_argument("--create", action="store_true",
                     help="make the registry folder when there is none (group-writable, setgid)")


def _read(path: Path) -> Any:
    try:
        return json.loads(read_bounded(path).decode())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def show(root: Path) -> dict[str, Any]:
    """The registry's state, as ``drl-policy registry show`` prints it."""
    doc: dict[str, Any] = {"registry": str(root), "active": _read(root / MANIFEST),
                           "last_good": _read(root / LAST_GOOD)}
    try:
        doc["objective"] = registry_objective(root)
    except CheckpointError as exc:
        doc["objective"] = {"error": str(exc)}
    try:
        serving = ModelRegistry(root).serving_checkpoint()
        doc["serving"] = {"checkpoint": str(serving.path), "sha256": serving.sha256, "named_by": serving.source}
    except CheckpointError as exc:
        doc["serving"] = {"error": str(exc)}
    doc["history"] = history(root)[-SHOW_HISTORY:]
    return doc


def _named(root: Path, checkpoint: Path) -> Path:
    """How the manifest names ``checkpoint``: relative to ``root`` when it lies inside it (compared
    as written, ``..`` folded, then with symlinks followed: a registry volume mounted at other
    paths on other hosts names the same files), else its absolute path with ``..`` folded."""
    absolute = Path(os.path.normpath(checkpoint.absolute()))
    for inside, base in ((absolute, Path(os.path.normpath(root.absolute()))), (absolute.resolve(), root.resolve())):
        try:
            return inside.relative_to(base)
        except ValueError:
            continue
    return absolute


def _active(root: Path) -> tuple[str, str, str] | None:
    """(checkpoint as named, sha256, objective as written) of ``root``'s manifest, None without one
    (the objective too: a switch of the objective alone is a change a rollback must not overwrite,
    found by review)."""
    doc = _read(root / MANIFEST)
    if isinstance(doc, dict) and isinstance(doc.get("checkpoint"), str):
        return doc["checkpoint"], str(doc.get("sha256") or ""), str(doc.get("objective") or DEFAULT_OBJECTIVE)
    return None


def activate_checked(root: Path, checkpoint: Path, *, note: str = "", check: bool = True,
                     device: str = "cpu", sha256: str = "",
                     unless_changed: tuple[str, str, str] | None | bool = False,
                     named_as: str = "", objective: str | None = None) -> dict[str, Any]:
    """Check ``checkpoint`` (unless ``check`` is false) and name it in ``root``'s manifest with its
    sha256; raises :class:`CheckpointError` (the registry untouched) when it would be refused.

    ``sha256``: the content it must have (a rollback's recorded hash). ``unless_changed``: the
    manifest's (checkpoint, sha256) as the caller read it (None: no manifest); when the manifest
    no longer says that once the activation lock is held (the nightly fine-tune promoted
    meanwhile), nothing is written. False: activate whatever is active now. ``objective``: None
    keeps the manifest's."""
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such registry folder (drl-policy registry activate --create makes one)")
    checkpoint = Path(os.path.normpath(checkpoint.absolute()))
    if not (checkpoint / "manifest.json").is_file():
        raise CheckpointError(f"{checkpoint}: not a checkpoint folder (no manifest.json there)")
    if objective is None:
        kept_objective(root)  # a manifest value that is not an objective: said before any loading
    actual = _sha(checkpoint)
    if sha256 and actual != sha256:
        raise CheckpointError(f"{checkpoint}: its files changed since it was active (sha256 {sha256[:12]}... "
                              f"recorded, {actual[:12]}... now)")
    version = ""
    if check:
        version = ModelRegistry(root, device=device).check(checkpoint, actual).version
    # a rollback keeps the name its history recorded (relative: the same files on every host)
    named = Path(named_as) if named_as and not Path(named_as).is_absolute() else _named(root, checkpoint)
    if not _named(root, checkpoint).is_absolute():
        # inside the registry: the group's, as the servers read it (found by review); a name kept
        # relative from the history (../private/a) is outside it: not ours to open up (found by review)
        share_tree(checkpoint)
    with activation_lock(root):
        if _sha(checkpoint) != actual:
            raise CheckpointError(f"{checkpoint}: its files changed while it was being checked; not activated")
        if unless_changed is not False and _active(root) != unless_changed:
            raise RegistryChanged(f"{root / MANIFEST} changed meanwhile (now {_active(root)}); nothing done: "
                                  "look at `drl-policy registry show` and run the command again")
        activate(root, named, sha256=actual, note=note, objective=objective)
    return {"checkpoint": str(named), "sha256": actual, "version": version, "checked": check,
            "objective": registry_objective(root)}


def switch_objective(root: Path, objective: str, *, note: str = "", check: bool = True,
                     device: str = "cpu") -> dict[str, Any]:
    """Activate the checkpoint the servers serve now for ``objective`` (the nightly fine-tune moves
    it towards the objective from there): the one ``active.json`` names when it would be served,
    else ``last_good.json``'s, as a server starting now falls back (found by review: a manifest
    whose checkpoint the loader refuses left the objective unswitchable). It keeps the name the
    file gave it (a relative name outside the registry stays relative: the same files on every
    host), except the package's own folder, which is copied into the registry (an upgrade replaces
    it: ``ensure_active``'s reason). Nothing is written if the manifest changes meanwhile."""
    unless = _active(root)  # a promotion landing meanwhile is not undone
    refused: list[str] = []
    for file in (MANIFEST, LAST_GOOD):
        doc = _read(root / file)
        if not (isinstance(doc, dict) and isinstance(doc.get("checkpoint"), str)):
            continue
        named = doc["checkpoint"]
        path = _where(root, named)
        named_as = "" if Path(named).is_absolute() else named
        try:
            if _in_package(path):
                path, named_as = root / copy_packaged(root, path)[0], ""
            return activate_checked(root, path, note=note, check=check, device=device,
                                    sha256=str(doc.get("sha256") or ""), unless_changed=unless,
                                    named_as=named_as, objective=objective)
        except (RegistryChanged, ObjectiveError):
            raise
        except (CheckpointError, OSError) as exc:
            refused.append(f"{file} names {named}: {exc}")
    raise CheckpointError("no checkpoint served now to switch the objective of: " +
                          ("; ".join(refused) or "the registry names none") + " (name a CHECKPOINT)")


def _in_package(path: Path) -> bool:
    """``path`` lies in this package's checkpoints folder (replaced by every upgrade)."""
    try:
        path.resolve().relative_to(DEFAULT_CHECKPOINT.parent.resolve())
        return True
    except ValueError:
        return False


def _sha(path: Path) -> str:
    try:
        return checkpoint_sha256(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc


def rollback(root: Path, *, note: str = "", device: str = "cpu") -> dict[str, Any]:
    """Activate (checked) the newest checkpoint of the history that is not the active one (by
    path, ``..`` and symlinks folded, or by content)."""
    now = _active(root)

    def same(entry: dict[str, str]) -> bool:
        """The active deployment: the same checkpoint (by content or path) for the same objective
        (mean_jct, p95_jct and cost share the packaged default: a switch of the objective alone is
        undone too, found by review)."""
        if now is None or (entry.get("objective") or DEFAULT_OBJECTIVE) != now[2]:
            return False
        if entry.get("sha256") and entry["sha256"] == now[1]:
            return True
        return _where(root, entry["checkpoint"]) == _where(root, now[0])

    for entry in reversed(history(root)):
        if same(entry):
            continue
        path = _where(root, entry["checkpoint"])
        why = note or f"rollback from {now[0] if now else 'nothing'}"
        # the objective it had then (an objective switched by mistake is undone with its checkpoint);
        # an entry that names none was a mean_jct deployment (found by review: it kept today's)
        objective = entry.get("objective") or DEFAULT_OBJECTIVE
        if objective not in OBJECTIVES:
            raise ObjectiveError(f"{root / HISTORY}: the entry of {entry['checkpoint']} (active since "
                                 f"{entry.get('at', '?')}) names objective {objective!r}, not one of "
                                 f"{', '.join(OBJECTIVES)}; activate the one you want with --objective")
        try:
            return activate_checked(root, path, note=why, device=device, sha256=entry.get("sha256", ""),
                                    unless_changed=now, named_as=entry["checkpoint"], objective=objective)
        except (RegistryChanged, ObjectiveError):  # the registry's fault, not the checkpoint's
            raise
        except CheckpointError as exc:
            raise CheckpointError(f"the previous checkpoint in {root / HISTORY} ({entry['checkpoint']}, active "
                                  f"since {entry.get('at', '?')}) would be refused: {exc}") from exc
    raise CheckpointError(f"{root / HISTORY}: no earlier checkpoint to roll back to")


def _where(root: Path, named: str) -> Path:
    """Where a manifest's path points (relative paths are the registry's), symlinks followed."""
    path = Path(named)
    return (path if path.is_absolute() else root / path).resolve()


def run(args: argparse.Namespace) -> int:
    root = Path(args.registry)
    created = False
    try:
        if getattr(args, "create", False) and not root.is_dir():
            root.mkdir()  # its parent must exist: a typo there is not made a tree of new folders
            created = True
            os.chmod(root, 0o2775)  # the group's, as the registry's files (servers and workers share it)
        if args.action == "show":
            if not root.is_dir():
                raise CheckpointError(f"{root}: no such registry folder")
            doc: dict[str, Any] = show(root)
        elif args.action == "activate":
            if args.checkpoint is None and args.objective is None:
                raise CheckpointError("name a CHECKPOINT, or --objective to switch the objective of the checkpoint "
                                      "served now")
            note = args.note or (f"objective {args.objective}" if args.checkpoint is None else "")
            if args.checkpoint is not None:
                doc = activate_checked(root, Path(args.checkpoint), note=note, check=not args.no_check,
                                       device=args.device, objective=args.objective)
            elif not root.is_dir():
                raise CheckpointError(f"{root}: no such registry folder (--create makes one)")
            elif (root / MANIFEST).exists() or (root / LAST_GOOD).exists():
                doc = switch_objective(root, args.objective, note=note, check=not args.no_check, device=args.device)
            else:  # an empty registry: the packaged checkpoint for it, copied inside (an upgrade
                # replaces the package's own folder)
                checkpoint = root / copy_packaged(root, PACKAGED_CHECKPOINTS[args.objective])[0]
                doc = activate_checked(root, checkpoint, note=note, check=not args.no_check, device=args.device,
                                       objective=args.objective)
        else:
            doc = rollback(root, note=args.note, device=args.device)
    except (CheckpointError, OSError, ValueError) as exc:  # ValueError: a path with a NUL, say
        if created:  # refused: no new registry left behind for the next mistyped --registry
            shutil.rmtree(root, ignore_errors=True)
        print(f"drl-policy registry {args.action}: refused: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2))
    return 0
