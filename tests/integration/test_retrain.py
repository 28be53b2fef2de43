"""The nightly retraining DAG on the real stack: export traces, fine-tune, gate, (maybe) promote."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from demo import Api
from localstack import Stack

from policy.checkpoint import load_checkpoint
from policy.registry import MANIFEST, activate

pytestmark = pytest.mark.integration

QUICK = ("--eval-runs 6 --eval-streams 1 --guard '' --min-runs 2 --runs 4 --iters 1 --load 0.5 "
         "--max-other-regression 1e9")


def test_nightly_retrain_promotes_a_candidate_the_running_server_then_serves(stack: Stack, api: Api) -> None:
    api.wait_dag("drl_ml_pipeline")
    for _ in range(2):  # traces to learn from
        run = api.trigger("drl_ml_pipeline")
        assert api.wait_run("drl_ml_pipeline", run, timeout=240) == "success"
    manifest = stack.state / "registry" / MANIFEST
    incumbent = json.loads(manifest.read_text())
    api.wait_dag("drl_nightly_retrain")
    # the gate itself is tested in tests/trainer/test_finetune.py; here any candidate passes it (no
    # gain needed, no bound on the other objectives), so
    # the promotion path runs end to end on every run of this test
    conf = {"hours": 1, "minutes": 0.1, "min_improvement": -1.0, "extra_args": QUICK}
    run_id = api.trigger("drl_nightly_retrain", conf=conf)
    assert api.wait_run("drl_nightly_retrain", run_id, timeout=400) == "success"
    reports = [json.loads(p.read_text()) for p in (stack.state / "registry" / "candidates").glob("*/report.json")]
    ours = [r for r in reports if r["config"]["minutes"] == 0.1]  # not the scheduled run's
    assert len(ours) == 1, "finetune wrote no report"
    report = ours[0]
    assert report["recorded_runs"] >= 2 and report["promoted"], report["decision"]
    active = json.loads(manifest.read_text())
    # named relative to the registry, which servers on other hosts mount at other paths
    promoted = manifest.parent / active["checkpoint"]
    assert not Path(active["checkpoint"]).is_absolute() and "candidates" in active["checkpoint"]
    assert promoted == Path(report["checkpoint"])
    # the running policy server hot-reloads the candidate rather than refusing it (its folder still
    # matches the hash the manifest names)
    want = (str(promoted), f"drl:{load_checkpoint(promoted).version}")
    assert _served(stack, want, timeout_s=60) == want
    # and back to the incumbent, so the tests after this one see the stack's packaged default
    activate(manifest.parent, incumbent["checkpoint"], sha256=incumbent.get("sha256"))
    seeded = manifest.parent / incumbent["checkpoint"]  # the registry's copy of the default, relative to it
    assert not Path(incumbent["checkpoint"]).is_absolute() and seeded.is_dir()
    back = (str(seeded), f"drl:{load_checkpoint(seeded).version}")
    assert _served(stack, back, timeout_s=60) == back


def _served(stack: Stack, want: tuple[str, str], timeout_s: float) -> tuple[str, str]:
    """The policy server's (checkpoint, version) from /health, once it is ``want`` or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.ports.metrics}/health", timeout=5) as r:
            health = json.load(r)
        got = (str(health["checkpoint"]), str(health["version"]))
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(1.0)
