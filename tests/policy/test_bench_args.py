"""``drl-policy bench`` refuses bad flags at parse time: one line naming the flag and the value,
exit code 2, no traceback, nothing started (found by review: ``--dag-sizes abc`` crashed with a
ValueError, ``--catalogue /nope.yaml`` with a CatalogueError, ``--clients 0`` printed rows of NaN)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from policy.cli import main


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        ("--dag-sizes", "abc", "'abc' is not an integer"),
        ("--dag-sizes", "50,x", "'x' is not an integer"),
        ("--dag-sizes", "0", "must be >= 1"),
        ("--dag-sizes", ",", "expected a comma-separated list"),
        ("--ready", "-4", "must be >= 1"),
        ("--clients", "0", "must be >= 1"),
        ("--clients", "1,0", "must be >= 1"),
        ("--duration", "-1", "expected a finite number > 0"),
        ("--duration", "0", "expected a finite number > 0"),
        ("--duration", "nan", "expected a finite number > 0"),
        ("--duration", "abc", "expected a finite number > 0"),
        ("--catalogue", "/nope.yaml", "cannot read the pool catalogue"),
        ("--replicas", "0", "must be >= 1"),
        ("--client-procs", "0", "must be >= 1"),
        ("--soak", "-1", "expected a finite number >= 0"),
        ("--rate", "0", "expected a finite number > 0"),
        ("--rss-every", "inf", "expected a finite number > 0"),
        ("--new-run-every", "-1", "must be >= 0"),
        ("--batch-max", "0", "must be >= 1"),
        ("--batch-wait-ms", "-1", "must be >= 0"),
    ],
)
def test_bad_flags_are_a_parser_error_naming_flag_and_value(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, value: str, reason: str
) -> None:
    out = tmp_path / "bench.json"
    # a tiny valid case first (the flag under test overrides it), so a flag let through runs briefly
    tiny = ["--dag-sizes", "5", "--ready", "1", "--clients", "1", "--duration", "0.05", "--device", "cpu"]
    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "WARNING", "bench", *tiny, f"{flag}={value}", "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("drl-policy bench: error: argument ")
    assert flag in last and value in last and reason in last, last
    assert not out.exists()


def test_bad_catalogue_file_names_the_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "typo.yaml"
    bad.write_text("vm_classes:\n  small: {cpus: 4, memory_gb: 16}\npools:\n  p: {vm_class: small, worker: 5}\n")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--catalogue", str(bad)])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --catalogue" in last and "typo.yaml: pools.p: unknown key 'worker'" in last


def test_the_command_line_prints_no_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "policy.cli", "bench", "--dag-sizes", "abc"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "drl-policy bench: error: argument --dag-sizes: 'abc' is not an integer (in 'abc')")
