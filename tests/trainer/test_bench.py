"""``drl-trainer bench``: flags, table, JSON keys, plots (a tiny run)."""

from __future__ import annotations

import json

from trainer.cli import main
from trainer.metrics import KEYS


def test_bench_writes_json_and_plots(tmp_path, capsys):
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    rc = main(["bench", "--workflows", "etl", "--workflows", "mlpipeline", "--policies", "fifo,srpt+eft,heft",
               "--dag-runs", "6", "--seeds", "2", "--load", "0.85", "--duration-noise", "0.3",
               "--json", str(out), "--plots", str(plots)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "srpt+eft" in text and "best fixed baseline" in text
    data = json.loads(out.read_text())
    rows = data["results"]
    assert len(rows) == 6
    for row in rows:
        assert set(KEYS) <= set(row)
        assert row["mean_jct_over_stream_lb"] >= 1.0 - 1e-9
    assert data["references"]["best_fixed"]["policy"] in {"fifo", "srpt+eft", "heft"}
    assert set(data["references"]["per_setting_best"]) == {"etl", "mlpipeline"}
    pngs = sorted(p.name for p in plots.glob("*.png"))
    assert "metrics-0.png" in pngs and "gantt-srpt_eft.png" in pngs


def test_bench_measures_the_committed_policy_against_baselines_only(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--workflows", "etl", "--policies", "drl,fifo,srpt+eft", "--dag-runs", "5",
               "--json", str(out)])
    assert rc == 0
    assert "drl: mean JCT / best fixed" in capsys.readouterr().out
    data = json.loads(out.read_text())
    drl = next(r for r in data["results"] if r["policy"] == "drl")
    assert data["references"]["best_fixed"]["policy"] != "drl"
    assert data["references"]["per_setting_best"]["etl"] != "drl"
    best = next(r for r in data["results"] if r["per_setting_best"])
    assert drl["mean_jct_over_per_setting_best"] == drl["mean_jct_s"] / best["mean_jct_s"]


def test_bench_bounds_holds_like_the_executor(tmp_path):
    # srpt+eft holds a task whose earliest-finish pool is busy; with --max-wait-s 0 every hold
    # ends at once in the fallback's placement, and the bound is recorded in the config.
    runs = {}
    for bound in (None, "0"):
        out = tmp_path / f"bench-{bound}.json"
        extra = ["--max-wait-s", bound] if bound else []
        assert main(["bench", "--workflows", "mlpipeline", "--policies", "srpt+eft", "--dag-runs", "8",
                     "--json", str(out), *extra]) == 0
        runs[bound] = json.loads(out.read_text())
    assert runs[None]["config"]["max_wait_s"] is None and runs["0"]["config"]["max_wait_s"] == 0.0
    assert runs[None]["results"][0]["wait_fallbacks"] == 0
    assert runs["0"]["results"][0]["wait_fallbacks"] > 0
