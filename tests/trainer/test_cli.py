"""``drl-trainer``: domain errors (a bad catalogue, a missing checkpoint) are one line on stderr
with exit code 2, not a traceback (found by review)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.cli import main


def test_explain_reports_a_missing_checkpoint_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--checkpoint", "/nope", "--png", ""]) == 2
    captured = capsys.readouterr()
    assert captured.err == "drl-trainer: error: /nope/manifest.json: missing (is /nope a checkpoint directory?)\n"
    assert captured.out == ""


def test_explain_reports_a_bad_catalogue_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    bad = tmp_path / "typo.yaml"
    bad.write_text("vm_classes:\n  small: {cpus: 4, memory_gb: 16, sped: 2}\npools:\n  p: {vm_class: small}\n")
    assert main(["explain", "--pools", str(bad), "--png", "", "--dag-runs", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"drl-trainer: error: {bad}: vm_classes.small: unknown key 'sped'") and err.count("\n") == 1


def test_the_command_line_prints_no_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "trainer.cli", "bench", "--pools", "/nope.yaml"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("drl-trainer: error: /nope.yaml: cannot read the pool catalogue")


def test_a_malformed_replay_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    """Found by review: a replay file the nightly export wrote badly printed a traceback."""
    bad = tmp_path / "replay.jsonl"
    bad.write_text('{"arrival_s": 0, "graph": {"run_key": "x"}}\n')
    from policy.registry import DEFAULT_CHECKPOINT, activate

    activate(tmp_path / "reg", DEFAULT_CHECKPOINT)
    assert main(["finetune", "--replay", str(bad), "--registry", str(tmp_path / "reg")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"drl-trainer: error: {bad}:1") and err.count("\n") == 1, err


def test_every_explain_flag_has_help() -> None:
    from trainer.explain import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert [a.dest for a in parser._actions if not a.help] == []


def _v15(tasks_spec: list[dict], tasks_exec: list[dict]) -> dict:
    return {"schemaVersion": "1.5", "name": "w",
            "workflow": {"specification": {"tasks": tasks_spec}, "execution": {"tasks": tasks_exec}}}


def _empty_workflow(tmp_path: Path) -> str:
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(_v15([], [])))
    return str(path)


@pytest.mark.parametrize(("command", "spec", "message"), [
    (["makespan"], _empty_workflow, "the workflow has no tasks"),
    (["makespan"], lambda tmp: str(tmp / "nope.json"), "nope.json"),
    (["makespan"], lambda tmp: "wfcommons:nope:100", "unknown recipe 'nope'"),
    (["makespan"], lambda tmp: "wfcommons:blast:many", "must be integers"),
    (["bench", "--dag-runs", "2"], _empty_workflow, "the workflow has no tasks"),
    (["train", "--iters", "1"], _empty_workflow, "the workflow has no tasks"),
], ids=["makespan-malformed-file", "makespan-missing-file", "makespan-unknown-recipe",
        "makespan-bad-recipe-count", "bench-malformed-file", "train-malformed-file"])
def test_a_bad_workflow_spec_is_one_line_not_a_traceback(
        command: list[str], spec, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``drl-trainer`` turns only CatalogueError, CheckpointError and ReplayError into its one-line
    ``drl-trainer: error: ...`` (trainer/cli.py:395). The errors of ``--workflows`` -- the
    SchemaError of a malformed WfFormat file, the ValueError of a path that does not exist or of
    a bad ``wfcommons:`` spec (trainer/workloads.py, trainer/recipes.py) -- escape as a Python
    traceback from bench, makespan, train and explain, although their messages already name
    the file and the field."""
    argv = [*command, "--workflows", spec(tmp_path)]
    if command[0] == "train":
        argv += ["--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("drl-trainer: error: ") and message in err and err.count("\n") == 1, err
