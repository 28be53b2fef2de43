"""The simulated figures stay where they were measured, or the change that moves them says so.

The README's and docs/policy.md's simulated figures are reproduced by re-running their commands,
so a change that moves the simulator, the workloads or a heuristic moves every figure measured
before it. c5b59e8 (EFT's ties broken by the queue before the price, 2026-12-06) moved all 216
held-out means by -5.4 to +6.2% while its message said no figure moved; nothing failed, and the
drift was found a day later by ``git bisect``. This test re-runs a small bench of the baselines
(EFT's ties, holds past the 60 s bound placed by the fallback, two families) and compares it
with the JSON committed beside it, exactly (pure Python and numpy arithmetic, versions pinned by
``constraints.txt``).

When it fails on purpose (a heuristic or the simulator was meant to change), the figures measured
before the change no longer reproduce: re-measure the ones the README leans on, say in the README
which commit the others need, then write the file again with the command in the JSON's
``command`` key (run from the repository root). The learned policy is left out: its float32
forward may round differently on another CPU, which the model's own tests cover.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from trainer.cli import main

PINNED = Path(__file__).parent / "pinned" / "baselines-bench.json"
#: what a bench row measures by simulation (its wall time and rates vary from run to run)
SIMULATED = ("mean_jct_s", "p95_jct_s", "mean_slowdown", "mean_jct_over_lb", "mean_jct_over_stream_lb",
             "makespan_s", "cost", "sla_violation_rate", "utilization", "failed_tries", "refused_decisions",
             "wait_fallbacks", "events")


def _rows(data: dict) -> dict[tuple[str, str], dict]:  # type: ignore[type-arg]
    return {(r["setting"], r["policy"]): {k: r[k] for k in SIMULATED} for r in data["results"]}


def test_the_baselines_simulate_as_when_the_figures_were_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    pinned = json.loads(PINNED.read_text())
    argv = shlex.split(pinned["command"])
    assert argv[:2] == ["drl-trainer", "bench"] and argv[-2] == "--json"
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the command's paths are the repository's
    out = tmp_path / "bench.json"
    assert main(argv[1:-1] + [str(out)]) == 0
    capsys.readouterr()
    got, want = _rows(json.loads(out.read_text())), _rows(pinned)
    assert got.keys() == want.keys()
    moved = {k: (got[k]["mean_jct_s"], want[k]["mean_jct_s"]) for k in want if got[k] != want[k]}
    assert not moved, (f"{len(moved)} of {len(want)} simulated rows moved (now, pinned: {moved}); the figures "
                       f"measured before this change no longer reproduce: see this test's docstring")
