"""The learned policy's mean JCT over the per-setting best baseline, from bench JSON run apart.

    python scripts/ratio_table.py BASE NAME=PREFIX [NAME=PREFIX ...] --seeds 0 20 40 60
        [--metric mean_jct_s | p95_jct_s | cost]

The ledger's benches run the (deterministic) baselines once per seed, ``drl-trainer bench
--policies <baselines> --seed S --json BASE-S.json``, then each checkpoint with ``--policies drl
--seed S --json PREFIX-S.json`` on the same settings. This prints, per checkpoint, the geometric
mean over settings and seed pairs of drl's mean JCT / the best baseline's on the same setting
and seeds (per seed pair, overall, and per setting), as in docs/policy.md's tables. Settings are
matched by name (a WfFormat file list by its first file's family), so files measured from
another folder still match. ``--metric`` takes another column of the JSON (the best baseline is
then the one lowest on that metric, per setting).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def family(setting: str) -> str:
    """``wfcommons:bwa:200:3`` -> ``bwa``; a comma list of WfFormat files -> the first file's
    family (``epigenomics-chameleon-...json`` -> ``epigenomics``); anything else as it is."""
    if setting.startswith("wfcommons:"):
        return setting.split(":")[1]
    first = Path(setting.split(",")[0]).name
    return first.split("-")[0] if first.endswith(".json") else setting


def _rows(path: str, learned: bool, metric: str = "mean_jct_s") -> dict[str, float]:
    """``metric`` per setting family: drl's (``learned``) or the best baseline's."""
    out: dict[str, float] = {}
    for r in json.loads(Path(path).read_text())["results"]:
        if (r["policy"] == "drl") == learned:
            key = family(r["setting"])
            out[key] = min(out.get(key, math.inf), r[metric])
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="prefix of the baselines' JSON (BASE-S.json)")
    ap.add_argument("models", nargs="+", help="NAME=PREFIX of each checkpoint's JSON (PREFIX-S.json)")
    ap.add_argument("--seeds", nargs="+", required=True, help="the first seed of each bench run")
    ap.add_argument("--metric", default="mean_jct_s", choices=["mean_jct_s", "p95_jct_s", "cost"],
                    help="the column compared (default: mean JCT)")
    args = ap.parse_args()
    for spec in args.models:
        name, _, prefix = spec.partition("=")
        per_seed: list[float] = []
        per_family: dict[str, list[float]] = {}
        for seed in args.seeds:
            best = _rows(f"{args.base}-{seed}.json", False, args.metric)
            mine = _rows(f"{prefix or name}-{seed}.json", True, args.metric)
            ratios = {k: v / best[k] for k, v in mine.items()}
            per_seed.append(_geomean(list(ratios.values())))
            for k, v in ratios.items():
                per_family.setdefault(k, []).append(v)
        overall = _geomean([v for vs in per_family.values() for v in vs])
        families = " / ".join(f"{k} {_geomean(v):.3f}" for k, v in per_family.items())
        print(f"{name}: {' / '.join(f'{x:.3f}' for x in per_seed)}  mean {overall:.3f}  ({families})")


if __name__ == "__main__":
    main()
