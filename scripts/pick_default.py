"""Whether a candidate replaces the default checkpoint: the rule, fixed before the candidates are measured.

    python scripts/pick_default.py BASE INCUMBENT=PREFIX NAME=PREFIX [NAME=PREFIX ...] --seeds 0 20 40
        [--objective mean_jct_s] [--min-improvement 0.01] [--max-other-regression 0.02]

BASE and PREFIX are as for ``scripts/ratio_table.py`` (bench JSON run apart, ``BASE-S.json`` the
baselines', ``PREFIX-S.json`` a checkpoint's, on the *validation* families: the default is never
picked on the families it is then reported on). Each model's ratio to the per-seed best baseline
is taken on every objective (mean JCT, p95 JCT, SLA violations, cost; geometric means over the
families and seed pairs). A candidate **passes** if its ratio on ``--objective`` is at least
``--min-improvement`` (relative) below the incumbent's and its ratio on each other objective at most
``--max-other-regression`` (relative) above the incumbent's: the constants of the nightly
fine-tune's promotion gate (``drl-trainer finetune``), which were fixed long before this rule was
written down (docs/policy.md, "How the next default is chosen"). The pick is the passing
candidate lowest on the objective, or the incumbent when none passes. Exit status 0 either way;
the last line says the pick.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def _ratio_table():  # type: ignore[no-untyped-def]
    """scripts/ratio_table.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("ratio_table", Path(__file__).with_name("ratio_table.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rt = _ratio_table()
OBJECTIVES: tuple[str, ...] = rt.METRICS


def verdict(incumbent: dict[str, float], candidate: dict[str, float], objective: str, min_improvement: float,
            max_other_regression: float) -> list[str]:
    """Why ``candidate`` (ratios per objective) does not replace ``incumbent``; empty: it passes."""
    why = []
    gain = 1.0 - candidate[objective] / incumbent[objective]
    if gain < min_improvement:
        why.append(f"{objective} {-gain:+.1%} (need <= {-min_improvement:+.1%})")
    for m in OBJECTIVES:
        change = candidate[m] / incumbent[m] - 1.0
        if m != objective and change > max_other_regression:
            why.append(f"{m} {change:+.1%} (allowed {max_other_regression:+.1%})")
    return why


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="prefix of the baselines' JSON (BASE-S.json), validation families")
    ap.add_argument("models", nargs="+", help="INCUMBENT=PREFIX, then NAME=PREFIX of each candidate")
    ap.add_argument("--seeds", nargs="+", required=True, help="the first seed of each bench run")
    ap.add_argument("--objective", default="mean_jct_s", choices=OBJECTIVES)
    ap.add_argument("--min-improvement", type=float, default=0.01)
    ap.add_argument("--max-other-regression", type=float, default=0.02)
    args = ap.parse_args(argv)
    if len(args.models) < 2:
        raise SystemExit("name the incumbent and at least one candidate")
    names = [spec.partition("=")[0] for spec in args.models]
    if len(set(names)) != len(names):
        raise SystemExit(f"{next(n for n in names if names.count(n) > 1)} is named twice")
    refs = {m: rt.references(args.base, args.seeds, m)[0] for m in OBJECTIVES}
    table: dict[str, dict[str, float]] = {}
    for spec in args.models:
        name, _, prefix = spec.partition("=")
        table[name] = {m: rt.ratios(args.base, prefix or name, args.seeds, m, refs[m])[1] for m in OBJECTIVES}
    incumbent, passing = names[0], []
    print("x the per-seed best: " + " / ".join(OBJECTIVES))
    for name in names:
        row = " / ".join(f"{table[name][m]:.3f}" for m in OBJECTIVES)
        if name == incumbent:
            print(f"{name} (incumbent): {row}")
            continue
        why = verdict(table[incumbent], table[name], args.objective, args.min_improvement,
                      args.max_other_regression)
        print(f"{name}: {row}  " + ("passes" if not why else "fails: " + "; ".join(why)))
        if not why:
            passing.append(name)
    pick = min(passing, key=lambda n: table[n][args.objective]) if passing else incumbent
    print(f"pick: {pick}")
    return pick


if __name__ == "__main__":
    main(sys.argv[1:])
