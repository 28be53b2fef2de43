"""Inputs of the nightly fine-tune (WfFormat traces, finetune flags, workload templates): found by
review, each failed on the code before its fix.

``trainer.finetune`` (torch) is imported inside the tests that need it, so the WfFormat and DAG
tests run without the trainer's extras."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from policy.errors import SchemaError
from trainer.wfformat import parse_wfformat, read_wfformat

ROOT = Path(__file__).resolve().parents[2]


def _v15(spec: list[dict], execution: list[dict]) -> dict:
    return {"schemaVersion": "1.5", "name": "w",
            "workflow": {"specification": {"tasks": spec}, "execution": {"tasks": execution}}}


def _v14(tasks: list[dict]) -> dict:
    return {"schemaVersion": "1.4", "name": "w",
            "workflow": {"makespanInSeconds": 8.0, "executedAt": "20200101T000000+0000", "tasks": tasks}}


# --- WfFormat: input that silently builds a wrong graph ------------------------------------------


def test_v14_duplicate_task_names_are_refused() -> None:
    """1.4 tasks refer to each other by name. Two tasks sharing a name (distinct ids) make every
    reference to that name ambiguous, yet the reader resolves it silently to the first one
    (``names = {...: i for i in reversed(...)}``): task ``c``'s parent ``a`` becomes task 0 and
    never task 1, a wrong DAG with no error. Only duplicate *ids* are checked."""
    doc = _v14([
        {"id": "ID1", "name": "a", "runtimeInSeconds": 1.0, "children": []},
        {"id": "ID2", "name": "a", "runtimeInSeconds": 2.0, "children": []},
        {"id": "ID3", "name": "c", "runtimeInSeconds": 3.0, "parents": ["a"]},
    ])
    with pytest.raises(SchemaError, match=r"duplicate.*'a'"):
        parse_wfformat(doc, "dupnames.json")


def test_v15_duplicate_execution_records_are_refused() -> None:
    """Two ``workflow.execution.tasks`` entries for one task id: the reader keeps the last one
    (``measured[t["id"]] = t``) and drops the other measurement without a word, so the task's
    runtime is 100 s or 1 s depending on the order of the file. A duplicate *specification* id
    is refused; a duplicate execution id should be too."""
    doc = _v15([{"id": "a"}], [{"id": "a", "runtimeInSeconds": 1.0}, {"id": "a", "runtimeInSeconds": 100.0}])
    with pytest.raises(SchemaError, match=r"execution\.tasks.*duplicate.*'a'|duplicate.*execution.*'a'"):
        parse_wfformat(doc, "dupexec.json")


def test_v15_execution_record_of_an_unknown_task_is_refused() -> None:
    """An execution record whose id names no specification task (a typo, a task renamed in one
    half of the file) is dropped silently: the measurement is lost and nothing says so, while a
    ``parents`` entry naming an unknown task is a SchemaError naming it."""
    doc = _v15([{"id": "a"}], [{"id": "a", "runtimeInSeconds": 1.0}, {"id": "zz", "runtimeInSeconds": 100.0}])
    with pytest.raises(SchemaError, match="'zz'"):
        parse_wfformat(doc, "unknownexec.json")


def test_a_task_name_that_is_not_valid_unicode_is_refused_where_it_is_read(tmp_path: Path) -> None:
    """JSON's ``\\udc00`` escape (a lone surrogate, as a broken encoder writes) reads as a Python
    str that cannot be encoded. ``read_wfformat`` accepts it as the task's kind and id, and the
    first featurisation then dies in ``policy.features.kind_bucket`` (``kind.encode()``:
    UnicodeEncodeError), far from the file and naming neither it nor the field."""
    path = tmp_path / "surrogate.json"
    path.write_text(json.dumps(_v15([{"id": "a", "name": "\udc00blast_ID01"}], [{"id": "a", "runtimeInSeconds": 1}])))
    try:
        trace = read_wfformat(path)
    except SchemaError as exc:
        assert str(path) in str(exc)
        return
    from policy.features import kind_bucket

    with pytest.raises(UnicodeEncodeError):  # what happens downstream today
        kind_bucket(trace.graph.tasks[0].kind)
    pytest.fail(f"{path}: a name that is not valid Unicode was accepted (kind {trace.graph.tasks[0].kind!r})")


def test_a_v15_document_without_a_specification_names_the_v15_field() -> None:
    """A 1.5 document whose ``workflow.specification`` is missing is parsed as the 1.4 layout and
    refused with "workflow.tasks: missing or not a list": a field a 1.5 file must not have. The
    error should name what is missing, ``workflow.specification``."""
    doc = {"schemaVersion": "1.5", "name": "w", "workflow": {"execution": {"tasks": [{"id": "a", "runtimeInSeconds": 1}]}}}
    with pytest.raises(SchemaError, match=r"workflow\.specification"):
        parse_wfformat(doc, "nospec.json")


# --- drl-trainer finetune: flags --------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "said"), [
    (["--seed", "-1"], "seed"),
    (["--load", "0"], "load"),
    (["--eval-runs", "0"], "eval_runs"),
    (["--duration-noise", "-1"], "duration_noise"),
    (["--iters", "-1"], "iters"),
], ids=["seed", "load", "eval-runs", "duration-noise", "iters"])
def test_a_finetune_flag_train_refuses_ends_the_command_before_any_work(flags: list[str], said: str) -> None:
    """``FinetuneArgs`` checks only --replay/--registry/--objective/--minutes/--min-runs/--runs;
    the values it hands on to ``trainer.train.Args`` are checked there, inside ``finetune()``,
    after the registry and the replay were read (``--seed -1`` is not even that: numpy's
    "expected non-negative integer" from ``np.random.default_rng``, naming no flag). Through
    ``drl-trainer finetune`` that is a traceback, not the check's message (``SystemExit``) before
    any work, which ``test_a_refused_value_ends_the_command_with_its_message`` promises."""
    import argparse

    pytest.importorskip("torch")
    from trainer import finetune as ft

    parser = argparse.ArgumentParser()
    ft.add_arguments(parser)
    # a registry and a replay that do not exist: reaching them is work done before the check
    args = parser.parse_args(["--replay", "/nonexistent/r.jsonl", "--registry", "/nonexistent/reg", *flags])
    with pytest.raises(SystemExit, match=re.escape("error: ") + ".*" + re.escape(said)):
        ft.run(args)


@pytest.mark.parametrize("field", ["minutes", "min_improvement", "max_regression", "max_other_regression"])
def test_finetune_refuses_a_threshold_that_is_not_a_number(field: str) -> None:
    """``minutes <= 0`` is the only check on the budget, and NaN passes it (then ``time_limit_s``
    is NaN and never ends the loop); a NaN ``--min-improvement`` or ``--max-regression`` is
    accepted and silently means "never promote" (every comparison with NaN is false: the report
    says "need >= +nan%"). The DAG's ``finetune_argv`` lets "nan" through too (``float("nan")``)."""
    pytest.importorskip("torch")
    from trainer.finetune import FinetuneArgs

    with pytest.raises(ValueError, match=field.replace("_", "[-_]")):
        FinetuneArgs(replay="r.jsonl", registry="reg", **{field: math.nan})  # type: ignore[arg-type]


# --- workloads: a WfFormat template the cluster cannot run ----------------------------------------


def test_a_wfformat_task_no_pool_can_hold_is_named_before_the_simulation(tmp_path: Path) -> None:
    """``load_templates`` (``drl-trainer train --workflows DIR``, ``--heldout``, guard settings)
    takes a WfFormat trace whose task needs more memory than any VM class has, and nothing on
    the way checks it against the catalogue (replays get ``runnable()``, templates do not): the
    first simulated stream dies with "placer 'srpt+eft' left 4 ready task(s) unplaced ... while
    nothing else can happen", naming neither the file nor the task. The error should name the
    task (and its asks), as ``runnable()``'s "task 'huge_task' (...) fits no pool" does."""
    import numpy as np

    pytest.importorskip("torch")
    from policy.catalogue import load_catalogue
    from policy.errors import PolicyError
    from trainer.baselines import make_placer
    from trainer.simulator import Simulator
    from trainer.train import Args
    from trainer.workloads import load_templates, make_jobs

    doc = _v15([{"id": "huge_task"}, {"id": "b", "parents": ["huge_task"]}],
               [{"id": "huge_task", "runtimeInSeconds": 5, "memoryInBytes": 5e12}, {"id": "b", "runtimeInSeconds": 5}])
    (tmp_path / "big.json").write_text(json.dumps(doc))
    catalogue = load_catalogue(Args.pools)
    rng = np.random.default_rng(0)
    with pytest.raises(PolicyError, match="huge_task"):
        templates = load_templates(str(tmp_path), rng)
        jobs = make_jobs(templates, catalogue, 4, rng)
        Simulator(catalogue, jobs, make_placer("srpt+eft", catalogue, 0), seed=0).run()
