"""``drl-trainer makespan``: each DAG alone on an idle cluster, its makespan against the makespan bound.

The check of issue 3 against an independent figure: single DAGs of the shared WfInstances on
speeds 1/2/4 with 8/4/2 workers, insertion HEFT at a median makespan / lower bound of at most 1.05::

    drl-trainer makespan --workflows ../shared/workflows/wfinstances \\
        --pools policy/catalogues/speeds-1-2-4.yaml --policies heft,srpt+eft

Every DAG arrives alone at t = 0 with no duration noise, no failures and no dispatch latency
(:class:`~trainer.simulator.SimConfig` defaults), so the simulated makespan is the schedule's
own length; the bound is :func:`trainer.bounds.makespan_lb`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from policy.catalogue import Catalogue, load_catalogue
from policy.schema import RunGraph
from trainer.baselines import expand, make_placer
from trainer.bench import text_table
from trainer.bounds import critical_path_lb, makespan_lb
from trainer.options import int_arg, output_file, policies
from trainer.simulator import Job, Simulator
from trainer.workloads import load_templates

DEFAULT_POOLS = Path(__file__).resolve().parent.parent / "policy" / "catalogues" / "speeds-1-2-4.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workflows", required=True,
                        help="WfFormat files/folders or a generator name (comma list, as in bench)")
    parser.add_argument("--pools", default=str(DEFAULT_POOLS), help="pool catalogue YAML (default: speeds 1/2/4)")
    parser.add_argument("--policies", type=policies, default="heft",
                        help="comma list; 'baselines' expands to every baseline")
    parser.add_argument("--seed", type=int_arg(0, "--seed"), default=0,
                        help="seed of the generators and placers (>= 0)")
    parser.add_argument("--json", dest="json_path", type=output_file, default=None,
                        help="write the rows and medians here")


def single_dag_rows(graphs: Sequence[RunGraph], catalogue: Catalogue, policies: Sequence[str],
                    seed: int = 0) -> list[dict[str, Any]]:
    """One row per DAG: its bounds, and each policy's makespan and makespan / bound."""
    rows = []
    for graph in graphs:
        lb = makespan_lb(graph, catalogue)
        row: dict[str, Any] = {"workflow": graph.run_key, "tasks": len(graph.tasks),
                               "critical_path_lb_s": critical_path_lb(graph, catalogue),
                               "makespan_lb_s": lb}
        for policy in policies:
            placer = make_placer(policy, catalogue, seed)
            span = Simulator(catalogue, [Job(graph, 0.0)], placer, seed=seed).run().makespan_s
            row[f"{policy}_makespan_s"] = span
            row[f"{policy}_over_lb"] = span / lb if lb > 0 else 1.0
        best = min(policies, key=lambda p: row[f"{p}_over_lb"])
        row["best_policy"], row["best_over_lb"] = best, row[f"{best}_over_lb"]
        rows.append(row)
    return rows


def medians(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> dict[str, float]:
    """policy (and ``best``: the best policy of each DAG) -> median over the DAGs of makespan / bound."""
    return {p: statistics.median(r[f"{p}_over_lb"] for r in rows) for p in (*policies, "best")}


def table(rows: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    """The rows as text, one column of makespan / bound per policy, then the best of them."""
    cols = [*policies, "best"] if len(policies) > 1 else list(policies)
    head = ["workflow", "tasks", "CP LB s", "makespan LB s", *[f"{p} /LB" for p in cols]]
    body = [[r["workflow"], str(r["tasks"]), f"{r['critical_path_lb_s']:.1f}", f"{r['makespan_lb_s']:.1f}",
             *[f"{r[f'{p}_over_lb']:.3f}" for p in cols]] for r in rows]
    med = medians(rows, policies)
    body.append(["median", "", "", "", *[f"{med[p]:.3f}" for p in cols]])
    return "\n".join(text_table(head, body))


def run(args: argparse.Namespace) -> int:
    catalogue = load_catalogue(args.pools)
    policies = expand(args.policies)
    graphs = load_templates(args.workflows, np.random.default_rng(args.seed))
    rows = single_dag_rows(graphs, catalogue, policies, args.seed)
    print(table(rows, policies))
    if args.json_path:
        out = {"config": {"workflows": args.workflows, "pools": str(args.pools), "policies": policies,
                          "seed": args.seed},
               "rows": rows, "median_over_lb": medians(rows, policies)}
        Path(args.json_path).write_text(json.dumps(out, indent=2))
    return 0
