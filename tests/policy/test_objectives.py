"""The deployment's objective: packaged checkpoints per objective, kept by the registry's manifest,
reported by the servers, changed by ``drl-policy registry activate --objective``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from policy.errors import CheckpointError
from policy.registry import (
    DEFAULT_CHECKPOINT,
    MANIFEST,
    PACKAGED_CHECKPOINTS,
    PACKAGED_NOTE,
    ModelRegistry,
    activate,
    checkpoint_sha256,
    ensure_active,
    gnn_loader,
    history,
    registry_objective,
)
from policy.registry_cli import run as registry_run

REPO = Path(__file__).resolve().parents[2]


def manifest(root: Path) -> dict[str, str]:
    doc: dict[str, str] = json.loads((root / MANIFEST).read_text())
    return doc


def cli(*argv: str) -> int:
    import argparse

    from policy.registry_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return registry_run(parser.parse_args(list(argv)))


def test_the_packaged_sla_checkpoint_is_the_measured_e3t_and_loads() -> None:
    """The README's SLA figures were measured on docs/exp-ledger/checkpoints/e3t: the packaged
    checkpoint must be those very files (a retrained or edited copy would not carry them)."""
    sla = PACKAGED_CHECKPOINTS["sla_violation_rate"]
    assert sla != DEFAULT_CHECKPOINT
    assert checkpoint_sha256(sla) == checkpoint_sha256(REPO / "docs" / "exp-ledger" / "checkpoints" / "e3t")
    assert PACKAGED_CHECKPOINTS["mean_jct"] == DEFAULT_CHECKPOINT
    placer = gnn_loader(sla, "cpu")
    assert placer.name == "drl" and placer.version == "ensemble-f2c6ff0e7d15"


def test_an_empty_registry_is_seeded_for_its_objective(tmp_path: Path) -> None:
    ensure_active(tmp_path, objective="sla_violation_rate")
    doc = manifest(tmp_path)
    sha = checkpoint_sha256(PACKAGED_CHECKPOINTS["sla_violation_rate"])
    assert doc["objective"] == "sla_violation_rate" and doc["checkpoint"] == f"packaged/{sha[:12]}"
    served = ModelRegistry(tmp_path).load_now()
    assert served is not None and served.placer.version == "ensemble-f2c6ff0e7d15"
    assert registry_objective(tmp_path) == "sla_violation_rate"


def test_a_packaged_seed_is_seeded_again_for_another_objective_but_an_activation_is_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ensure_active(tmp_path)  # mean_jct: the default
    assert manifest(tmp_path)["objective"] == "mean_jct"
    assert manifest(tmp_path)["sha256"] == checkpoint_sha256(DEFAULT_CHECKPOINT)
    ensure_active(tmp_path, objective="sla_violation_rate")  # the deployment's setting changed
    assert manifest(tmp_path)["objective"] == "sla_violation_rate"
    assert manifest(tmp_path)["sha256"] == checkpoint_sha256(PACKAGED_CHECKPOINTS["sla_violation_rate"])
    ensure_active(tmp_path, objective="sla_violation_rate")  # again: nothing to do
    assert len(history(tmp_path)) == 2

    activate(tmp_path, manifest(tmp_path)["checkpoint"], note="nightly fine-tune")  # someone's choice
    with caplog.at_level(logging.WARNING, logger="policy.registry"):
        ensure_active(tmp_path, objective="p95_jct")
    assert manifest(tmp_path)["note"] == "nightly fine-tune", "left alone"
    assert manifest(tmp_path)["objective"] == "sla_violation_rate"
    assert "optimises sla_violation_rate" in caplog.text and "--objective p95_jct" in caplog.text


def test_every_activation_keeps_the_objective_unless_it_is_given(tmp_path: Path) -> None:
    activate(tmp_path, "a")
    assert "objective" not in manifest(tmp_path) and registry_objective(tmp_path) == "mean_jct"
    activate(tmp_path, "b", objective="p95_jct")
    activate(tmp_path, "c", note="by hand")
    assert manifest(tmp_path)["objective"] == "p95_jct"
    assert [e.get("objective") for e in history(tmp_path)] == [None, "p95_jct", "p95_jct"]
    with pytest.raises(CheckpointError, match="objective must be one of"):
        activate(tmp_path, "d", objective="latency")
    assert manifest(tmp_path)["checkpoint"] == "c", "nothing written"


def test_a_manifest_naming_no_objective_we_know_is_an_error_not_the_mean(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text(json.dumps({"checkpoint": "a", "objective": "sla"}))
    with pytest.raises(CheckpointError, match="objective must be one of"):
        registry_objective(tmp_path)
    registry = ModelRegistry(tmp_path)
    assert registry.objective() == "invalid"
    (tmp_path / MANIFEST).write_text(json.dumps({"checkpoint": "a", "objective": ["p95_jct"]}))
    with pytest.raises(CheckpointError, match="expected one of"):
        registry_objective(tmp_path)


def test_registry_objective_is_read_again_after_a_poll_interval(tmp_path: Path) -> None:
    now = [0.0]
    registry = ModelRegistry(tmp_path, poll_s=2.0, clock=lambda: now[0])
    assert registry.objective() == "mean_jct"  # no manifest yet
    activate(tmp_path, "a", objective="cost")
    assert registry.objective() == "mean_jct", "cached for poll_s"
    now[0] = 2.5
    assert registry.objective() == "cost"


def test_cli_activates_the_packaged_checkpoint_of_an_objective(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    reg = tmp_path / "reg"
    assert cli("activate", "--registry", str(reg), "--create", "--objective", "sla_violation_rate") == 0
    out = json.loads(capsys.readouterr().out)
    sha = checkpoint_sha256(PACKAGED_CHECKPOINTS["sla_violation_rate"])
    assert out["objective"] == "sla_violation_rate" and out["checkpoint"] == f"packaged/{sha[:12]}"
    assert out["version"] == "drl:ensemble-f2c6ff0e7d15", "checked as a server loads it"
    doc = manifest(reg)
    assert doc["note"] != PACKAGED_NOTE, "a server given another --objective must not seed over it"
    ensure_active(reg)  # a server started with the default objective
    assert manifest(reg) == doc

    # another checkpoint by hand: the objective stays; a rollback keeps it too
    assert cli("activate", "--registry", str(reg), str(DEFAULT_CHECKPOINT)) == 0
    capsys.readouterr()
    assert manifest(reg)["objective"] == "sla_violation_rate"
    assert cli("rollback", "--registry", str(reg)) == 0
    capsys.readouterr()
    assert manifest(reg)["objective"] == "sla_violation_rate" and manifest(reg)["sha256"] == sha
    assert cli("show", "--registry", str(reg)) == 0
    assert json.loads(capsys.readouterr().out)["objective"] == "sla_violation_rate"

    assert cli("activate", "--registry", str(reg)) == 1
    assert "--objective" in capsys.readouterr().err
    assert cli("activate", "--registry", str(tmp_path / "typo"), "--objective", "p95_jct") == 1
    assert "no such registry folder" in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_server_config_refuses_an_unknown_objective() -> None:
    from policy.config import ConfigError, ServerConfig

    with pytest.raises(ConfigError, match="objective"):
        ServerConfig(objective="sla")
    assert ServerConfig.from_sources({}, {"DRL_POLICY_OBJECTIVE": "p95_jct"}).objective == "p95_jct"


def test_a_server_seeds_and_reports_its_objective(tmp_path: Path, start_server, redis_url: str) -> None:
    import time

    import redis

    from policy.transport import Keys

    rs = start_server(consumer="obj-1", placer=None, registry=str(tmp_path), objective="sla_violation_rate")
    assert rs.server.version == "drl:ensemble-f2c6ff0e7d15"
    assert rs.server.health()["objective"] == "sla_violation_rate"
    r = redis.Redis.from_url(redis_url)
    key = Keys("t").heartbeat
    deadline = time.monotonic() + 10
    while not r.hexists(key, "obj-1") and time.monotonic() < deadline:
        time.sleep(0.02)
    beat = json.loads(r.hget(key, "obj-1") or b"{}")
    assert beat["objective"] == "sla_violation_rate" and beat["version"] == rs.server.version
    assert start_server(consumer="obj-2", placer=None).server.health()["objective"] is None  # the heuristic
