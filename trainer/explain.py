"""``drl-trainer explain``: the evidence behind one placement decision of a checkpoint.

Simulates a job stream with the policy up to decision point ``--request`` and explains the
decision for one ready task (``--task``, default: the first task the policy sent there):

* the decision and the reason string the policy server would send (:func:`policy.gnn.explain_row`);
* gradient x input of the margin between the chosen pool's logit and the runner-up's over the
  pair features (what made this pool better than the next), over the task features summed over
  the run's nodes, and per task node of the run (:func:`policy.gnn.attribute`);
* a PNG of the run's DAG, nodes coloured by that importance (a Grad-CAM style heat map), the
  decided task outlined, finished tasks drawn hollow.

Example::

    drl-trainer explain --workflows mlpipeline --request 40 --png explain.png
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import numpy as np

from policy.catalogue import load_catalogue
from policy.errors import WorkloadError
from policy.gnn import Attribution, Decoded, GNNPlacer, attribute, explain_row
from policy.graph import view
from policy.schema import PlacementRequest
from trainer.options import float_arg, int_arg, output_file
from trainer.simulator import SimConfig, Simulator
from trainer.workloads import ArrivalSpec, load_templates, make_jobs

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = ROOT / "policy" / "checkpoints" / "default"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="checkpoint directory")
    parser.add_argument("--workflows", default="mlpipeline", help="workload setting (as in bench)")
    parser.add_argument("--pools", default=str(ROOT / "policy" / "catalogues" / "gpu-affinity.yaml"),
                        help="pool catalogue YAML (default: the GPU-affinity cluster)")
    parser.add_argument("--load", type=float_arg(0, "--load", strict=True), default=0.85,
                        help="offered work / nominal capacity of the simulated stream (as in bench)")
    parser.add_argument("--duration-noise", type=float_arg(0, "--duration-noise"),
                        default=0.3, help="log-normal sigma of realised run times (as in bench)")
    parser.add_argument("--dag-runs", type=int_arg(1, "--dag-runs"), default=20,
                        help="DAG runs in the simulated stream")
    parser.add_argument("--seed", type=int_arg(0, "--seed"), default=0,
                        help="seed of the stream and its run times (>= 0)")
    parser.add_argument("--request", type=int_arg(0, "--request"), default=10,
                        help="explain the decision at this decision point (0 = the first; the first after it "
                             "where the policy sends a task)")
    parser.add_argument("--task", default=None, help="task_id to explain (default: first one sent)")
    parser.add_argument("--top", type=int_arg(1, "--top"), default=8,
                        help="how many nodes and features to list")
    # checked before the simulation (found by review: a missing folder was a traceback after it)
    parser.add_argument("--png", type=output_file, default="explain.png",
                        help="write the DAG heat map here ('' = none)")


def find_decision(args: argparse.Namespace, placer: GNNPlacer) -> tuple[PlacementRequest, Decoded, int]:
    """Run the stream with ``placer`` to decision point ``args.request`` (or the first after it
    where the policy sends a task); decode it there. A stream that ends before is a
    :class:`~policy.errors.WorkloadError` saying how many decision points it had."""
    catalogue = load_catalogue(args.pools)
    templates = load_templates(args.workflows, np.random.default_rng([args.seed, 3]))
    jobs = make_jobs(templates, catalogue, args.dag_runs, np.random.default_rng([args.seed, 7]),
                     ArrivalSpec(load=args.load))
    sim = Simulator(catalogue, jobs, seed=args.seed, config=SimConfig(duration_noise=args.duration_noise))
    request = sim.reset()
    k = 0
    found: tuple[PlacementRequest, Decoded] | None = None
    while request is not None:
        dec = placer.decode(request, sim.graphs)
        if dec.placed_order and k >= args.request:
            found = (request, dec)
            break
        k += 1
        request = sim.step(placer.place(request, sim.graphs))
    if found is None:
        # found by review: the stream's last decision was explained as if it were the one asked for
        raise WorkloadError(f"--request {args.request}: the stream ({args.dag_runs} DAG runs of "
                            f"{args.workflows!r}, seed {args.seed}) has {k} decision points, and the policy "
                            f"sends no task at or after decision point {args.request}")
    request, dec = found
    if args.task is None:
        row = dec.placed_order[0]
    else:
        rows = [i for i, r in enumerate(request.ready) if r.task_id == args.task]
        if not rows:
            raise SystemExit(f"task {args.task!r} is not ready at decision point {k}; ready: "
                             f"{[r.task_id for r in request.ready][:20]}")
        row = rows[0]
    return request, dec, row


def _outcome(dec: Decoded, row: int) -> str:
    choice = int(dec.actions[row])
    if choice >= 0:
        return f"sent to {dec.batch.pools[choice].name}"
    # -1 is also a late-bound row: chosen at a step, on a busy pool, not sent (found by review:
    # said "stop chosen" of a decoding that chose none)
    chosen = [s.action[1] for s in dec.steps if s.action is not None and s.action[0] == row]
    if chosen:
        return f"reserved the next slot of {dec.batch.pools[chosen[0]].name} (busy), not sent yet"
    return "held (stop chosen before it)"


def report(request: PlacementRequest, dec: Decoded, row: int, att: Attribution, top: int) -> str:
    fb = dec.batch
    ready = fb.ready[row]
    rf = fb.runs[int(fb.ready_run[row])]
    g = rf.view
    lines = [
        f"decision point at t={request.created_at:.1f}s: {fb.num_ready} ready tasks, "
        f"{len(fb.runs)} runs, pools " + ", ".join(
            f"{p.name}(busy {p.busy}/{p.slots}, queued {p.queued})" for p in fb.pools),
        f"task {ready.task_id} of run {ready.run_key}: " + _outcome(dec, row),
        f"reason: {explain_row(dec, row)}",
        f"margin over the runner-up: {att.margin:+.3f} (logit units)",
        "",
        "pair features (chosen minus runner-up, gradient x input):",
    ]
    for name, v in sorted(att.pair.items(), key=lambda kv: -abs(kv[1]))[:top]:
        lines.append(f"  {name:18s} {v:+.3f}")
    lines.append("task features over the run's nodes (|gradient x input|, summed):")
    assert att.task_features is not None and att.nodes is not None
    for name, v in sorted(att.task_features.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {name:18s} {v:.3f}")
    total = float(att.nodes.sum()) or 1.0
    lines.append(f"DAG nodes that drove it (share of node attribution, top {top}):")
    for i in np.argsort(-att.nodes)[:top]:
        t = g.graph.tasks[int(i)]
        lines.append(f"  {t.task_id:24s} {att.nodes[i] / total:6.1%}  kind={t.kind} dur={t.duration_s:.0f}s "
                     f"rank={g.rank[int(i)]:.0f}s children={len(g.children[int(i)])}")
    return "\n".join(lines)


def draw(dec: Decoded, row: int, att: Attribution, request: PlacementRequest, path: str) -> None:
    """The run's DAG, layered by depth, nodes coloured by attribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fb = dec.batch
    rf = fb.runs[int(fb.ready_run[row])]
    g = view(rf.view.graph)
    n = len(g.graph.tasks)
    depth = [0] * n
    for i in g.order:
        for c in g.children[i]:
            depth[c] = max(depth[c], depth[i] + 1)
    layers: dict[int, list[int]] = {}
    for i in range(n):
        layers.setdefault(depth[i], []).append(i)
    pos = {}
    for d, nodes in layers.items():
        for k, i in enumerate(nodes):
            pos[i] = (d, k - (len(nodes) - 1) / 2)
    assert att.nodes is not None
    imp = att.nodes / (att.nodes.max() or 1.0)
    prog = {p.run_key: p for p in request.progress}.get(rf.run_key)
    finished = set(prog.finished) if prog else set()
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(layers)), max(4, 0.35 * max(len(v) for v in layers.values()))))
    for p, c in g.graph.edges:
        ax.plot([pos[p][0], pos[c][0]], [pos[p][1], pos[c][1]], color="0.8", lw=0.6, zorder=1)
    cmap = plt.get_cmap("inferno_r")
    for i in range(n):
        done = g.graph.tasks[i].task_id in finished
        ax.scatter(*pos[i], s=90, color="white" if done else cmap(imp[i]), edgecolors=cmap(imp[i]) if done else "0.3",
                   linewidths=1.5 if done else 0.5, zorder=2)
    me = int(fb.ready_node[row])
    ax.scatter(*pos[me], s=260, facecolors="none", edgecolors="tab:blue", linewidths=2.5, zorder=3)
    sm = plt.cm.ScalarMappable(cmap=cmap)
    fig.colorbar(sm, ax=ax, label="relative importance |grad x input|")
    choice = int(dec.actions[row])
    where = fb.pools[choice].name if choice >= 0 else "held"
    ax.set_title(f"{fb.ready[row].task_id} -> {where} (run {rf.run_key})\n"
                 "hollow = finished, blue ring = the decided task", fontsize=9)
    ax.set_xlabel("depth in the DAG")
    ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")  # what --png names, whatever its extension
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    placer = GNNPlacer.from_checkpoint(args.checkpoint)
    request, dec, row = find_decision(args, placer)
    att = attribute(placer.models, dec, row)
    print(f"checkpoint {args.checkpoint} ({placer.version})")
    print(report(request, dec, row, att, args.top))
    if args.png:
        draw(dec, row, att, request, args.png)
        print(f"wrote {args.png}")
    return 0


def explain_json(att: Attribution) -> dict[str, Any]:
    """The attribution as plain JSON (for tools)."""
    return {"margin": att.margin, "pair": att.pair, "task_features": att.task_features,
            "nodes": None if att.nodes is None else att.nodes.tolist(), "chosen": att.chosen,
            "runner_up": att.runner_up}
