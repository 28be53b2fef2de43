"""Must-show (issue 4): a few seconds of imitation on a tiny workload lower the loss, and the
trained policy beats random placement in the simulator; the CLI writes a loadable checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from policy.catalogue import load_catalogue
from policy.features import featurize, pair_dynamic
from policy.gnn import GNNPlacer
from policy.model import ModelConfig, PlacementGNN
from trainer.baselines import make_placer
from trainer.simulator import Simulator
from trainer.train import (
    Args,
    add_arguments,
    bc_update,
    choose_teachers,
    collect,
    imitation_nll,
    make_stream,
    run,
    settings_from,
    sim_config,
    teacher_steps,
)
from trainer.train import simulate as sim_summary

ROOT = Path(__file__).resolve().parents[2]


def test_imitation_loss_falls_and_beats_random() -> None:
    torch.manual_seed(0)
    args = Args(workflows="mlpipeline", heldout="", epochs=1, batch_requests=32, lr=1e-2, threads=1)
    catalogue = load_catalogue(args.pools)
    setting = settings_from("mlpipeline", seed=1)[0]
    setting.teacher = "srpt+eft"
    model = PlacementGNN(ModelConfig(hidden=16, layers=2))
    student = GNNPlacer(model, seed=0)
    samples = collect(setting, catalogue, student, True, n_runs=4, seed=3, args=args)
    assert len(samples) > 10
    before = imitation_nll(model, samples)
    rng = np.random.default_rng(0)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for _ in range(8):
        bc_update(model, opt, samples, args, rng)
    after = imitation_nll(model, samples)
    assert after < 0.8 * before, (before, after)

    jobs = make_stream(setting, catalogue, 5, seed=99, args=args)
    trained = sim_summary(catalogue, jobs, GNNPlacer(model), 99, args)["mean_jct_s"]
    random = sim_summary(catalogue, jobs, make_placer("random", catalogue, 99), 99, args)["mean_jct_s"]
    assert trained < random, (trained, random)


def test_the_row_bias_learns_srpt_s_run_order_from_an_srpt_teacher() -> None:
    """``--row-bias 1``: imitating ``srpt+eft`` on a stream where several runs wait at once, the
    learned weight on ``run_work_left_ratio`` turns negative (the run with the least work left
    first), from 0 at the start."""
    torch.manual_seed(0)
    args = Args(workflows="etl", heldout="", epochs=1, batch_requests=32, lr=1e-2, threads=1, row_bias=1)
    catalogue = load_catalogue(args.pools)
    setting = settings_from("etl", seed=1)[0]
    setting.teacher = "srpt+eft"
    model = PlacementGNN(ModelConfig(hidden=16, layers=2, row_bias=True))
    samples = collect(setting, catalogue, GNNPlacer(model, seed=0), True, n_runs=8, seed=3, args=args)
    assert float(model.row_k.detach()[0]) == 0.0
    rng = np.random.default_rng(0)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for _ in range(8):
        bc_update(model, opt, samples, args, rng)
    assert float(model.row_k.detach()[0]) < -0.05


def test_every_flag_says_what_it_does() -> None:
    """``drl-trainer train --help`` shows each ``Args`` field's ``#:`` comment; a comment covers
    the fields after it up to the next one (``--load`` and ``--duration-noise`` share theirs)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help or "" for a in parser._actions if a.dest != "help"}
    assert set(helps) == {f.name for f in dataclasses.fields(Args)}
    assert all(not h.startswith("(default") for h in helps.values()), [d for d, h in helps.items()
                                                                        if h.startswith("(default")]
    assert helps["pool_loss"].startswith("weight of the cross-entropy of the teacher's pool")
    assert helps["load"] == helps["duration_noise"].replace("0.3)", "0.85)")
    parser.format_help()  # a '%' in a comment would break argparse's formatting


def test_cli_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--workflows", "mlpipeline", "--heldout", "etl", "--teacher", "srpt+eft", "--iters", "2",
        "--runs-start", "3", "--runs-end", "4", "--eval-runs", "4", "--eval-streams", "1",
        "--hidden", "8", "--layers", "1", "--threads", "1", "--out", str(tmp_path / "ckpt"),
        "--feature-schema", "4",  # an older schema: the model reads its leading ready columns
    ])
    assert run(args) == 0
    placer = GNNPlacer.from_checkpoint(tmp_path / "ckpt")
    training = placer.manifest["training"]
    assert placer.model.schema_version == placer.manifest["feature_schema"]["version"] == 4
    assert "--feature-schema 4" in training["command"]
    assert training["teachers"] == {"mlpipeline": "srpt+eft"}
    assert "drl" in placer.manifest["evaluation"]["heldout"]["etl"]
    # no failed tries, GPU requests or pins in the lab's streams: those inputs never trained, and
    # the checkpoint says so (policy/inputs.py); the model loads with them cut off
    assert {"ready.retry", "task.pinned", "pair.pinned_here"} <= set(training["untrained_inputs"])
    assert "ready.run_done_frac" not in training["untrained_inputs"]
    assert placer.model.untrained_inputs == tuple(training["untrained_inputs"])
    assert (tmp_path / "ckpt" / "log.jsonl").read_text().count("losses/loss") == 2
    # the same scalars as TensorBoard event files (tensorboardX is in the trainer extra)
    events = list((tmp_path / "ckpt" / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1
    data = events[0].read_bytes()
    assert b"losses/loss" in data and b"eval/etl/drl/mean_jct_s" in data


def test_airflows_limits_reach_the_training_simulations() -> None:
    # --max-active-tasks / --pool-slots / --parallelism reach every simulated stream (sim_config);
    # 0 = no limit, as every checkpoint before 2026-12-07 night was trained
    assert (sim_config(Args()).max_active_tasks, sim_config(Args()).pool_slots, sim_config(Args()).parallelism) \
        == (None, None, None)
    limited = Args(workflows="mlpipeline", max_active_tasks=1, pool_slots=2, parallelism=3)
    config = sim_config(limited)
    assert (config.max_active_tasks, config.pool_slots, config.parallelism) == (1, 2, 3)
    catalogue = load_catalogue(limited.pools)
    setting = settings_from("mlpipeline", seed=1)[0]
    jobs = make_stream(setting, catalogue, 8, seed=5, args=limited)
    rows = {a.max_active_tasks: sim_summary(catalogue, jobs, make_placer("srpt+eft", catalogue, 5), 5, a)
            for a in (Args(workflows="mlpipeline"), limited)}
    assert rows[1]["mean_jct_s"] > rows[0]["mean_jct_s"], "one task of a run at a time: slower runs"
    with pytest.raises(ValueError, match="pool_slots"):
        Args(pool_slots=-1)


def test_max_wait_bounds_the_training_simulations_as_the_executor() -> None:
    # --max-wait-s reaches every simulated stream (imitation, PPO, evaluation share sim_config):
    # srpt+eft holds tasks for a busy pool, and with a near-zero bound the fallback places them.
    assert sim_config(Args()).max_wait_s is None  # 0 = unbounded, as before
    bounded_args = Args(workflows="mlpipeline", max_wait_s=1e-3)
    assert sim_config(bounded_args).max_wait_s == 1e-3
    # and the executor's bound on the whole hold: its default (300 s), or as given (= max_wait_s:
    # the single bound the checkpoints trained with --max-wait-s before 2026-12-07 saw)
    assert sim_config(bounded_args).max_hold_s == 300.0 and sim_config(Args()).max_hold_s is None
    assert sim_config(Args(max_wait_s=60.0, max_hold_s=60.0)).max_hold_s == 60.0
    catalogue = load_catalogue(bounded_args.pools)
    setting = settings_from("mlpipeline", seed=1)[0]
    jobs = make_stream(setting, catalogue, 8, seed=5, args=bounded_args)
    rows = {a.max_wait_s: sim_summary(catalogue, jobs, make_placer("srpt+eft", catalogue, 5), 5, a)
            for a in (Args(workflows="mlpipeline"), bounded_args)}
    assert rows[0.0]["wait_fallbacks"] == 0
    assert rows[1e-3]["wait_fallbacks"] > 0


def test_reservations_are_learned_from_the_rule_s_trace() -> None:
    """``srpt+eft`` holds a task whose earliest-finish pool is busy and reserves that pool's slot
    for the rest of the batch; its trace says so in order, and with it the teacher's steps are
    the trace's (task, pool) choices, each reservation on a pool with no free slot at its step
    (what a ``reserve_busy`` decoder does not send). A student trained with ``reserve_busy``
    records those steps; ``--reserve-busy`` takes only 0 or 1."""
    args = Args(workflows="mlpipeline", heldout="", threads=1, reserve_busy=1)
    catalogue = load_catalogue(args.pools)
    setting = settings_from("mlpipeline", seed=1)[0]
    jobs = make_stream(setting, catalogue, 8, seed=4, args=args)
    teacher = make_placer("srpt+eft", catalogue, 4)
    seen = {"reserved": 0, "requests": 0}

    class Probe:
        name, version = "probe", "0"

        def place(self, request, graphs):  # type: ignore[no-untyped-def]
            out = teacher.place(request, graphs)
            trace = teacher.trace
            assert [(d.run_key, d.task_id, d.pool) for d in out] == [t[:3] for t in trace if t[3]]
            fb = featurize(request, graphs, pairs=False)
            steps = teacher_steps(fb, out, trace)
            assert steps is not None
            pairs = [st for st in steps if st.action is not None]
            assert len(pairs) == len(trace)
            for st, (_, _, _, sent) in zip(pairs, trace, strict=True):
                r, pool = st.action
                free = pair_dynamic(fb.pairs, np.array([r]), st.placed)[0, pool, 3] > 0.5
                assert free == sent or fb.pairs.slots[pool] == 0
                seen["reserved"] += not sent
            seen["requests"] += 1
            return out

    Simulator(catalogue, jobs, Probe(), seed=4, config=sim_config(args)).run()
    assert seen["requests"] > 10 and seen["reserved"] > 0, seen

    setting.teacher = "srpt+eft"
    student = GNNPlacer(PlacementGNN(ModelConfig(hidden=8, layers=1)), reserve_busy=True)
    samples = collect(setting, catalogue, student, True, n_runs=4, seed=3, args=args)
    assert any(st.action is not None and pair_dynamic(fb.pairs, np.array([st.action[0]]), st.placed)[
        0, st.action[1], 3] < 0.5 for fb, steps in samples for st in steps)
    with pytest.raises(ValueError, match="reserve_busy must be 0 or 1"):
        Args(reserve_busy=2)
    with pytest.raises(ValueError, match="feature_schema must be one of"):
        Args(feature_schema=2)


@pytest.mark.parametrize("premium", [0.0, 3.0])
def test_trailing_reservations_become_a_stop_where_the_student_may_stop(premium: float) -> None:
    """``cost-cp`` reserves every ready task it walks while a premium pool has a slot; after its
    last dispatch those reservations change nothing, so the teacher's steps end with a stop
    instead wherever the student's guards allow one (with ``premium_ratio`` 3 they do: only the
    premium GPU is free). The dispatches are kept in order, and every such stop is one the
    student's decoder could take (no remaining task has a free pool its guards count)."""
    from policy.features import guard_fit, pool_free_within

    args = Args(workflows="etl", heldout="", threads=1, reserve_busy=1, premium_ratio=premium)
    catalogue = load_catalogue(args.pools)
    jobs = make_stream(settings_from("etl", seed=1)[0], catalogue, 10, seed=4, args=args)
    teacher = make_placer("cost-cp", catalogue, 4)
    seen = {"trimmed": 0, "steps": 0, "trace": 0}

    class Probe:
        name, version = "probe", "0"

        def place(self, request, graphs):  # type: ignore[no-untyped-def]
            out = teacher.place(request, graphs)
            trace = teacher.trace
            fb = featurize(request, graphs, pairs=False)
            steps = teacher_steps(fb, out, trace, late=True, premium=premium)
            assert steps is not None
            chosen = [st.action for st in steps if st.action is not None]
            assert [(t[1], t[2]) for t in trace[: len(chosen)]] == [  # a prefix of the trace
                (fb.ready[r].task_id, fb.pools[j].name) for r, j in chosen]
            if len(chosen) < len(trace):  # trimmed: only reservations went, and the stop is legal
                seen["trimmed"] += 1
                assert all(not t[3] for t in trace[len(chosen):])
                stop = steps[-1]
                assert stop.action is None and stop.premium == premium
                d = pair_dynamic(fb.pairs, stop.rows, stop.placed)
                assert not pool_free_within(d, guard_fit(fb.pairs, stop.rows, fb.pairs.mask[stop.rows], premium))
            seen["steps"] += len(steps)
            seen["trace"] += len(trace)
            return out

    Simulator(catalogue, jobs, Probe(), seed=4, config=sim_config(args)).run()
    if premium:
        assert seen["trimmed"] > 0 and seen["steps"] < seen["trace"], seen


def test_a_cp_gated_student_is_taught_only_steps_it_can_take() -> None:
    """With ``cp_gate`` the teacher's requests are featurized with the student's gate: every
    ``cost-cp`` choice (the same rule, ratio 3) is a step the gated student can take, so no
    request is dropped; ``srpt+eft`` sends work off the critical path to the premium GPU, and
    those requests are dropped rather than taught a masked step (the test can fail: without the
    gate they are kept). Every kept step has a finite likelihood; a bad gate is refused."""
    args = Args(workflows="etl", heldout="", threads=1, reserve_busy=1, premium_ratio=3)
    catalogue = load_catalogue(args.pools)
    setting = settings_from("etl", seed=1)[0]
    torch.manual_seed(0)
    model = PlacementGNN(ModelConfig(hidden=8, layers=1))
    kept = {}
    for teacher in ("cost-cp", "srpt+eft"):
        setting.teacher = teacher
        for gate in (0.0, 3.0):
            student = GNNPlacer(model, reserve_busy=True, premium_ratio=3, cp_gate=gate)
            samples = collect(setting, catalogue, student, True, n_runs=6, seed=3,
                              args=dataclasses.replace(args, cp_gate=gate))
            assert np.isfinite(imitation_nll(model, samples))
            kept[teacher, gate] = len(samples)
    assert kept["cost-cp", 3.0] == kept["cost-cp", 0.0] > 10
    assert kept["srpt+eft", 3.0] < kept["srpt+eft", 0.0], kept
    with pytest.raises(ValueError, match="cp_gate"):
        Args(cp_gate=0.5)
    with pytest.raises(ValueError, match="cp_gate_scope"):
        Args(cp_gate=3.0, cp_gate_scope="critical")


def test_pool_loss_teaches_the_teacher_s_pools() -> None:
    """With ``pool_loss`` the same updates from the same weights fit the teacher's pools
    (``cost-cp``: premium GPU or not, or hold) better than the exact-row loss alone; the pool's
    likelihood is at least the exact step's; the weight may not be negative."""
    args = Args(workflows="etl", heldout="", threads=1, reserve_busy=1, premium_ratio=3, epochs=1, lr=1e-2)
    catalogue = load_catalogue(args.pools)
    setting = settings_from("etl", seed=1)[0]
    setting.teacher = "cost-cp"
    torch.manual_seed(0)
    # schema 6, the features this was measured on: with schema 7's boot floor the pool loss's edge
    # in this tiny setup held in 4 of 6 probes (3 torch seeds x 4 / 8 updates; 6 of 6 on schema 6;
    # docs/policy.md, "The featurizer counts a boot")
    init = PlacementGNN(ModelConfig(hidden=16, layers=2), schema_version=6)
    samples = collect(setting, catalogue, GNNPlacer(init, reserve_busy=True, premium_ratio=3), True, n_runs=6,
                      seed=3, args=args)
    assert len(samples) > 10
    assert imitation_nll(init, samples, pool=True) <= imitation_nll(init, samples)
    fitted = {}
    for weight in (0.0, 3.0):
        model = PlacementGNN(init.config, schema_version=init.schema_version)
        model.load_state_dict(init.state_dict())
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        rng = np.random.default_rng(0)
        for _ in range(4):
            stats = bc_update(model, opt, samples, dataclasses.replace(args, pool_loss=weight), rng)
        assert stats["pool_acc"] >= stats["step_acc"]
        fitted[weight] = imitation_nll(model, samples, pool=True)
    assert fitted[3.0] < fitted[0.0], fitted
    with pytest.raises(ValueError, match="pool_loss must be >= 0"):
        Args(pool_loss=-1)


def test_time_scale_randomises_training_streams_only() -> None:
    catalogue = load_catalogue(Args().pools)
    setting = settings_from("etl", seed=1)[0]
    plain, wide = Args(), Args(time_scale=10.0)

    def work(jobs: list) -> np.ndarray:  # type: ignore[type-arg]
        return np.array([sum(t.duration_s for t in j.graph.tasks) for j in jobs])

    base = work(make_stream(setting, catalogue, 6, 3, plain))
    assert np.array_equal(work(make_stream(setting, catalogue, 6, 3, wide)), base)  # not randomised
    assert np.array_equal(work(make_stream(setting, catalogue, 6, 3, plain, randomise=True)), base)  # off
    factors = []
    for seed in range(8):
        plain_jobs = make_stream(setting, catalogue, 6, seed, plain)
        scaled = make_stream(setting, catalogue, 6, seed, wide, randomise=True)
        ratio = work(scaled) / work(plain_jobs)
        assert np.allclose(ratio, ratio[0])  # one factor per stream, the same runs drawn
        assert 0.1 - 1e-9 <= ratio[0] <= 10 + 1e-9
        # arrivals follow the load: a stream of shorter jobs arrives faster
        assert np.isclose(scaled[-1].arrival_s / plain_jobs[-1].arrival_s, ratio[0])
        assert scaled[0].graph.digest != plain_jobs[0].graph.digest
        again = make_stream(setting, catalogue, 6, seed, wide, randomise=True)
        assert np.array_equal(work(again), work(scaled))  # same seed, same factor
        factors.append(ratio[0])
    assert min(factors) < 0.7 and max(factors) > 1.4


def test_teacher_streams_score_the_candidates_on_more_than_one_stream() -> None:
    """'auto' scores each candidate by the mean objective over ``teacher_streams`` streams (seeds
    seed + 500, seed + 501, ...); one stream is the choice as before."""
    catalogue = load_catalogue(Args().pools)
    streams = {}
    for n in (1, 3):
        args = Args(workflows="etl", objective="p95_jct", candidates="srpt+eft,fifo+eft,heft", eval_runs=6,
                    teacher_streams=n, seed=2)
        setting = settings_from("etl", seed=2)[0]
        choose_teachers([setting], catalogue, args)
        streams[n] = setting.scores
        assert setting.teacher == min(setting.scores, key=setting.scores.__getitem__)
    one = Args(workflows="etl", objective="p95_jct", eval_runs=6, seed=2)
    per_seed = {name: [sim_summary(catalogue, make_stream(setting, catalogue, 6, seed, one),
                                   make_placer(name, catalogue, 2), seed, one)["p95_jct_s"] for seed in (502, 503, 504)]
                for name in ("srpt+eft", "fifo+eft", "heft")}
    for name, values in per_seed.items():
        assert streams[1][name] == pytest.approx(values[0])
        assert streams[3][name] == pytest.approx(np.mean(values))
    assert streams[3] != streams[1]
    with pytest.raises(ValueError, match="teacher_streams must be positive"):
        Args(teacher_streams=0)


def test_init_gains_a_row_bias_that_stays_fixed_when_asked(tmp_path: Path) -> None:
    """``--init CK --row-bias 1 --row-bias-init K``: CK's model (without a row bias) gains one
    at ``K`` and keeps its other weights to start from; with ``--row-bias-fixed 1`` the weight
    is still ``K`` after training while the other weights moved, without it the weight learns."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    tiny = ["--workflows", "mlpipeline", "--heldout", "", "--teacher", "srpt+eft", "--iters", "2",
            "--runs-start", "3", "--runs-end", "4", "--eval-runs", "2", "--eval-streams", "1", "--hidden", "8",
            "--layers", "1", "--threads", "1", "--lr", "0.01"]
    assert run(parser.parse_args([*tiny, "--out", str(tmp_path / "base")])) == 0
    base = GNNPlacer.from_checkpoint(tmp_path / "base").model
    assert not base.config.row_bias
    ks = {}
    for fixed in ("1", "0"):
        out = tmp_path / f"fixed{fixed}"
        assert run(parser.parse_args([*tiny, "--init", str(tmp_path / "base"), "--row-bias", "1",
                                      "--row-bias-init", "-5", "--row-bias-fixed", fixed, "--out", str(out)])) == 0
        placer = GNNPlacer.from_checkpoint(out)
        assert placer.model.config.row_bias and placer.manifest["training"]["init_version"]
        ks[fixed] = float(placer.model.row_k.detach()[0])
        moved = placer.model.state_dict()["head_out.weight"] - base.state_dict()["head_out.weight"]
        assert float(moved.abs().max()) > 0
    assert ks["1"] == -5.0
    assert ks["0"] != -5.0
    with pytest.raises(ValueError, match="row_bias_fixed"):
        Args(row_bias_fixed=1)
    with pytest.raises(ValueError, match="within"):
        Args(row_bias=1, row_bias_init=300.0)
