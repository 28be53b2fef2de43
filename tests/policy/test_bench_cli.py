"""``drl-policy bench`` end to end: a private redis-server and server, one short case, its JSON."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")


def test_bench_measures_a_private_stack_and_splits_the_round_trip(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "policy.cli", "--log-level", "WARNING", "bench", "--placer", "eft",
         "--device", "cpu", "--dag-sizes", "50", "--ready", "4", "--clients", "1,2", "--duration", "0.5",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [(c["dag_tasks"], c["ready_tasks"], c["clients"]) for c in doc["cases"]] == [(50, 4, 1), (50, 4, 2)]
    for case in doc["cases"]:
        assert case["errors"] == 0 and case["requests"] > 10 and case["device"] == "cpu"
        assert 0 < case["p50_ms"] <= case["p99_ms"]
        assert case["decisions_per_s"] > 0
        # the server's share is part of each round trip, so it is smaller at every percentile
        assert 0 < case["server_p50_ms"] < case["p50_ms"]
        assert case["server_p50_ms"] <= case["server_p99_ms"] < case["p99_ms"]
    assert "srv p99" in proc.stdout


def test_soak_samples_rss_and_turns_runs_over(tmp_path: Path) -> None:
    """``--soak`` samples the servers' RSS through the run, every replica's; ``--new-run-every`` starts new DAG runs
    (each a full graph the server has not seen), so the server's graph cache fills and evicts."""
    out = tmp_path / "soak.json"
    log = tmp_path / "server.log"
    proc = subprocess.run(
        [sys.executable, "-m", "policy.cli", "--log-level", "WARNING", "bench", "--placer", "eft",
         "--device", "cpu", "--dag-sizes", "50", "--ready", "2", "--clients", "2", "--soak", "2",
         "--rate", "200", "--rss-every", "0.5", "--new-run-every", "5", "--out", str(out),
         "--server-log", str(log), "--replicas", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    soak = json.loads(out.read_text())["soak"]
    assert soak["errors"] == 0 and soak["requests"] > 50 and soak["new_run_every"] == 5
    # each client moved to a new run every 5 requests (its count rounds per client)
    assert soak["requests"] // 5 - 2 <= soak["runs"] <= soak["requests"] // 5 + 2
    samples = soak["server_rss_kib"]
    assert len(samples) >= 4 and samples[0][0] == 0.0 and samples[-1][0] >= 2.0
    assert all(kib > 10_000 for _, kib in samples)
    assert soak["server_rss_kib_start"] == samples[0][1] and soak["server_rss_kib_end"] == samples[-1][1]
    # every replica's (was: the first replica's only)
    each = soak["replicas_rss_kib"]
    assert [row[:2] for row in each] == samples and all(len(row) == 3 and row[2] > 10_000 for row in each)
    # the CPU each replica used, sampled with the RSS: it grows and stays within the wall time
    cpu = soak["replicas_cpu_s"]
    assert [row[0] for row in cpu] == [row[0] for row in samples] and all(len(row) == 3 for row in cpu)
    assert all(0 <= row[i] <= nxt[i] for row, nxt in itertools.pairwise(cpu) for i in (1, 2))
    assert 0 < cpu[-1][1] - cpu[0][1] < cpu[-1][0] + 0.5
    # the private redis-server's RSS and CPU seconds, sampled with them (the graph store grows there)
    rds = soak["redis"]
    assert [row[0] for row in rds] == [row[0] for row in samples] and all(row[1] > 1000 for row in rds)
    assert all(0 <= row[2] <= nxt[2] for row, nxt in itertools.pairwise(rds))
    # the rate the clients got, interval by interval: its intervals add up to the requests answered
    timeline = soak["timeline"]
    assert [end for end, _ in timeline] == [0.5, 1.0, 1.5, 2.0]
    assert round(sum(rate * 0.5 for _, rate in timeline)) == soak["requests"]


def test_a_server_that_cannot_start_ends_the_bench_with_its_reason(tmp_path: Path) -> None:
    """Was: the bench waited out its 45 s start-up timeout and said only that no heartbeat came."""
    from policy.registry import activate

    activate(tmp_path / "reg", "nowhere")  # a registry naming a checkpoint that is not there
    proc = subprocess.run(
        [sys.executable, "-m", "policy.cli", "--log-level", "WARNING", "bench", "--placer", "gnn",
         "--registry", str(tmp_path / "reg"), "--device", "cpu", "--dag-sizes", "50", "--ready", "1",
         "--clients", "1", "--duration", "0.5", "--out", str(tmp_path / "bench.json")],
        capture_output=True, text=True, timeout=40,
    )
    assert proc.returncode == 1
    assert "exited with status" in proc.stderr and "nowhere" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "bench.json").exists()


def test_the_timeline_bins_replies_by_when_they_came() -> None:
    from policy.bench import _timeline

    t0 = 100.0
    done = [100.1, 100.2, 100.9, 101.5, 103.2, 104.0]  # the last two after a 3 s soak ended
    assert _timeline(done, t0, 3.0, 1.0) == [[1.0, 3.0], [2.0, 1.0], [3.0, 2.0]]
    # a shorter last interval is a rate over its own length
    assert _timeline(done, t0, 2.5, 1.0) == [[1.0, 3.0], [2.0, 1.0], [2.5, 4.0]]
    assert _timeline(done, t0, 3.0, None) == [] and _timeline([], t0, 2.0, 1.0) == [[1.0, 0.0], [2.0, 0.0]]
