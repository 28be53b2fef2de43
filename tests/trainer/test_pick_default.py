"""``scripts/pick_default.py``: the rule that picks the default checkpoint on the validation families."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pick_default.py"
METRICS = ("mean_jct_s", "p95_jct_s", "sla_violation_rate", "cost")


def _bench(path: Path, policy: str, values: dict[str, float]) -> None:
    path.write_text(json.dumps({"results": [{"policy": policy, "setting": "wfcommons:cycles:200:3", **values}]}))


def _pick(tmp_path: Path, candidates: dict[str, dict[str, float]], *flags: str) -> tuple[str, str]:
    """The pick among the incumbent (1.0 x the baseline on every metric) and ``candidates`` (their
    ratios), and what the script printed."""
    _bench(tmp_path / "base-0.json", "srpt+eft", dict.fromkeys(METRICS, 100.0))
    _bench(tmp_path / "inc-0.json", "drl", dict.fromkeys(METRICS, 100.0))
    for name, ratios in candidates.items():
        _bench(tmp_path / f"{name}-0.json", "drl", {m: 100.0 * ratios.get(m, 1.0) for m in METRICS})
    main = runpy.run_path(str(SCRIPT))["main"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pick = main([str(tmp_path / "base"), f"inc={tmp_path / 'inc'}",
                     *(f"{n}={tmp_path / n}" for n in candidates), "--seeds", "0", *flags])
    return pick, out.getvalue()


@pytest.mark.parametrize(("candidates", "pick"), [
    ({"a": {"mean_jct_s": 0.995}}, "inc"),  # 0.5% better: not the 1% asked
    ({"a": {"mean_jct_s": 0.98, "sla_violation_rate": 1.03}}, "inc"),  # SLA +3% > 2%
    ({"a": {"mean_jct_s": 0.98, "sla_violation_rate": 1.015, "cost": 1.01}}, "a"),  # within the bounds
    # the lowest mean that passes, not the lowest mean
    ({"a": {"mean_jct_s": 0.98}, "b": {"mean_jct_s": 0.95, "p95_jct_s": 1.05}, "c": {"mean_jct_s": 0.97}}, "c"),
])
def test_the_pick_is_the_lowest_objective_among_candidates_within_the_bounds(
        tmp_path: Path, candidates: dict[str, dict[str, float]], pick: str) -> None:
    assert _pick(tmp_path, candidates)[0] == pick


def test_it_says_why_a_candidate_fails_and_takes_another_objective(tmp_path: Path) -> None:
    pick, out = _pick(tmp_path, {"a": {"mean_jct_s": 0.98, "sla_violation_rate": 1.03}})
    assert "a: 0.980 / 1.000 / 1.030 / 1.000  fails: sla_violation_rate +3.0% (allowed +2.0%)" in out
    assert out.strip().endswith("pick: inc")
    # with SLA violations the objective, the same candidate loses SLA and the mean is bounded instead
    pick, out = _pick(tmp_path, {"a": {"mean_jct_s": 0.98, "sla_violation_rate": 1.03}},
                      "--objective", "sla_violation_rate")
    assert pick == "inc" and "fails: sla_violation_rate +3.0% (need <= -1.0%)" in out


def test_a_model_named_twice_is_refused(tmp_path: Path) -> None:
    main = runpy.run_path(str(SCRIPT))["main"]
    with pytest.raises(SystemExit, match="inc is named twice"):
        main([str(tmp_path / "base"), f"inc={tmp_path / 'a'}", f"inc={tmp_path / 'b'}", "--seeds", "0"])
