"""The policy-gradient phase of ``drl-trainer train``: PPO over the simulator, Decima's practices.

Read top to bottom, CleanRL style (``cleanrl/ppo.py``); the configuration is the ``--rl-*``
fields of :class:`trainer.train.Args`, and :func:`reinforce` is called by
:func:`trainer.train.train` after the imitation phase (``--iters 0 --init CHECKPOINT`` fine-tunes
an existing checkpoint with PPO only).

**Rollouts** (Mao et al., "Learning Scheduling Algorithms for Data Processing Clusters", SIGCOMM
2019). Each iteration draws ONE job stream of one training setting (round robin) and simulates it
``rl_rollouts`` (K) times with the policy *sampling* (:meth:`policy.gnn.GNNPlacer.decode` at
``rl_temperature``, each rollout with its own sampling seed). The K rollouts share the arrival
sequence and the realised durations (the simulator's common random numbers), so the only
difference between them is the policy's choices. Every decision point records the featurized
request, its decoding steps, the simulated time and the cost billed so far.

**Reward** between decision ``i`` (at time ``t_i``) and the next one (the last one runs to the end
of the episode), for the configured objective, divided by the same quantity of the setting's
*reference* heuristic (its teacher: the best baseline for that objective) on the same stream, so
the reference's return is ``-(1 + cost_weight)`` whatever the stream's size (Decima normalises
by a baseline in the same spirit):

* ``mean_jct``: ``-(integral of the number of DAG runs in the system over [t_i, t_{i+1}))``; over an
  episode this sums to ``-sum of JCTs`` (Little's law; Decima's reward for mean JCT).
* ``p95_jct``: a per-run penalty at its completion, ``-max(0, JCT - q)`` with ``q`` the
  reference's 75th-percentile JCT on the stream: only the tail is penalised.
* ``sla_violation_rate``: a per-run penalty at completion, ``-(1 + lateness / allowed)`` for a
  run finishing after its deadline (arrival + 2 x critical-path bound, as ``summarize``), where
  ``allowed`` = deadline - arrival: the count of violations, plus a slope so that "less late" is
  still better.
* ``cost`` (objective) or ``--cost-weight w`` (on top of any objective): ``-w x`` the billed
  VM-seconds x price accrued between the two decisions (elastic pools boot and release workers,
  so the policy's choices change the bill).

**Returns and baseline.** Differential returns (average-reward RL): each reward has ``rho x
(t_{i+1} - t_i)`` subtracted, ``rho`` being a running mean of the reward per simulated second of
that setting, so long episodes do not drown early decisions in the drift of the whole stream.
The return-to-go ``R_i`` is the sum of the differential rewards from ``i`` on, undiscounted
(Decima) or, with ``rl_horizon_s`` > 0, discounted by ``exp(-elapsed simulated s / rl_horizon_s)``
(less variance, shorter credit assignment; decisions are irregular in time, so the discount is in
seconds, not steps). The
**input-dependent baseline** (Mao et al., "Variance Reduction for Reinforcement Learning in
Input-Driven Environments", ICLR 2019) at time ``t`` is the mean over the K rollouts of their
return-to-go at ``t`` (linear interpolation between each rollout's decision times), so the
arrival sequence's luck cancels out of the advantage ``A_i = R_i - b(t_i)``. Advantages are
divided by their standard deviation over the iteration. The value head is not used.

**Update.** PPO with the clipped objective (Schulman et al. 2017) over the decoding steps: every
step of a decision point gets its advantage; ``log p_old`` comes from
:meth:`~policy.model.PlacementGNN.step_forward` before the update, at ``rl_temperature`` like
the new one (the sampling distribution: the policy PPO improves is the tempered one),
``rl_epochs`` epochs of minibatches of ``rl_batch_requests`` decision points, loss
``-min(ratio A, clip(ratio, 1 +- clip_coef) A) - ent_coef x entropy``; the entropy coefficient
decays linearly from ``rl_ent_coef`` to ``rl_ent_coef_final``.

**Curriculum**: the episode grows from ``rl_runs_start`` to ``rl_runs_end`` DAG runs and the
templates from the smallest ``rl_size_start`` fraction of each setting's DAGs (by task count) to
all of them.

**Evaluation and selection**: every ``rl_eval_every`` iterations the greedy policy is evaluated
on the training settings' evaluation streams (:func:`trainer.train.evaluate`); the weights with
the lowest geometric mean of ``drl / reference`` (the configured objective) are kept (the state
before the first iteration included, so fine-tuning never returns something worse than its start
on these streams).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
import torch

from policy.features import FeatureBatch
from policy.gnn import GNNPlacer
from policy.model import PlacementGNN, Step, collate_steps
from policy.schema import Decision, PlacementRequest, RunGraph
from trainer.baselines import make_placer
from trainer.metrics import Bounds
from trainer.simulator import JobRecord, SimConfig, Simulator

if TYPE_CHECKING:
    from policy.catalogue import Catalogue
    from trainer.train import Args, Setting

log = logging.getLogger(__name__)

Sample = tuple[FeatureBatch, list[Step]]


# --- rollouts ----------------------------------------------------------------------------------


class _Sampler:
    """A placer that samples from the GNN and records every decision point.

    Handed the simulator by :meth:`Simulator.run` (``bind``), it reads the simulated time and
    the cost billed so far at each decision point.
    """

    name, version = "drl-sampler", "0"

    def __init__(self, placer: GNNPlacer, temperature: float) -> None:
        self.placer, self.temperature = placer, temperature
        self.sim: Simulator | None = None
        self.samples: list[Sample] = []
        self.times: list[float] = []
        self.costs: list[float] = []

    def bind(self, sim: Simulator) -> None:
        self.sim = sim

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        dec = self.placer.decode(request, graphs, temperature=self.temperature)
        assert self.sim is not None
        if dec.steps:
            self.samples.append((dec.batch, dec.steps))
            self.times.append(self.sim.now)
            self.costs.append(billed_so_far(self.sim))
        fb = dec.batch
        return [Decision(fb.ready[i].run_key, fb.ready[i].task_id, fb.pools[int(dec.actions[i])].name,
                         fb.pools[int(dec.actions[i])].vm_class) for i in dec.placed_order]


def billed_so_far(sim: Simulator) -> float:
    """Cost accrued up to ``sim.now``: released workers as billed, live ones pro rata."""
    total = 0.0
    for p in sim.pools:
        price = p.spec.vm_class.price_per_hour / 3600.0
        total += p.cost + sum(max(0.0, sim.now - since) for since in p.alive_since) * price
    return total


@dataclass
class Rollout:
    """One sampled episode: ``D`` decision points with their time, cost so far and reward."""

    samples: list[Sample]
    times: np.ndarray  # [D]
    costs: np.ndarray  # [D]
    end_s: float
    end_cost: float
    jobs: list[JobRecord]
    rewards: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # [D]


def rollout(placer: GNNPlacer, catalogue: Catalogue, jobs: Sequence[Any], sim_seed: int, sample_seed: int,
            temperature: float, config: SimConfig) -> Rollout:
    """One episode sampled by ``placer`` (reseeded with ``sample_seed``). The K rollouts of an
    iteration share one placer, so the runs' graph embeddings are computed once, not K times."""
    placer.rng = np.random.default_rng(sample_seed)
    sampler = _Sampler(placer, temperature)
    sim = Simulator(catalogue, jobs, sampler, seed=sim_seed, config=config)
    result = sim.run()
    return Rollout(sampler.samples, np.asarray(sampler.times), np.asarray(sampler.costs),
                   max(sim.now, result.makespan_s), result.cost, result.jobs)


# --- rewards, returns, baseline ----------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """What the rewards are divided by: the reference heuristic's totals on the same stream."""

    sum_jct: float
    tail_q: float
    tail_sum: float
    late_sum: float
    cost: float


def job_penalties(jobs: Sequence[JobRecord], objective: str, deadline: Mapping[str, float],
                  tail_q: float) -> np.ndarray:
    """Per-run penalty at completion (``[J]``) for the per-run objectives (see the docstring)."""
    if objective == "p95_jct":
        return np.array([max(0.0, j.jct_s - tail_q) for j in jobs])
    if objective == "sla_violation_rate":
        out = []
        for j in jobs:
            d = deadline[j.run_key]
            late = j.finish_s - d
            out.append(1.0 + late / max(d - j.arrival_s, 1e-9) if late > 1e-9 else 0.0)
        return np.array(out)
    return np.zeros(len(jobs))


def reference_of(jobs: Sequence[JobRecord], cost: float, deadline: Mapping[str, float]) -> Reference:
    jct = np.array([j.jct_s for j in jobs])
    q = float(np.percentile(jct, 75)) if len(jct) else 0.0
    tail = float(job_penalties(jobs, "p95_jct", deadline, q).sum())
    late = float(job_penalties(jobs, "sla_violation_rate", deadline, q).sum())
    mean = float(jct.mean()) if len(jct) else 1.0
    # a floor keeps a reference with (almost) no tail, lateness or cost from blowing rewards up
    return Reference(sum_jct=max(float(jct.sum()), 1e-9), tail_q=q, tail_sum=max(tail, 0.05 * mean),
                     late_sum=max(late, 1.0), cost=max(cost, 1e-9))


def interval_rewards(ro: Rollout, objective: str, cost_weight: float, ref: Reference,
                     deadline: Mapping[str, float]) -> np.ndarray:
    """``[D]`` normalised rewards of a rollout's decision intervals (see the module docstring)."""
    t = ro.times
    edges = np.append(t, ro.end_s)  # [D + 1]
    arrival = np.array([j.arrival_s for j in ro.jobs])
    finish = np.array([j.finish_s for j in ro.jobs])
    r = np.zeros(len(t))
    if objective == "mean_jct":
        # area(t) = integral of the number of runs in the system up to t
        area = np.clip(np.minimum(edges[:, None], finish[None]) - arrival[None], 0.0, None).sum(axis=1)
        r -= np.diff(area) / ref.sum_jct
    elif objective in ("p95_jct", "sla_violation_rate"):
        pen = job_penalties(ro.jobs, objective, deadline, ref.tail_q)
        # a run's penalty goes to the interval it finished in
        # (side "left": a run done at t_i+1 finished before decision i+1 saw the system, in
        # [t_i, t_i+1] as the JCT and cost terms count it; found by review)
        k = np.clip(np.searchsorted(t, finish, side="left") - 1, 0, len(t) - 1)
        np.add.at(r, k, -pen / (ref.tail_sum if objective == "p95_jct" else ref.late_sum))
    w_cost = cost_weight + (1.0 if objective == "cost" else 0.0)
    if w_cost:
        r -= w_cost * np.diff(np.append(ro.costs, ro.end_cost)) / ref.cost
    return r


def returns_to_go(rewards: np.ndarray, times: np.ndarray, end_s: float, rho: float,
                  horizon_s: float = 0.0) -> np.ndarray:
    """``R_i = sum_{j >= i} d_ij (r_j - rho (t_{j+1} - t_j))``: differential returns, with
    ``d_ij = exp(-(t_j - t_i) / horizon_s)`` (a discount in simulated time) or 1 if ``horizon_s`` is 0."""
    dt = np.diff(np.append(times, end_s))
    diff = rewards - rho * dt
    if not horizon_s:
        return np.cumsum(diff[::-1])[::-1].copy()
    out = np.zeros(len(diff))
    acc = 0.0
    for i in range(len(diff) - 1, -1, -1):
        acc = diff[i] + math.exp(-dt[i] / horizon_s) * acc
        out[i] = acc
    return out


def time_baseline(times: Sequence[np.ndarray], returns: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Decima's input-dependent baseline: at each decision time of each rollout, the mean over
    all rollouts (of the same arrival sequence) of their return-to-go at that time."""
    out = []
    for t in times:
        out.append(np.mean([np.interp(t, tk, rk) if len(tk) else np.zeros(len(t))
                            for tk, rk in zip(times, returns, strict=True)], axis=0))
    return out


# --- the update --------------------------------------------------------------------------------


@torch.no_grad()
def old_log_probs(model: PlacementGNN, samples: Sequence[Sample], batch_requests: int,
                  temperature: float = 1.0) -> list[torch.Tensor]:
    """``log p_old`` of every recorded step, per minibatch-sized chunk of decision points, under
    the distribution the rollouts sampled from (``temperature``)."""
    model.eval()
    out = []
    for k in range(0, len(samples), batch_requests):
        logp = model.step_forward(collate_steps(samples[k : k + batch_requests]), temperature).logp
        out.append(logp)
    return out


def ppo_update(model: PlacementGNN, opt: torch.optim.Optimizer, samples: Sequence[Sample],
               advantages: np.ndarray, args: Args, ent_coef: float, rng: np.random.Generator) -> dict[str, float]:
    """PPO-clip epochs over the decision points (``advantages [D]``, one per decision point)."""
    old = torch.cat(old_log_probs(model, samples, args.rl_batch_requests, args.rl_temperature))
    n_steps = np.array([len(st) for _, st in samples])
    first = np.concatenate([[0], np.cumsum(n_steps)[:-1]])
    model.train()
    stats: dict[str, list[float]] = {k: [] for k in ("pg_loss", "entropy", "approx_kl", "clipfrac", "loss")}
    for _ in range(args.rl_epochs):
        perm = rng.permutation(len(samples))
        for k in range(0, len(perm), args.rl_batch_requests):
            idx = perm[k : k + args.rl_batch_requests]
            st = collate_steps([samples[i] for i in idx])
            steps = np.concatenate([np.arange(first[i], first[i] + n_steps[i]) for i in idx])
            adv = torch.from_numpy(np.repeat(advantages[idx], n_steps[idx])).float()
            # at the rollouts' temperature (found by review: scored at 1, a ratio of the
            # untempered policy to itself weighted samples drawn from another distribution)
            logp, entropy, *_ = model.step_forward(st, args.rl_temperature)
            logratio = logp - old[torch.from_numpy(steps)]
            ratio = logratio.exp()
            pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.rl_clip_coef, 1 + args.rl_clip_coef)).mean()
            loss = pg_loss - ent_coef * entropy.mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.rl_max_grad_norm)
            opt.step()
            with torch.no_grad():
                stats["approx_kl"].append(float(((ratio - 1) - logratio).mean()))
                stats["clipfrac"].append(float(((ratio - 1.0).abs() > args.rl_clip_coef).float().mean()))
            stats["pg_loss"].append(float(pg_loss.detach()))
            stats["entropy"].append(float(entropy.detach().mean()))
            stats["loss"].append(float(loss.detach()))
    model.eval()
    return {k: float(np.mean(v)) for k, v in stats.items()}


# --- the loop ----------------------------------------------------------------------------------


def curriculum(setting: Setting, frac: float, args: Args) -> tuple[Setting, int]:
    """The setting restricted to its smallest DAGs, and the episode length, at progress ``frac``."""
    from trainer.train import Setting

    size = args.rl_size_start + (1.0 - args.rl_size_start) * frac
    by_size = sorted(setting.templates, key=lambda g: len(g.tasks))
    keep = by_size[: max(1, math.ceil(size * len(by_size)))]
    n_runs = int(round(args.rl_runs_start + (args.rl_runs_end - args.rl_runs_start) * frac))
    return Setting(setting.name, keep, setting.teacher, setting.scores), n_runs


def eval_score(settings: Sequence[Setting], args: Args, res: dict[str, Any],
               reference: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Geometric mean over settings of ``drl / teacher`` (the objective) of an evaluation ``res``
    of the greedy policy, against the teachers' evaluation ``reference`` on the same streams."""
    from trainer.train import objective_value

    ratios = {}
    for s in settings:
        ref = reference[s.name][s.teacher]
        ratios[s.name] = _ratio(objective_value(res[s.name]["drl"], args, ref), objective_value(ref, args, ref))
    return float(np.exp(np.mean(np.log(list(ratios.values()))))), ratios


def _ratio(drl: float, teacher: float, tie: float = 1e-9) -> float:
    """``drl / teacher``, 1 for a tie at zero, and the teacher floored at 1% of ``drl`` (found by
    review: a teacher with no late run made a tie 0, log 0 = -inf, and the geometric mean over
    every setting 0, the best score however bad the rest; one late run made 1e8)."""
    if drl <= tie and teacher <= tie:
        return 1.0
    return drl / max(teacher, 0.01 * drl, tie)


def reinforce(model: PlacementGNN, settings: Sequence[Setting], catalogue: Catalogue, args: Args,
              record: Callable[..., None], global_step: int = 0,
              select: Sequence[Setting] = ()) -> dict[str, Any]:
    """The PPO loop (see the module docstring) on ``model``, in place; the settings' teachers must
    be chosen. The weights kept are those scoring best on ``select`` (settings not trained on,
    teachers chosen) or, without it, on the training settings' evaluation streams. Returns a
    summary (best eval score, iterations, wall time)."""
    from trainer.train import evaluate, make_stream, policy_placer, sim_config

    t0 = time.perf_counter()
    config = sim_config(args)  # every stream of the phase: the reference's and the rollouts'
    rng = np.random.default_rng([args.seed, 41])
    opt = torch.optim.Adam(model.parameters(), lr=args.rl_lr)
    rho: dict[str, float] = {}
    scored = list(select) or list(settings)
    reference = evaluate(model, scored, catalogue, args, baselines=sorted({s.teacher for s in scored}))
    best_score, ratios = eval_score(scored, args, reference, reference)
    best_state, best_iter = copy.deepcopy(model.state_dict()), -1
    record(global_step, **{"eval/rl_score": best_score}, **{f"eval/rl_ratio/{k}": v for k, v in ratios.items()})
    try:
        from tqdm import tqdm

        bar: Any = tqdm(range(args.rl_iters), desc="ppo", disable=None)
    except ImportError:  # tqdm is optional
        bar = range(args.rl_iters)
    done = 0
    for it in bar:
        frac = it / max(args.rl_iters - 1, 1)
        setting, n_runs = curriculum(settings[it % len(settings)], frac, args)
        stream_seed = args.seed * 100_003 + 7919 * it
        jobs = make_stream(setting, catalogue, n_runs, stream_seed, args, randomise=True)
        deadline = Bounds(jobs, catalogue).deadline
        # the reference heuristic on the same stream, same durations: what rewards are divided by
        ref_sim = Simulator(catalogue, jobs, make_placer(setting.teacher, catalogue, stream_seed), seed=stream_seed,
                            config=config)
        ref_res = ref_sim.run()
        ref = reference_of(ref_res.jobs, ref_res.cost, deadline)
        # weights as of this iteration
        placer = policy_placer(model, args, version="rl", explain=False)
        rollouts = [rollout(placer, catalogue, jobs, stream_seed, args.seed * 1_000_003 + 101 * it + k,
                            args.rl_temperature, config) for k in range(args.rl_rollouts)]
        for ro in rollouts:
            ro.rewards = interval_rewards(ro, args.objective, args.cost_weight, ref, deadline)
        # differential returns: rho = running mean reward per simulated second of this setting
        rate = float(np.mean([ro.rewards.sum() / max(ro.end_s, 1e-9) for ro in rollouts]))
        rho[setting.name] = rate if setting.name not in rho else 0.8 * rho[setting.name] + 0.2 * rate
        returns = [returns_to_go(ro.rewards, ro.times, ro.end_s, rho[setting.name], args.rl_horizon_s)
                   for ro in rollouts]
        baselines = time_baseline([ro.times for ro in rollouts], returns)
        adv = np.concatenate([r - b for r, b in zip(returns, baselines, strict=True)])
        adv = adv / (adv.std() + 1e-8)
        samples = [s for ro in rollouts for s in ro.samples]
        ent_coef = args.rl_ent_coef + (args.rl_ent_coef_final - args.rl_ent_coef) * frac
        stats = ppo_update(model, opt, samples, adv, args, ent_coef, rng)
        n_steps = sum(len(st) for _, st in samples)
        global_step += n_steps
        episode = [float(ro.rewards.sum()) for ro in rollouts]
        jct = [float(np.mean([j.jct_s for j in ro.jobs])) for ro in rollouts]
        ref_jct = ref.sum_jct / max(len(ref_res.jobs), 1)
        charts = {"episode_return": float(np.mean(episode)), "mean_jct_vs_reference": float(np.mean(jct)) / max(
            ref_jct, 1e-9), "ent_coef": ent_coef, "rho": rho[setting.name], "runs": n_runs,
            "templates": len(setting.templates), "decisions": len(samples), "iter": it,
            "wall_s": time.perf_counter() - t0}
        record(global_step, **{f"losses/{k}": v for k, v in stats.items()},
               **{f"charts/{k}": float(v) for k, v in charts.items()})
        if getattr(bar, "disable", True) is False:
            bar.set_postfix(ret=f"{np.mean(episode):.3f}", jct_ref=f"{np.mean(jct) / max(ref_jct, 1e-9):.3f}",
                            kl=f"{stats['approx_kl']:.4f}")
        else:  # no tqdm, or not a terminal: a plain line per iteration
            log.info("ppo iter %d: return %.3f, mean JCT / reference %.3f, kl %.4f", it, np.mean(episode),
                     np.mean(jct) / max(ref_jct, 1e-9), stats["approx_kl"])
        done = it + 1
        # the last iteration is evaluated, whether rl_iters or the time limit ends the loop (found
        # by review: stopped by the limit, the weights since the last evaluation were dropped)
        stop = bool(args.rl_time_limit_s) and time.perf_counter() - t0 > args.rl_time_limit_s
        if args.rl_eval_every and (done % args.rl_eval_every == 0 or done == args.rl_iters or stop):
            score, ratios = eval_score(scored, args, evaluate(model, scored, catalogue, args), reference)
            record(global_step, **{"eval/rl_score": score}, **{f"eval/rl_ratio/{k}": v for k, v in ratios.items()})
            if score < best_score:
                best_score, best_state, best_iter = score, copy.deepcopy(model.state_dict()), it
        if stop:
            log.info("RL time limit reached after %d iterations", done)
            break
    if args.rl_eval_every:
        model.load_state_dict(best_state)
    return {"rl_iters_done": done, "rl_best_iter": best_iter, "rl_best_eval_score": best_score,
            "rl_wall_s": round(time.perf_counter() - t0, 1), "rl_global_step": global_step}
