"""Synthetic WfCommons recipe instances (offline), imported like the real traces."""

from __future__ import annotations

import numpy as np
import pytest

from policy.graph import view
from trainer.recipes import parse_spec
from trainer.workloads import load_templates


def test_recipe_instances_are_seeded_dags() -> None:
    a = load_templates("wfcommons:epigenomics:100:2", np.random.default_rng(3))
    b = load_templates("wfcommons:epigenomics:100:2", np.random.default_rng(3))
    assert [g.digest for g in a] == [g.digest for g in b], "same seed, same instances"
    for g in a:
        assert 80 <= len(g.tasks) <= 120 and g.edges
        assert view(g).critical_path_s > 0 and all(t.duration_s > 0 for t in g.tasks)


@pytest.mark.parametrize(("spec", "message"), [
    ("wfcommons:nope:100", "unknown recipe 'nope'"),
    ("wfcommons:blast", "expected wfcommons:RECIPE:TASKS"),
    ("wfcommons:blast:many", "must be integers"),
    ("wfcommons:blast:1", "TASKS >= 2"),
])
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec(spec)


def test_too_small_for_the_recipe_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="wfcommons:bwa:10"):
        load_templates("wfcommons:bwa:10:1", np.random.default_rng(0))
