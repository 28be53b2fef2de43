"""The ``drl-trainer`` command line and the ratio / cost-frontier scripts' arguments: found by review
(2026-12-07), each test failed on the code before its fix and names the bug it shows.

Runs that reach a simulation use tiny sizes (a few DAG runs, one imitation iteration)."""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cli_checks import _in_process

ROOT = Path(__file__).resolve().parents[2]
RATIO_TABLE = ROOT / "scripts" / "ratio_table.py"
COST_FRONTIER = ROOT / "scripts" / "cost_frontier.py"
#: a tiny training run (a few seconds; the teacher named, so no teacher selection)
TINY_TRAIN = ["--iters", "1", "--runs-start", "2", "--runs-end", "2", "--eval-runs", "2", "--eval-streams", "1",
              "--epochs", "1", "--workflows", "montecarlo", "--heldout", "etl", "--teacher", "srpt+eft",
              "--hidden", "8", "--layers", "1", "--threads", "1"]
TINY_BENCH = ["--dag-runs", "2", "--policies", "fifo+eft", "--seeds", "1"]


def _cli(*argv: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ}, cwd=cwd or ROOT)




def _refused_cleanly(code: int | str | None) -> bool:
    return isinstance(code, int) and code != 0 or isinstance(code, str) and not code.startswith("traceback")


# --- drl-trainer bench: replay: specs --------------------------------------------------------------


@pytest.mark.parametrize("what", ["missing", "folder", "empty"])
def test_bench_replay_spec_that_cannot_be_read_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                            what: str) -> None:
    """``--workflows replay:FILE`` naming a file that does not exist, a folder, or an empty file is
    a traceback (``FileNotFoundError`` / ``IsADirectoryError`` from ``policy.replay.read_replay``'s
    ``open``; ``ValueError: ... holds no runs`` from ``trainer.workloads.replay_jobs``): trainer/cli.py
    turns only CatalogueError/CheckpointError/SchemaError/WorkloadError into its one-line error, and
    its docstring promises "a missing path" is one of them. A malformed line is one line already."""
    from trainer.cli import main

    path = {"missing": tmp_path / "nope.jsonl", "folder": tmp_path, "empty": tmp_path / "empty.jsonl"}[what]
    if what == "empty":
        path.write_text("")
    code, _, err = _in_process(main, ["bench", "--workflows", f"replay:{path}", *TINY_BENCH], capsys)
    assert _refused_cleanly(code), code
    assert str(path) in err + str(code), err[-300:]


# --- drl-trainer train: values accepted, then a traceback, NaN in the outputs, or no training ------


@pytest.mark.parametrize("field, value", [
    ("lr", -1.0),                 # torch.optim.Adam: ValueError "Invalid learning rate" after --out is made
    ("lr", math.nan),             # same
    ("ent_coef", math.nan),       # NaN loss -> ModelOutputError traceback in the final evaluation
    ("pool_loss", math.nan),      # "pool_loss < 0" lets NaN through
    ("rl_lr", math.nan),          # "rl_lr <= 0" lets NaN through: Adam's ValueError in the RL phase
    ("rl_temperature", math.nan),  # "rl_temperature <= 0" lets NaN through
    ("rl_clip_coef", math.nan),   # "rl_clip_coef <= 0" lets NaN through
    ("rl_ent_coef", math.nan),    # NaN loss -> ModelOutputError traceback after the PPO phase
    ("rl_max_grad_norm", -1.0),   # clip_grad_norm_ with a negative norm flips the gradients (ascent)
    ("rl_max_grad_norm", math.nan),  # NaN weights -> ModelOutputError traceback
    ("rl_horizon_s", -5.0),       # exp(+dt / 5): returns overflow (RuntimeWarning), silently
    ("cost_weight", math.nan),    # NaN teacher scores: summary.json / manifest.json hold NaN
    ("time_scale", math.inf),     # numpy OverflowError in make_stream after --out is made
    ("time_scale", math.nan),     # silently no time scaling
    ("buffer", 0),                # every sample dropped: NaN losses in log.jsonl, an untrained model saved
    ("time_limit_s", -1.0),       # stops before the first iteration: an untrained model saved, exit 0
])
def test_train_args_refuse_a_value_the_training_cannot_use(field: str, value: float) -> None:
    """``trainer.train.Args.__post_init__`` is where ``drl-trainer train`` checks its flags before
    any work (one ``error: ...`` line through ``dataclass_args``), but these values pass it
    (trainer/train.py ``Args.__post_init__``, lines 224-263): some are tracebacks from torch or
    numpy after ``--out`` was made and its log.jsonl truncated, some train nothing and save the
    untrained model with exit status 0, some write NaN into the JSON outputs."""
    from trainer.train import Args

    with pytest.raises(ValueError, match=field):
        Args(**{field: value})


def test_train_with_a_bad_learning_rate_is_one_line_and_leaves_out_alone(tmp_path: Path) -> None:
    """``drl-trainer train --lr -1`` runs, creates ``--out`` with an empty log.jsonl and a tb/
    folder, then dies with torch's ``ValueError: Invalid learning rate: -1.0`` traceback
    (trainer/train.py ``imitate``, ``torch.optim.Adam``; ``Args`` never checks ``lr``)."""
    out = tmp_path / "out"
    proc = _cli("-m", "trainer.cli", "--log-level", "WARNING", "train", *TINY_TRAIN, "--out", str(out), "--lr", "-1")
    assert "Traceback" not in proc.stderr, proc.stderr[-400:]
    assert proc.returncode != 0
    assert not out.exists()


@pytest.mark.parametrize("flag, value", [
    ("--hidden", "0"),           # CheckpointError from ModelConfig, after out.mkdir and log.jsonl's truncation
    ("--time-scale", "inf"),     # OverflowError from numpy's uniform(-inf, inf), after the same
])
def test_a_refused_train_run_leaves_the_previous_log_alone(tmp_path: Path, flag: str, value: str) -> None:
    """``train`` builds the model (``PlacementGNN(ModelConfig(hidden, layers))``, trainer/train.py:648)
    and draws the first stream only after ``out.mkdir`` and ``(out / "log.jsonl").open("w")``
    (trainer/train.py:633-634): a rerun refused for ``--hidden 0`` (one line, but late) or killed by
    ``--time-scale inf`` (a traceback) empties the previous run's training log beside its checkpoint."""
    out = tmp_path / "gnn"
    out.mkdir()
    (out / "log.jsonl").write_text('{"global_step": 1}\n')
    proc = _cli("-m", "trainer.cli", "--log-level", "WARNING", "train", *TINY_TRAIN, "--out", str(out), flag, value)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-400:]
    assert (out / "log.jsonl").read_text() == '{"global_step": 1}\n'
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl"]


def test_train_out_under_a_file_is_one_line_before_the_work(tmp_path: Path) -> None:
    """``--out FILE/ckpt`` (a file where a folder is needed above the checkpoint) passes the check
    ``out.exists() and not out.is_dir()`` (trainer/train.py ``train``) and is a
    ``NotADirectoryError`` traceback from ``out.mkdir`` after every input was read and the
    teachers chosen; ``bench --plots`` refuses the same path at parse time (``output_folder``)."""
    (tmp_path / "afile").write_text("x")
    proc = _cli("-m", "trainer.cli", "--log-level", "WARNING", "train", *TINY_TRAIN,
                "--out", str(tmp_path / "afile" / "ckpt"))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-400:]
    assert "afile" in proc.stderr


def test_train_that_trains_nothing_is_refused(tmp_path: Path) -> None:
    """``drl-trainer train --iters 0`` with neither ``--init`` nor ``--rl-iters`` saves a freshly
    initialised model as a checkpoint, prints its results table and exits 0, as if it were trained
    (trainer/train.py ``run``: only an empty ``--workflows`` is refused, found by review for the
    same reason: an untrained model saved as a checkpoint, exit status 0)."""
    out = tmp_path / "out"
    proc = _cli("-m", "trainer.cli", "--log-level", "WARNING", "train", *TINY_TRAIN, "--out", str(out),
                "--iters", "0")
    assert proc.returncode != 0, proc.stdout[-300:]
    assert not (out / "manifest.json").exists()


def test_the_recorded_training_command_reproduces_the_arguments() -> None:
    """The manifest's ``training.command`` is "the command that reproduces the checkpoint"
    (trainer/train.py module docstring), but ``_flags`` (trainer/train.py:681-688) joins
    ``--flag value`` unquoted: an empty value (``--heldout ''``) swallows the next flag, a value with
    a space (``--workflows 'montecarlo, etl'``, a path with a space) becomes two words, and a
    ``;``-list of settings ends the shell command. ``ensemble`` records its own with ``shlex.join``."""
    from trainer.train import Args, _flags, add_arguments, dataclass_args

    args = Args(workflows="montecarlo, etl;mlpipeline", heldout="", out="/tmp/my runs/gnn", seed=3)
    command = "drl-trainer train " + " ".join(_flags(args))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    try:
        again = dataclass_args(Args, parser.parse_args(shlex.split(command)[2:]))
    except SystemExit as exc:
        pytest.fail(f"the recorded command {command!r} does not parse: {exc}")
    assert again == args, command


# --- drl-trainer ensemble ----------------------------------------------------------------------


def _members(tmp_path: Path, n: int = 2) -> list[str]:
    from policy.checkpoint import save_checkpoint
    from policy.model import ModelConfig, PlacementGNN

    paths = []
    for seed in range(n):
        torch.manual_seed(seed)
        path = tmp_path / f"m{seed}"
        save_checkpoint(PlacementGNN(ModelConfig(hidden=8, layers=2)), path)
        paths.append(str(path))
    return paths


def test_an_ensemble_of_one_checkpoint_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``drl-trainer ensemble A A --out E`` writes "2 members: gnn-x, gnn-x", the mean of one model's
    logits with themselves, presented as an ensemble of two seeds (trainer/ensemble.py
    ``_check_members`` refuses fewer than two, a nested ensemble and ``--out`` = a member, but not
    the same checkpoint twice, e.g. a repeated shell glob or a typo of the second path)."""
    from trainer.cli import main

    a, _ = _members(tmp_path)
    code, _, err = _in_process(main, ["ensemble", a, a, "--out", str(tmp_path / "ens")], capsys)
    assert _refused_cleanly(code), code
    assert not (tmp_path / "ens").exists()


def test_ensemble_out_under_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--out FILE/ens`` passes ``_check_members``' "a file is there" check (it looks at ``--out``
    only, not at the folders above it) and is a ``NotADirectoryError`` traceback from
    ``save_ensemble``'s mkdir, after every member was loaded (and, with ``--evaluate``, after the
    whole evaluation) (trainer/ensemble.py ``_check_members``)."""
    from trainer.cli import main

    members = _members(tmp_path)
    (tmp_path / "afile").write_text("x")
    code, _, err = _in_process(main, ["ensemble", *members, "--out", str(tmp_path / "afile" / "ens")], capsys)
    assert _refused_cleanly(code), code
    assert "afile" in err + str(code), err[-300:]


# --- scripts/cost_frontier.py ------------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [
    ("--jobs", "0"),      # ValueError: max_workers must be greater than 0 (ProcessPoolExecutor)
    ("--lams", "abc"),    # ValueError: could not convert string to float: 'abc'
    ("--load", "0"),      # ValueError: load must be > 0, re-raised from a worker process
    ("--load", "nan"),    # same
    ("--seeds", "-1"),    # numpy: expected non-negative integer, from a worker process
])
def test_cost_frontier_refuses_a_bad_argument_in_one_line(flag: str, value: str) -> None:
    """scripts/cost_frontier.py parses ``--jobs``, ``--load`` and ``--seeds`` as plain int/float and
    ``--lams`` after parsing (``float(x)`` in ``main``): each bad value is a Python traceback, some
    from inside the worker processes after other simulations were started, not argparse's one-line
    ``error: argument ...`` with exit status 2."""
    proc = _cli(str(COST_FRONTIER), flag, value, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-400:]
    assert proc.returncode == 2, proc.returncode
    assert flag in proc.stderr


# --- scripts/ratio_table.py --------------------------------------------------------------------


def _bench(path: Path, rows: list[tuple[str, str, float]]) -> None:
    path.write_text(json.dumps({"results": [{"policy": p, "setting": s, "mean_jct_s": v} for p, s, v in rows]}))


def _ratio_table(monkeypatch: pytest.MonkeyPatch, *argv: str) -> Any:
    monkeypatch.setattr(sys, "argv", ["ratio_table.py", *argv])
    return runpy.run_path(str(RATIO_TABLE), run_name="__main__")


def test_ratio_table_names_a_missing_bench_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A seed whose bench JSON is not there (a typo in ``--seeds`` or in the prefix) is a
    ``FileNotFoundError`` traceback (scripts/ratio_table.py ``_table``: ``Path(path).read_text()``),
    where every other refusal of the script is a ``SystemExit`` naming the file."""
    _bench(tmp_path / "base-0.json", [("srpt+eft", "wfcommons:bwa:200:3", 50)])
    _bench(tmp_path / "m-0.json", [("drl", "wfcommons:bwa:200:3", 55)])
    with pytest.raises(SystemExit, match="base-20.json"):
        _ratio_table(monkeypatch, str(tmp_path / "base"), f"m={tmp_path / 'm'}", "--seeds", "0", "20")


def test_ratio_table_names_a_model_file_without_drl_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model prefix whose bench JSON has no ``drl`` row (the baselines' file given as the model,
    or a bench run without ``--policies drl``) is ``KeyError: 'drl'`` (scripts/ratio_table.py
    ``main``: ``_table(...)["drl"]``)."""
    _bench(tmp_path / "base-0.json", [("srpt+eft", "wfcommons:bwa:200:3", 50)])
    _bench(tmp_path / "m-0.json", [("heft", "wfcommons:bwa:200:3", 55)])
    with pytest.raises(SystemExit, match="drl"):
        _ratio_table(monkeypatch, str(tmp_path / "base"), f"m={tmp_path / 'm'}", "--seeds", "0")


def test_ratio_table_names_a_setting_the_baselines_did_not_run(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """drl measured on a family the baselines' file lacks (files without ``config``, which
    ``check_same_streams`` skips) is ``KeyError: 'soykb'`` (scripts/ratio_table.py ``main``:
    ``v / best[k]``)."""
    _bench(tmp_path / "base-0.json", [("srpt+eft", "wfcommons:bwa:200:3", 50)])
    _bench(tmp_path / "m-0.json", [("drl", "wfcommons:bwa:200:3", 55), ("drl", "wfcommons:soykb:200:3", 60)])
    with pytest.raises(SystemExit, match="soykb"):
        _ratio_table(monkeypatch, str(tmp_path / "base"), f"m={tmp_path / 'm'}", "--seeds", "0")


def test_ratio_table_does_not_pair_two_settings_of_one_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Two settings of one recipe (``wfcommons:bwa:200:3`` and ``wfcommons:bwa:1000:3``) are one
    family for ``family()``, and ``_table`` keeps the lowest value per family: drl's best setting is
    divided by the baselines' best setting, which may be the other one. Here drl is 2x the best
    baseline on bwa:200 and 0.5x on bwa:1000 (geometric mean 1.0); the script prints 2.000 (drl's
    100 on bwa:1000 over the baselines' 50 on bwa:200) (scripts/ratio_table.py ``family``/``_table``)."""
    _bench(tmp_path / "base-0.json", [("srpt+eft", "wfcommons:bwa:200:3", 50),
                                      ("srpt+eft", "wfcommons:bwa:1000:3", 200)])
    _bench(tmp_path / "m-0.json", [("drl", "wfcommons:bwa:200:3", 100), ("drl", "wfcommons:bwa:1000:3", 100)])
    try:
        _ratio_table(monkeypatch, str(tmp_path / "base"), f"m={tmp_path / 'm'}", "--seeds", "0")
    except SystemExit:
        return  # refusing to merge two settings is a fix too
    out = capsys.readouterr().out
    assert "mean 1.000" in out, out


def test_ratio_table_counts_a_repeated_seed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--seeds 0 0 20`` reads seed 0's files once (a dict keyed by seed) but loops over the list,
    so seed 0 counts twice in the overall geometric mean: 1.1 and 0.9 become (1.1^2 x 0.9)^(1/3)
    = 1.029 instead of 0.995 (scripts/ratio_table.py ``main``: ``for seed in args.seeds``)."""
    for seed, drl in ((0, 110), (20, 90)):
        _bench(tmp_path / f"base-{seed}.json", [("srpt+eft", "wfcommons:bwa:200:3", 100)])
        _bench(tmp_path / f"m-{seed}.json", [("drl", "wfcommons:bwa:200:3", drl)])
    _ratio_table(monkeypatch, str(tmp_path / "base"), f"m={tmp_path / 'm'}", "--seeds", "0", "20")
    once = capsys.readouterr().out.split("mean ")[1].split()[0]
    try:
        _ratio_table(monkeypatch, str(tmp_path / "base"), f"m={tmp_path / 'm'}", "--seeds", "0", "0", "20")
    except SystemExit:
        return  # refusing a repeated seed is a fix too
    twice = capsys.readouterr().out.split("mean ")[1].split()[0]
    assert twice == once
