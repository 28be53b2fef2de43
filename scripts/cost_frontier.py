"""Where does the money go, and how much of it can a placement rule save? (issue 4's cost goal)

    python scripts/cost_frontier.py [--lams 300,500] [--cp 2,3-free,3-all,3-ride,3-near0.9,3-slack1]
        [--checkpoints DIR,DIR@3,DIR@3/all,...] [--seeds 0 1] [--load 0.85] [--jobs 2]

Simulates the held-out settings of the benchmark (Epigenomics traces, BWA and SoyKB recipes of
~200 tasks; GPU-affinity cluster, duration noise 0.3, 30 DAG runs per stream, the streams
``drl-trainer bench`` draws for ``--seed S``) under the cost-blind list rules, ``cost-aware``,
``cost-cp`` and a *boot-aware* EFT rule, and prints each policy's mean JCT and cost (total and
per pool, with the share of the pool's billed slot-seconds that ran a task and the tasks it ran)
with both as ratios to the cost-blind per-setting best (the lowest mean JCT of ``srpt+eft``,
``rcp+eft``, ``fifo+eft``); ``--checkpoints`` adds learned policies.

The boot-aware rule (``boot-<lam>``) is ``srpt+eft`` with a pool's estimated finish charged
``lam`` seconds per dollar of VM time the choice commits: a free slot of a live worker costs the
task's share of that worker (run time x price / slots per worker); a choice that makes an elastic
pool grow costs a whole new worker from boot to scale-down (boot delay + run time +
``idle_scale_down_s``, the autoscaler's 300 s idle tail that dominates the bill of a short
task on a booted VM). ``lam`` = 0 is ``srpt+eft``.
"""

from __future__ import annotations

import argparse
import glob
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

from policy.catalogue import Catalogue, load_catalogue
from policy.placement import Placer
from policy.schema import PoolState, ReadyTask, TaskNode
from trainer.baselines import make_placer
from trainer.baselines.rules import INF, CriticalPathCost, ListScheduler, run_time
from trainer.bench import one_torch_thread, setting_jobs
from trainer.options import finite_at_least, float_arg, int_arg
from trainer.simulator import SCALE_IN_RULES, SimConfig, Simulator

W = "../shared/workflows/wfinstances"
NAMES = ("Epigenomics", "BWA", "SoyKB")
COST_BLIND = ("srpt+eft", "rcp+eft", "fifo+eft")


def settings() -> list[str]:
    epi = ",".join(sorted(glob.glob(f"{W}/*epigenomics*.json")))
    if not epi:
        raise SystemExit(f"no Epigenomics traces under {W} (run from the repository root)")
    return [epi, "wfcommons:bwa:200:3", "wfcommons:soykb:200:3"]


class BootAware(ListScheduler):
    """``srpt+eft`` whose pool choice adds ``lam`` x the dollars of VM time it commits."""

    def __init__(self, catalogue: Catalogue, lam: float) -> None:
        super().__init__("srpt", "eft", catalogue)
        self.lam = lam
        self.spec = {p.name: p for p in catalogue.pools}
        self.name = f"boot-{lam:g}"

    def committed_dollars(self, pool: PoolState, run_s: float, free_at: float) -> float:
        led, spec = self.ledger, self.spec[pool.name]
        per_s = pool.price_per_hour / 3600.0
        boots = (not led.has_free_slot(pool) and led.can_grow(pool)
                 and free_at >= led.now + spec.boot_delay_s - 1e-9)
        if boots:  # the free slot is a worker that this task makes the autoscaler boot
            return per_s * (spec.boot_delay_s + run_s + spec.idle_scale_down_s)
        return per_s * run_s / spec.slots_per_worker

    def _place_eft(self, out: list, ready: ReadyTask, task: TaskNode, pools: list[PoolState],
                   margin: float | None) -> None:
        led = self.ledger
        best: tuple[tuple[float, float, str], PoolState, float] | None = None
        for p in pools:
            run_s = run_time(task, p)
            free_at = led.free_at(p)
            if free_at == INF:
                continue
            finish = free_at + run_s
            key = (finish - led.now + self.lam * self.committed_dollars(p, run_s, free_at),
                   p.price_per_hour, p.name)
            if best is None or key < best[0]:
                best = (key, p, finish)
        if best is None:
            return
        _, p, finish = best
        if led.has_free_slot(p) or led.can_grow(p):
            self._send(out, ready, p, run_time(task, p), f"boot-aware eft {finish - led.now:.1f}s on {p.name}")
        else:
            self._reserve(ready, p, finish)


def simulate(
    args: tuple[str, int, str, int, str, float, str],
) -> tuple[int, int, str, float, float, dict[str, tuple[float, float, float, int]]]:
    spec, pos, pools, seed, name, load, scale_in = args
    catalogue = load_catalogue(pools)
    jobs = setting_jobs(spec, pos, seed, catalogue, 30, load)
    placer: Placer
    if name.startswith("boot-"):
        placer = BootAware(catalogue, float(name[5:]))
    elif name.startswith("cp-"):
        # cp-<ratio>[-free|-all][-ride[<f>]][-near<f>][-slack<k>][-soft<s>][-noboot<k>][-fifo|-rcp]
        ratio, *flags = name[3:].split("-")
        opt = {k: f[len(k):] for f in flags for k in ("ride", "near", "slack", "soft", "noboot") if f.startswith(k)}
        placer = CriticalPathCost(catalogue, ratio=float(ratio), premium_free_slots="free" in flags,
                                  every_task="all" in flags, ride=float(opt["ride"] or 1) if "ride" in opt else 0.0,
                                  near=float(opt.get("near", 1)),
                                  slack=float(opt["slack"]) if "slack" in opt else None,
                                  soft=float(opt["soft"]) if "soft" in opt else None,
                                  noboot=float(opt["noboot"]) if "noboot" in opt else None,
                                  order=next((f for f in flags if f in ("fifo", "rcp")), "srpt"))
    elif name.startswith("drl:"):  # a learned policy: drl:CHECKPOINT[@GATE[/all]] (GATE: cp_gate)
        ckpt, _, gate = name[4:].partition("@")
        gate, _, scope = gate.partition("/")
        placer = make_placer("drl", catalogue, seed, checkpoint=ckpt, cp_gate=float(gate) if gate else None,
                             cp_gate_scope=scope or None)
    else:
        placer = make_placer(name, catalogue, seed)
    sim = Simulator(catalogue, jobs, placer, seed=seed, config=SimConfig(duration_noise=0.3, scale_in=scale_in))
    res = sim.run()
    jct = sum(j.jct_s for j in res.jobs) / len(res.jobs)
    tasks = Counter(t.pool for t in res.tasks)
    return pos, seed, name, jct, res.cost, {p.name: (p.cost, p.busy_slot_s, p.capacity_slot_s, tasks[p.name])
                                            for p in sim._pools}


def _lams(text: str) -> str:
    """``--lams`` as given, once each item reads as a finite number >= 0."""
    for x in (x for x in text.split(",") if x):
        try:
            finite_at_least(float(x), 0, "--lams")
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--lams: {x!r}: {exc}") from None
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # checked where parsed: one line with exit status 2, not a traceback from a worker process
    # (found by review)
    ap.add_argument("--lams", default="300,500", type=_lams, help="comma list of boot-aware weights (s per $)")
    ap.add_argument("--seeds", type=int_arg(0, "--seeds"), nargs="+", default=[0, 1])
    ap.add_argument("--load", type=float_arg(0, "--load", strict=True), default=0.85)
    ap.add_argument("--cp", default="", help="comma list of cost-cp variants: RATIO, RATIO-free "
                    "(tasks with slack may also take a premium pool's free slot), RATIO-all (no task may "
                    "take a premium pool), RATIO-ride[<F>] (a free slot that a running task keeps billed), "
                    "RATIO-near<F>, RATIO-slack<K>, RATIO-soft<S> (a second tier within S x the cheapest, "
                    "with -slack<K>), RATIO-noboot<K> (no boot for a task with slack unless it gains over K x "
                    "its slack), RATIO-fifo / -rcp (CriticalPathCost's options); "
                    "flags combine: 3-ride-fifo")
    ap.add_argument("--checkpoints", default="", help="comma list of learned-policy checkpoints to add, "
                    "each DIR, DIR@GATE (decoded with that cp_gate: premium pools only for critical-path tasks) "
                    "or DIR@GATE/all (the gate for every task)")
    ap.add_argument("--pools", default="policy/catalogues/gpu-affinity.yaml")
    ap.add_argument("--jobs", type=int_arg(1, "--jobs"), default=1)
    ap.add_argument("--scale-in", choices=SCALE_IN_RULES, default="sustained",
                    help="elastic pools' scale-in rule (trainer/cluster.py; window: as Kubernetes HPA / KEDA)")
    args = ap.parse_args()
    names = [*COST_BLIND, "cost-aware", "cost-cp", *(f"boot-{float(x):g}" for x in args.lams.split(",") if x),
             *(f"cp-{x}" for x in args.cp.split(",") if x),
             *(f"drl:{x}" for x in args.checkpoints.split(",") if x)]
    specs = settings()
    work = [(spec, pos, args.pools, s, n, args.load, args.scale_in) for pos, spec in enumerate(specs)
            for s in args.seeds for n in names]
    with ProcessPoolExecutor(args.jobs, initializer=one_torch_thread) as ex:
        results = list(ex.map(simulate, work))
    k = len(args.seeds)
    agg: dict[tuple[int, str], list] = {}
    for pos, _, name, jct, cost, per in results:
        a = agg.setdefault((pos, name), [0.0, 0.0, {}])
        a[0] += jct / k
        a[1] += cost / k
        for pool, (c, busy, billed, n) in per.items():
            old = a[2].get(pool, (0.0, 0.0, 0.0, 0))
            a[2][pool] = (old[0] + c / k, old[1] + busy, old[2] + billed, old[3] + n)
    print(f"seeds {args.seeds}, load {args.load}, scale-in {args.scale_in}; ratios to the cost-blind "
          "per-setting best (lowest mean JCT)")
    for pos, label in enumerate(NAMES):
        ref = min(COST_BLIND, key=lambda n: agg[(pos, n)][0])
        j0, c0 = agg[(pos, ref)][:2]
        print(f"{label} (best: {ref}, {j0:.1f} s, ${c0:.2f})")
        for name in names:
            jct, cost, per = agg[(pos, name)]
            pools = "  ".join(f"{p} ${c:.2f} ({busy / max(billed, 1e-9):.0%} busy, {n} tasks)"
                              for p, (c, busy, billed, n) in per.items())
            print(f"  {name:12s} JCT {jct:8.1f} s ({jct / j0:.3f})  cost ${cost:7.2f} ({cost / c0:.3f})  {pools}")


if __name__ == "__main__":
    main()
