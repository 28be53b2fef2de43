"""The nightly retraining DAG on the real stack: export traces, fine-tune, gate, (maybe) promote."""

from __future__ import annotations

import json

import pytest
from demo import Api
from localstack import Stack

from policy.checkpoint import load_checkpoint
from policy.registry import MANIFEST

pytestmark = pytest.mark.integration

QUICK = ("--eval-runs 6 --eval-streams 1 --guard '' --min-runs 2 --runs 4 --iters 1 --load 0.5")


def test_nightly_retrain_writes_a_report_and_keeps_a_loadable_model(stack: Stack, api: Api) -> None:
    api.wait_dag("drl_ml_pipeline")
    for _ in range(2):  # traces to learn from
        run = api.trigger("drl_ml_pipeline")
        assert api.wait_run("drl_ml_pipeline", run, timeout=240) == "success"
    api.wait_dag("drl_nightly_retrain")
    run_id = api.trigger("drl_nightly_retrain", conf={"hours": 1, "minutes": 0.1, "extra_args": QUICK})
    assert api.wait_run("drl_nightly_retrain", run_id, timeout=400) == "success"
    reports = [json.loads(p.read_text()) for p in (stack.state / "registry" / "candidates").glob("*/report.json")]
    ours = [r for r in reports if r["config"]["minutes"] == 0.1]  # not the scheduled run's
    assert len(ours) == 1, "finetune wrote no report"
    report = ours[0]
    assert report["recorded_runs"] >= 2 and report["decision"]
    active = json.loads((stack.state / "registry" / MANIFEST).read_text())
    assert load_checkpoint(active["checkpoint"]).version  # whichever won, it loads
    if report["promoted"]:
        assert "candidates" in active["checkpoint"]
