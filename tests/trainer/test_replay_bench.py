"""Recorded runs (policy.replay files, as the executor exports them) replayed at their own times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_a_pin_no_pool_honours_is_replayed_as_production_placed_it(tmp_path: Path) -> None:
    """The executor places a task pinned to a pool too small for it (or not in the catalogue) off
    its pin. was: the replay kept the pin, the simulator refused every decision for the task, and
    the nightly fine-tune stopped ("placer 'srpt+eft' left 2 ready task(s) unplaced")"""
    big = TaskNode("join", duration_s=8, cpus=8, memory_gb=48, pool="cpu-small")
    gone = TaskNode("old", duration_s=5, pool="retired-pool")
    fine = TaskNode("a", duration_s=30, pool="gpu")
    never = TaskNode("huge", duration_s=5, cpus=10_000)
    path = tmp_path / "replay.jsonl"
    write_replay(path, [ReplayRun(RunGraph("etl/r1", (fine, big, gone), ((0, 1), (1, 2))), 0.0),
                        ReplayRun(RunGraph("etl/r2", (never,), ()), 1.0)])
    (job,) = replay_jobs(path, load_catalogue(POOLS))  # the run with a task no pool fits is left out
    assert [t.pool for t in job.graph.tasks] == ["gpu", None, None], "a pin honoured is kept"
    out = tmp_path / "bench.json"
    assert main(["bench", "--workflows", f"replay:{path}", "--pools", str(POOLS), "--policies", "srpt+eft",
                 "--json", str(out)]) == 0
    write_replay(path, [ReplayRun(RunGraph("etl/r2", (never,), ()), 1.0)])
    with pytest.raises(ValueError, match="no run of the replay file can run on these pools"):
        replay_jobs(path, load_catalogue(POOLS))
