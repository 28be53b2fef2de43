"""Checks of the ``drl-trainer`` subcommands' options: policy names, numbers in range, output paths.

A check takes the value and the option's name and returns the value or raises ``ValueError``
naming both; :func:`checked` / :func:`checked_int` make one an argparse type (the parser's
one-line error, exit code 2), and ``trainer.train.Args`` calls the same checks. Found by review:
bad values were tracebacks from the simulator, numpy or torch, some after minutes of work, and an
output folder that does not exist was found only when the results were written, after every
simulation.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable

from trainer.baselines import BASELINES, LEARNED, SIMPLE, SLOW
from trainer.baselines.rules import ORDERS, PLACEMENTS


def policy_names(text: str, *, baselines_only: bool = False, name: str = "") -> list[str]:
    """The names of the comma list ``text``, each one :func:`~trainer.baselines.make_placer`
    builds (``baselines_only``: neither the learned policy nor the ``baselines`` keyword); the
    ``ValueError`` of another starts with ``name``, the setting's (argparse gives the flag's)."""
    said = f"{name}: " if name else ""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError(f"{said}expected a comma list of policies, got {text!r}")
    keywords = () if baselines_only else ("baselines", LEARNED)
    for policy in names:
        if policy not in (*keywords, *BASELINES, *SLOW):
            raise ValueError(
                f"{said}unknown policy {policy!r} in {text!r}; expected {''.join(f'{k!r}, ' for k in keywords)}one of "
                f"{', '.join(SIMPLE + SLOW)}, or ORDER+PLACEMENT with ORDER in {', '.join(ORDERS)} "
                f"and PLACEMENT in {', '.join(PLACEMENTS)}")
    return names


def policies(text: str) -> str:
    """An argparse type: a comma list of policies (:func:`policy_names`); an unknown one would
    otherwise fail only in the first simulation, as a traceback."""
    try:
        policy_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def finite_at_least(value: float, low: float, name: str, *, strict: bool = False) -> float:
    """``value`` if it is a finite number >= ``low`` (> ``low`` with ``strict``); NaN is refused."""
    if not (math.isfinite(value) and (value > low if strict else value >= low)):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")
    return value


def probability(value: float, name: str) -> float:
    """``value`` if it is in [0, 1) (a failure rate: 1 would retry a task for ever)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


def int_at_least(value: int, low: int, name: str) -> int:
    """``value`` if it is >= ``low`` (a count, or a seed numpy accepts)."""
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def checked(check: Callable[[float], float]) -> Callable[[str], float]:
    """An argparse type: the text as a float passed through ``check`` (its ``ValueError`` becomes
    the parser's error message)."""
    def convert(text: str) -> float:
        try:
            return check(float(text))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def checked_int(check: Callable[[int], int]) -> Callable[[str], int]:
    """:func:`checked` for an integer."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        try:
            return check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def int_arg(low: int, name: str) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (:func:`int_at_least`), the flag ``name`` in its error."""
    return checked_int(lambda v: int_at_least(v, low, name))


def float_arg(low: float, name: str, *, strict: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low`` (> with ``strict``; :func:`finite_at_least`)."""
    return checked(lambda v: finite_at_least(v, low, name, strict=strict))


def output_file(text: str) -> str:
    """An argparse type: a file the results are written to ('' = none), refused when its folder
    does not exist, is not a folder or is not writable, or when it is a folder itself."""
    if not text:
        return text
    path = Path(text)
    folder = path.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text}: {str(folder)!r} {what}")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: the folder {str(folder)!r} is not writable")
    return text


def nearest_existing(path: Path) -> Path | None:
    """``path`` or the nearest path above it that exists (None: not even the working folder)."""
    return next((p for p in (path, *path.parents) if p.exists()), None)


def output_folder(text: str) -> str:
    """An argparse type: a folder files are written into, made (with its parents) if missing;
    refused when it, or the nearest path above it that exists, is not a writable folder."""
    path = Path(text)
    existing = nearest_existing(path)
    if existing is None:  # not even the working folder (removed): mkdir will say so
        return text
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {str(existing)!r} is not a folder")
    if not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: the folder {str(existing)!r} is not writable")
    return text
