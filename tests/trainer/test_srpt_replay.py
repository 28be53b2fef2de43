"""``scripts/srpt_replay.py``: the model's stream replayed with the rule asked alongside."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_replay_counts_agreement_and_srpt_order(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["srpt_replay.py", "policy/checkpoints/default", "--workflows", "etl"])
    runpy.run_path(str(ROOT / "scripts" / "srpt_replay.py"), run_name="__main__")
    out = capsys.readouterr().out
    m = re.search(r"mean JCT ([\d.]+) s; same pool (\d+) / both sent (\d+); SRPT first: model (\d+) \(\d+%\), "
                  r"rule (\d+) \(\d+%\) of (\d+) multi-run requests", out)
    assert m, out
    jct, same, both, model, rule, multi = float(m[1]), *map(int, m.groups()[1:])
    assert jct > 0 and 0 < same <= both and multi > 0
    # the rule orders runs by least work left: it sends the SRPT run first in most requests (it
    # may reserve a slot for that run's task and send another run's first)
    assert model <= multi and multi // 2 < rule <= multi
