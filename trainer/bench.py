"""``drl-trainer bench``: simulate policies on workloads and report metrics against lower bounds.

Each ``--workflows`` value is one *setting* (a generator name -- ``seed``, ``montecarlo``,
``mlpipeline``, ``etl`` -- or WfFormat files / folders, comma-separated). For every setting and
seed the same job stream (Poisson at ``--load``) and the same realised durations are given to every
policy. Prints a table per setting, marks the per-setting best baseline (``best``) and the best
fixed baseline (``fixed``: the single policy with the lowest geometric mean of mean JCT over the
settings), and writes JSON / PNG plots on request::

    drl-trainer bench --workflows seed --pools policy/catalogues/gpu-affinity.yaml \\
        --policies baselines --load 0.85 --dag-runs 200 --seeds 3 --duration-noise 0.3 \\
        --json bench.json --plots plots/
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from policy.catalogue import Catalogue, load_catalogue
from policy.errors import WorkloadError
from policy.features import CP_GATE_SCOPES, HOLD_RATIO, check_hold_ratio, check_premium_ratio
from trainer.baselines import LEARNED, expand, make_placer
from trainer.metrics import Bounds, average, summarize
from trainer.options import checked, float_arg, int_arg, output_file, output_folder, policies, probability
from trainer.simulator import SCALE_IN_RULES, Job, SimConfig, SimResult, Simulator, executor_holds
from trainer.workloads import REPLAY_PREFIX, ArrivalSpec, load_templates, make_jobs, replay_jobs

log = logging.getLogger(__name__)

DEFAULT_POOLS = Path(__file__).resolve().parent.parent / "policy" / "catalogues" / "gpu-affinity.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workflows", action="append", default=None,
                        help="a setting: 'seed', 'montecarlo', 'mlpipeline', 'etl', "
                             "'wfcommons:RECIPE:TASKS[:COUNT]', or WfFormat files/folders (comma list); "
                             "'replay:FILE.jsonl' replays recorded runs at their recorded arrival times "
                             "(--load and --dag-runs do not apply); repeat for several settings "
                             "(default: seed)")
    parser.add_argument("--pools", default=str(DEFAULT_POOLS), help="pool catalogue YAML")
    parser.add_argument("--policies", type=policies, default="baselines",
                        help="comma list of policies; 'baselines' expands to every baseline")
    parser.add_argument("--load", type=float_arg(0, "--load", strict=True), default=0.85,
                        help="offered work / nominal capacity (a finite number > 0)")
    parser.add_argument("--arrival", choices=("poisson", "burst"), default="poisson",
                        help="arrival process of the DAG runs at --load: poisson, or burst (groups of 10 at once, "
                             "the groups Poisson; trainer/workloads.py); default: %(default)s")
    parser.add_argument("--dag-runs", type=int_arg(1, "--dag-runs"), default=200,
                        help="DAG runs per simulation")
    parser.add_argument("--checkpoint", default=None,
                        help="checkpoint folder of the 'drl' policy (default: policy/checkpoints/default); "
                             "several joined by commas: their ensemble (mean logits, the first one's decoder settings)")
    parser.add_argument("--seed", type=int_arg(0, "--seed"), default=0,
                        help="first seed (>= 0)")
    parser.add_argument("--seeds", type=int_arg(1, "--seeds"), default=1,
                        help="number of seeds (seed, seed+1, ...)")
    parser.add_argument("--duration-noise", type=float_arg(0, "--duration-noise"),
                        default=0.3, help="log-normal sigma of run times")
    parser.add_argument("--failure-rate", type=checked(lambda v: probability(v, "--failure-rate")), default=0.0,
                        help="probability a try fails, in [0, 1)")
    parser.add_argument("--dispatch-latency", type=float_arg(0, "--dispatch-latency"),
                        default=0.0, help="seconds per dispatch")
    parser.add_argument("--scale-in", choices=SCALE_IN_RULES, default="sustained",
                        help="how elastic pools scale in (trainer/cluster.py): sustained (every figure so far) "
                             "or window (Kubernetes HPA's stabilisation window, which KEDA uses)")
    parser.add_argument("--max-wait-s", type=float_arg(0, "--max-wait-s"), default=None,
                        help="bound holding as the executor does ([drl_executor] max_wait_s, 60 there): a task "
                             "held this long while a pool that fits it has a free slot is placed by the fallback "
                             "heuristic (default: unbounded)")
    parser.add_argument("--max-hold-s", type=float_arg(0, "--max-hold-s"), default=None,
                        help="the executor's other bound ([drl_executor] max_hold_s): a task held this long in all "
                             "is placed by the fallback heuristic (default: with --max-wait-s, the executor's "
                             "default, max(--max-wait-s, 300), else unbounded; equal to --max-wait-s: the single "
                             "bound of versions before 2026-12-07, which every bounded figure measured before "
                             "then used)")
    parser.add_argument("--max-active-tasks", type=int_arg(1, "--max-active-tasks"), default=None,
                        help="Airflow's [core] max_active_tasks_per_dag (per DAG run; 16 by default there): the "
                             "scheduler hands the executor at most this many tasks of one run queued (held "
                             "included) or running (default: no limit, as every figure before 2026-12-07 night)")
    parser.add_argument("--pool-slots", type=int_arg(1, "--pool-slots"), default=None,
                        help="the slots of Airflow's default_pool (128 by default there): at most this many tasks "
                             "of all runs queued (held included) or running (default: no limit)")
    parser.add_argument("--parallelism", type=int_arg(1, "--parallelism"), default=None,
                        help="Airflow's [core] parallelism (32 by default there): at most this many tasks sent to "
                             "Celery and not finished; held tasks do not count (default: no limit)")
    parser.add_argument("--hold-ratio", type=checked(check_hold_ratio), default=None,
                        help="the 'drl' policy's stop guard: stop (hold) is refused while a remaining task has a "
                             "free feasible pool finishing within this factor of its best (default: inf, "
                             "work-conserving; 1: only while its best pool is free, the rule through 8d49468)")
    parser.add_argument("--reserve-busy", type=int, choices=(0, 1), default=None,
                        help="the 'drl' policy's late binding: 1 = a task it gives a pool with no free slot "
                             "reserves that slot and waits, 0 = it is sent (default: as the checkpoint was trained)")
    parser.add_argument("--cp-gate", type=checked(functools.partial(check_premium_ratio, name="--cp-gate")),
                        default=None,
                        help="the 'drl' policy's premium gate: a task off its run's critical path may not take a pool "
                             "priced over this factor x its cheapest feasible one per unit of its work (cost-cp's "
                             "rule after the policy; 0 = off; default: as the checkpoint was trained)")
    parser.add_argument("--cp-gate-scope", choices=CP_GATE_SCOPES, default=None,
                        help="the tasks the premium gate applies to: off-cp (those off their run's critical "
                             "path) or all (every task; default: as the checkpoint was trained)")
    parser.add_argument("--jobs", type=int_arg(1, "--jobs"), default=1,
                        help="worker processes")
    # the output paths are checked here, before any simulation (found by review: a missing folder
    # was a traceback after the whole bench, and --json was written when --markdown then failed)
    parser.add_argument("--json", dest="json_path", type=output_file, default=None, help="write the results here")
    parser.add_argument("--markdown", type=output_file, default=None, help="write the tables as Markdown here")
    parser.add_argument("--plots", type=output_folder, default=None,
                        help="write PNG plots into this folder (made if missing)")


def one_torch_thread() -> None:
    """A ``--jobs`` worker runs torch on one thread: the workers already share the cores, and a
    worker with torch's default (a thread a core) spent 1.4x the CPU for the same figures (measured
    2026-12-07 on 2 cores; the learned policy's decisions do not depend on the thread count)."""
    os.environ["OMP_NUM_THREADS"] = "1"  # for a torch imported later in the worker
    torch = sys.modules.get("torch")  # inherited from the parent (fork)
    if torch is not None:
        torch.set_num_threads(1)


def _simulate(catalogue: Catalogue, jobs: list[Job], policy: str, seed: int, config: SimConfig,
              bounds: Bounds, keep: bool, checkpoint: str | None = None, hold_ratio: float | None = None,
              reserve_busy: int | None = None, cp_gate: float | None = None,
              cp_gate_scope: str | None = None) -> tuple[dict[str, Any], SimResult | None]:
    placer = make_placer(policy, catalogue, seed, checkpoint, hold_ratio,
                         None if reserve_busy is None else bool(reserve_busy), cp_gate, cp_gate_scope)
    result = Simulator(catalogue, jobs, placer, seed=seed, config=config).run()
    row = summarize(result, bounds)
    row["policy"] = policy
    return row, (result if keep else None)


def setting_jobs(spec: str, position: int, seed: int, catalogue: Catalogue, dag_runs: int,
                 load: float = 0.85, arrival: str = "poisson") -> list[Job]:
    """The stream the bench simulates for setting ``spec`` at ``position`` of its ``--workflows``
    list and ``seed``: drawn from ``(seed, position)``, so one spec at another position is another
    stream; a ``replay:`` spec gives its recorded runs at their recorded arrival times."""
    if spec.startswith(REPLAY_PREFIX):
        return replay_jobs(spec[len(REPLAY_PREFIX):], catalogue)
    rng = np.random.default_rng([seed, position])
    return make_jobs(load_templates(spec, rng), catalogue, dag_runs, rng, ArrivalSpec(load=load, process=arrival))


def _geomean(values: list[float]) -> float:
    return float(math.exp(np.mean([math.log(max(v, 1e-12)) for v in values])))


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    catalogue = load_catalogue(args.pools)
    policies = expand(args.policies)
    settings = args.workflows or ["seed"]
    repeated = sorted({s for s in settings if settings.count(s) > 1})
    if repeated:
        # found by review: the per-setting best is keyed by the setting, so the second stream's
        # overwrote the first's and the first was divided by the other stream's best
        raise WorkloadError(f"--workflows {', '.join(repeated)} given twice: one stream per setting (a second "
                            "would be other arrival draws; use --seeds for more)")
    max_wait_s, max_hold_s = executor_holds(args.max_wait_s, args.max_hold_s)
    config = SimConfig(duration_noise=args.duration_noise, failure_rate=args.failure_rate,
                       dispatch_latency_s=args.dispatch_latency, max_wait_s=max_wait_s, max_hold_s=max_hold_s,
                       scale_in=args.scale_in, max_active_tasks=args.max_active_tasks,
                       pool_slots=args.pool_slots, parallelism=args.parallelism)
    seeds = [args.seed + k for k in range(args.seeds)]
    work = []
    for s, spec in enumerate(settings):
        for seed in seeds:
            jobs = setting_jobs(spec, s, seed, catalogue, args.dag_runs, args.load, args.arrival)
            bounds = Bounds(jobs, catalogue)
            for policy in policies:
                keep = bool(args.plots) and s == 0 and seed == seeds[0]
                work.append(((s, seed, policy), (catalogue, jobs, policy, seed, config, bounds, keep,
                                                 args.checkpoint, args.hold_ratio, args.reserve_busy, args.cp_gate,
                                                 args.cp_gate_scope)))
    t0 = time.perf_counter()
    done: dict[tuple[int, int, str], tuple[dict[str, Any], SimResult | None]] = {}
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, initializer=one_torch_thread) as pool:
            futures = {key: pool.submit(_simulate, *a) for key, a in work}
            for key, fut in futures.items():
                done[key] = fut.result()
    else:
        for key, a in work:
            done[key] = _simulate(*a)
    wall = time.perf_counter() - t0
    results = []
    for s, spec in enumerate(settings):
        for policy in policies:
            row = average([done[(s, seed, policy)][0] for seed in seeds])
            row["setting"] = spec
            row["seeds"] = len(seeds)
            row["events_per_s"] = row["events"] / row["wall_s"] if row["wall_s"] > 0 else 0.0
            results.append(row)
    # The references are baselines only: the learned policy is measured against them.
    baselines = [p for p in policies if p != LEARNED] or policies
    best = {}
    for spec in settings:
        rows = [r for r in results if r["setting"] == spec and r["policy"] in baselines]
        best[spec] = min(rows, key=lambda r: r["mean_jct_s"])["policy"]
    geo = {p: _geomean([r["mean_jct_s"] for r in results if r["policy"] == p]) for p in policies}
    fixed = min(baselines, key=lambda p: geo[p])
    by_key = {(r["setting"], r["policy"]): r for r in results}
    for r in results:
        r["per_setting_best"] = r["policy"] == best[r["setting"]]
        r["best_fixed"] = r["policy"] == fixed
        r["mean_jct_over_per_setting_best"] = r["mean_jct_s"] / by_key[(r["setting"], best[r["setting"]])]["mean_jct_s"]
        r["mean_jct_over_best_fixed"] = r["mean_jct_s"] / by_key[(r["setting"], fixed)]["mean_jct_s"]
    out = {
        "config": {
            "workflows": settings, "pools": str(args.pools), "policies": policies, "load": args.load,
            "arrival": args.arrival, "dag_runs": args.dag_runs, "seeds": seeds,
            "duration_noise": args.duration_noise, "failure_rate": args.failure_rate,
            "dispatch_latency_s": args.dispatch_latency, "max_wait_s": config.max_wait_s,
            "max_hold_s": config.max_hold_s, "scale_in": args.scale_in,
            "max_active_tasks": args.max_active_tasks, "pool_slots": args.pool_slots,
            "parallelism": args.parallelism,
            "hold_ratio": str(HOLD_RATIO if args.hold_ratio is None else args.hold_ratio),
            "reserve_busy": "checkpoint" if args.reserve_busy is None else args.reserve_busy,
            "cp_gate": "checkpoint" if args.cp_gate is None else args.cp_gate,
            "cp_gate_scope": args.cp_gate_scope or "checkpoint", "wall_s": wall,
        },
        "results": results,
        "references": {
            "per_setting_best": best,
            "best_fixed": {"policy": fixed, "geomean_mean_jct_s": geo[fixed]},
            "geomean_mean_jct_s": geo,
        },
    }
    if args.plots:
        from trainer import plots

        folder = Path(args.plots)
        folder.mkdir(parents=True, exist_ok=True)
        for s, spec in enumerate(settings):
            rows = sorted([r for r in results if r["setting"] == spec], key=lambda r: r["mean_jct_s"])
            plots.metric_bars(rows, folder / f"metrics-{s}.png", title=spec)
        for policy in policies:
            res = done[(0, seeds[0], policy)][1]
            if res is not None:
                plots.gantt(res, folder / f"gantt-{policy.replace('+', '_')}.png")
    return out


COLUMNS = (
    ("mean_jct_s", "mean JCT s", "{:.0f}"), ("mean_jct_over_per_setting_best", "/best", "{:.3f}"),
    ("mean_jct_over_best_fixed", "/fixed", "{:.3f}"), ("p95_jct_s", "p95 JCT s", "{:.0f}"),
    ("mean_slowdown", "slowdown", "{:.2f}"), ("mean_jct_over_lb", "JCT/LB", "{:.2f}"),
    ("mean_jct_over_stream_lb", "JCT/streamLB", "{:.2f}"), ("makespan_s", "makespan s", "{:.0f}"),
    ("cost", "cost $", "{:.1f}"), ("sla_violation_rate", "SLA viol.", "{:.1%}"),
    ("mean_utilization", "util.", "{:.1%}"), ("decisions_per_s", "decisions/s", "{:.0f}"),
    ("events_per_s", "events/s", "{:.0f}"),
)


def text_table(head: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """Aligned text lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
            for row in [head, *body]]


def tables(out: dict[str, Any], markdown: bool = False) -> str:
    lines = []
    for spec in out["config"]["workflows"]:
        rows = sorted([r for r in out["results"] if r["setting"] == spec], key=lambda r: r["mean_jct_s"])
        head = ["policy", *[c[1] for c in COLUMNS]]
        body = []
        for r in rows:
            mark = (" **best**" if r["per_setting_best"] else "") + (" *fixed*" if r["best_fixed"] else "")
            if not markdown:
                mark = mark.replace("*", "")
            body.append([r["policy"] + mark, *[fmt.format(r[k]) for k, _, fmt in COLUMNS]])
        lines.append(f"\nsetting: {spec}")
        if markdown:
            lines.append("")
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "---|" * len(head))
            lines.extend("| " + " | ".join(row) + " |" for row in body)
        else:
            lines.extend(text_table(head, body))
    ref = out["references"]["best_fixed"]
    lines.append(f"\nbest fixed baseline: {ref['policy']} "
                 f"(geometric mean of mean JCT {ref['geomean_mean_jct_s']:.0f} s)")
    learned = [r for r in out["results"] if r["policy"] == LEARNED]
    if learned:
        vs_fixed = _geomean([r["mean_jct_over_best_fixed"] for r in learned])
        vs_best = _geomean([r["mean_jct_over_per_setting_best"] for r in learned])
        worst = max(learned, key=lambda r: r["mean_jct_over_per_setting_best"])
        lines.append(f"{LEARNED}: mean JCT / best fixed {vs_fixed:.3f} (geometric mean over settings), "
                     f"/ per-setting best {vs_best:.3f}; worst setting {worst['setting']} "
                     f"{worst['mean_jct_over_per_setting_best']:.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    out = run_bench(args)
    print(tables(out))
    print(f"simulated in {out['config']['wall_s']:.1f} s")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(tables(out, markdown=True) + "\n")
    return 0
