"""``drl-trainer makespan``: single DAGs on an idle cluster against the makespan bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.cli import main

TRACES = Path(__file__).resolve().parents[3] / "shared" / "workflows" / "wfinstances"


@pytest.mark.skipif(not TRACES.is_dir(), reason="the shared WfInstances are not checked out here")
def test_makespan_command_prints_ratios_and_writes_json(tmp_path, capsys):
    out = tmp_path / "makespan.json"
    files = ",".join(str(TRACES / f) for f in ("helloworld-chain-5-chameleon.json",
                                                "helloworld-forkjoin-10-chameleon.json"))
    rc = main(["makespan", "--workflows", files, "--policies", "heft,fifo", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "helloworld-forkjoin-10-chameleon" in text and "median" in text
    data = json.loads(out.read_text())
    assert [r["workflow"] for r in data["rows"]] == ["helloworld-chain-5-chameleon",
                                                      "helloworld-forkjoin-10-chameleon"]
    chain, forkjoin = data["rows"]
    assert chain["heft_over_lb"] == 1.0  # a chain on the fastest slot is optimal
    assert forkjoin["makespan_lb_s"] > forkjoin["critical_path_lb_s"]
    assert 1.0 <= forkjoin["heft_over_lb"] < 1.01
    assert forkjoin["best_over_lb"] == min(forkjoin["heft_over_lb"], forkjoin["fifo_over_lb"])
    assert set(data["median_over_lb"]) == {"heft", "fifo", "best"}
