"""Workloads: the three seed families, real traces, and arrival processes.

Seed families (from the source documents; 7 sizes x 4 topologies each, durations in seconds at
speed 1.0):

=============  ==========================================  ======  =====================
family         shape                                        tasks   duration
=============  ==========================================  ======  =====================
``montecarlo`` layered fan-out with an aggregation tail     20-80   LogNormal(4.5, 0.8)
``mlpipeline`` mostly a chain with checkpoint branches      15-50   Gamma(k=3, theta=40)
``etl``        star: many sources into a hub                30-120  Weibull(lambda=100, k=1.2)
=============  ==========================================  ======  =====================

Task kinds make the GPU-affinity cluster matter: ML ``train`` steps are ``gpu_train`` and its
evaluations ``inference`` (a GPU box runs them 8x / 4x faster); Monte Carlo simulations are 1 in
4 ``inference``; ETL hubs need 32 GB of memory (only big VM classes hold them).

Arrivals: :func:`poisson_jobs` draws a stream at a target *load* = offered work per second /
cluster capacity, capacity = sum over pools of ``workers x slots_per_worker x speed`` (the
catalogue's nominal workers; speed-1 seconds of work per second).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from policy.catalogue import Catalogue
from policy.errors import WorkloadError
from policy.replay import ReplayRun, read_replay
from policy.schema import PoolState, RunGraph, TaskNode
from trainer.bounds import critical_path_lb
from trainer.simulator import Job

log = logging.getLogger(__name__)

FAMILIES = ("montecarlo", "mlpipeline", "etl")
SIZES: dict[str, tuple[int, int]] = {"montecarlo": (20, 80), "mlpipeline": (15, 50), "etl": (30, 120)}
N_SIZES = 7
N_TOPOLOGIES = 4


def family_sizes(family: str) -> list[int]:
    """The 7 task counts of a family, evenly spread over its range."""
    lo, hi = SIZES[_check_family(family)]
    return [int(round(x)) for x in np.linspace(lo, hi, N_SIZES)]


def _check_family(family: str) -> str:
    if family not in SIZES:
        raise ValueError(f"unknown workload family {family!r}; expected one of {FAMILIES}")
    return family


def _durations(family: str, rng: np.random.Generator, n: int) -> list[float]:
    if family == "montecarlo":
        d = rng.lognormal(4.5, 0.8, n)
    elif family == "mlpipeline":
        d = rng.gamma(3.0, 40.0, n)
    else:
        d = 100.0 * rng.weibull(1.2, n)
    return [max(1.0, round(float(x), 3)) for x in d]


class _Builder:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.kinds: list[str] = []
        self.mem: list[float] = []
        self.edges: list[tuple[int, int]] = []

    def add(self, name: str, kind: str = "default", mem: float = 2.0, parents: Sequence[int] = ()) -> int:
        i = len(self.names)
        self.names.append(f"{name}_{i}")
        self.kinds.append(kind)
        self.mem.append(mem)
        self.edges.extend((p, i) for p in parents)
        return i

    def build(self, run_key: str, durations: list[float]) -> RunGraph:
        tasks = tuple(
            TaskNode(task_id=nm, duration_s=durations[i], kind=self.kinds[i], memory_gb=self.mem[i])
            for i, nm in enumerate(self.names)
        )
        return RunGraph(run_key=run_key, tasks=tasks, edges=tuple(self.edges))


def _montecarlo(b: _Builder, n: int, topo: int, rng: np.random.Generator) -> None:
    split = b.add("split")
    body = n - 2 - (topo == 1) * 3
    kind = lambda: "inference" if rng.random() < 0.25 else "default"  # noqa: E731
    if topo == 0:  # one wide fan-out
        sims = [b.add("simulate", kind(), parents=[split]) for _ in range(body)]
    elif topo == 1:  # grouped fan-out with partial reductions
        groups = [b.add("partition", parents=[split]) for _ in range(3)]
        sims = [b.add("simulate", kind(), parents=[groups[k % 3]]) for k in range(body)]
    elif topo == 2:  # two layers: simulate then post-process pairs
        half = max(1, body // 2)
        first = [b.add("simulate", kind(), parents=[split]) for _ in range(half)]
        sims = [b.add("postprocess", parents=[first[k % half]]) for k in range(body - half)] or first
    else:  # independent chains of three
        sims = []
        prev: list[int] = []
        for k in range(body):
            parent = split if k % 3 == 0 else prev[-1]
            prev.append(b.add("step", kind(), parents=[parent]))
            if k % 3 == 2 or k == body - 1:
                sims.append(prev[-1])
    b.add("aggregate", mem=8.0, parents=sims)


def _mlpipeline(b: _Builder, n: int, topo: int, rng: np.random.Generator) -> None:
    ingest = b.add("ingest")
    if topo == 1:  # two feature branches merging into the training chain
        fa = b.add("features_a", parents=[ingest])
        fb = b.add("features_b", parents=[ingest])
        last = b.add("join", parents=[fa, fb])
    elif topo == 2:
        last = b.add("prepare", parents=[ingest])
    else:
        last = ingest
    evals: list[int] = []
    every = 3 if topo != 3 else 2
    while len(b.names) < n - 1:
        if topo == 2 and len(b.names) < n - 3:  # a sweep: parallel trainings off one prepare step
            t = b.add("train", "gpu_train", mem=16.0, parents=[last])
            evals.append(b.add("evaluate", "inference", parents=[t]))
            continue
        last = b.add("train", "gpu_train", mem=16.0, parents=[last])
        if len(b.names) % every == 0 and len(b.names) < n - 1:
            evals.append(b.add("checkpoint_eval", "inference", parents=[last]))
    b.add("report", parents=[last, *evals] if topo != 0 else [last])


def _etl(b: _Builder, n: int, topo: int, rng: np.random.Generator) -> None:
    if topo == 0:  # sources -> hub -> two sinks
        srcs = [b.add("extract") for _ in range(n - 3)]
        hub = b.add("merge", mem=32.0, parents=srcs)
        b.add("load", parents=[hub])
        b.add("publish", parents=[hub])
    elif topo == 1:  # each source transformed before the hub
        k = (n - 1) // 2
        srcs = [b.add("extract") for _ in range(k)]
        tr = [b.add("transform", parents=[s]) for s in srcs]
        b.add("merge", mem=32.0, parents=tr + [b.add("extract") for _ in range(n - 1 - 2 * k)])
    elif topo == 2:  # regional hubs then a global hub
        regions = 4
        k = n - regions - 1
        srcs = [b.add("extract") for _ in range(k)]
        hubs = [b.add("regional_merge", mem=32.0, parents=srcs[r::regions]) for r in range(regions)]
        b.add("global_merge", mem=32.0, parents=hubs)
    else:  # star in, fan out after the hub
        k = n // 2
        srcs = [b.add("extract") for _ in range(k)]
        hub = b.add("merge", mem=32.0, parents=srcs)
        for _ in range(n - k - 1):
            b.add("load", parents=[hub])


_SHAPES: dict[str, Callable[[_Builder, int, int, np.random.Generator], None]] = {
    "montecarlo": _montecarlo, "mlpipeline": _mlpipeline, "etl": _etl,
}


def seed_graph(family: str, size: int, topology: int, rng: np.random.Generator,
               run_key: str | None = None) -> RunGraph:
    """One DAG of ``family`` with about ``size`` tasks in topology ``0..3``."""
    _check_family(family)
    if not 0 <= topology < N_TOPOLOGIES:
        raise ValueError(f"topology must be in 0..{N_TOPOLOGIES - 1}, got {topology!r}")
    if size < 6:
        raise ValueError(f"size must be at least 6, got {size!r}")
    b = _Builder()
    _SHAPES[family](b, size, topology, rng)
    return b.build(run_key or f"{family}-s{size}-t{topology}", _durations(family, rng, len(b.names)))


def seed_dataset(family: str, rng: np.random.Generator) -> list[RunGraph]:
    """The 28 (7 sizes x 4 topologies) DAGs of one family, durations drawn from ``rng``."""
    return [seed_graph(family, s, t, rng) for s in family_sizes(family) for t in range(N_TOPOLOGIES)]


def with_run_key(graph: RunGraph, run_key: str) -> RunGraph:
    """The same graph under another run key (its digest, which covers only content, is kept)."""
    return dataclasses.replace(graph, run_key=run_key)


def nominal_capacity(catalogue: Catalogue) -> float:
    """Seconds of speed-1 work the cluster does per second at its nominal worker counts."""
    return sum(p.workers * p.slots_per_worker * p.vm_class.speed for p in catalogue.pools)


@dataclass(frozen=True)
class ArrivalSpec:
    """How runs arrive: ``poisson`` at ``load``, or ``burst`` (groups of ``burst_size`` at once)."""

    load: float = 0.85
    process: str = "poisson"
    burst_size: int = 10
    #: SLA deadline = arrival + ``sla_factor`` x the job's critical-path lower bound
    sla_factor: float = 2.0

    def __post_init__(self) -> None:
        if not self.load > 0:
            raise ValueError(f"load must be > 0, got {self.load!r}")
        if self.process not in ("poisson", "burst"):
            raise ValueError(f"arrival process must be 'poisson' or 'burst', got {self.process!r}")
        if self.burst_size < 1:
            raise ValueError(f"burst_size must be >= 1, got {self.burst_size!r}")


def make_jobs(templates: Sequence[RunGraph], catalogue: Catalogue, n_runs: int,
              rng: np.random.Generator, spec: ArrivalSpec | None = None) -> list[Job]:
    """``n_runs`` runs drawn uniformly from ``templates``, arriving as ``spec`` says."""
    if not templates:
        raise ValueError("no workflow templates to draw runs from")
    if n_runs < 1:
        raise ValueError(f"n_runs must be >= 1, got {n_runs!r}")
    spec = spec or ArrivalSpec()
    picks = rng.integers(0, len(templates), n_runs)
    mean_work = float(np.mean([sum(t.duration_s for t in templates[k].tasks) for k in picks]))
    rate = spec.load * nominal_capacity(catalogue) / max(mean_work, 1e-9)
    if spec.process == "poisson":
        arrivals = np.cumsum(rng.exponential(1.0 / rate, n_runs))
        arrivals -= arrivals[0]
    else:
        groups = np.arange(n_runs) // spec.burst_size
        gaps = np.cumsum(rng.exponential(spec.burst_size / rate, groups[-1] + 1))
        arrivals = gaps[groups] - gaps[0]
    jobs = []
    lbs: dict[str, float] = {}
    for j, (k, a) in enumerate(zip(picks, arrivals, strict=True)):
        tpl = templates[int(k)]
        lb = lbs.get(tpl.digest)
        if lb is None:
            fit, why = runnable(tpl, catalogue.states())
            if fit is None:  # found by review: a WfFormat template with a task no pool holds stopped
                # the first simulation ("left 4 ready task(s) unplaced"), naming neither run nor task
                raise WorkloadError(f"template {tpl.run_key!r}: {why} of the catalogue {catalogue.source}")
            lb = lbs[tpl.digest] = critical_path_lb(tpl, catalogue)
        g = with_run_key(tpl, f"{tpl.run_key}#{j}")
        jobs.append(Job(g, float(a), float(a) + spec.sla_factor * lb))
    return jobs


REPLAY_PREFIX = "replay:"


def replay_jobs(path: str | Path, catalogue: Catalogue, sla_factor: float = 2.0) -> list[Job]:
    """The recorded runs of a replay file (:mod:`policy.replay`, e.g. exported from production
    traces) as jobs arriving at their recorded times, each with its recorded graph and durations."""
    kept, left_out = read_runnable(path, catalogue)
    if not kept and not left_out:
        raise WorkloadError(f"{path}: the replay file holds no runs")
    jobs = []
    for j, run in kept:
        lb = critical_path_lb(run.graph, catalogue)
        g = with_run_key(run.graph, f"{run.graph.run_key}#{j}")
        jobs.append(Job(g, run.arrival_s, run.arrival_s + sla_factor * lb))
    if not jobs:
        raise WorkloadError(f"{path}: no run of the replay file can run on these pools")
    return jobs


def read_runnable(path: str | Path, catalogue: Catalogue) -> tuple[list[tuple[int, ReplayRun]], int]:
    """The runs of a replay file (in arrival order) as the simulator can run them on
    ``catalogue``'s pools (:func:`runnable`), each with its place in the file; and how many were
    left out (each logged)."""
    pools = catalogue.states()
    kept, left_out = [], 0
    for j, run in enumerate(read_replay(path)):
        graph, why = runnable(run.graph, pools)
        if graph is None:
            log.warning("%s: run %s left out: %s", path, run.graph.run_key, why)
            left_out += 1
        else:
            kept.append((j, dataclasses.replace(run, graph=graph)))
    return kept, left_out


def runnable(graph: RunGraph, pools: Sequence[PoolState]) -> tuple[RunGraph | None, str]:
    """``graph`` as the simulator can run it on ``pools``: a pin no pool honours (a pool not in
    the catalogue, or one too small for the task) is dropped, as production placed that task off
    its pin (``policy.placement.unfit``; was: the simulator refused every decision for it, and a
    nightly fine-tune on such a replay stopped with "left 2 ready task(s) unplaced"); None, and
    why, when a task fits no pool at all."""
    tasks = list(graph.tasks)
    for i, t in enumerate(tasks):
        if t.pool is not None and not any(p.fits(t) for p in pools):
            tasks[i] = t = dataclasses.replace(t, pool=None)
        if not any(p.fits(t) for p in pools):
            return None, f"task {t.task_id!r} ({t.asks}) fits no pool"
    if tasks == list(graph.tasks):
        return graph, ""
    return RunGraph(run_key=graph.run_key, tasks=tuple(tasks), edges=graph.edges), ""


def load_templates(spec: str, rng: np.random.Generator) -> list[RunGraph]:
    """Templates from a spec: comma list of WfFormat files/folders and generator names.

    Generator names: ``montecarlo``, ``mlpipeline``, ``etl`` (28 DAGs each) or ``seed`` (all three);
    ``wfcommons:RECIPE:TASKS[:COUNT]`` for synthetic instances of a WfCommons recipe
    (:mod:`trainer.recipes`).
    """
    from trainer import recipes
    from trainer.wfformat import load_wfformat

    out: list[RunGraph] = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item == "seed":
            for fam in FAMILIES:
                out.extend(seed_dataset(fam, rng))
        elif item in SIZES:
            out.extend(seed_dataset(item, rng))
        elif item.startswith(recipes.PREFIX):
            out.extend(recipes.generate(item, rng))
        else:
            path = Path(item)
            if path.is_dir():
                files = sorted(path.glob("*.json"))
                if not files:
                    raise WorkloadError(f"{path}: no *.json WfFormat files in this folder")
                out.extend(load_wfformat(f) for f in files)
            elif path.exists():
                out.append(load_wfformat(path))
            else:
                raise WorkloadError(f"workflow spec {item!r} is neither a file, a folder nor one of "
                                 f"{('seed', *FAMILIES)}")
    if not out:
        raise WorkloadError(f"workflow spec {spec!r} names no workflows")
    return out
