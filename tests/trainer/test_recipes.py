"""Synthetic WfCommons recipe instances (offline), imported like the real traces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from policy.graph import view
from trainer.recipes import parse_spec
from trainer.workloads import load_templates

ROOT = Path(__file__).resolve().parents[2]


def test_recipe_instances_are_seeded_dags() -> None:
    a = load_templates("wfcommons:epigenomics:100:2", np.random.default_rng(3))
    b = load_templates("wfcommons:epigenomics:100:2", np.random.default_rng(3))
    assert [g.digest for g in a] == [g.digest for g in b], "same seed, same instances"
    for g in a:
        assert 80 <= len(g.tasks) <= 120 and g.edges
        assert view(g).critical_path_s > 0 and all(t.duration_s > 0 for t in g.tasks)


def test_instances_do_not_depend_on_the_process_string_hashing() -> None:
    """WfChef iterates over sets of names: built in-process, the same seed gave different
    instances under different ``PYTHONHASHSEED``s (so a benchmark's baselines and its model, run
    in two processes, met different workflows). Two processes with different hash seeds now get
    the same instances, structure and durations."""
    code = ("import sys, numpy as np; from trainer.recipes import generate; "
            "gs = generate('wfcommons:rnaseq:200:2', np.random.default_rng(0)); "
            "print([(g.digest, [(t.task_id, t.duration_s) for t in g.tasks], sorted(g.edges)) for g in gs])")
    out = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout for seed in ("1", "2")]
    assert out[0] and out[0] == out[1]


@pytest.mark.parametrize(("spec", "message"), [
    ("wfcommons:nope:100", "unknown recipe 'nope'"),
    ("wfcommons:blast", "expected wfcommons:RECIPE:TASKS"),
    ("wfcommons:blast:many", "must be integers"),
    ("wfcommons:blast:1", "2 <= TASKS"),
    # found by review: no upper bound (an extra 0 had WfChef build for hours a run no server takes)
    ("wfcommons:blast:50001", "TASKS <= 50000"),
    ("wfcommons:blast:200:1001", "COUNT <= 1000"),
])
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_too_small_for_the_recipe_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="wfcommons:bwa:10"):
        load_templates("wfcommons:bwa:10:1", np.random.default_rng(0))
