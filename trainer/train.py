"""``drl-trainer train``: train the GNN placement policy in the simulator.

One readable loop, CleanRL style (``cleanrl/ppo.py``): an :class:`Args` dataclass is the CLI,
scalars are logged by ``global_step`` under ``losses/``, ``charts/`` and ``eval/`` prefixes (a
JSON-lines file ``log.jsonl`` next to the checkpoint, and TensorBoard event files in ``tb/``
when ``tensorboardX`` is installed, as it is with the ``trainer`` extra).

**Imitation (DAgger)** of the per-setting best heuristic. For each training setting (a workload
family) the candidate baselines are simulated once on a probe stream and the one with the lowest
objective becomes that setting's *teacher* (``--teacher`` names one instead). Each iteration
simulates a fresh job stream per setting; at every decision point the teacher's reply is turned
into decoding steps (its dispatch order, each (task, pool) choice, then "stop" for the tasks it
holds) and stored; the stream is driven by the teacher with probability ``beta`` and by the
student otherwise (DAgger, Ross et al. 2011: the student learns to recover from its own states);
``beta`` decays linearly to ``beta_final``. The loss is the cross-entropy of the teacher's steps
under :meth:`~policy.model.PlacementGNN.step_forward`, minus an entropy bonus, plus
``pool_loss`` x the cross-entropy of the teacher's *pool* (the step's probability summed over
the rows, :attr:`~policy.model.StepScores.logp_pool`): with a cost weight the pool (premium or
not, or hold) is the decision that sets cost, while the order among equally good rows is not,
and the exact-row loss alone spends the model on that order. The curriculum
grows the episode from ``runs_start`` to ``runs_end`` DAG runs.

**Policy gradient** (``--rl-iters N``, :mod:`trainer.rl`): after imitation (or instead of it,
``--iters 0 --init CHECKPOINT`` to fine-tune an existing checkpoint), PPO in the simulator with
Decima's practices: K rollouts per iteration on the same job stream, an input-dependent
(time-indexed) baseline, differential returns, a curriculum of DAG sizes and episode lengths, a
decaying entropy bonus, rewards normalised by the setting's best heuristic on the same stream,
and the best weights kept by periodic evaluation. The ``--rl-*`` flags are documented on
:class:`Args` and in :mod:`trainer.rl`.

The objective is configuration: ``--objective mean_jct`` (default), ``p95_jct``,
``sla_violation_rate`` or ``cost``, plus ``--cost-weight`` (objective + w x cost, scaled by the
first candidate's result). It picks each setting's teacher, so the student imitates the best
heuristic *for that objective*, and it is the reward of the RL phase (how each objective becomes
a reward between decisions is in :mod:`trainer.rl`).

The command that reproduces the default checkpoint is stored in its ``manifest.json``
(``training.command``) and shown in ``docs/policy.md``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np
import torch

from policy.catalogue import Catalogue, load_catalogue
from policy.checkpoint import load_checkpoint, save_checkpoint
from policy.config import field_docs
from policy.errors import CheckpointError
from policy.features import (
    CP_GATE_SCOPE,
    FEATURE_SCHEMA_VERSION,
    HOLD_RATIO,
    READY_COLUMNS,
    FeatureBatch,
    check_gate_scope,
    check_premium_ratio,
    guard_fit,
    pair_dynamic,
    pool_free_within,
)
from policy.gnn import GNNPlacer
from policy.inputs import untrained_since
from policy.model import ModelConfig, PlacementGNN, Step, check_row_bias_weight, collate_steps, upgraded
from policy.placement import Placer
from policy.registry import OBJECTIVES
from policy.schema import Decision, PlacementRequest, RunGraph
from trainer.baselines import make_placer
from trainer.metrics import Bounds, summarize
from trainer.options import finite_at_least, int_at_least, nearest_existing, policy_names
from trainer.simulator import Job, SimConfig, Simulator, executor_holds
from trainer.workloads import ArrivalSpec, load_templates, make_jobs

log = logging.getLogger(__name__)
T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
METRIC = {"mean_jct": "mean_jct_s", "p95_jct": "p95_jct_s", "sla_violation_rate": "sla_violation_rate",
           "cost": "cost"}


@dataclass
class Args:
    """Training configuration; every field is a ``--flag`` (underscores become dashes)."""

    #: training settings: workload families or WfFormat paths, ';'-separated (one teacher each)
    workflows: str = "montecarlo;mlpipeline"
    #: held-out settings evaluated at the end (never trained on), ';'-separated
    heldout: str = "etl"
    #: pool catalogue
    pools: str = str(ROOT / "policy" / "catalogues" / "gpu-affinity.yaml")
    #: offered load and duration noise of the simulated streams
    load: float = 0.85
    duration_noise: float = 0.3
    #: bound holds as the executor does (its ``max_wait_s``, 60 there): a task held this long while
    #: a pool that fits it has a free slot is placed by the fallback heuristic, in imitation, PPO and
    #: evaluation alike; 0 = unbounded
    max_wait_s: float = 0.0
    #: with ``max_wait_s``, the executor's bound on the whole hold (its ``max_hold_s``); 0 = its
    #: default, max(max_wait_s, 300). Checkpoints trained before 2026-12-07 had one bound, on the
    #: whole hold: ``max_hold_s = max_wait_s``
    max_hold_s: float = 0.0
    #: Airflow's concurrency limits on what the scheduler hands the executor, in imitation, PPO and
    #: evaluation alike (``SimConfig``; docs/policy.md, "Airflow's concurrency limits"): tasks of
    #: one run queued (held included) or running (``[core] max_active_tasks_per_dag``, 16 by
    #: default there), of all runs (``default_pool``'s slots, 128), sent and not finished
    #: (``[core] parallelism``, 32); 0 = no limit
    max_active_tasks: int = 0
    pool_slots: int = 0
    parallelism: int = 0
    #: 1: the policy decodes with late binding on busy pools (``policy.features.RESERVE_BUSY``):
    #: a task it gives a pool with no free slot reserves that slot and waits; imitation learns
    #: the teacher's reservations; the checkpoint records it and decodes so when loaded
    reserve_busy: int = 0
    #: > 0: the decoder's guards (work-conserving stop, late binding) do not count a pool priced
    #: more than this factor x the task's cheapest feasible one per unit of its work
    #: (``policy.features.PREMIUM_RATIO``; ``cost-cp``'s premium pools), so holding a task off a
    #: free premium slot is a step the policy can take and imitation can teach; the checkpoint
    #: records it and decodes so when loaded; 0 = off
    premium_ratio: float = 0.0
    #: > 0: premium pools (priced more than this factor x the task's cheapest feasible one per
    #: unit of its work) are masked for tasks off their run's remaining critical path, in
    #: imitation, PPO and evaluation (``policy.features.CP_GATE``, ``cost-cp``'s rule as a hard
    #: constraint); the checkpoint records it and decodes so when loaded; 0 = off
    cp_gate: float = 0.0
    #: the tasks ``cp_gate`` applies to: off-cp (those off their run's critical path) or all
    #: (every task; ``policy.features.CP_GATE_SCOPES``); recorded like ``cp_gate``
    cp_gate_scope: str = CP_GATE_SCOPE
    #: domain randomisation of time scale: each imitation and PPO stream has its task durations
    #: multiplied by one factor drawn log-uniformly from [1 / time_scale, time_scale], so the
    #: policy meets short and long jobs against the same boot delays; teacher choice and
    #: evaluation streams keep the real durations; 1 = off
    time_scale: float = 1.0
    #: teacher: 'auto' = per-setting best of ``candidates``; or one baseline name
    teacher: str = "auto"
    #: streams of ``eval_runs`` DAG runs each that 'auto' scores the candidates on (the mean of
    #: the objective over them); a p95 of one 30-run stream is its 2nd-longest run, so one stream
    #: can pick a different teacher with each seed
    teacher_streams: int = 1
    #: the baselines 'auto' chooses each setting's teacher from (comma list; with ``cost_weight``
    #: the first one's result scales the cost term)
    candidates: str = "srpt+eft,srpt+eftm,fifo+eft,rcp+eft,cost-aware,heft,min-min"
    #: objective to minimise (see the module docstring) and the weight of cost on top of it
    objective: str = "mean_jct"
    cost_weight: float = 0.0
    #: model size
    hidden: int = 32
    layers: int = 3
    #: 1: a learned weight on SRPT's key (``run_work_left_ratio``) added to every pair logit of
    #: its row, a direct path for the run order (``policy.model.ModelConfig.row_bias``); 0 = off
    #: (an ``--init`` model keeps its own); with ``--init``, its model gains one (or has its own
    #: reset) at ``row_bias_init`` and keeps its other weights
    row_bias: int = 0
    #: the row bias's weight ``k`` at the start (with ``row_bias``); negative: SRPT's run first
    row_bias_init: float = 0.0
    #: 1: the row bias's weight stays at ``row_bias_init`` (a prior the other weights train
    #: around); 0: it is learned
    row_bias_fixed: int = 0
    #: feature schema the new model reads (an older one reads its leading ready columns; the
    #: default is this code's newest)
    feature_schema: int = FEATURE_SCHEMA_VERSION
    #: imitation iterations (one simulated stream per setting each) and curriculum of DAG runs
    iters: int = 24
    runs_start: int = 10
    runs_end: int = 40
    #: DAgger: probability the teacher drives the stream, from 1.0 down to ``beta_final``
    beta_final: float = 0.2
    #: optimisation
    epochs: int = 2
    batch_requests: int = 32
    lr: float = 3e-3
    ent_coef: float = 0.01
    #: weight of the cross-entropy of the teacher's pool, summed over the step's rows, on top of
    #: that of its exact (row, pool) choice (0 = off)
    pool_loss: float = 0.0
    #: keep at most this many recorded requests (oldest dropped)
    buffer: int = 30_000
    #: evaluation: DAG runs per stream and streams per setting (seeds eval_seed, eval_seed+1, ...)
    eval_runs: int = 60
    eval_streams: int = 2
    eval_seed: int = 10_000
    #: seed of everything else
    seed: int = 1
    #: torch threads
    threads: int = 2
    #: where the checkpoint and log.jsonl go
    out: str = "runs/gnn"
    #: stop the imitation loop after this many seconds (0 = no limit)
    time_limit_s: float = 0.0
    #: start from this checkpoint's weights instead of a fresh model (its size wins over
    #: ``hidden``/``layers``); with ``--iters 0`` only the RL phase runs
    init: str = ""
    #: --- policy-gradient phase (trainer/rl.py); 0 iterations = imitation only ---
    rl_iters: int = 0
    #: rollouts per iteration, all on the same job stream (Decima's shared arrival sequence)
    rl_rollouts: int = 4
    #: curriculum: DAG runs per episode, and the fraction of each setting's DAGs (smallest
    #: first) used at the first iteration; both grow linearly to their end values
    rl_runs_start: int = 6
    rl_runs_end: int = 20
    rl_size_start: float = 0.5
    #: sampling temperature of the rollouts (1 = the policy's own distribution, as PPO assumes)
    rl_temperature: float = 1.0
    #: PPO: learning rate, clip coefficient, epochs, minibatch of decision points, grad-norm clip
    rl_lr: float = 3e-4
    rl_clip_coef: float = 0.2
    rl_epochs: int = 3
    rl_batch_requests: int = 64
    rl_max_grad_norm: float = 0.5
    #: discount horizon of the returns in simulated seconds (0 = undiscounted, as Decima)
    rl_horizon_s: float = 0.0
    #: entropy coefficient, decaying linearly from the first to the second value
    rl_ent_coef: float = 0.01
    rl_ent_coef_final: float = 0.001
    #: evaluate the greedy policy every this many iterations and keep the best weights (0 = never)
    rl_eval_every: int = 5
    #: stop the RL loop after this many seconds (0 = no limit)
    rl_time_limit_s: float = 0.0
    #: keep the weights that score best on these settings (a validation family, not trained on,
    #: not a test family) instead of on the training settings' evaluation streams ("" = those)
    rl_select: str = ""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not 0.0 <= self.beta_final <= 1.0:
            raise ValueError(f"beta_final must be in [0, 1], got {self.beta_final!r}")
        for name in ("iters", "runs_start", "runs_end", "epochs", "batch_requests", "eval_runs", "eval_streams",
                     "teacher_streams", "rl_iters", "rl_rollouts", "rl_runs_start", "rl_runs_end", "rl_epochs",
                     "rl_batch_requests", "rl_eval_every"):
            if getattr(self, name) < (0 if name in ("iters", "rl_iters", "rl_eval_every") else 1):
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.row_bias not in (0, 1):
            raise ValueError(f"row_bias must be 0 or 1, got {self.row_bias!r}")
        if not math.isfinite(self.row_bias_init) or (self.row_bias_init and not self.row_bias):
            raise ValueError(f"row_bias_init needs --row-bias 1 and a finite value, got {self.row_bias_init!r}")
        if self.row_bias_fixed not in (0, 1) or (self.row_bias_fixed and not self.row_bias):
            raise ValueError(f"row_bias_fixed must be 0 or 1 and needs --row-bias 1, got {self.row_bias_fixed!r}")
        check_row_bias_weight(self.row_bias_init)  # refused here, before any work, as train() would
        if self.feature_schema not in READY_COLUMNS:
            raise ValueError(f"feature_schema must be one of {sorted(READY_COLUMNS)}, got {self.feature_schema!r}")
        if self.reserve_busy not in (0, 1):
            raise ValueError(f"reserve_busy must be 0 or 1, got {self.reserve_busy!r}")
        check_premium_ratio(self.premium_ratio)
        check_premium_ratio(self.cp_gate, "cp_gate")
        check_gate_scope(self.cp_gate_scope)
        if self.pool_loss < 0:
            raise ValueError(f"pool_loss must be >= 0, got {self.pool_loss!r}")
        # found by review: each of these was a traceback from torch, numpy, the simulator or the
        # baselines, after --out was made and its log.jsonl truncated
        int_at_least(self.threads, 1, "threads")
        int_at_least(self.seed, 0, "seed")
        int_at_least(self.eval_seed, 0, "eval_seed")
        finite_at_least(self.load, 0, "load", strict=True)
        finite_at_least(self.duration_noise, 0, "duration_noise")
        finite_at_least(self.max_wait_s or 0.0, 0, "max_wait_s")  # None (older manifests) = 0 = unbounded
        finite_at_least(self.max_hold_s or 0.0, 0, "max_hold_s")
        for name in ("max_active_tasks", "pool_slots", "parallelism"):
            int_at_least(getattr(self, name), 0, name)
        policy_names(self.candidates, baselines_only=True, name="candidates")
        if self.teacher != "auto" and policy_names(self.teacher, baselines_only=True, name="teacher") != [self.teacher]:
            raise ValueError(f"teacher must be 'auto' or one baseline, got {self.teacher!r}")
        if not 0.0 < self.rl_size_start <= 1.0:
            raise ValueError(f"rl_size_start must be in (0, 1], got {self.rl_size_start!r}")
        if self.rl_temperature <= 0 or self.rl_clip_coef <= 0 or self.rl_lr <= 0:
            raise ValueError(f"rl_temperature, rl_clip_coef and rl_lr must be > 0, got {self.rl_temperature!r}, "
                             f"{self.rl_clip_coef!r}, {self.rl_lr!r}")
        # found by review: each of these passed (NaN passes every comparison above), then was a
        # torch traceback after --out was made, a NaN in summary.json, gradient ascent (a negative
        # clip norm), or an untrained model saved with exit status 0
        for name in ("lr", "rl_lr", "rl_temperature", "rl_clip_coef"):
            finite_at_least(getattr(self, name), 0, name, strict=True)
        for name in ("ent_coef", "rl_ent_coef", "pool_loss", "cost_weight", "time_limit_s", "rl_horizon_s",
                     "rl_max_grad_norm"):
            finite_at_least(getattr(self, name), 0, name)
        finite_at_least(self.time_scale, 1, "time_scale")
        int_at_least(self.buffer, 1, "buffer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, Args)


def add_dataclass_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per field of the dataclass ``cls``, its help the field's ``#:`` comment
    (``policy.config.field_docs``) and its default (``drl-trainer train`` and ``finetune``)."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        default = f.default
        flag = "--" + f.name.replace("_", "-")
        text = docs.get(f.name, "").replace("%", "%%")
        parser.add_argument(flag, type=type(default), default=default, dest=f.name,
                            help=f"{text} (default: {default!r})".lstrip())


def dataclass_args(cls: Callable[..., T], args: argparse.Namespace) -> T:
    """``cls`` built from the flags of :func:`add_dataclass_arguments`; a value its checks refuse
    ends the command with the check's message (``SystemExit``), not a traceback."""
    try:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


# --- the pieces --------------------------------------------------------------------------------


@dataclass
class Setting:
    """One training or evaluation setting: templates, and its teacher once chosen."""

    name: str
    templates: list[RunGraph]
    teacher: str = ""
    scores: dict[str, float] = field(default_factory=dict)


def objective_value(row: dict[str, Any], args: Args, ref: dict[str, Any] | None = None) -> float:
    """The configured objective of a summarised simulation (lower is better)."""
    value = float(row[METRIC[args.objective]])
    if args.cost_weight and ref is not None:
        value += args.cost_weight * float(row["cost"]) / max(float(ref["cost"]), 1e-9) * max(
            float(ref[METRIC[args.objective]]), 1e-9)
    return value


def make_stream(setting: Setting, catalogue: Catalogue, n_runs: int, seed: int, args: Args,
                randomise: bool = False) -> list[Job]:
    """The stream of ``setting`` for ``seed``; with ``randomise`` and ``args.time_scale`` > 1,
    its durations scaled by a factor drawn from the seed (see :attr:`Args.time_scale`)."""
    rng = np.random.default_rng([seed, 7])
    templates = setting.templates
    if randomise and args.time_scale > 1:
        span = math.log(args.time_scale)
        factor = math.exp(np.random.default_rng([seed, 8]).uniform(-span, span))
        templates = [time_scaled(g, factor) for g in templates]
    return make_jobs(templates, catalogue, n_runs, rng, ArrivalSpec(load=args.load))


def time_scaled(graph: RunGraph, factor: float) -> RunGraph:
    """``graph`` with every task's duration multiplied by ``factor`` (a new digest and run key)."""
    tasks = tuple(dataclasses.replace(t, duration_s=t.duration_s * factor) for t in graph.tasks)
    return dataclasses.replace(graph, tasks=tasks, digest="", run_key=f"{graph.run_key}@x{factor:.4g}")


def sim_config(args: Args) -> SimConfig:
    """The simulated world of training and evaluation streams."""
    max_wait_s, max_hold_s = executor_holds(args.max_wait_s or None, args.max_hold_s or None)
    return SimConfig(duration_noise=args.duration_noise, max_wait_s=max_wait_s, max_hold_s=max_hold_s,
                     max_active_tasks=args.max_active_tasks or None, pool_slots=args.pool_slots or None,
                     parallelism=args.parallelism or None)


def simulate(catalogue: Catalogue, jobs: list[Job], placer: Placer, seed: int, args: Args) -> dict[str, Any]:
    config = sim_config(args)
    result = Simulator(catalogue, jobs, placer, seed=seed, config=config).run()
    return summarize(result, Bounds(jobs, catalogue))


def teacher_steps(fb: FeatureBatch, decisions: Sequence[Decision],
                  trace: Sequence[tuple[str, str, str, bool]] = (), late: bool = False,
                  premium: float = 0.0, hold_ratio: float = HOLD_RATIO) -> list[Step] | None:
    """A teacher's reply as decoding steps: its dispatch order, then stop for the held tasks.

    With ``trace`` (a rule's :attr:`~trainer.baselines.rules._Rule.trace`: every task it took, in
    order, sent or reserving a busy pool's slot), the steps are the trace's (task, pool) choices,
    what a student decoding with ``reserve_busy`` replays: a reserved choice is a step on a pool
    with no free slot, which that decoder does not send. ``late``: the steps are that decoder's
    (:attr:`policy.model.Step.late`), with its guards' ``premium`` and ``hold_ratio``; trailing
    reservations become a stop where those guards allow it (:func:`_trim_reservations`)."""
    row_of = {(r.run_key, r.task_id): i for i, r in enumerate(fb.ready)}
    pool_of = {p.name: j for j, p in enumerate(fb.pools)}
    busy_anywhere = any(p.busy + p.queued > 0 for p in fb.pools)
    rows = fb.order.copy()
    placed = np.zeros(fb.num_pools)
    steps: list[Step] = []
    choices = list(trace) or [(d.run_key, d.task_id, d.pool, True) for d in decisions]
    for run_key, task_id, pool, _ in choices:
        r = row_of.get((run_key, task_id))
        j = pool_of.get(pool)
        if r is None or j is None or r not in rows or (fb.pairs.mask[r].any() and not fb.pairs.mask[r, j]):
            return None  # not a step the student can take (e.g. a pool its cp_gate masks)
        steps.append(Step(placed.copy(), rows.copy(), (r, j), bool(busy_anywhere or placed.sum() > 0), late, premium))
        placed[j] += 1
        rows = rows[rows != r]
    if len(rows):
        steps.append(Step(placed.copy(), rows.copy(), None, True, late, premium))
    return _trim_reservations(fb, steps, [sent for *_, sent in choices], premium, hold_ratio)


def _trim_reservations(fb: FeatureBatch, steps: list[Step], sent: Sequence[bool], premium: float,
                       hold_ratio: float) -> list[Step]:
    """``steps`` with the reservations after the teacher's last dispatch replaced by one stop
    where the student's guards allow that stop (no remaining task has a free feasible pool that
    counts, :func:`policy.features.pool_free_within` with :func:`~policy.features.guard_fit`).

    Nothing after them is sent, so they and the stop hold the same tasks; but a rule such as
    ``cost-cp`` reserves every remaining ready task while a premium pool has a slot (~150
    reservation steps per decision on BWA), which would bury the few steps that matter (hold or
    take the premium slot) under steps that change nothing. A reservation takes no free slot, so
    the pools' free flags are those at the first trailing reservation throughout the tail and
    the earliest legal stop is after the last reservation of a row that has such a pool."""
    tail = len(sent)
    while tail and not sent[tail - 1]:
        tail -= 1
    if tail == len(sent) or steps[tail].action is None:
        return steps

    def counted_free(st: Step) -> np.ndarray:
        """``[r]``: whether each row of ``st`` has a free pool the student's guards count."""
        d = pair_dynamic(fb.pairs, st.rows, st.placed)
        fit = guard_fit(fb.pairs, st.rows, fb.pairs.mask[st.rows], premium)
        return pool_free_within(d[:, None], fit[:, None], hold_ratio)

    at = steps[tail]
    bad = set(at.rows[counted_free(at)].tolist())
    k = tail
    for i in range(tail, len(sent)):
        act = steps[i].action
        if act is not None and act[0] in bad:
            k = i + 1
    if k >= len(sent):
        return steps
    stop = steps[k]
    if not stop.stop_ok:  # nothing runs and nothing was chosen before: the decoder must choose
        return steps
    if counted_free(stop).any():
        return steps  # a finite hold ratio: the reservations moved a row's earliest finish
    return [*steps[:k], dataclasses.replace(stop, action=None)]


def policy_placer(model: PlacementGNN, args: Args, **kwargs: Any) -> GNNPlacer:
    """The learned policy decoding as ``args`` train it (late binding, premium pools' guards and gate)."""
    return GNNPlacer(model, reserve_busy=bool(args.reserve_busy), premium_ratio=args.premium_ratio,
                     cp_gate=args.cp_gate, cp_gate_scope=args.cp_gate_scope, **kwargs)


class _Recorder:
    """Drives a simulation with teacher or student while recording the teacher's steps."""

    def __init__(self, teacher: Placer, student: GNNPlacer, use_teacher: bool) -> None:
        self.teacher, self.student, self.use_teacher = teacher, student, use_teacher
        #: learn the teacher's reservations too (the student decodes with ``reserve_busy``)
        self.reservations = student.reserve_busy
        self.samples: list[tuple[FeatureBatch, list[Step]]] = []
        self.name, self.version = "recorder", "0"

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        taught = self.teacher.place(request, graphs)
        fb = self.student.features(request, graphs)
        steps = teacher_steps(fb, taught, getattr(self.teacher, "trace", ()) if self.reservations else (),
                              self.reservations, self.student.premium_ratio, self.student.hold_ratio)
        if steps:
            self.samples.append((fb, steps))
        if self.use_teacher:
            return taught
        return self.student.place(request, graphs)


def collect(setting: Setting, catalogue: Catalogue, student: GNNPlacer, use_teacher: bool, n_runs: int,
            seed: int, args: Args) -> list[tuple[FeatureBatch, list[Step]]]:
    """Simulate one stream of ``setting`` and return the teacher's steps at every decision point."""
    jobs = make_stream(setting, catalogue, n_runs, seed, args, randomise=True)
    rec = _Recorder(make_placer(setting.teacher, catalogue, seed), student, use_teacher)
    student.clear_cache()
    config = sim_config(args)
    Simulator(catalogue, jobs, rec, seed=seed, config=config).run()
    return rec.samples


@torch.no_grad()
def imitation_nll(model: PlacementGNN, samples: Sequence[tuple[FeatureBatch, list[Step]]],
                  batch_requests: int = 64, pool: bool = False) -> float:
    """Mean negative log-likelihood of the recorded teacher steps under ``model`` (``pool``: of
    their pools, :attr:`~policy.model.StepScores.logp_pool`)."""
    model.eval()
    total, count = 0.0, 0
    for k in range(0, len(samples), batch_requests):
        scores = model.step_forward(collate_steps(samples[k : k + batch_requests]))
        logp = scores.logp_pool if pool else scores.logp
        total += float(-logp.sum())
        count += int(logp.shape[0])
    return total / max(count, 1)


def bc_update(model: PlacementGNN, opt: torch.optim.Optimizer, buffer: list[tuple[FeatureBatch, list[Step]]],
              args: Args, rng: np.random.Generator) -> dict[str, float]:
    """One pass of imitation over the buffer; returns mean loss, accuracy proxy and entropy."""
    model.train()
    losses, ents, nll, pool_nll = [], [], [], []
    for _ in range(args.epochs):
        perm = rng.permutation(len(buffer))
        for k in range(0, len(perm), args.batch_requests):
            batch = [buffer[i] for i in perm[k : k + args.batch_requests]]
            scores = model.step_forward(collate_steps(batch))
            loss = -scores.logp.mean() - args.ent_coef * scores.entropy.mean()
            if args.pool_loss:
                loss = loss - args.pool_loss * scores.logp_pool.mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            nll.append(float(-scores.logp.detach().mean()))
            pool_nll.append(float(-scores.logp_pool.detach().mean()))
            ents.append(float(scores.entropy.detach().mean()))
    model.eval()
    return {"loss": float(np.mean(losses)), "nll": float(np.mean(nll)), "entropy": float(np.mean(ents)),
            "step_acc": float(np.exp(-np.mean(nll))), "pool_acc": float(np.exp(-np.mean(pool_nll)))}


def evaluate(model: PlacementGNN, settings: Sequence[Setting], catalogue: Catalogue, args: Args,
             baselines: Sequence[str] = (), members: Sequence[PlacementGNN] = ()) -> dict[str, Any]:
    """Objective of the greedy policy (and of ``baselines``) per setting, on fixed eval streams;
    with ``members``, of the ensemble of ``model`` and them (their mean logits)."""
    out: dict[str, Any] = {}
    for s in settings:
        rows: dict[str, list[dict[str, Any]]] = {}
        for k in range(args.eval_streams):
            seed = args.eval_seed + k
            jobs = make_stream(s, catalogue, args.eval_runs, seed, args)
            placer = policy_placer(model, args, version="eval")
            if members:
                placer.with_members([(f"eval-m{i + 1}", m) for i, m in enumerate(members)])
            rows.setdefault("drl", []).append(simulate(catalogue, jobs, placer, seed, args))
            for name in baselines:
                rows.setdefault(name, []).append(simulate(catalogue, jobs, make_placer(name, catalogue, seed),
                                                          seed, args))
        out[s.name] = {
            name: {m: float(np.mean([r[m] for r in rs])) for m in ("mean_jct_s", "p95_jct_s",
                                                                    "sla_violation_rate", "cost")}
            for name, rs in rows.items()
        }
    return out


def final_evaluation(model: PlacementGNN, settings: Sequence[Setting], heldout: Sequence[Setting],
                     catalogue: Catalogue, args: Args, members: Sequence[PlacementGNN] = ()) -> dict[str, Any]:
    """The evaluation a checkpoint's manifest records: the training settings against their
    teachers and random placement, the held-out ones against ``srpt+eft`` and random."""
    return {
        "train": evaluate(model, settings, catalogue, args, members=members,
                          baselines=[*sorted({s.teacher for s in settings}), "random"]),
        "heldout": evaluate(model, heldout, catalogue, args, members=members, baselines=["srpt+eft", "random"]),
    }


def choose_teachers(settings: Sequence[Setting], catalogue: Catalogue, args: Args) -> None:
    names = [c.strip() for c in args.candidates.split(",") if c.strip()]
    for s in settings:
        if args.teacher != "auto":
            s.teacher = args.teacher
            continue
        per_stream: dict[str, list[float]] = {n: [] for n in names}
        for seed in range(args.seed + 500, args.seed + 500 + args.teacher_streams):
            jobs = make_stream(s, catalogue, args.eval_runs, seed, args)
            rows = {n: simulate(catalogue, jobs, make_placer(n, catalogue, args.seed), seed, args) for n in names}
            for n, r in rows.items():
                per_stream[n].append(objective_value(r, args, rows[names[0]]))
        s.scores = {n: float(np.mean(v)) for n, v in per_stream.items()}
        s.teacher = min(s.scores, key=lambda n: s.scores[n])
        log.info("setting %s: teacher %s (%s)", s.name, s.teacher,
                 ", ".join(f"{n} {v:.1f}" for n, v in sorted(s.scores.items(), key=lambda kv: kv[1])))


def setting_names(spec: str) -> list[str]:
    """The settings of a ';'-separated spec (``workflows``, ``heldout``, ``rl_select``)."""
    return [x.strip() for x in spec.split(";") if x.strip()]


def settings_from(spec: str, seed: int) -> list[Setting]:
    return [Setting(item, load_templates(item, np.random.default_rng([seed, 3]))) for item in setting_names(spec)]


# --- the loop ----------------------------------------------------------------------------------


def imitate(model: PlacementGNN, settings: Sequence[Setting], catalogue: Catalogue, args: Args,
            rng: np.random.Generator, record: Callable[..., None], t_start: float) -> tuple[int, float]:
    """The DAgger imitation loop (see the module docstring) on ``model``, in place; the settings'
    teachers must be chosen. Returns the number of recorded steps and the seconds since ``t_start``."""
    student = policy_placer(model, args, version="training", seed=args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    buffer: list[tuple[FeatureBatch, list[Step]]] = []
    global_step = 0
    try:
        from tqdm import tqdm

        bar: Any = tqdm(range(args.iters), desc="imitation", disable=None)
    except ImportError:  # tqdm is optional
        bar = range(args.iters)
    for it in bar:
        if args.time_limit_s and time.perf_counter() - t_start > args.time_limit_s:
            log.info("time limit reached after %d iterations", it)
            break
        frac = it / max(args.iters - 1, 1)
        beta = 1.0 - (1.0 - args.beta_final) * frac
        n_runs = int(round(args.runs_start + (args.runs_end - args.runs_start) * frac))
        for k, s in enumerate(settings):
            seed = args.seed * 1000 + it * 17 + k
            samples = collect(s, catalogue, student, bool(rng.random() < beta), n_runs, seed, args)
            buffer.extend(samples)
            global_step += sum(len(st) for _, st in samples)
        del buffer[: max(0, len(buffer) - args.buffer)]
        stats = bc_update(model, opt, buffer, args, rng)
        student.clear_cache()
        record(global_step, **{f"losses/{k}": v for k, v in stats.items()}, **{"charts/beta": beta,
               "charts/runs": n_runs, "charts/buffer": len(buffer), "charts/iter": it})
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['step_acc']:.2f}",
                            pool=f"{stats['pool_acc']:.2f}", beta=f"{beta:.2f}")
    return global_step, time.perf_counter() - t_start


#: characters TensorBoard does not allow in a tag (setting names are file lists with commas)
_TB_ILLEGAL = re.compile(r"[^-/\w.]")


def tensorboard_writer(logdir: Path) -> Any:
    """A TensorBoard event writer on ``logdir`` (``tensorboardX``, in the ``trainer`` extra), or
    None when it is not installed: log.jsonl holds the same scalars either way."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        log.info("tensorboardX is not installed: scalars go to log.jsonl only")
        return None
    return SummaryWriter(str(logdir))


def train(args: Args) -> dict[str, Any]:
    """Train, save the checkpoint into ``args.out`` and return the summary written there."""
    t_start = time.perf_counter()
    ckpt = load_checkpoint(args.init) if args.init else None  # refused before any work
    if ckpt is not None and ckpt.members:
        raise CheckpointError(f"--init {args.init}: an ensemble ({ckpt.version}) is not trained as one;"
                              " start from one of its members (manifest 'members')")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out}: a file is there; a checkpoint is a folder")
    above = nearest_existing(out.absolute())
    if above is not None and not above.is_dir():  # found by review: NotADirectoryError after the work
        raise CheckpointError(f"--out {out}: {above} is a file, not a folder to make the checkpoint in")
    # every input is read before --out is touched (found by review: a rerun refused for a typo in
    # --pools truncated the previous run's log.jsonl beside its checkpoint)
    catalogue = load_catalogue(args.pools)
    settings = settings_from(args.workflows, args.seed)
    heldout = settings_from(args.heldout, args.seed + 1) if args.heldout else []
    select = settings_from(args.rl_select, args.seed + 2) if args.rl_iters and args.rl_select else []
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    choose_teachers(settings, catalogue, args)
    # the model before --out is touched, as every input (found by review: --hidden 0 was refused
    # after the previous run's log.jsonl had been truncated)
    init_version = ""
    if ckpt is not None:
        model, init_version = upgraded(ckpt.model), ckpt.version  # an older schema gains the new columns
    else:
        model = PlacementGNN(ModelConfig(hidden=args.hidden, layers=args.layers), args.feature_schema)
    if args.row_bias:  # a new model's, or one given to --init's model (which keeps its other weights)
        model = model.with_row_bias(args.row_bias_init)
        model.row_k.requires_grad_(not args.row_bias_fixed)
    out.mkdir(parents=True, exist_ok=True)
    logf = (out / "log.jsonl").open("w")
    tb = tensorboard_writer(out / "tb")

    def record(global_step: int, **scalars: float) -> None:
        logf.write(json.dumps({"global_step": global_step, **scalars}) + "\n")
        logf.flush()
        if tb is not None:
            for tag, value in scalars.items():
                tb.add_scalar(_TB_ILLEGAL.sub("_", tag), value, global_step)

    initial = copy.deepcopy(model)  # which inputs training never moves (policy/inputs.py)
    global_step, train_s = imitate(model, settings, catalogue, args, rng, record, t_start)
    rl: dict[str, Any] = {}
    if args.rl_iters:
        from trainer.rl import reinforce

        choose_teachers(select, catalogue, args)
        rl = reinforce(model, settings, catalogue, args, record, global_step, select=select)
    evaluation = final_evaluation(model, settings, heldout, catalogue, args)
    for part in evaluation.values():
        for name, res in part.items():
            for pol, m in res.items():
                record(global_step, **{f"eval/{name}/{pol}/{k}": v for k, v in m.items()})
    wall = time.perf_counter() - t_start
    training = {**dataclasses.asdict(args), "teachers": {s.name: s.teacher for s in settings},
                "teacher_scores": {s.name: s.scores for s in settings}, "init_version": init_version, **rl,
                "train_wall_s": round(train_s, 1),
                "total_wall_s": round(wall, 1), "machine": f"{torch.get_num_threads()} torch threads, CPU",
                "untrained_inputs": untrained_since(model, initial, ckpt.model if ckpt is not None else None),
                "command": "drl-trainer train " + " ".join(_flags(args))}
    save_checkpoint(model, out, training=training, evaluation=evaluation)
    logf.close()
    if tb is not None:
        tb.close()
    summary = {"training": training, "evaluation": evaluation}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _flags(args: Args) -> list[str]:
    default = Args()
    out = []
    for f in dataclasses.fields(Args):
        v = getattr(args, f.name)
        if v != getattr(default, f.name):  # quoted (found by review: '' or a space split the command)
            out.append(f"--{f.name.replace('_', '-')} {shlex.quote(str(v))}")
    return out


def _table(evaluation: dict[str, Any], args: Args) -> str:
    metric = METRIC[args.objective]
    lines = []
    for part, res in evaluation.items():
        for name, pols in res.items():
            ref = min((v[metric] for k, v in pols.items() if k != "drl"), default=math.nan)
            cells = ", ".join(f"{k} {v[metric]:.1f}" for k, v in pols.items())
            lines.append(f"{part:8s} {name:12s} {metric}: {cells} | drl / best baseline = "
                         f"{pols['drl'][metric] / ref:.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    a = dataclass_args(Args, args)
    if not setting_names(a.workflows):
        # here, not in Args: finetune trains on its traces with workflows="" (found by review: an
        # unset shell variable saved an untrained model as a checkpoint, exit status 0)
        raise SystemExit(f"error: --workflows names no training setting (';'-separated workload families or "
                         f"WfFormat paths), got {a.workflows!r}")
    if not a.iters and not a.rl_iters and not a.init:  # found by review: an untrained model saved, exit 0
        raise SystemExit("error: --iters 0 without --rl-iters or --init trains nothing")
    summary = train(a)
    print(_table(summary["evaluation"], a))
    t = summary["training"]
    rl = f", PPO {t['rl_wall_s']:.0f} s" if "rl_wall_s" in t else ""
    print(f"imitation {t['train_wall_s']:.0f} s{rl} (total {t['total_wall_s']:.0f} s); checkpoint in {a.out}")
    return 0
