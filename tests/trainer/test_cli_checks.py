"""``drl-trainer`` refuses bad flag values in one line before any work, and leaves what a refused
run would have overwritten alone (found by review, 2026-12-06). Subcommands that reach a
simulation use tiny sizes (a few DAG runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: a tiny training run (a few seconds) for drl-trainer train
TINY_TRAIN = ["--iters", "1", "--runs-start", "2", "--runs-end", "2", "--eval-runs", "2", "--eval-streams", "1",
              "--epochs", "1", "--workflows", "montecarlo", "--heldout", "etl", "--candidates", "srpt+eft,fifo+eft",
              "--hidden", "8", "--layers", "1", "--threads", "1"]
#: a tiny bench (three DAG runs, one policy)
TINY_BENCH = ["--workflows", "montecarlo", "--dag-runs", "3", "--policies", "fifo+eft", "--seeds", "1"]


def _cli(module: str, *argv: str, env: dict[str, str] | None = None, timeout: float = 60,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, "--log-level", "WARNING", *argv], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd or ROOT)


def _in_process(main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]
                ) -> tuple[int | str | None, str, str]:
    """(exit status, stdout, stderr) of ``main(argv)``; an exception that escapes ``main`` is what a
    user sees as a traceback, and is returned as the status ``"traceback: <exc>"``."""
    try:
        code: int | str | None = main(argv)
    except SystemExit as exc:
        code = exc.code
    except Exception as exc:  # noqa: BLE001 - the bug under test
        code = f"traceback: {type(exc).__name__}: {exc}"
    out, err = capsys.readouterr()
    return code, out, err


def _refused_cleanly(code: int | str | None, err: str) -> bool:
    return isinstance(code, int) and code != 0 and "Traceback" not in err


# --- drl-trainer train ---------------------------------------------------------------------------


def test_a_refused_train_run_leaves_the_existing_checkpoint_folder_alone(tmp_path: Path) -> None:
    """``drl-trainer train --out runs/gnn`` opens ``runs/gnn/log.jsonl`` for writing (truncating it)
    and starts a new TensorBoard event file BEFORE reading the catalogue or the workflows
    (trainer/train.py ``train``: ``out.mkdir``; ``(out / "log.jsonl").open("w")``). A rerun that is
    refused at once (a typo in ``--pools``, one clean error line) empties the previous run's
    training log next to its still-present checkpoint, and a run that fails later leaves the old
    manifest beside the new run's log."""
    out = tmp_path / "gnn"
    out.mkdir()
    (out / "log.jsonl").write_text('{"global_step": 1, "losses/total": 0.5}\n')
    (out / "manifest.json").write_text("{}\n")
    proc = _cli("trainer.cli", "train", *TINY_TRAIN, "--out", str(out), "--pools", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "cannot read the pool catalogue" in proc.stderr, proc.stderr[-400:]
    assert (out / "log.jsonl").read_text() == '{"global_step": 1, "losses/total": 0.5}\n'
    assert sorted(p.name for p in out.iterdir()) == ["log.jsonl", "manifest.json"]


@pytest.mark.parametrize("flag, value", [
    ("--threads", "0"),          # RuntimeError: set_num_threads expects a positive integer
    ("--load", "0"),             # ValueError: load must be > 0 (from ArrivalSpec, after --out is truncated)
    ("--max-wait-s", "-5"),      # ValueError from SimConfig
    ("--teacher", "bogus"),      # ValueError: unknown policy 'bogus' (from make_placer)
    ("--candidates", ","),       # ValueError: min() arg is an empty sequence
    ("--seed", "-1"),            # ValueError: expected non-negative integer (numpy)
])
def test_train_refuses_a_bad_value_in_one_line_before_touching_out(tmp_path: Path, flag: str, value: str) -> None:
    """``drl-trainer train`` checks a few fields in ``Args.__post_init__`` (one ``error: ...`` line)
    but not these: each is a Python traceback from deep inside torch, numpy, the simulator or the
    baselines (``--candidates ,`` says only "min() arg is an empty sequence"), after ``--out`` was
    created and its log truncated (trainer/train.py ``Args.__post_init__`` / ``train``)."""
    out = tmp_path / "out"
    proc = _cli("trainer.cli", "train", *TINY_TRAIN, "--out", str(out), flag, value)
    assert "Traceback" not in proc.stderr, proc.stderr[-500:]
    assert proc.returncode != 0
    assert not out.exists()


@pytest.mark.parametrize("workflows", ["", ";"])
def test_train_with_no_training_setting_is_refused(tmp_path: Path, workflows: str) -> None:
    """``drl-trainer train --workflows ''`` (an unset shell variable, or ``';'``) trains on nothing:
    ``settings_from`` returns no setting, imitation takes no step (NaN losses in the log), and an
    untrained model is saved as a checkpoint with exit status 0 and a results table, as if it were
    a trained policy (trainer/train.py ``Args``: ``workflows`` is never checked; ``finetune`` passes
    ``workflows=""`` on purpose, so the check belongs to ``train``'s command line)."""
    out = tmp_path / "out"
    proc = _cli("trainer.cli", "train", *TINY_TRAIN, "--out", str(out), "--workflows", workflows)
    assert proc.returncode != 0 and "workflows" in proc.stderr, (proc.returncode, proc.stdout[-300:])
    assert not (out / "manifest.json").exists()


def test_train_help_of_candidates_describes_candidates() -> None:
    """``drl-trainer train --help`` documents ``--candidates`` with ``--teacher-streams``' text
    ("streams of eval_runs DAG runs each that 'auto' scores the candidates on..."): ``candidates``
    has no ``#:`` comment of its own in ``Args`` (trainer/train.py), so ``field_docs`` gives it the
    comment above it. A user reading the help cannot learn that it takes a comma list of baselines."""
    import argparse

    from trainer.train import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help or "" for a in parser._actions}
    assert "streams of" not in helps["candidates"], helps["candidates"]


# --- drl-trainer bench / makespan / explain ------------------------------------------------------


@pytest.mark.parametrize("flag, value", [
    ("--failure-rate", "1.5"),       # ValueError from SimConfig: failure rate ... must be in [0, 1)
    ("--dispatch-latency", "-1"),    # ValueError from SimConfig
    ("--max-wait-s", "-1"),          # ValueError from SimConfig
    ("--seed", "-1"),                # ValueError: expected non-negative integer (numpy)
    ("--dispatch-latency", "nan"),   # accepted: a table of results for a NaN latency, exit 0
])
def test_bench_refuses_a_bad_simulator_flag_in_one_line(capsys: pytest.CaptureFixture[str], flag: str,
                                                        value: str) -> None:
    """``drl-trainer bench`` checks ``--load``, ``--policies``, ``--hold-ratio`` and ``--cp-gate``
    at parse time, but ``--failure-rate``, ``--dispatch-latency``, ``--max-wait-s`` and ``--seed``
    are plain ``float``/``int``: bad values are tracebacks from ``SimConfig`` or numpy, and
    ``--dispatch-latency nan`` passes ``SimConfig``'s ``< 0`` check and prints results
    (trainer/bench.py ``add_arguments``)."""
    from trainer.cli import main

    code, _, err = _in_process(main, ["bench", *TINY_BENCH, flag, value], capsys)
    assert _refused_cleanly(code, err), code
    assert flag in err and value in err, err[-300:]


def test_makespan_refuses_an_unknown_policy_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``drl-trainer makespan --policies bogus`` is a traceback (``ValueError: unknown policy
    'bogus'`` from ``make_placer``) after the workflows are loaded; ``bench`` refuses the same value
    at parse time with its ``_policies`` type (trainer/makespan.py ``add_arguments``)."""
    from trainer.cli import main

    code, _, err = _in_process(main, ["makespan", "--workflows", "montecarlo", "--policies", "bogus"], capsys)
    assert _refused_cleanly(code, err), code
    assert "bogus" in err


@pytest.mark.parametrize("argv, option", [
    (["bench", *TINY_BENCH, "--json", "{missing}/out.json"], "--json"),
    (["bench", *TINY_BENCH, "--markdown", "{missing}/out.md"], "--markdown"),
    (["makespan", "--workflows", "montecarlo", "--policies", "heft", "--json", "{missing}/out.json"], "--json"),
    (["explain", "--dag-runs", "2", "--png", "{missing}/explain.png"], "--png"),
])
def test_an_unwritable_output_path_is_refused_before_the_work(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], option: str) -> None:
    """An output path in a folder that does not exist (or under a file) is found only when the
    results are written, after every simulation: a ``FileNotFoundError`` / ``NotADirectoryError``
    traceback, and the work (minutes for a real bench) is lost (trainer/bench.py, makespan.py,
    explain.py ``run``). The path's folder can be checked before any work."""
    from trainer.cli import main

    argv = [a.replace("{missing}", str(tmp_path / "missing")) for a in argv]
    code, out, err = _in_process(main, argv, capsys)
    assert _refused_cleanly(code, err), code
    assert option in err or str(tmp_path / "missing") in err, err[-300:]
    assert "simulated in" not in out and "median" not in out and "decision point" not in out


def test_bench_writes_no_json_when_its_markdown_cannot_be_written(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    """``--json ok.json --markdown missing/out.md``: the JSON is written, then the Markdown write
    raises: a traceback, exit 1, and a results file left behind as if the run had succeeded
    (trainer/bench.py ``run`` writes the outputs one after the other, unchecked)."""
    from trainer.cli import main

    good = tmp_path / "ok.json"
    code, _, err = _in_process(main, ["bench", *TINY_BENCH, "--json", str(good), "--markdown",
                                      str(tmp_path / "missing" / "out.md")], capsys)
    assert _refused_cleanly(code, err), code
    assert not good.exists()


@pytest.mark.parametrize("flag, value", [
    ("--dag-runs", "0"),           # ValueError: n_runs must be >= 1
    ("--load", "0"),               # ValueError: load must be > 0
    ("--duration-noise", "-1"),    # ValueError from SimConfig
    ("--seed", "-1"),              # ValueError: expected non-negative integer (numpy)
    ("--top", "-3"),               # accepted: lists all but the last 3 (a Python slice [:-3])
    ("--request", "100000"),       # accepted: silently explains the stream's last decision point
])
def test_explain_refuses_a_bad_value_in_one_line(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    """``drl-trainer explain`` parses these as plain ``int``/``float`` and checks none: four are
    tracebacks from the workload generator, the simulator or numpy; ``--top -3`` prints every
    feature but the last three; ``--request 100000`` on a stream of far fewer decision points
    explains the last one without saying it is not the one asked for (trainer/explain.py
    ``add_arguments`` / ``find_decision``)."""
    from trainer.cli import main

    argv = ["explain", "--dag-runs", "2", "--png", "", flag, value]
    if flag == "--dag-runs":
        argv = ["explain", "--png", "", flag, value]
    code, _, err = _in_process(main, argv, capsys)
    assert _refused_cleanly(code, err), code
    assert flag in err or value in err, err[-300:]
