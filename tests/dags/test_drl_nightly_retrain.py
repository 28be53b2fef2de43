"""The nightly retraining DAG hands ``finetune`` what ``export_traces`` wrote, on any two workers."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import shutil
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_drl_executor.config import SECTION, packaged_catalogue

DAG_FILE = Path(__file__).resolve().parents[2] / "dags" / "drl_nightly_retrain.py"


@pytest.fixture(scope="module")
def module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("drl_nightly_retrain", DAG_FILE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def catalogue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A pool catalogue named by ``[drl_executor] catalogue`` in Airflow's configuration (not by
    the environment), at a path the shell would split."""
    from airflow.configuration import conf

    path = tmp_path / "it's the pools.yaml"
    shutil.copy(packaged_catalogue(), path)
    monkeypatch.delenv("AIRFLOW__DRL_EXECUTOR__CATALOGUE", raising=False)
    if not conf.has_section(SECTION):
        conf.add_section(SECTION)
    conf.set(SECTION, "catalogue", str(path))
    yield path
    conf.remove_option(SECTION, "catalogue")


def test_traces_go_to_the_shared_registry(module: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """was: /tmp/drl-traces, a folder of whichever worker ran export_traces"""
    monkeypatch.delenv("DRL_TRACES_DIR", raising=False)
    monkeypatch.setenv("DRL_REGISTRY_DIR", "/var/lib/drl/registry")
    assert module.traces_dir() == "/var/lib/drl/registry/traces"
    monkeypatch.setenv("DRL_TRACES_DIR", "/shared/traces")
    assert module.traces_dir() == "/shared/traces"
    monkeypatch.delenv("DRL_TRACES_DIR")
    monkeypatch.delenv("DRL_REGISTRY_DIR")
    with pytest.raises(RuntimeError, match="DRL_REGISTRY_DIR is not set"):
        module.traces_dir()


def test_the_catalogue_is_the_executors(module: types.ModuleType, catalogue: Path) -> None:
    assert module.catalogue_path() == str(catalogue)


def test_finetune_runs_on_what_export_traces_wrote(module: types.ModuleType, catalogue: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """export_traces returns the replay file (in the registry) and the executor's catalogue;
    finetune's command receives both as single arguments, whatever characters they hold."""
    import airflow.sdk

    import airflow_drl_executor.export

    registry = tmp_path / "the registry"
    monkeypatch.setenv("DRL_REGISTRY_DIR", str(registry))
    monkeypatch.delenv("DRL_TRACES_DIR", raising=False)
    until = dt.datetime(2026, 12, 4, 2, 0, tzinfo=dt.UTC)
    monkeypatch.setattr(module, "get_current_context", lambda: {"data_interval_end": until, "params": {"hours": 24}})
    monkeypatch.setattr(airflow.sdk.BaseHook, "get_connection",
                        lambda conn_id: types.SimpleNamespace(get_uri=lambda: "sqlite://"))
    exported: list[Any] = []
    monkeypatch.setattr(airflow_drl_executor.export, "export_runs",
                        lambda session, catalogue, **kw: exported.append(catalogue) or [])
    dag = module.drl_nightly_retrain()
    xcom = dag.get_task("export_traces").python_callable()
    name = "replay-20261204T020000.jsonl"
    assert xcom == {"replay": str(registry / "traces" / name), "name": name, "pools": str(catalogue)}
    assert Path(xcom["replay"]).exists() and exported[0].source == str(catalogue)
    # the fine-tune's worker mounts the registry elsewhere: the file is found by its name under its own
    # mount (found by review: the exporting worker's absolute path alone was passed)
    mounted = tmp_path / "mounted elsewhere"
    shutil.move(registry, mounted)
    monkeypatch.setenv("DRL_REGISTRY_DIR", str(mounted))
    registry = mounted

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "drl-trainer").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
    (bin_dir / "drl-trainer").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("ARGV_OUT", str(tmp_path / "argv"))
    params = {"minutes": 10, "min_improvement": 0.01, "seed": 1, "extra_args": "--guard ''"}
    monkeypatch.setattr(module, "get_current_context", lambda: {"params": params})
    dag.get_task("finetune").python_callable(xcom)
    assert (tmp_path / "argv").read_text().splitlines() == [
        "finetune", "--replay", str(mounted / "traces" / name), "--registry", str(registry),
        "--pools", str(catalogue),
        "--minutes", "10", "--min-improvement", "0.01", "--seed", "1", "--guard", ""]


def test_finetune_parameters_never_reach_a_shell(module: types.ModuleType, tmp_path: Path) -> None:
    """was: rendered into a bash command: a run triggered with {"minutes": "1; touch PWNED"} ran it
    on the worker (which can write the model registry). Now a number must be one, and extra_args
    is split into arguments, never run; the trigger form checks the types too."""
    exported = {"replay": "r.jsonl", "pools": "p.yaml"}
    ok = {"minutes": 10, "min_improvement": 0.01, "seed": 1, "extra_args": ""}
    with pytest.raises(ValueError, match=r"params.minutes must be a number, got '1; touch PWNED'"):
        module.finetune_argv(exported, {**ok, "minutes": "1; touch PWNED"}, "reg")
    argv = module.finetune_argv(exported, {**ok, "extra_args": "--runs 4; touch PWNED $(id)"}, "reg")
    assert argv[-5:] == ["--runs", "4;", "touch", "PWNED", "$(id)"], "arguments for drl-trainer to refuse"
    dag = module.drl_nightly_retrain()
    assert dag.params.get_param("minutes").schema == {"type": "number", "exclusiveMinimum": 0}
    from airflow.sdk.definitions.param import ParamValidationError
    with pytest.raises(ParamValidationError):
        dag.params.get_param("minutes").resolve("1; touch PWNED")


def test_prune_traces_keeps_keep_days_of_placements_and_replays(module: types.ModuleType, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """was: drl_placement grew by a row per task try forever, and a replay file a night"""
    import uuid

    import airflow.sdk
    from sqlalchemy import create_engine, func, insert, select

    from airflow_drl_executor import traces

    db = f"sqlite:///{tmp_path / 'traces.db'}"
    engine = create_engine(db)
    traces.ensure_schema(engine)
    now = dt.datetime.now(dt.UTC)
    rec = traces.PlacementRecord(ti_id=str(uuid.uuid4()), dag_id="d", run_id="r", task_id="t", map_index=-1,
                                 try_number=1, pool="gpu", vm_class="x", score=0.0, reason="", fallback=False,
                                 policy="eft", policy_version="1", request_id="q", decision_ms=1.0, features={})
    with engine.begin() as conn:
        conn.execute(insert(traces.placements), [rec.row(now - dt.timedelta(days=d)) for d in (1, 5, 40, 400)])
    folder = tmp_path / "registry" / "traces"
    folder.mkdir(parents=True)
    for name, age_days in (("replay-old.jsonl", 40), ("replay-new.jsonl", 1), ("notes.txt", 400)):
        (folder / name).write_text("")
        stamp = (now - dt.timedelta(days=age_days)).timestamp()
        os.utime(folder / name, (stamp, stamp))
    monkeypatch.setenv("DRL_REGISTRY_DIR", str(tmp_path / "registry"))
    monkeypatch.delenv("DRL_TRACES_DIR", raising=False)
    monkeypatch.setattr(airflow.sdk.BaseHook, "get_connection",
                        lambda conn_id: types.SimpleNamespace(get_uri=lambda: db))
    prune = module.drl_nightly_retrain().get_task("prune_traces").python_callable
    monkeypatch.setattr(module, "get_current_context", lambda: {"params": {"keep_days": 0}})
    prune()
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(traces.placements)).scalar() == 4, "0 keeps all"
    monkeypatch.setattr(module, "get_current_context", lambda: {"params": {"keep_days": 30}})
    prune()
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(traces.placements)).scalar() == 2
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "replay-new.jsonl"]
    engine.dispose()


def test_old_candidates_are_pruned_but_not_the_served_ones(module: types.ModuleType, tmp_path: Path) -> None:
    """Found by review: every night left a candidate folder in the registry, for ever."""
    from policy.registry import LAST_GOOD, activate

    registry = tmp_path / "registry"
    now = dt.datetime.now(dt.UTC)
    for name, age_days in (("old", 40), ("old-active", 40), ("old-last-good", 50), ("new", 1)):
        (registry / "candidates" / name / "checkpoint").mkdir(parents=True)
        stamp = (now - dt.timedelta(days=age_days)).timestamp()
        os.utime(registry / "candidates" / name, (stamp, stamp))
    activate(registry, "candidates/old-active/checkpoint")
    (registry / LAST_GOOD).write_text(json.dumps({"checkpoint": str(registry / "candidates/old-last-good/checkpoint")}))
    gone = module.prune_candidates(str(registry), now - dt.timedelta(days=30))
    assert gone == ["old"]
    assert sorted(p.name for p in (registry / "candidates").iterdir()) == ["new", "old-active", "old-last-good"]
    assert module.prune_candidates(str(tmp_path / "none"), now) == []


def test_finetune_names_what_it_cannot_find_on_its_worker(module: types.ModuleType, catalogue: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither the exporting worker's path nor this worker's traces folder holds the replay, or the export's
    catalogue is not here: an error naming them (found by review: another catalogue was used silently)."""
    monkeypatch.setenv("DRL_REGISTRY_DIR", str(tmp_path / "reg"))
    monkeypatch.delenv("DRL_TRACES_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match="neither at /elsewhere/replay-1.jsonl"):
        module._here({"replay": "/elsewhere/replay-1.jsonl", "name": "replay-1.jsonl", "pools": str(catalogue)})
    (tmp_path / "reg" / "traces").mkdir(parents=True)
    (tmp_path / "reg" / "traces" / "replay-1.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="/etc/prod-pools.yaml, is not on this worker"):
        module._here({"replay": "/elsewhere/replay-1.jsonl", "name": "replay-1.jsonl", "pools": "/etc/prod-pools.yaml"})
    # an XCom of the previous version (an absolute path, no name) still works
    old = {"replay": str(tmp_path / "reg" / "traces" / "replay-1.jsonl"), "pools": str(catalogue)}
    assert module._here(old) == old
    # the pruning runs even when the export failed
    assert module.drl_nightly_retrain().get_task("prune_traces").trigger_rule == "all_done"


def test_prune_never_deletes_the_active_candidate_when_active_json_does_not_read(module: types.ModuleType,
                                                                                 tmp_path: Path) -> None:
    """``prune_candidates`` keeps what ``ModelRegistry.named_checkpoints()`` names, and that names
    nothing for a manifest that does not parse ("a file that is missing or does not read names
    none"). An ``active.json`` caught half-written or hand-edited wrongly on the night of the
    prune: the active candidate (older than ``keep_days``) is deleted for good, and the operator
    who then fixes the manifest has nothing left to serve. A manifest that exists but does not
    read should make the prune keep everything (or at least what the history last activated)."""
    from policy.registry import MANIFEST, activate

    registry = tmp_path / "registry"
    now = dt.datetime.now(dt.UTC)
    for name in ("served", "old"):
        (registry / "candidates" / name / "checkpoint").mkdir(parents=True)
        (registry / "candidates" / name / "checkpoint" / "manifest.json").write_text("{}")
    activate(registry, "candidates/served/checkpoint")
    for name in ("served", "old"):
        stamp = (now - dt.timedelta(days=40)).timestamp()
        os.utime(registry / "candidates" / name, (stamp, stamp))
    (registry / MANIFEST).write_text('{"checkpoint": "candidates/served/chec')  # truncated
    module.prune_candidates(str(registry), now - dt.timedelta(days=30))
    assert (registry / "candidates" / "served" / "checkpoint").is_dir(), "the active candidate was deleted"
