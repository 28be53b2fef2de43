"""The checkpoint loader, the model registry and ``drl-policy registry`` at their edges: each test
failed on the code before its fix (policy/checkpoint.py, policy/registry.py, policy/registry_cli.py)."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from policy import registry as registry_module
from policy.cli import main
from policy.errors import CheckpointError
from policy.placement import EarliestFinishPlacer
from policy.registry import MANIFEST, ModelRegistry, activate, checkpoint_sha256, ensure_active

#: a file name that is not UTF-8 (Latin-1 "é"), as an old tool or an unpacked archive writes one
LATIN1_NAME = os.fsdecode(b"notes-\xe9.txt")


def fake_loader(path: Path, device: str) -> EarliestFinishPlacer:
    """Reads ``weights.json`` ({"version": ...}): a stand-in model that loads in no time."""
    placer = EarliestFinishPlacer()
    placer.name = "fake"
    placer.version = json.loads((path / "weights.json").read_text())["version"]
    return placer


def fake_checkpoint(root: Path, name: str, version: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "weights.json").write_text(json.dumps({"version": version}))
    return d


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real GNN checkpoint (the loader's own checks, a probe request)."""
    from policy.checkpoint import save_checkpoint
    from policy.model import ModelConfig, PlacementGNN

    d = tmp_path_factory.mktemp("ck") / "small"
    save_checkpoint(PlacementGNN(ModelConfig(hidden=8, layers=1)), d, name="tiny",
                    training={"untrained_inputs": []})
    return d


def cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["registry", *argv])
    return code, capsys.readouterr().err


def test_a_file_name_that_is_not_utf8_in_a_checkpoint_does_not_crash_the_server_start(tmp_path: Path) -> None:
    """Operator: a checkpoint folder holding a stray file whose name is not UTF-8 (``notes-\\xe9.txt``,
    valid on Linux) is activated; every server restarted after that dies at start-up with
    ``UnicodeEncodeError: 'utf-8' codec can't encode character '\\udce9'`` out of
    ``ModelRegistry.load_now`` (not a CheckpointError, so not even the last good checkpoint is served:
    a crash loop). Expected: the folder hashes (its names as the bytes they are) and the checkpoint
    loads; at worst it is refused and the last good one served."""
    v1 = fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1", sha256=checkpoint_sha256(v1))
    assert ModelRegistry(tmp_path, loader=fake_loader).load_now() is not None  # recorded as last good
    v2 = fake_checkpoint(tmp_path, "v2", "2")
    (v2 / LATIN1_NAME).write_text("written by hand")
    activate(tmp_path, "v2")
    try:
        model = ModelRegistry(tmp_path, loader=fake_loader).load_now()
    except CheckpointError:
        model = None  # a refusal is a reason, not a crash; then the last good one must serve
    assert model is not None and model.version in ("fake:2", "fake:1")


def test_activate_a_checkpoint_holding_a_file_name_that_is_not_utf8(
        tmp_path: Path, small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Operator: ``drl-policy registry activate --registry DIR CK`` on a good checkpoint that also
    holds a file whose name is not UTF-8 prints ``refused: 'utf-8' codec can't encode character
    '\\udce9' in position 6: surrogates not allowed`` (no file named, no reason about the checkpoint),
    and ``drl-policy registry show`` of a registry naming it is refused the same way. Expected: it
    is activated (nothing about the checkpoint is wrong)."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(small, ck)
    (ck / LATIN1_NAME).write_text("notes")
    reg = tmp_path / "reg"
    reg.mkdir()
    code, err = cli("activate", "--registry", str(reg), str(ck), capsys=capsys)
    assert code == 0, err
    assert json.loads((reg / MANIFEST).read_text())["checkpoint"] == str(ck)


def test_a_hot_reload_is_not_missed_when_the_manifest_keeps_its_size_and_mtime(tmp_path: Path) -> None:
    """Operator: on a file system with coarse timestamps (NFS/SMB mounts, FAT's 2 s, ext4's
    jiffy-granular clock) two activations in one tick, ``candidates/a`` then ``candidates/b`` (same
    length, so ``active.json`` keeps its size), leave the servers on ``a`` for good, with nothing
    logged: the poll compares only (mtime, size) of the manifest, though every activation replaces it
    by a rename (a new file). The test gives the new manifest the old one's mtime, as such a file
    system does. Expected: the servers swap to ``b`` at the next poll."""
    fake_checkpoint(tmp_path, "v1", "1")
    fake_checkpoint(tmp_path, "v2", "2")
    activate(tmp_path, "v1")
    reg = ModelRegistry(tmp_path, loader=fake_loader, poll_s=0.0, clock=lambda: 0.0)
    first = reg.load_now()
    assert first is not None and first.version == "fake:1"
    before = (tmp_path / MANIFEST).stat()
    activate(tmp_path, "v2")  # a promotion in the same tick
    os.utime(tmp_path / MANIFEST, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (tmp_path / MANIFEST).stat().st_size == before.st_size
    assert reg.poll() is None  # starts the load of what the manifest now names
    reg.wait_idle()
    swapped = reg.poll()
    assert swapped is not None and swapped.version == "fake:2", "the activation of v2 was never picked up"


def test_the_registry_folder_a_server_makes_is_the_groups(tmp_path: Path) -> None:
    """Operator: ``drl-policy serve --registry /srv/models`` (folder not there yet) makes it while seeding
    the packaged default, with the process's umask: 0755, or 0700 under a daemon umask of 077, so the
    nightly fine-tune's worker (another user of the registry's group, README "Deploying") cannot write
    ``candidates/`` into it, nor another server's user read it. ``drl-policy registry activate
    --create`` makes the same folder 2775 (group-writable, setgid) for exactly this reason, and every
    folder written into the registry is 2775. Expected: 2775 whatever the umask."""
    source = tmp_path / "packaged-default"
    source.mkdir()
    (source / "manifest.json").write_text("{}")
    reg = tmp_path / "models"
    old = os.umask(0o077)
    try:
        ensure_active(reg, source)
    finally:
        os.umask(old)
    assert (reg / MANIFEST).exists()
    assert stat.S_IMODE(reg.stat().st_mode) == 0o2775, oct(stat.S_IMODE(reg.stat().st_mode))


def test_switching_the_objective_does_not_open_up_a_checkpoint_outside_the_registry(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Operator: ``active.json`` names a checkpoint beside the registry, ``../private/a`` (a relative path
    is the registry's, documented); ``drl-policy registry activate --registry DIR --objective cost``
    chmods that folder, outside the registry, to 2775 and its files to 664: a private 0700 folder of
    the operator's becomes group-writable. ``activate_checked`` shares every checkpoint whose name is
    relative, taking "relative" for "inside the registry". Expected: only checkpoints inside the
    registry are made the group's; ``../private/a`` keeps its modes."""
    reg = tmp_path / "reg"
    reg.mkdir()
    ck = tmp_path / "private" / "a"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text("{}")
    (ck / "manifest.json").chmod(0o600)
    ck.chmod(0o700)
    activate(reg, "../private/a", sha256=checkpoint_sha256(ck))
    code, err = cli("activate", "--registry", str(reg), "--objective", "cost", "--no-check", capsys=capsys)
    assert code == 0, err
    assert json.loads((reg / MANIFEST).read_text())["objective"] == "cost"
    assert stat.S_IMODE(ck.stat().st_mode) == 0o700, oct(stat.S_IMODE(ck.stat().st_mode))
    assert stat.S_IMODE((ck / "manifest.json").stat().st_mode) == 0o600


def test_a_manifest_whose_training_record_is_not_an_object_is_refused_with_a_reason(small: Path,
                                                                                   tmp_path: Path) -> None:
    """Operator: a hand-edited manifest with ``"training": "see notes"`` (or an ensemble member's) is
    not covered by the weights' hash; ``load_checkpoint`` (``GNNPlacer.from_checkpoint``,
    ``drl-trainer``, ``python -m policy.bench_model``) dies with ``AttributeError: 'str' object has no
    attribute 'get'``, and a server logs "cannot load: AttributeError: ..." with no word of the
    manifest. The module promises a CheckpointError naming the file and the mismatch. Expected: a
    CheckpointError naming manifest.json and ``training``."""
    import shutil

    from policy.checkpoint import MANIFEST_FILE, load_checkpoint

    ck = tmp_path / "ck"
    shutil.copytree(small, ck)
    manifest = json.loads((ck / MANIFEST_FILE).read_text())
    manifest["training"] = "see notes"
    (ck / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="training"):
        load_checkpoint(ck)


def test_a_failed_activation_leaves_no_temporary_file_in_the_registry(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Operator: on a full disk every activation, and every server's ``last_good.json`` update at each
    load, fails after ``mkstemp`` made its temporary file; the ``.active.*.json`` /
    ``.last_good.*.json`` files stay in the registry for good, one more each time (found with
    ``ls -a``, eating the inodes and bytes the full disk lacked). Expected: the error is raised and
    the temporary file removed."""
    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(registry_module.json, "dump", full_disk)
    with pytest.raises(OSError):
        activate(tmp_path, "v1")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".json")) == []


@pytest.mark.parametrize("name", [MANIFEST, "history.jsonl"])
def test_a_fifo_in_the_registry_is_an_error_not_a_hung_poll(tmp_path: Path, name: str) -> None:
    """Found by review: ``read_bytes`` on a FIFO waits for a writer, so a FIFO named ``active.json``
    hung the server's registry poll (and ``drl-policy registry show``) for good."""
    import threading

    fake_checkpoint(tmp_path, "v1", "1")
    activate(tmp_path, "v1")
    (tmp_path / name).unlink()
    os.mkfifo(tmp_path / name)
    outcome: list[object] = []

    def poll() -> None:
        try:
            outcome.append(registry_module.history(tmp_path) if name != MANIFEST
                           else ModelRegistry(tmp_path, loader=fake_loader).load_now())
        except CheckpointError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=poll, daemon=True)
    worker.start()
    worker.join(60)
    if worker.is_alive():  # release the blocked reader before failing
        os.close(os.open(tmp_path / name, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail(f"reading a FIFO named {name} blocked")
    if name == MANIFEST:
        assert isinstance(outcome[0], CheckpointError) and "not a regular file" in str(outcome[0])
    else:
        assert outcome == [[]]  # the history reads as empty, with a warning
