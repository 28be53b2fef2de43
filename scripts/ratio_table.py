"""The learned policy's mean JCT over the per-setting best baseline, from bench JSON run apart.

    python scripts/ratio_table.py BASE NAME=PREFIX [NAME=PREFIX ...] --seeds 0 20 40 60
        [--metric mean_jct_s | p95_jct_s | cost | sla_violation_rate]

The ledger's benches run the (deterministic) baselines once per seed, ``drl-trainer bench
--policies <baselines> --seed S --json BASE-S.json``, then each checkpoint with ``--policies drl
--seed S --json PREFIX-S.json`` on the same settings. This prints, per checkpoint, the geometric
mean over settings and seed pairs of drl's mean JCT / the best baseline's on the same setting
and seeds (per seed pair, overall, and per setting), as in docs/policy.md's tables. Settings are
matched by name (a WfFormat file list by its first file's family), so files measured from
another folder still match. ``--metric`` takes another column of the JSON (the best baseline is
then the one lowest on that metric, per setting). ``--reference best-fixed`` divides by one
baseline everywhere instead: the one with the lowest geometric mean of the metric over every
setting and seed pair (issue 4's "best fixed baseline"), named in the output with the per-setting
best's ratio to it (how far apart the two references are on these settings). The default
reference picks the best baseline per setting AND seed pair, an oracle over each arrival draw
(with seven noisy baselines, the minimum of seven samples); ``--reference per-setting-rule``
picks one baseline per setting, the lowest geometric mean over all the seeds, i.e. the rule a
user would choose for that workload, and names it with its ratio to the per-seed oracle.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def family(setting: str) -> str:
    """``wfcommons:bwa:200:3`` -> ``bwa``; a comma list of WfFormat files -> the first file's
    family (``epigenomics-chameleon-...json`` -> ``epigenomics``); anything else as it is."""
    if setting.startswith("wfcommons:"):
        return setting.split(":")[1]
    first = Path(setting.split(",")[0]).name
    return first.split("-")[0] if first.endswith(".json") else setting


def _load(path: str) -> dict:
    """A bench JSON, or the script stops naming the file (found by review: a traceback)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: cannot read this bench JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise SystemExit(f"{path}: not a bench JSON (no 'results' list)")
    return doc


def _table(path: str, metric: str) -> dict[str, dict[str, float]]:
    """``metric`` per policy and setting family of one bench JSON. A value that is not > 0 (a
    rate of 0 SLA violations) stops the script naming it: no ratio to it, and no geometric mean
    with it (found by review: drl's own 0, or a baseline's under ``--reference
    per-setting-rule``/``best-fixed``, was a math domain error); so do two settings of one family
    (found by review: ``wfcommons:bwa:200:3`` and ``wfcommons:bwa:1000:3`` were one, the lowest
    of each kept, and drl's best setting was divided by the baselines' other one)."""
    out: dict[str, dict[str, float]] = {}
    named: dict[str, str] = {}
    for r in _load(path)["results"]:
        row, key = out.setdefault(r["policy"], {}), family(r["setting"])
        if named.setdefault(key, r["setting"]) != r["setting"]:
            raise SystemExit(f"{path}: settings {named[key]!r} and {r['setting']!r} are both family {key}: "
                             "bench them apart")
        value = r[metric]
        if not value > 0:
            raise SystemExit(f"{path}: {metric} of {r['policy']} on {key} is {value}: no ratio nor geometric "
                             "mean takes it (a rate of 0: compare that family apart)")
        row[key] = min(row.get(key, math.inf), value)
    return out


#: what a bench JSON's ``config`` must share with the baselines' for a ratio to pair the same
#: streams (each setting's stream is drawn from its seed and position), and each one's default
_SAME_STREAMS = {"seeds": None, "load": None, "arrival": "poisson", "dag_runs": None, "duration_noise": None,
                 "failure_rate": 0.0, "dispatch_latency_s": 0.0, "max_wait_s": None, "max_hold_s": None,
                 "scale_in": "sustained", "max_active_tasks": None, "pool_slots": None, "parallelism": None}


def _setting(config: dict[str, Any], key: str, default: Any) -> Any:
    """``config[key]``, or what a file written before the key existed ran: ``default``; for
    ``max_hold_s`` (2026-12-07), the one bound of then, on the whole hold: ``max_wait_s``."""
    if key in config:
        return default if config[key] is None else config[key]
    if key == "max_hold_s":
        return config.get("max_wait_s")
    return default


def check_same_streams(base: str, other: str) -> None:
    """Stop, naming the first difference, when the bench JSON ``other`` ran other streams than
    ``base``: other seeds, settings in another order, another load, size, noise, bound or pool
    catalogue (found by review: only family names were matched, so a checkpoint benched with its
    ``--workflows`` in another order was divided by the baselines of other arrival draws). Files
    without a ``config`` are not checked; paths compare by their last part (another checkout)."""
    a, b = (_load(p).get("config") for p in (base, other))
    if not a or not b:
        return
    for key, default in _SAME_STREAMS.items():
        mine, theirs = (_setting(c, key, default) for c in (b, a))
        if mine != theirs:
            raise SystemExit(f"{other}: {key} {mine!r}, and {base} ran {theirs!r}: other streams")
    families = [[family(w) for w in c.get("workflows", [])] for c in (a, b)]
    if families[0] != families[1]:
        raise SystemExit(f"{other}: settings {families[1]}, and {base} ran {families[0]}: each stream is drawn "
                         "from its seed and its position, so these are other streams")
    if Path(str(a.get("pools"))).name != Path(str(b.get("pools"))).name:
        raise SystemExit(f"{other}: pools {b.get('pools')}, and {base} ran {a.get('pools')}")


def _best(table: dict[str, dict[str, float]]) -> dict[str, float]:
    """The best baseline's value per setting family."""
    out: dict[str, float] = {}
    for policy, row in table.items():
        if policy != "drl":
            for key, v in row.items():
                out[key] = min(out.get(key, math.inf), v)
    return out


def _lowest(tables: list[dict[str, dict[str, float]]], cells: list[tuple[int, str]]) -> str:
    """The baseline with the lowest geometric mean over ``cells`` (table index, setting family),
    among those that ran in every one of them."""
    ok = [p for p in tables[0] if p != "drl" and all(k in tables[i].get(p, {}) for i, k in cells)]
    if not ok:
        raise SystemExit(f"no baseline ran on every seed of {', '.join(sorted({k for _, k in cells}))}")
    return min(ok, key=lambda p: _geomean([tables[i][p][k] for i, k in cells]))


def _families(table: dict[str, dict[str, float]]) -> set[str]:
    return {k for p, row in table.items() if p != "drl" for k in row}


def best_fixed(tables: list[dict[str, dict[str, float]]]) -> str:
    """The baseline with the lowest geometric mean over every (setting, seed) cell it ran in all."""
    return _lowest(tables, [(i, k) for i, t in enumerate(tables) for k in _families(t)])


def per_setting_rules(tables: list[dict[str, dict[str, float]]]) -> dict[str, str]:
    """Per setting family, the baseline with the lowest geometric mean over all the seeds."""
    return {k: _lowest(tables, [(i, k) for i in range(len(tables))])
            for k in sorted(set().union(*map(_families, tables)))}


#: the bench JSON's columns a ratio is taken of (each an objective, lower is better)
METRICS = ("mean_jct_s", "p95_jct_s", "sla_violation_rate", "cost")


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="prefix of the baselines' JSON (BASE-S.json)")
    ap.add_argument("models", nargs="+", help="NAME=PREFIX of each checkpoint's JSON (PREFIX-S.json)")
    ap.add_argument("--seeds", nargs="+", required=True, help="the first seed of each bench run")
    ap.add_argument("--metric", default="mean_jct_s",
                    choices=METRICS,
                    help="the column compared (default: mean JCT)")
    ap.add_argument("--reference", default="per-setting-best",
                    choices=["per-setting-best", "per-setting-rule", "best-fixed"],
                    help="divide by the best baseline of each setting and seed (default), by one "
                         "baseline per setting chosen over all seeds, or by the best fixed one")
    args = ap.parse_args()
    if len(set(args.seeds)) != len(args.seeds):  # found by review: a seed listed twice counted twice
        raise SystemExit(f"--seeds: {next(x for x in args.seeds if args.seeds.count(x) > 1)} is listed twice")
    refs, said = references(args.base, args.seeds, args.metric, args.reference)
    if said:
        print(said)
    for spec in args.models:
        name, _, prefix = spec.partition("=")
        per_seed, overall, per_family = ratios(args.base, prefix or name, args.seeds, args.metric, refs)
        families = " / ".join(f"{k} {v:.3f}" for k, v in per_family.items())
        print(f"{name}: {' / '.join(f'{x:.3f}' for x in per_seed)}  mean {overall:.3f}  ({families})")


def references(base: str, seeds: list[str], metric: str,
               reference: str = "per-setting-best") -> tuple[dict[str, dict[str, float]], str]:
    """The reference value of ``metric`` per seed pair and setting family (``--reference``), and
    what the output says of it (the rule or baseline chosen; empty for the per-seed best)."""
    bases = {seed: _table(f"{base}-{seed}.json", metric) for seed in seeds}  # read once
    bests = {seed: _best(t) for seed, t in bases.items()}
    if reference == "per-setting-rule":
        rules = per_setting_rules(list(bases.values()))
        refs = {seed: {k: t[p][k] for k, p in rules.items()} for seed, t in bases.items()}
        gaps = {k: _geomean([bests[seed][k] / refs[seed][k] for seed in bases]) for k in rules}
        return refs, "per-setting rule: " + " / ".join(f"{k} {p} (the per-seed best is {gaps[k]:.3f} x it)"
                                                       for k, p in rules.items())
    if reference == "best-fixed":
        fixed = best_fixed(list(bases.values()))
        refs = {seed: t[fixed] for seed, t in bases.items()}
        gap = _geomean([bests[seed][k] / v for seed, ref in refs.items() for k, v in ref.items()])
        return refs, (f"best fixed baseline: {fixed}; the per-setting best is {gap:.3f} x it, so 0.95 x it "
                      f"is {0.95 / gap:.3f} x the per-setting best")
    return bests, ""


def ratios(base: str, prefix: str, seeds: list[str], metric: str,
           refs: dict[str, dict[str, float]]) -> tuple[list[float], float, dict[str, float]]:
    """drl's ``metric`` in ``PREFIX-S.json`` over ``refs`` (:func:`references`): the geometric mean
    per seed pair, over every setting and seed pair, and per setting family."""
    per_seed: list[float] = []
    per_family: dict[str, list[float]] = {}
    for seed in seeds:
        best = refs[seed]
        check_same_streams(f"{base}-{seed}.json", f"{prefix}-{seed}.json")
        path = f"{prefix}-{seed}.json"
        mine = _table(path, metric).get("drl")
        if not mine:  # found by review: KeyError 'drl'
            raise SystemExit(f"{path}: no drl row (bench the checkpoint with --policies drl)")
        missing = sorted(set(mine) - set(best))
        if missing:  # found by review: KeyError on a family the baselines did not run
            raise SystemExit(f"{path}: drl ran {', '.join(missing)}, which {base}-{seed}.json has no "
                             "baseline for")
        ratio = {k: v / best[k] for k, v in mine.items()}
        per_seed.append(_geomean(list(ratio.values())))
        for k, v in ratio.items():
            per_family.setdefault(k, []).append(v)
    overall = _geomean([v for vs in per_family.values() for v in vs])
    return per_seed, overall, {k: _geomean(v) for k, v in per_family.items()}


if __name__ == "__main__":
    main()
