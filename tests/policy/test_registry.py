"""The model registry and hot reload: good checkpoints are swapped in between batches, bad ones refused."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Mapping

import pytest
import redis
from server_helpers import ask, chain, request

from policy.errors import CheckpointError
from policy.placement import EarliestFinishPlacer
from policy.registry import (
    ACTIVATION_LOCK,
    LAST_GOOD,
    MANIFEST,
    ModelRegistry,
    ServingCheckpoint,
    activate,
    activation_lock,
    checkpoint_sha256,
    ensure_active,
    gnn_loader,
)
from policy.schema import Decision, PlacementRequest, RunGraph


class Tagged(EarliestFinishPlacer):
    """The EFT heuristic under another name and version (a stand-in model)."""

    def __init__(self, version: str) -> None:
        super().__init__()
        self.name = "fake"
        self.version = version

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        return super().place(request, graphs)


class Broken(Tagged):
    """Loads, then fails on every request (weights that produce NaNs, an op the device lacks)."""

    def place(self, request: PlacementRequest, graphs: Mapping[str, RunGraph]) -> list[Decision]:
        raise RuntimeError("probability tensor contains nan")


def fake_loader(path: Path, device: str) -> Tagged:
    """Reads ``weights.json`` ({"version": ..., "shape": [..], "broken": bool}); refuses a wrong shape."""
    doc = json.loads((path / "weights.json").read_text())
    if doc.get("shape") != [4, 4]:
        raise CheckpointError(f"{path}: shape {doc.get('shape')} does not match the model's [4, 4]")
    return Broken(doc["version"]) if doc.get("broken") else Tagged(doc["version"])


def fake_checkpoint(root: Path, name: str, version: str, shape: list[int] | None = None,
                    broken: bool = False) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "weights.json").write_text(json.dumps({"version": version, "shape": shape or [4, 4], "broken": broken}))
    return d


def wait_for(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_registry_loads_hashes_and_refuses(tmp_path: Path) -> None:
    failures: list[str] = []
    reg = ModelRegistry(tmp_path, loader=fake_loader, poll_s=0.01, on_failure=failures.append)
    assert reg.load_now() is None  # no manifest yet
    v1 = fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1", sha256=checkpoint_sha256(v1))
    model = reg.load_now()
    assert model is not None and model.version == "fake:1" and model.device == "cpu"
    # a hash mismatch is refused
    fake_checkpoint(tmp_path, "v2", "2")
    activate(tmp_path, "v2", sha256="0" * 64)
    time.sleep(0.02)
    assert reg.poll() is None
    reg.wait_idle()
    assert reg.poll() is None and "does not match the manifest" in failures[-1]
    # a bad manifest is refused
    (tmp_path / "active.json").write_text("{not json")
    time.sleep(0.02)
    assert reg.poll() is None and "not JSON" in failures[-1]
    # bytes that are not UTF-8, or a path with a NUL: refused too (found by review: the first raised
    # UnicodeDecodeError out of poll(), the replica down; at start-up out of load_now, a crash loop)
    for bad in (b'\xff{"checkpoint": "v1"}', b'{"checkpoint": "v1\\u0000"}'):
        (tmp_path / "active.json").write_bytes(bad)
        time.sleep(0.02)
        n = len(failures)
        assert reg.poll() is None and len(failures) == n + 1 and "active.json" in failures[-1]
        restarted = ModelRegistry(tmp_path, loader=fake_loader).load_now()  # the last good one, no crash
        assert restarted is not None and restarted.version == "fake:1"
    # a good one is loaded in the background and handed over once
    activate(tmp_path, str(fake_checkpoint(tmp_path, "v3", "3")), note="absolute path")
    time.sleep(0.02)
    reg.poll()
    reg.wait_idle()
    got = reg.poll()
    assert got is not None and got.version == "fake:3"
    assert reg.poll() is None


def test_bad_checkpoint_is_refused_while_serving_continues(tmp_path: Path, start_server,
                                                           rclient: redis.Redis) -> None:
    fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1")
    rs = start_server(placer=None, loader=fake_loader, registry=str(tmp_path), registry_poll_s=0.05)
    server = rs.server
    g = chain("reload")
    reply = ask(rclient, request([g], [("reload", "t0")]))
    assert reply is not None and reply.ok and (reply.policy, reply.policy_version) == ("fake", "1")
    # push a checkpoint whose shapes do not match: refused, v1 keeps answering
    fake_checkpoint(tmp_path, "v2", "2", shape=[8, 8])
    activate(tmp_path, "v2")
    wait_for(lambda: server.metrics.model_load_failures._value.get() == 1)
    for i in range(5):
        reply = ask(rclient, request([g], [("reload", f"t{i}")]))
        assert reply is not None and reply.ok and reply.policy_version == "1"
    # a good one is swapped in between batches, without a restart
    fake_checkpoint(tmp_path, "v3", "3")
    activate(tmp_path, "v3")
    wait_for(lambda: server.version == "fake:3")
    reply = ask(rclient, request([g], [("reload", "t1")]))
    assert reply is not None and reply.policy_version == "3"
    assert server.metrics.model_swaps._value.get() == 1
    assert server.health()["version"] == "fake:3"


def test_auto_without_a_loadable_model_serves_the_heuristic(tmp_path: Path, start_server,
                                                             rclient: redis.Redis) -> None:
    fake_checkpoint(tmp_path, "broken", "x", shape=[1])
    activate(tmp_path, "broken")
    rs = start_server(placer=None, loader=fake_loader, registry=str(tmp_path), registry_poll_s=0.05)
    reply = ask(rclient, request([chain("a")], [("a", "t0")]))
    assert reply is not None and reply.ok and reply.policy == "eft"
    assert rs.server.metrics.model_load_failures._value.get() == 1


def test_a_restart_after_a_bad_push_serves_the_last_good_checkpoint(tmp_path: Path, start_server,
                                                                     rclient: redis.Redis) -> None:
    v1 = fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1", sha256=checkpoint_sha256(v1))
    assert ModelRegistry(tmp_path, loader=fake_loader).load_now() is not None  # a first server
    assert json.loads((tmp_path / LAST_GOOD).read_text())["checkpoint"] == "v1"  # relative to the registry
    # a bad push (its content no longer matches the hash), then a restart: v1 serves, refusal counted
    v2 = fake_checkpoint(tmp_path, "v2", "2")
    activate(tmp_path, "v2", sha256=checkpoint_sha256(v2))
    (v2 / "report.json").write_text("{}")
    rs = start_server(placer=None, loader=fake_loader, registry=str(tmp_path), registry_poll_s=0.05)
    reply = ask(rclient, request([chain("lg")], [("lg", "t0")]))
    assert reply is not None and reply.ok and (reply.policy, reply.policy_version) == ("fake", "1")
    assert rs.server.metrics.model_load_failures._value.get() == 1
    # the next good push is swapped in as usual and becomes the last good one
    v3 = fake_checkpoint(tmp_path, "v3", "3")
    activate(tmp_path, "v3", sha256=checkpoint_sha256(v3))
    wait_for(lambda: rs.server.version == "fake:3")
    assert json.loads((tmp_path / LAST_GOOD).read_text())["checkpoint"] == "v3"


def test_a_restart_after_a_push_the_loader_rejects_otherwise_serves_the_last_good_one(tmp_path: Path) -> None:
    """A manifest value the loader rejects with an error of its own (a ValueError for an unknown
    gate scope, an AttributeError for a training record that is not an object) is a refused
    checkpoint like a hash mismatch. was: it escaped the last-good fallback at start-up, so every
    restarted replica crashed (a hot reload refused it)."""
    def loader(path: Path, device: str) -> Tagged:
        doc = json.loads((path / "weights.json").read_text())
        if doc.get("scope") not in (None, "off-cp", "all"):
            raise ValueError(f"cp_gate_scope must be one of ('off-cp', 'all'), got {doc['scope']!r}")
        return fake_loader(path, device)

    v1 = fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1", sha256=checkpoint_sha256(v1))
    assert ModelRegistry(tmp_path, loader=loader).load_now() is not None
    v2 = fake_checkpoint(tmp_path, "v2", "2")
    (v2 / "weights.json").write_text(json.dumps({"version": "2", "shape": [4, 4], "scope": "nope"}))
    activate(tmp_path, "v2", sha256=checkpoint_sha256(v2))
    served = ModelRegistry(tmp_path, loader=loader).load_now()
    assert served is not None and served.version == "fake:1"
    with pytest.raises(CheckpointError, match="cannot load: ValueError: cp_gate_scope"):
        ModelRegistry(tmp_path, loader=loader)._load(v2, checkpoint_sha256(v2))


def test_the_last_good_checkpoint_survives_the_registry_moving(tmp_path: Path) -> None:
    """Servers on other hosts mount the registry volume at other paths: last_good.json names a
    checkpoint under the registry relative to it, as the fine-tune's active.json does."""
    root = tmp_path / "here"
    v1 = fake_checkpoint(root, "v1", "1")
    activate(root, "v1", sha256=checkpoint_sha256(v1))
    assert ModelRegistry(root, loader=fake_loader).load_now() is not None
    activate(root, "gone")  # a bad push, then the volume is mounted elsewhere
    shutil.move(root, tmp_path / "there")
    served = ModelRegistry(tmp_path / "there", loader=fake_loader).load_now()
    assert served is not None and served.version == "fake:1"


def test_serving_checkpoint_is_what_a_server_would_serve(tmp_path: Path) -> None:
    """The manifest's checkpoint when its content matches the hash named (or none is named), else
    the last good one; neither: the manifest's reason. Nothing is loaded."""
    reg = ModelRegistry(tmp_path, loader=fake_loader)
    with pytest.raises(CheckpointError, match="active.json: does not exist"):
        reg.serving_checkpoint()
    v1 = fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1", sha256=checkpoint_sha256(v1))
    assert reg.serving_checkpoint() == ServingCheckpoint(v1, checkpoint_sha256(v1), MANIFEST)
    assert reg.load_now() is not None  # v1 is now the last good one
    v2 = fake_checkpoint(tmp_path, "v2", "2")
    activate(tmp_path, "v2", sha256="0" * 64)  # refused by the servers
    assert (reg.serving_checkpoint().path, reg.serving_checkpoint().source) == (v1, LAST_GOOD)
    activate(tmp_path, "gone")
    assert reg.serving_checkpoint().path == v1
    activate(tmp_path, v2)  # no hash named: served as it is
    assert reg.serving_checkpoint() == ServingCheckpoint(v2, checkpoint_sha256(v2), MANIFEST)
    (v1 / "weights.json").write_text("{}")  # the last good one changed since it loaded
    activate(tmp_path, "v2", sha256="0" * 64)
    with pytest.raises(CheckpointError, match="does not match the manifest"):
        reg.serving_checkpoint()


def test_the_activation_lock_is_exclusive(tmp_path: Path) -> None:
    import fcntl

    def try_lock() -> bool:
        with open(tmp_path / ACTIVATION_LOCK, "a") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

    with activation_lock(tmp_path):
        assert not try_lock()
    assert try_lock()


def test_the_registrys_files_are_shared_with_the_group_whatever_the_umask(tmp_path: Path) -> None:
    """The policy servers and the workers that promote run as different users of one group on a
    shared registry (docker-compose.yaml). was: active.json and last_good.json came out 0600 from
    mkstemp: a worker's promotion could not be read by a server ('Permission denied'), nor the
    server's seeded manifest by the nightly fine-tune"""
    import os
    import stat

    old = os.umask(0o077)
    try:
        activate(tmp_path, fake_checkpoint(tmp_path, "v1", "1"))
        assert ModelRegistry(tmp_path, loader=fake_loader).load_now() is not None
        with activation_lock(tmp_path):
            pass
    finally:
        os.umask(old)
    for name in ("active.json", "last_good.json", ACTIVATION_LOCK):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o664, name


def test_a_last_good_checkpoint_that_changed_is_not_served(tmp_path: Path) -> None:
    v1 = fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1", sha256=checkpoint_sha256(v1))
    ModelRegistry(tmp_path, loader=fake_loader).load_now()
    (v1 / "weights.json").write_text(json.dumps({"version": "1b", "shape": [4, 4]}))  # changed since
    activate(tmp_path, tmp_path / "gone")
    with pytest.raises(CheckpointError, match="does not exist"):  # the manifest's reason, not v1's
        ModelRegistry(tmp_path, loader=fake_loader).load_now()
    (tmp_path / LAST_GOOD).write_text("{half")
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelRegistry(tmp_path, loader=fake_loader).load_now()


def test_an_empty_registry_serves_the_packaged_default(tmp_path: Path, redis_url: str) -> None:
    from policy.config import ServerConfig
    from policy.registry import DEFAULT_CHECKPOINT
    from policy.server import PolicyServer

    server = PolicyServer(ServerConfig(redis_url=redis_url, placer="gnn", registry=str(tmp_path), hold_ratio=2.0,
                                       cp_gate=3.0, cp_gate_scope="all"))
    assert server.placer.name == "drl"
    assert server.placer.hold_ratio == 2.0  # type: ignore[attr-defined]  # the setting reaches the GNN
    assert server.placer.cp_gate == 3.0  # type: ignore[attr-defined]
    assert server.health()["cp_gate"] == 3.0  # /health says how the GNN decodes
    assert server.placer.cp_gate_scope == "all" and server.health()["cp_gate_scope"] == "all"  # type: ignore[attr-defined]
    sha = checkpoint_sha256(DEFAULT_CHECKPOINT)
    assert json.loads((tmp_path / MANIFEST).read_text())["checkpoint"] == f"packaged/{sha[:12]}"
    assert checkpoint_sha256(tmp_path / "packaged" / sha[:12]) == sha, "a copy, in the registry"


def test_an_upgrade_replacing_the_packaged_default_does_not_strand_the_registry(tmp_path: Path) -> None:
    """was: the manifest named the package's own folder, pinned to its hash; an upgrade replaced
    its content, and every server refused it and its last good one (the same folder) alike, and
    the fine-tune could not start from it. Now the default is copied into the registry; a registry
    seeded the old way is seeded again from the new default."""
    from policy.registry import DEFAULT_CHECKPOINT, PACKAGED_NOTE

    package = tmp_path / "site-packages" / "default"
    shutil.copytree(DEFAULT_CHECKPOINT, package)
    old = tmp_path / "old"
    activate(old, package, sha256=checkpoint_sha256(package), note=PACKAGED_NOTE)  # seeded the old way
    new = tmp_path / "new"
    ensure_active(new, package)
    served = ModelRegistry(new, loader=gnn_loader).load_now()
    assert served is not None and served.placer.name == "drl"
    (package / "README").write_text("v2")  # the upgrade changes the package's folder
    served = ModelRegistry(new, loader=gnn_loader).load_now()
    assert served is not None, "the registry's copy is unchanged"
    with pytest.raises(CheckpointError, match="does not match"):
        ModelRegistry(old, loader=gnn_loader).load_now()
    ensure_active(old, package)  # a server starting after the upgrade
    doc = json.loads((old / MANIFEST).read_text())
    assert doc["checkpoint"].startswith("packaged/") and doc["sha256"] == checkpoint_sha256(package)
    assert ModelRegistry(old, loader=gnn_loader).load_now() is not None
    activate(old, "packaged/x")  # anything else a user or the fine-tune activated is left alone
    ensure_active(old, package)
    assert json.loads((old / MANIFEST).read_text())["checkpoint"] == "packaged/x"


def test_gnn_placer_requires_a_model_that_loads(tmp_path: Path, redis_url: str) -> None:
    from policy.config import ServerConfig
    from policy.server import PolicyServer

    activate(tmp_path, tmp_path / "gone")
    with pytest.raises(CheckpointError):
        PolicyServer(ServerConfig(redis_url=redis_url, placer="gnn", registry=str(tmp_path)))


def test_real_gnn_checkpoint_is_served_and_a_tampered_one_refused(tmp_path: Path, start_server,
                                                                  rclient: redis.Redis) -> None:
    from policy.checkpoint import save_checkpoint
    from policy.model import ModelConfig, PlacementGNN

    save_checkpoint(PlacementGNN(ModelConfig(hidden=8, layers=1)), tmp_path / "small", name="tiny")
    activate(tmp_path, "small")
    rs = start_server(placer=None, registry=str(tmp_path), registry_poll_s=0.05, device="auto")
    server = rs.server
    assert server.placer.name == "drl" and server.device == "cpu"
    g = chain("gnn", 12)
    reply = ask(rclient, request([g], [("gnn", "t0"), ("gnn", "t3")]))
    # an untrained model may hold one of the two (late binding); what it places is valid
    assert reply is not None and reply.ok and reply.policy == "drl" and 1 <= len(reply.decisions) <= 2
    assert {d.task_id for d in reply.decisions} <= {"t0", "t3"}
    before = server.version
    # tamper: same manifest, different weights bytes
    shutil.copytree(tmp_path / "small", tmp_path / "tampered")
    weights = tmp_path / "tampered" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF
    weights.write_bytes(bytes(blob))
    activate(tmp_path, "tampered")
    wait_for(lambda: server.metrics.model_load_failures._value.get() == 1)
    reply = ask(rclient, request([g], [("gnn", "t1")]))
    assert reply is not None and reply.ok and server.version == before
    # shapes that do not match the manifest's model config
    save_checkpoint(PlacementGNN(ModelConfig(hidden=16, layers=1)), tmp_path / "other", name="other")
    manifest = json.loads((tmp_path / "other" / "manifest.json").read_text())
    manifest["model"]["hidden"] = 8
    (tmp_path / "other" / "manifest.json").write_text(json.dumps(manifest))
    activate(tmp_path, "other")
    wait_for(lambda: server.metrics.model_load_failures._value.get() == 2)
    reply = ask(rclient, request([g], [("gnn", "t2")]))
    assert reply is not None and reply.ok and server.version == before
    # an ensemble checkpoint (drl-trainer ensemble) hot-reloads as one model, and serves
    from policy.checkpoint import load_checkpoint, save_ensemble

    save_checkpoint(PlacementGNN(ModelConfig(hidden=4, layers=1)), tmp_path / "second", name="second")
    save_ensemble([load_checkpoint(tmp_path / "small"), load_checkpoint(tmp_path / "second")], tmp_path / "ens")
    activate(tmp_path, "ens")
    ens = load_checkpoint(tmp_path / "ens").version
    wait_for(lambda: server.version == f"drl:{ens}")
    assert len(server.placer.models) == 2
    reply = ask(rclient, request([g], [("gnn", "t2"), ("gnn", "t5")]))
    assert reply is not None and reply.ok and reply.policy_version.endswith(ens) and 1 <= len(reply.decisions) <= 2


def test_a_model_that_loads_but_cannot_place_is_refused(tmp_path: Path) -> None:
    """Each checkpoint places a probe request before it serves; failing it is a refusal."""
    failures: list[str] = []
    reg = ModelRegistry(tmp_path, loader=fake_loader, poll_s=0.01, on_failure=failures.append)
    v1 = fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1", sha256=checkpoint_sha256(v1))
    assert reg.load_now() is not None
    bad = fake_checkpoint(tmp_path, "v2", "2", broken=True)
    activate(tmp_path, "v2", sha256=checkpoint_sha256(bad))
    time.sleep(0.02)
    assert reg.poll() is None
    reg.wait_idle()
    assert reg.poll() is None
    assert "fails on a probe request: RuntimeError: probability tensor contains nan" in failures[-1]
    with pytest.raises(CheckpointError, match="fails on a probe request"):
        ModelRegistry(tmp_path / "fresh", loader=fake_loader)._load(bad, checkpoint_sha256(bad))


@pytest.fixture
def unreadable(monkeypatch: pytest.MonkeyPatch) -> set[Path]:
    """Folders whose contents fail with PermissionError, as after ``chmod 000`` (simulated: the
    tests may run as root, which ignores file modes). Add a folder to the returned set to lock it."""
    locked: set[Path] = set()
    real_stat, real_open = Path.stat, Path.open

    def check(p: Path) -> None:
        if any(d in p.parents for d in locked):
            raise PermissionError(13, "Permission denied", str(p))

    def stat(self: Path, **kwargs):  # type: ignore[no-untyped-def]
        check(self)
        return real_stat(self, **kwargs)

    def open_(self: Path, *args, **kwargs):  # type: ignore[no-untyped-def]
        check(self)
        return real_open(self, *args, **kwargs)

    real_os_open = os.open

    def os_open(path, flags, *args, **kwargs):  # type: ignore[no-untyped-def]  # policy.files.read_bounded
        if isinstance(path, (str, os.PathLike)) and not flags & (os.O_WRONLY | os.O_RDWR):
            check(Path(path))  # reads only, as Path.open above: activate() still writes
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(Path, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    return locked


def test_an_unreadable_registry_keeps_the_current_model_serving(tmp_path: Path, start_server,
                                                                 rclient: redis.Redis,
                                                                 unreadable: set[Path],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1")
    rs = start_server(placer=None, loader=fake_loader, registry=str(tmp_path), registry_poll_s=0.02)
    g = chain("locked")
    assert ask(rclient, request([g], [("locked", "t0")])).policy_version == "1"  # type: ignore[union-attr]
    fake_checkpoint(tmp_path, "v2", "2")
    unreadable.add(tmp_path)
    activate(tmp_path, "v2")  # pushed while this host cannot read the registry
    wait_for(lambda: rs.server.metrics.model_load_failures._value.get() == 1)
    time.sleep(0.3)  # a dozen polls more: the same error is logged and counted once
    reply = ask(rclient, request([g], [("locked", "t1")]))
    assert reply is not None and reply.ok and reply.policy_version == "1"
    assert rs.thread.is_alive() and rs.server.metrics.model_load_failures._value.get() == 1
    assert sum("Permission denied" in r.getMessage() for r in caplog.records
               if r.levelname == "ERROR") == 1
    unreadable.clear()  # readable again: retried at the next poll
    wait_for(lambda: rs.server.version == "fake:2")


def test_an_unreadable_registry_at_start_up_falls_back_to_the_heuristic(tmp_path: Path, redis_url: str,
                                                                        unreadable: set[Path]) -> None:
    from policy.config import ServerConfig
    from policy.server import PolicyServer

    fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1")
    unreadable.add(tmp_path)
    with pytest.raises(CheckpointError, match="Permission denied"):
        ModelRegistry(tmp_path, loader=fake_loader).load_now()
    with pytest.raises(CheckpointError, match="Permission denied"):
        ensure_active(tmp_path)
    server = PolicyServer(ServerConfig(redis_url=redis_url, placer="auto", registry=str(tmp_path)),
                          loader=fake_loader)
    assert server.placer.name == "eft"
    assert server.metrics.model_load_failures._value.get() == 1
    unreadable.clear()
    assert server.registry is not None
    server.registry.poll()  # once readable, the next poll loads what the manifest names
    server.registry.wait_idle()
    model = server.registry.poll()
    assert model is not None and model.version == "fake:1"


def test_a_checkpoint_that_fails_to_read_is_retried(tmp_path: Path, unreadable: set[Path]) -> None:
    """An I/O error says nothing about the checkpoint: it is tried again at the next poll (once
    counted), not refused until the manifest changes, as a bad hash or shape is."""
    failures: list[str] = []
    now = [0.0]
    reg = ModelRegistry(tmp_path, loader=fake_loader, poll_s=1.0, on_failure=failures.append,
                        clock=lambda: now[0])
    fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1")
    assert reg.load_now() is not None
    v2 = fake_checkpoint(tmp_path, "v2", "2")
    activate(tmp_path, "v2")
    unreadable.add(v2)
    for _ in range(3):
        now[0] += 1.0
        assert reg.poll() is None
        reg.wait_idle()
    assert len(failures) == 1 and "Permission denied" in failures[0]
    unreadable.clear()
    now[0] += 1.0
    reg.poll()
    reg.wait_idle()
    model = reg.poll()
    assert model is not None and model.version == "fake:2"


def test_a_checkpoint_refused_once_is_tried_again_when_activated_again(tmp_path: Path) -> None:
    """Found by review: after one failed load (CUDA out of memory, say) the same checkpoint activated again was
    skipped as already tried; only a restart loaded it."""
    failures: list[str] = []
    calls: list[Path] = []

    def flaky(path: Path, device: str) -> Tagged:
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory")
        return fake_loader(path, device)

    fake_checkpoint(tmp_path, "v1", "1")
    fake_checkpoint(tmp_path, "v2", "2")
    activate(tmp_path, "v1")
    reg = ModelRegistry(tmp_path, loader=flaky, poll_s=0.01, on_failure=failures.append)
    assert reg.load_now() is not None
    for attempt in range(2):  # refused, then the same checkpoint activated again: loaded
        time.sleep(0.02)
        activate(tmp_path, "v2", note=f"try {attempt}")
        time.sleep(0.02)
        reg.poll()
        reg.wait_idle()
    got = reg.poll()
    assert len(failures) == 1 and "out of memory" in failures[0]
    assert got is not None and got.version == "fake:2" and len(calls) == 3
