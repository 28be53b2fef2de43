"""The deployment's objective: packaged checkpoints per objective, kept by the registry's manifest,
reported by the servers, changed by ``drl-policy registry activate --objective``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from policy.errors import CheckpointError
from policy.registry import (
    DEFAULT_CHECKPOINT,
    LAST_GOOD,
    MANIFEST,
    PACKAGED_CHECKPOINTS,
    PACKAGED_NOTE,
    ModelRegistry,
    activate,
    checkpoint_sha256,
    copy_packaged,
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


E3T = REPO / "docs" / "exp-ledger" / "checkpoints" / "e3t"  # another checkpoint for an objective


@pytest.fixture
def sla_preset(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A packaged checkpoint of its own for sla_violation_rate (none is packaged: docs/policy.md,
    "Objectives as configuration"), to see the seeding take the objective's."""
    import policy.registry as registry_mod

    monkeypatch.setitem(registry_mod.PACKAGED_CHECKPOINTS, "sla_violation_rate", E3T)
    return E3T


def test_every_objective_has_a_packaged_checkpoint_that_loads() -> None:
    from policy.registry import OBJECTIVES

    assert set(PACKAGED_CHECKPOINTS) == set(OBJECTIVES)
    for path in set(PACKAGED_CHECKPOINTS.values()):
        assert gnn_loader(path, "cpu").name == "drl"


def test_an_empty_registry_is_seeded_for_its_objective(tmp_path: Path, sla_preset: Path) -> None:
    ensure_active(tmp_path, objective="sla_violation_rate")
    doc = manifest(tmp_path)
    sha = checkpoint_sha256(sla_preset)
    assert doc["objective"] == "sla_violation_rate" and doc["checkpoint"] == f"packaged/{sha[:12]}"
    served = ModelRegistry(tmp_path).load_now()
    assert served is not None and served.placer.version == "ensemble-f2c6ff0e7d15"
    assert registry_objective(tmp_path) == "sla_violation_rate"


def test_a_registry_with_a_manifest_keeps_its_objective_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Servers given different objectives must not seed over each other's choice at every restart
    (found by review: the last replica to start flipped the whole fleet's model)."""
    ensure_active(tmp_path)  # mean_jct: the default
    seeded = manifest(tmp_path)
    assert seeded["objective"] == "mean_jct" and seeded["sha256"] == checkpoint_sha256(DEFAULT_CHECKPOINT)
    with caplog.at_level(logging.WARNING, logger="policy.registry"):
        ensure_active(tmp_path, objective="sla_violation_rate")
    assert manifest(tmp_path) == seeded and len(history(tmp_path)) == 1
    assert "optimises mean_jct" in caplog.text and "--objective sla_violation_rate" in caplog.text


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
    with pytest.raises(CheckpointError, match="objective 'sla' is not one of"):
        registry_objective(tmp_path)
    registry = ModelRegistry(tmp_path)
    assert registry.objective() == "unknown"
    (tmp_path / MANIFEST).write_text(json.dumps({"checkpoint": "a", "objective": ["p95_jct"]}))
    with pytest.raises(CheckpointError, match=r"objective \['p95_jct'\] is not one of"):
        registry_objective(tmp_path)


def test_registry_objective_is_read_again_after_a_poll_interval(tmp_path: Path) -> None:
    now = [0.0]
    registry = ModelRegistry(tmp_path, poll_s=2.0, clock=lambda: now[0])
    assert registry.objective() == "mean_jct"  # no manifest yet
    activate(tmp_path, "a", objective="cost")
    assert registry.objective() == "mean_jct", "cached for poll_s"
    now[0] = 2.5
    assert registry.objective() == "cost"


def test_cli_switches_the_objective_of_what_is_served(tmp_path: Path, sla_preset: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    reg = tmp_path / "reg"
    # an empty registry: the packaged checkpoint for the objective, checked as a server loads it
    assert cli("activate", "--registry", str(reg), "--create", "--objective", "sla_violation_rate") == 0
    out = json.loads(capsys.readouterr().out)
    sha = checkpoint_sha256(sla_preset)
    assert out["objective"] == "sla_violation_rate" and out["checkpoint"] == f"packaged/{sha[:12]}"
    assert out["version"] == "drl:ensemble-f2c6ff0e7d15"
    doc = manifest(reg)
    assert doc["note"] != PACKAGED_NOTE
    ensure_active(reg)  # a server started without --objective
    assert manifest(reg) == doc

    # another checkpoint by hand: the objective stays
    assert cli("activate", "--registry", str(reg), str(DEFAULT_CHECKPOINT)) == 0
    capsys.readouterr()
    assert manifest(reg)["objective"] == "sla_violation_rate"
    # the objective alone: the checkpoint served now, unchanged
    served = manifest(reg)["sha256"]
    assert cli("activate", "--registry", str(reg), "--objective", "p95_jct") == 0
    capsys.readouterr()
    assert manifest(reg)["objective"] == "p95_jct" and manifest(reg)["sha256"] == served
    # a rollback undoes the switch (and a second one redoes it, as cd - does)
    assert cli("rollback", "--registry", str(reg)) == 0
    assert manifest(reg)["objective"] == "sla_violation_rate" and manifest(reg)["sha256"] == served
    assert cli("rollback", "--registry", str(reg)) == 0
    capsys.readouterr()
    assert manifest(reg)["objective"] == "p95_jct" and manifest(reg)["sha256"] == served
    assert cli("show", "--registry", str(reg)) == 0
    assert json.loads(capsys.readouterr().out)["objective"] == "p95_jct"
    assert sha != served

    assert cli("activate", "--registry", str(reg)) == 1
    assert "--objective" in capsys.readouterr().err
    assert cli("activate", "--registry", str(tmp_path / "typo"), "--objective", "p95_jct") == 1
    assert "no such registry folder" in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_switching_the_objective_alone_does_not_undo_a_promotion_landing_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    ensure_active(tmp_path)
    real = ModelRegistry.check

    def check_while_promoted(self, path, sha256=""):  # type: ignore[no-untyped-def]
        out = real(self, path, sha256)
        activate(tmp_path, "candidates/x", sha256="ab" * 32, note="nightly fine-tune")
        return out

    monkeypatch.setattr(ModelRegistry, "check", check_while_promoted)
    assert cli("activate", "--registry", str(tmp_path), "--objective", "p95_jct") == 1
    assert "changed meanwhile" in capsys.readouterr().err
    assert manifest(tmp_path)["note"] == "nightly fine-tune" and manifest(tmp_path)["objective"] == "mean_jct"


def test_server_config_refuses_an_unknown_objective() -> None:
    from policy.config import ConfigError, ServerConfig

    with pytest.raises(ConfigError, match="objective"):
        ServerConfig(objective="sla")
    assert ServerConfig.from_sources({}, {"DRL_POLICY_OBJECTIVE": "p95_jct"}).objective == "p95_jct"


def test_a_server_seeds_and_reports_its_objective(tmp_path: Path, start_server, redis_url: str,
                                                  sla_preset: Path) -> None:
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


# --- found by review of the first version (each failed on it) ----------------------------------


def test_seeding_an_empty_registry_waits_for_the_activation_lock(tmp_path: Path) -> None:
    import threading

    from policy.registry import activation_lock

    done = threading.Event()
    worker = threading.Thread(target=lambda: (ensure_active(tmp_path, objective="sla_violation_rate"), done.set()),
                              daemon=True)
    with activation_lock(tmp_path):  # a promotion, or the CLI, in the middle of its critical section
        worker.start()
        assert not done.wait(1.0), "seeded while another writer held the lock"
    worker.join(30)
    assert done.is_set() and manifest(tmp_path)["objective"] == "sla_violation_rate"


def test_an_activation_landing_while_a_server_seeds_is_not_overwritten(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import policy.registry as registry_mod

    real_copy = registry_mod.copy_packaged

    def copy_during_an_activation(root: Path, source: Path):  # type: ignore[no-untyped-def]
        out = real_copy(root, source)
        activate(root, "elsewhere", sha256="ab" * 32, note="by hand", objective="p95_jct")
        return out

    monkeypatch.setattr(registry_mod, "copy_packaged", copy_during_an_activation)
    ensure_active(tmp_path, objective="sla_violation_rate")
    assert manifest(tmp_path)["note"] == "by hand" and manifest(tmp_path)["objective"] == "p95_jct"


def test_replicas_started_for_another_objective_than_their_registry_are_a_warning(
        tmp_path: Path, start_server, redis_url: str) -> None:
    """The first replica seeds the registry; one started with another --objective serves what the
    registry names (no flip at each restart) and says in its heartbeat what it was given, so
    `airflow drl-executor check` warns."""
    import time

    import redis

    from airflow_drl_executor.check import WARN, check_servers
    from policy.transport import Keys

    start_server(consumer="r-mean", placer=None, registry=str(tmp_path), objective="mean_jct")
    sla = start_server(consumer="r-sla", placer=None, registry=str(tmp_path), objective="sla_violation_rate")
    assert [e["objective"] for e in history(tmp_path)] == ["mean_jct"]
    assert sla.server.health()["objective"] == "mean_jct"
    assert sla.server.health()["objective_given"] == "sla_violation_rate"
    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10
    while r.hlen(Keys("t").heartbeat) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    found = check_servers(SimpleNamespace(key_prefix="t", server_stale_after_s=30.0), r)
    r.close()
    assert found.status == WARN and "r-sla was started with --objective sla_violation_rate" in found.detail, found


def _typo(root: Path) -> None:
    doc = manifest(root)
    doc["objective"] = "sla"  # a hand edit
    (root / MANIFEST).write_text(json.dumps(doc))


def test_a_manifest_objective_that_is_not_one_is_said_where_it_is(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """was: "objective must be one of ..., got 'sla'" from an activate given no objective, and a
    rollback that blamed the (good) checkpoint it rolled back to after loading it."""
    ensure_active(tmp_path)
    assert cli("activate", "--registry", str(tmp_path), "--no-check", str(E3T)) == 0
    _typo(tmp_path)
    assert cli("activate", "--registry", str(tmp_path), "--no-check", str(DEFAULT_CHECKPOINT)) == 1
    err = capsys.readouterr().err
    assert "active.json: objective 'sla' is not one of" in err and "--objective O" in err, err
    # a rollback restores its entry's objective: it repairs the manifest, nothing blamed on the checkpoint
    assert cli("rollback", "--registry", str(tmp_path)) == 0
    capsys.readouterr()
    assert registry_objective(tmp_path) == "mean_jct"
    _typo(tmp_path)
    # given an objective, the activation repairs it
    assert cli("activate", "--registry", str(tmp_path), "--no-check", "--objective", "mean_jct",
               str(DEFAULT_CHECKPOINT)) == 0
    assert registry_objective(tmp_path) == "mean_jct"


def test_an_activation_over_a_manifest_that_does_not_parse_keeps_the_recorded_objective(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """was: read as no objective, so the next activation silently made the deployment mean_jct;
    the servers reported mean_jct for it too."""
    activate(tmp_path, "x", objective="sla_violation_rate")
    (tmp_path / MANIFEST).write_text('{"checkpoint": "x", "objective": "sla_violation_rate"')  # cut short
    assert ModelRegistry(tmp_path).objective() == "unknown"
    with pytest.raises(CheckpointError, match="not JSON"):
        registry_objective(tmp_path)
    assert cli("activate", "--registry", str(tmp_path), "--no-check", str(DEFAULT_CHECKPOINT)) == 0
    capsys.readouterr()
    assert manifest(tmp_path)["objective"] == "sla_violation_rate"


def test_a_rollback_restores_the_objective_its_history_entry_recorded(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ensure_active(tmp_path)  # mean_jct
    assert cli("activate", "--registry", str(tmp_path), "--objective", "sla_violation_rate") == 0
    assert cli("rollback", "--registry", str(tmp_path)) == 0
    capsys.readouterr()
    assert manifest(tmp_path)["sha256"] == history(tmp_path)[0]["sha256"]
    assert registry_objective(tmp_path) == "mean_jct"


def _finetune_registry(tmp_path: Path) -> Path:
    incumbent = tmp_path / "models" / "default"
    shutil.copytree(DEFAULT_CHECKPOINT, incumbent)
    reg = tmp_path / "registry"
    activate(reg, incumbent)
    return reg


def _finetune_args(tmp_path: Path, reg: Path, **kw: object):  # type: ignore[no-untyped-def]
    import numpy as np

    from policy.replay import ReplayRun, write_replay
    from trainer.finetune import FinetuneArgs
    from trainer.workloads import seed_dataset

    graphs = [g for g in seed_dataset("mlpipeline", np.random.default_rng(0)) if len(g.tasks) <= 20][:8]
    path = tmp_path / "replay.jsonl"
    write_replay(path, [ReplayRun(g, 10.0 * i) for i, g in enumerate(graphs)])
    base = dict(replay=str(path), registry=str(reg), minutes=0.05, iters=1, runs=4, eval_runs=4,
                eval_streams=1, guard="", min_runs=100)  # min_runs: stops before any training
    base.update(kw)
    return FinetuneArgs(**base)  # type: ignore[arg-type]


def test_the_fine_tune_names_the_manifest_whose_objective_is_not_one_unless_given_its_own(tmp_path: Path) -> None:
    from trainer.finetune import finetune

    reg = _finetune_registry(tmp_path)
    activate(reg, manifest(reg)["checkpoint"], objective="p95_jct")
    _typo(reg)
    with pytest.raises(CheckpointError, match="active.json: objective 'sla'"):
        finetune(_finetune_args(tmp_path, reg))
    assert finetune(_finetune_args(tmp_path, reg, objective="p95_jct"))["config"]["objective"] == "p95_jct"


# --- found by the second review (each failed on df27ea6) ----------------------------------------

SLA = E3T  # a checkpoint other than the default


def test_the_fine_tune_over_a_manifest_that_does_not_parse_runs_on_the_last_good_as_before(tmp_path: Path) -> None:
    """Before 17ff76e the fine-tune started from the last good checkpoint (the one the servers
    serve) when active.json did not parse, and its promotion repaired the manifest. Now it stops
    at once ("not JSON"), every night, though activate() itself keeps the history's objective."""
    from trainer.finetune import finetune

    incumbent = tmp_path / "models" / "default"
    shutil.copytree(DEFAULT_CHECKPOINT, incumbent)
    reg = tmp_path / "registry"
    activate(reg, incumbent, objective="sla_violation_rate")
    (reg / LAST_GOOD).write_text(json.dumps({"checkpoint": str(incumbent), "sha256": checkpoint_sha256(incumbent)}))
    (reg / MANIFEST).write_text('{"checkpoint": "x"')  # cut short
    report = finetune(_finetune_args(tmp_path, reg))
    assert report["incumbent"]["named_by"] == LAST_GOOD
    assert report["config"]["objective"] == "sla_violation_rate", "the history's, as an activation keeps"


def test_a_manifest_that_is_json_but_not_an_object_is_not_read_as_mean_jct(tmp_path: Path) -> None:
    """A manifest of `[]` / `null` / `"x"` names no checkpoint either (the servers refuse it), but
    it is read as "no objective": the heartbeat says mean_jct (docs: `unknown`), the next
    activation silently makes an SLA deployment mean_jct, the fine-tune trains for mean_jct."""
    activate(tmp_path, "a", objective="sla_violation_rate")
    (tmp_path / MANIFEST).write_text("[]")
    assert ModelRegistry(tmp_path).objective() == "unknown"
    activate(tmp_path, "b")
    assert manifest(tmp_path).get("objective") == "sla_violation_rate"


def test_a_rollback_to_an_entry_that_recorded_no_objective_restores_mean_jct(tmp_path: Path) -> None:
    """An entry without an objective was a mean_jct deployment (no objective = mean_jct; every
    activation of a registry that never named one, and every one before objectives). Rolling
    back an `activate --objective sla_violation_rate` kept sla_violation_rate on the old model."""
    reg = tmp_path / "reg"
    assert cli("activate", "--registry", str(reg), "--create", "--no-check", str(DEFAULT_CHECKPOINT)) == 0
    assert registry_objective(reg) == "mean_jct"
    assert cli("activate", "--registry", str(reg), "--no-check", "--objective", "sla_violation_rate") == 0
    assert cli("rollback", "--registry", str(reg)) == 0
    assert manifest(reg)["sha256"] == checkpoint_sha256(DEFAULT_CHECKPOINT)
    assert registry_objective(reg) == "mean_jct"


def test_a_rollback_does_not_overwrite_an_objective_switched_while_it_checked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rollback's "changed meanwhile" guard compares (checkpoint, sha256) only: an operator's
    `activate --objective p95_jct` of the active checkpoint, landing while the rollback loads its
    target, is overwritten without a word."""
    reg = tmp_path / "reg"
    assert cli("activate", "--registry", str(reg), "--create", "--no-check", str(DEFAULT_CHECKPOINT)) == 0
    assert cli("activate", "--registry", str(reg), "--no-check", str(SLA)) == 0
    active = manifest(reg)

    def check_while_switched(self, path, sha256=""):  # type: ignore[no-untyped-def]
        activate(reg, active["checkpoint"], sha256=active["sha256"], note="switch", objective="p95_jct")
        return SimpleNamespace(version="drl:probe")

    monkeypatch.setattr(ModelRegistry, "check", check_while_switched)
    assert cli("rollback", "--registry", str(reg)) == 1, "the manifest changed meanwhile: nothing done"
    assert manifest(reg)["objective"] == "p95_jct"


def test_activating_the_packaged_checkpoint_leaves_it_reachable_by_the_group(tmp_path: Path) -> None:
    """`activate --objective O` (no CHECKPOINT) makes <registry>/packaged with the process umask:
    under 077 (an Airflow worker started with -D, an operator's shell) it is 2700, so the servers,
    another user of the registry's group, cannot reach packaged/<sha> and refuse the activation
    the CLI reported as done (the fine-tune shares candidates/ for this very reason)."""
    reg = tmp_path / "reg"
    old = os.umask(0o077)
    try:
        assert cli("activate", "--registry", str(reg), "--create", "--no-check", "--objective", "p95_jct") == 0
    finally:
        os.umask(old)
    mode = stat.S_IMODE((reg / "packaged").stat().st_mode)
    assert mode & 0o050 == 0o050, oct(mode)


def test_a_replica_given_no_objective_is_not_reported_as_started_with_one(
        tmp_path: Path, start_server, redis_url: str) -> None:
    """The documented switch (`drl-policy registry activate --objective`) of a deployment whose
    servers were started without --objective: every replica is then said to be "started with
    --objective mean_jct" and the check warns for ever, since the default cannot be told from a
    flag given."""
    import time

    import redis

    from airflow_drl_executor.check import OK, check_servers
    from policy.transport import Keys

    reg = tmp_path / "reg"
    assert cli("activate", "--registry", str(reg), "--create", "--no-check", "--objective", "sla_violation_rate") == 0
    rs = start_server(consumer="plain", placer=None, registry=str(reg))  # no --objective
    assert rs.server.health()["objective"] == "sla_violation_rate"
    r = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10
    while not r.hexists(Keys("t").heartbeat, "plain") and time.monotonic() < deadline:
        time.sleep(0.02)
    found = check_servers(SimpleNamespace(key_prefix="t", server_stale_after_s=30.0), r)
    r.close()
    assert found.status == OK, found


def test_a_rollback_undoes_an_objective_only_switch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """mean_jct, p95_jct and cost share the packaged default: `activate --objective p95_jct` on a
    freshly seeded registry names the same checkpoint, and the rollback meant to undo it (README:
    "rollback restores the one its history entry recorded") refuses, "no earlier checkpoint"."""
    ensure_active(tmp_path)  # mean_jct
    assert cli("activate", "--registry", str(tmp_path), "--no-check", "--objective", "p95_jct") == 0
    capsys.readouterr()
    assert cli("rollback", "--registry", str(tmp_path)) == 0, capsys.readouterr().err
    assert registry_objective(tmp_path) == "mean_jct"


def test_a_server_that_loses_the_seeding_race_to_another_objective_warns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two replicas of different --objective start on an empty registry: the one that takes the
    lock second keeps the other's seed (right) but says nothing (the re-check is quiet), where
    the docs promise a warning naming the command that switches it."""
    import policy.registry as registry_mod

    real_copy = registry_mod.copy_packaged

    def copy_while_another_replica_seeds(root: Path, source: Path):  # type: ignore[no-untyped-def]
        out = real_copy(root, source)
        copy, sha = real_copy(root, SLA)
        activate(root, copy, sha256=sha, note=PACKAGED_NOTE, objective="sla_violation_rate")
        return out

    monkeypatch.setattr(registry_mod, "copy_packaged", copy_while_another_replica_seeds)
    with caplog.at_level(logging.WARNING, logger="policy.registry"):
        ensure_active(tmp_path, objective="p95_jct")
    assert manifest(tmp_path)["objective"] == "sla_violation_rate" and len(history(tmp_path)) == 1
    assert "optimises sla_violation_rate" in caplog.text, caplog.text


# --- found by the third review (the first four failed on c29020f; the rest pin what was checked) ---


def test_switching_a_registry_seeded_with_the_package_folder_keeps_it_reseedable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A registry seeded before copy_packaged names the package's own folder (absolute, with
    PACKAGED_NOTE): ensure_active re-seeds it with a copy, because an upgrade replaces that folder
    and the pinned hash then refuses it (and its last good alike). ``activate --objective O``
    used to copy the packaged checkpoint in; now it re-names the package's own folder, absolute,
    with the note "objective O", so no server re-seeds it any more and the next upgrade leaves
    every replica refusing the manifest and last_good.json alike."""
    sha = checkpoint_sha256(DEFAULT_CHECKPOINT)
    (tmp_path / MANIFEST).write_text(json.dumps({"checkpoint": str(DEFAULT_CHECKPOINT), "sha256": sha,
                                                 "note": PACKAGED_NOTE}))
    (tmp_path / LAST_GOOD).write_text(json.dumps({"checkpoint": str(DEFAULT_CHECKPOINT), "sha256": sha}))
    assert cli("activate", "--registry", str(tmp_path), "--no-check", "--objective", "cost") == 0
    capsys.readouterr()
    doc = manifest(tmp_path)
    assert doc["objective"] == "cost"
    # either a copy inside the registry (as ensure_active and the old --objective did) ...
    named = Path(doc["checkpoint"])
    assert not named.is_absolute(), (
        f"the objective switch pinned the package's own folder {named} (sha {sha[:12]}): an upgrade "
        "replacing it leaves the servers refusing it, and ensure_active no longer re-seeds it")
    assert named == Path("packaged") / sha[:12]


def test_switching_the_objective_keeps_a_relative_name_outside_the_registry(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The objective alone must not change how the manifest names the served checkpoint: a
    registry and a checkpoint store mounted side by side (``../ckpts/v3``) name the same files on
    every host; the switch rewrote it as this host's absolute path (a rollback keeps the name its
    history recorded for the same reason)."""
    reg, store = tmp_path / "reg", tmp_path / "ckpts"
    reg.mkdir()
    store.mkdir()
    shutil.copytree(DEFAULT_CHECKPOINT, store / "v3")
    sha = checkpoint_sha256(store / "v3")
    activate(reg, "../ckpts/v3", sha256=sha, note="by hand")
    assert ModelRegistry(reg).serving_checkpoint().sha256 == sha
    assert cli("activate", "--registry", str(reg), "--no-check", "--objective", "p95_jct") == 0
    capsys.readouterr()
    doc = manifest(reg)
    assert doc["objective"] == "p95_jct" and doc["sha256"] == sha
    assert doc["checkpoint"] == "../ckpts/v3", f"renamed to {doc['checkpoint']}"


def _loader_refused_copy(reg: Path) -> tuple[str, str]:
    """A copy of the default inside ``reg`` whose weights do not match its manifest: its sha256
    pinned as it is now (the registry's hash check passes), refused by the loader."""
    bad = reg / "bad"
    shutil.copytree(DEFAULT_CHECKPOINT, bad)
    weights = bad / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF
    weights.write_bytes(bytes(blob))
    return "bad", checkpoint_sha256(bad)


def test_switching_the_objective_while_the_servers_serve_the_last_good_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """active.json names a checkpoint the loader refuses (its hash matches: serving_checkpoint
    returns it); every server serves last_good.json's. ``activate --objective O`` is documented to
    keep "the checkpoint served now"; it checks the refused one instead and exits 1, blaming that
    checkpoint and not saying the servers serve another: the objective cannot be switched without
    naming a checkpoint (and --no-check re-pins the refused one)."""
    copy, good = copy_packaged(tmp_path, DEFAULT_CHECKPOINT)
    name, bad_sha = _loader_refused_copy(tmp_path)
    activate(tmp_path, copy, sha256=good, note="seed")
    activate(tmp_path, name, sha256=bad_sha, note="a bad one by hand, --no-check")
    (tmp_path / LAST_GOOD).write_text(json.dumps({"checkpoint": str(copy), "sha256": good}))
    served = ModelRegistry(tmp_path).load_now()  # what a server starting now does: refuses it,
    assert served is not None and served.sha256 == good  # serves the last good one
    assert ModelRegistry(tmp_path).serving_checkpoint().sha256 == bad_sha  # what the CLI takes

    rc = cli("activate", "--registry", str(tmp_path), "--objective", "cost")
    err = capsys.readouterr().err
    assert rc == 0, f"refused: {err}"
    doc = manifest(tmp_path)
    assert doc["objective"] == "cost" and doc["sha256"] == good and doc["checkpoint"] == str(copy)


def test_the_usage_error_says_what_objective_alone_does_now(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``activate`` with neither: the message still says --objective activates "the packaged
    checkpoint of that objective", which is what this change stopped doing for a registry with a
    manifest (the docstring, --help and README say "what is served now")."""
    ensure_active(tmp_path)
    assert cli("activate", "--registry", str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "--objective" in err and "packaged checkpoint" not in err, err


# --- probes of the review that pass (kept: they pin behaviour the change is meant to have) --------

def test_probe_a_refused_manifest_switches_to_the_last_good_named_relative(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy, good = copy_packaged(tmp_path, DEFAULT_CHECKPOINT)
    activate(tmp_path, copy, sha256=good, note="seed")
    (tmp_path / LAST_GOOD).write_text(json.dumps({"checkpoint": str(copy), "sha256": good}))
    activate(tmp_path, copy, sha256="ab" * 32, note="pinned to other content")
    assert cli("activate", "--registry", str(tmp_path), "--no-check", "--objective", "cost") == 0
    capsys.readouterr()
    doc = manifest(tmp_path)
    assert doc == {"checkpoint": str(copy), "sha256": good, "note": "objective cost", "objective": "cost"}
    assert history(tmp_path)[-1]["checkpoint"] == str(copy)


def test_probe_a_manifest_that_does_not_parse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy, good = copy_packaged(tmp_path, DEFAULT_CHECKPOINT)
    (tmp_path / LAST_GOOD).write_text(json.dumps({"checkpoint": str(copy), "sha256": good}))
    (tmp_path / MANIFEST).write_text("{not json")
    assert cli("activate", "--registry", str(tmp_path), "--no-check", "--objective", "cost") == 0
    capsys.readouterr()
    assert manifest(tmp_path)["checkpoint"] == str(copy) and manifest(tmp_path)["objective"] == "cost"


def test_probe_a_symlinked_registry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    ensure_active(real)
    named = manifest(real)["checkpoint"]
    # the manifest naming the registry's files by an absolute path through the other name
    activate(real, str(real.resolve() / named), sha256=manifest(real)["sha256"])
    assert cli("activate", "--registry", str(tmp_path / "link"), "--no-check", "--objective", "cost") == 0
    capsys.readouterr()
    assert manifest(real)["checkpoint"] == named


def test_probe_create_with_objective(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reg = tmp_path / "new"
    assert cli("activate", "--registry", str(reg), "--create", "--no-check", "--objective", "cost") == 0
    capsys.readouterr()
    assert manifest(reg)["objective"] == "cost" and not Path(manifest(reg)["checkpoint"]).is_absolute()
    # nothing served and no last good: refused, exit 1, nothing written
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / MANIFEST).write_text(json.dumps({"checkpoint": "missing"}))
    assert cli("activate", "--registry", str(bad), "--objective", "cost") == 1
    assert "no checkpoint served now" in capsys.readouterr().err
    assert manifest(bad) == {"checkpoint": "missing"}
