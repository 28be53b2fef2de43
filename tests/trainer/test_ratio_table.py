"""``scripts/ratio_table.py``: drl over the per-setting best baseline from JSON run apart."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ratio_table.py"


def _bench(path: Path, rows: list[tuple[str, str, float]]) -> None:
    # p95 JCT is 3x the mean for every policy but srpt+eft (2x): it is the best on p95
    path.write_text(json.dumps({"results": [
        {"policy": p, "setting": s, "mean_jct_s": v, "p95_jct_s": v * (2 if p == "srpt+eft" else 3)}
        for p, s, v in rows]}))


def test_ratio_table_matches_settings_across_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    epi_here = "../shared/w/epigenomics-a-001.json,../shared/w/epigenomics-b-001.json"
    epi_there = "/work/shared/w/epigenomics-a-001.json,/work/shared/w/epigenomics-b-001.json"
    for seed, scale in ((0, 1.0), (20, 2.0)):
        _bench(tmp_path / f"base-{seed}.json", [("srpt+eft", epi_here, 100 * scale), ("heft", epi_here, 80 * scale),
                                                ("srpt+eft", "wfcommons:bwa:200:3", 50 * scale)])
        _bench(tmp_path / f"m-{seed}.json", [("drl", epi_there, 88 * scale), ("drl", "wfcommons:bwa:200:3", 55 * scale)])
    monkeypatch.setattr(sys, "argv", ["ratio_table.py", str(tmp_path / "base"), f"m={tmp_path / 'm'}",
                                      "--seeds", "0", "20"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    # 88/80 = 1.1 (the best baseline, heft, not srpt+eft) and 55/50 = 1.1 on both seed pairs
    assert out.strip() == "m: 1.100 / 1.100  mean 1.100  (epigenomics 1.100 / bwa 1.100)"
    monkeypatch.setattr(sys, "argv", sys.argv + ["--metric", "p95_jct_s"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    # p95: 264 / 200 = 1.32 (srpt+eft is now the best baseline on Epigenomics), 165 / 100 = 1.65
    assert capsys.readouterr().out.strip() == "m: 1.476 / 1.476  mean 1.476  (epigenomics 1.320 / bwa 1.650)"


def test_ratio_table_over_the_best_fixed_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # heft wins Epigenomics, srpt+eft BWA; over both settings srpt+eft has the lower geometric mean
    for seed in (0, 20):
        _bench(tmp_path / f"base-{seed}.json", [("srpt+eft", "a/epigenomics-x-001.json", 100), ("heft", "a/epigenomics-x-001.json", 80),
                                                ("srpt+eft", "wfcommons:bwa:200:3", 50), ("heft", "wfcommons:bwa:200:3", 90)])
        _bench(tmp_path / f"m-{seed}.json", [("drl", "b/epigenomics-x-001.json", 90), ("drl", "wfcommons:bwa:200:3", 45)])
    monkeypatch.setattr(sys, "argv", ["ratio_table.py", str(tmp_path / "base"), f"m={tmp_path / 'm'}",
                                      "--seeds", "0", "20", "--reference", "best-fixed"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    # 90/100 and 45/50 against srpt+eft (per-setting best would give 90/80 = 1.125 on Epigenomics);
    # the per-setting best is sqrt(80/100 x 50/50) = 0.894 x srpt+eft, and 0.95 / 0.894 = 1.062
    assert capsys.readouterr().out.strip().splitlines() == [
        "best fixed baseline: srpt+eft; the per-setting best is 0.894 x it, so 0.95 x it is 1.062 x the "
        "per-setting best", "m: 0.900 / 0.900  mean 0.900  (epigenomics 0.900 / bwa 0.900)"]


def test_ratio_table_refuses_a_zero_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SLA violation rates can be 0: a clear error instead of a division by zero."""
    for name, rows in (("base", [("srpt+eft", "wfcommons:bwa:200:3", 0.0)]), ("m", [("drl", "wfcommons:bwa:200:3", 0.1)])):
        (tmp_path / f"{name}-0.json").write_text(json.dumps({"results": [
            {"policy": p, "setting": s, "sla_violation_rate": v} for p, s, v in rows]}))
    monkeypatch.setattr(sys, "argv", ["ratio_table.py", str(tmp_path / "base"), f"m={tmp_path / 'm'}",
                                      "--seeds", "0", "--metric", "sla_violation_rate"])
    with pytest.raises(SystemExit, match=r"sla_violation_rate of srpt\+eft on bwa is 0.0"):
        runpy.run_path(str(SCRIPT), run_name="__main__")


def test_ratio_table_over_one_rule_per_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--reference per-setting-rule``: one baseline per setting over all seeds, not the best of each seed."""
    for seed, heft in ((0, 90), (20, 120)):  # heft wins seed 0, srpt+eft seed 20 and over both
        _bench(tmp_path / f"base-{seed}.json", [("srpt+eft", "wfcommons:bwa:200:3", 100), ("heft", "wfcommons:bwa:200:3", heft)])
        _bench(tmp_path / f"m-{seed}.json", [("drl", "wfcommons:bwa:200:3", 95)])
    argv = ["ratio_table.py", str(tmp_path / "base"), f"m={tmp_path / 'm'}", "--seeds", "0", "20"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPT), run_name="__main__")
    # per seed: 95/90 and 95/100
    assert capsys.readouterr().out.strip() == "m: 1.056 / 0.950  mean 1.001  (bwa 1.001)"
    monkeypatch.setattr(sys, "argv", argv + ["--reference", "per-setting-rule"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    # srpt+eft's geometric mean 100 < heft's sqrt(90 x 120) = 103.9; the per-seed best is sqrt(0.9 x 1.0) x it
    assert capsys.readouterr().out.strip().splitlines() == [
        "per-setting rule: bwa srpt+eft (the per-seed best is 0.949 x it)", "m: 0.950 / 0.950  mean 0.950  (bwa 0.950)"]
