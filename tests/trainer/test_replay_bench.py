"""Recorded runs (policy.replay files, as the executor exports them) replayed at their own times."""

from __future__ import annotations

import json
from pathlib import Path

from policy.catalogue import load_catalogue
from policy.replay import ReplayRun, write_replay
from policy.schema import RunGraph, TaskNode
from trainer.cli import main
from trainer.workloads import replay_jobs

ROOT = Path(__file__).resolve().parents[2]
POOLS = ROOT / "policy" / "catalogues" / "gpu-affinity.yaml"


def _replay(tmp_path: Path) -> Path:
    g = RunGraph("etl/run", (TaskNode("a", duration_s=30), TaskNode("b", duration_s=60)), ((0, 1),))
    path = tmp_path / "replay.jsonl"
    write_replay(path, [ReplayRun(g, 0.0), ReplayRun(g, 5.0), ReplayRun(g, 100.0)])
    return path


def test_replayed_jobs_keep_their_recorded_arrivals(tmp_path: Path) -> None:
    jobs = replay_jobs(_replay(tmp_path), load_catalogue(POOLS))
    assert [j.arrival_s for j in jobs] == [0.0, 5.0, 100.0]
    assert len({j.run_key for j in jobs}) == 3
    assert all(j.deadline_s is not None and j.deadline_s > j.arrival_s for j in jobs)


def test_bench_replays_a_recorded_file(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--workflows", f"replay:{_replay(tmp_path)}", "--pools", str(POOLS),
               "--policies", "srpt+eft,fifo", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["policy"] for r in rows} == {"srpt+eft", "fifo"}
    assert all(r["mean_jct_s"] > 0 for r in rows)
