"""``drl-trainer``: domain errors (a bad catalogue, a missing checkpoint) are one line on stderr
with exit code 2, not a traceback (found by review)."""

from __future__ import annotations

import argparse
import subprocess
import sys

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
