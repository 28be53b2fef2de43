"""``drl-trainer bench``: flags, table, JSON keys, plots (a tiny run)."""

from __future__ import annotations

import json

import pytest

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


def _with_and_without(tmp_path, flag: str, value: str, args: list[str]) -> dict:
    """The bench JSON of ``args`` without ``flag`` (key None) and with ``flag value`` (key value)."""
    runs = {}
    for v in (None, value):
        out = tmp_path / f"bench-{v}.json"
        assert main(["bench", *args, "--json", str(out), *([flag, v] if v else [])]) == 0
        runs[v] = json.loads(out.read_text())
    return runs


def test_bench_bounds_holds_like_the_executor(tmp_path):
    # srpt+eft holds a task whose earliest-finish pool is busy; with --max-wait-s 0 every hold
    # ends at once in the fallback's placement, and the bound is recorded in the config.
    runs = _with_and_without(tmp_path, "--max-wait-s", "0",
                             ["--workflows", "mlpipeline", "--policies", "srpt+eft", "--dag-runs", "8"])
    assert runs[None]["config"]["max_wait_s"] is None and runs["0"]["config"]["max_wait_s"] == 0.0
    assert runs[None]["results"][0]["wait_fallbacks"] == 0
    assert runs["0"]["results"][0]["wait_fallbacks"] > 0


def test_bench_sets_the_learned_policys_stop_guard(tmp_path, capsys):
    # --hold-ratio reaches the drl placer and is recorded; the default is the shipped guard (inf,
    # work-conserving); a ratio below 1 is refused by the parser with the reason.
    runs = _with_and_without(tmp_path, "--hold-ratio", "1",
                             ["--workflows", "etl", "--policies", "drl", "--dag-runs", "4"])
    assert runs[None]["config"]["hold_ratio"] == "inf" and runs["1"]["config"]["hold_ratio"] == "1.0"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["bench", "--workflows", "etl", "--policies", "drl", "--hold-ratio", "0.5"])
    assert "hold_ratio must be >= 1" in capsys.readouterr().err


def test_bench_sets_the_learned_policys_late_binding(tmp_path):
    # --reserve-busy 0 makes the default checkpoint (trained reserving busy pools) send every
    # chosen task instead: other decisions, recorded in the config; by default it decodes as trained.
    runs = _with_and_without(tmp_path, "--reserve-busy", "0",
                             ["--workflows", "mlpipeline", "--policies", "drl", "--dag-runs", "8"])
    assert runs[None]["config"]["reserve_busy"] == "checkpoint" and runs["0"]["config"]["reserve_busy"] == 0
    assert runs[None]["results"][0]["mean_jct_s"] != runs["0"]["results"][0]["mean_jct_s"]


def test_bench_sets_the_learned_policys_premium_gate(tmp_path, capsys):
    # --cp-gate 3 keeps the GPU pool for critical-path tasks: on an ETL stream (CPU work only) the
    # default checkpoint then costs less, recorded in the config; a gate below 1 is refused.
    runs = _with_and_without(tmp_path, "--cp-gate", "3",
                             ["--workflows", "etl", "--policies", "drl", "--dag-runs", "10"])
    assert runs[None]["config"]["cp_gate"] == "checkpoint" and runs["3"]["config"]["cp_gate"] == 3.0
    assert runs["3"]["results"][0]["cost"] < runs[None]["results"][0]["cost"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["bench", "--workflows", "etl", "--policies", "drl", "--cp-gate", "0.5"])
    assert "--cp-gate must be 0 (off)" in capsys.readouterr().err


def test_bench_sets_the_premium_gates_scope(tmp_path, capsys):
    # --cp-gate-scope all gates the GPU pool for critical-path tasks too: on an ETL stream (CPU
    # work only) no task runs there, recorded in the config; an unknown scope is refused.
    runs = _with_and_without(tmp_path, "--cp-gate-scope", "all",
                             ["--workflows", "etl", "--policies", "drl", "--dag-runs", "10", "--cp-gate", "3"])
    assert runs[None]["config"]["cp_gate_scope"] == "checkpoint" and runs["all"]["config"]["cp_gate_scope"] == "all"
    assert runs["all"]["results"][0]["cost"] < runs[None]["results"][0]["cost"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["bench", "--workflows", "etl", "--policies", "drl", "--cp-gate-scope", "critical"])
    assert "invalid choice: 'critical'" in capsys.readouterr().err


# --- bad input is a one-line error with exit code 2, not a traceback (found by review) ---


@pytest.mark.parametrize("policies", ["nosuch", "fifo,nosuch", "srpt+nosuch", ","])
def test_bench_refuses_an_unknown_policy_naming_it(capsys, policies):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--workflows", "etl", "--policies", policies, "--dag-runs", "2"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("drl-trainer bench: error: argument --policies: ") and repr(policies) in last, last


def test_bench_reports_an_unreadable_catalogue_in_one_line(capsys):
    assert main(["bench", "--workflows", "etl", "--pools", "/nope.yaml", "--dag-runs", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("drl-trainer: error: /nope.yaml: cannot read the pool catalogue") and err.count("\n") == 1


def test_bench_reports_a_missing_checkpoint_in_one_line(capsys):
    assert main(["bench", "--workflows", "etl", "--policies", "drl", "--checkpoint", "/nope",
                 "--dag-runs", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("drl-trainer: error: /nope/manifest.json: missing") and err.count("\n") == 1


def test_every_bench_flag_has_help():
    import argparse

    from trainer.bench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert [a.dest for a in parser._actions if not a.help] == []


@pytest.mark.parametrize("load", ["nan", "-0.5", "0", "inf"])
def test_bench_refuses_a_load_that_is_not_a_positive_number(load: str, capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--load", load])
    assert exc.value.code == 2 and "--load must be a finite number > 0" in capsys.readouterr().err


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def test_bench_workers_run_torch_on_one_thread(tmp_path, monkeypatch):
    """``--jobs N`` workers share the cores; each with torch's default pool (a thread a core)
    oversubscribed them: on 2 cores ``--jobs 2`` with the learned policy took 75-80 s against
    36-38 s with one thread a worker, the same figures (measured 2026-12-07). The bench's pool
    starts its workers with :func:`trainer.bench.one_torch_thread`, and a worker it starts runs
    torch on one thread whatever the parent's count."""
    import concurrent.futures

    import torch

    from trainer import bench

    assert torch.get_num_threads() >= 1
    with concurrent.futures.ProcessPoolExecutor(1, initializer=bench.one_torch_thread) as pool:
        assert pool.submit(_torch_threads).result() == 1
    made = []

    class Recording(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            made.append(kwargs.get("initializer"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(bench, "ProcessPoolExecutor", Recording)
    out = tmp_path / "b.json"
    assert main(["bench", "--workflows", "etl", "--policies", "drl,srpt+eft", "--dag-runs", "4",
                 "--jobs", "2", "--json", str(out)]) == 0
    assert made == [bench.one_torch_thread]
    serial = tmp_path / "s.json"
    assert main(["bench", "--workflows", "etl", "--policies", "drl,srpt+eft", "--dag-runs", "4",
                 "--json", str(serial)]) == 0
    keys = ("policy", "mean_jct_s", "p95_jct_s", "cost", "sla_violation_rate")
    assert [{k: r[k] for k in keys} for r in json.loads(out.read_text())["results"]] == \
        [{k: r[k] for k in keys} for r in json.loads(serial.read_text())["results"]]
