"""``drl-policy registry``: show, activate (checked, pinned, relative to the current directory), rollback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from policy.cli import main
from policy.registry import HISTORY, LAST_GOOD, MANIFEST, ModelRegistry, activate, checkpoint_sha256, history


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real GNN checkpoint (the loader's own checks, a probe request)."""
    from policy.checkpoint import save_checkpoint
    from policy.model import ModelConfig, PlacementGNN

    d = tmp_path_factory.mktemp("ck") / "small"
    save_checkpoint(PlacementGNN(ModelConfig(hidden=8, layers=1)), d, name="tiny")
    return d


def cli(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict | None, str]:
    code = main(["registry", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_activate_takes_a_path_from_the_current_directory_and_pins_its_hash(
        tmp_path: Path, small: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "work"
    shutil.copytree(small, work / "models" / "v1")
    reg = tmp_path / "reg"
    monkeypatch.chdir(work)
    # the path is the current directory's (written by hand into active.json it would be the registry's)
    code, _, err = cli("activate", "--registry", str(reg), "models/v1", capsys=capsys)
    assert code == 1 and "no such registry folder" in err and not reg.exists()  # a mistyped --registry
    code, doc, err = cli("activate", "--registry", str(reg), "models/v1", "--note", "by hand", "--create",
                         capsys=capsys)
    assert code == 0, err
    assert reg.stat().st_mode & 0o7777 == 0o2775  # the group's, as the files in it
    manifest = json.loads((reg / MANIFEST).read_text())
    assert Path(manifest["checkpoint"]) == work / "models" / "v1"
    assert manifest["sha256"] == checkpoint_sha256(work / "models" / "v1") == doc["sha256"]
    assert manifest["note"] == "by hand" and doc["checked"] is True and doc["version"].startswith("drl:")
    model = ModelRegistry(reg).load_now()
    assert model is not None and model.version == doc["version"]
    # inside the registry: named relative to it (the same files wherever the volume is mounted)
    shutil.copytree(small, reg / "models" / "v2")
    code, doc, err = cli("activate", "--registry", str(reg), str(reg / "models" / "v2"), capsys=capsys)
    assert code == 0, err
    assert json.loads((reg / MANIFEST).read_text())["checkpoint"] == "models/v2"
    assert [h["checkpoint"] for h in history(reg)] == [str(work / "models" / "v1"), "models/v2"]
    # spelled with .. or through a symlink to the registry: still named relative to it
    (tmp_path / "link").symlink_to(reg)
    for spelling in (str(work / ".." / "reg" / "models" / "v2"), str(tmp_path / "link" / "models" / "v2")):
        code, doc, err = cli("activate", "--registry", str(tmp_path / "link"), spelling, "--no-check", capsys=capsys)
        assert code == 0 and doc["checkpoint"] == "models/v2", (spelling, err)


def test_a_checkpoint_a_server_would_refuse_is_refused_and_the_registry_left_alone(
        tmp_path: Path, small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reg = tmp_path / "reg"
    reg.mkdir()
    shutil.copytree(small, tmp_path / "good")
    assert cli("activate", "--registry", str(reg), str(tmp_path / "good"), capsys=capsys)[0] == 0
    before = (reg / MANIFEST).read_text()
    shutil.copytree(small, tmp_path / "tampered")
    weights = tmp_path / "tampered" / "model.safetensors"
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF
    weights.write_bytes(bytes(blob))
    code, _, err = cli("activate", "--registry", str(reg), str(tmp_path / "tampered"), capsys=capsys)
    assert code == 1 and "refused" in err and "tampered" in err
    for bad in (tmp_path / "nowhere", tmp_path):  # missing; a folder that is not a checkpoint
        code, _, err = cli("activate", "--registry", str(reg), str(bad), capsys=capsys)
        assert code == 1 and "not a checkpoint folder" in err
    assert (reg / MANIFEST).read_text() == before and len(history(reg)) == 1
    # --no-check names it all the same (pinned to the hash it has now), and the servers refuse it
    code, doc, err = cli("activate", "--registry", str(reg), str(tmp_path / "tampered"), "--no-check", capsys=capsys)
    assert code == 0 and doc["checked"] is False
    assert json.loads((reg / MANIFEST).read_text())["sha256"] == checkpoint_sha256(tmp_path / "tampered")


def test_rollback_activates_the_previous_checkpoint_and_again_goes_back(
        tmp_path: Path, small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reg = tmp_path / "reg"
    reg.mkdir()
    code, _, err = cli("rollback", "--registry", str(reg), capsys=capsys)
    assert code == 1 and "no earlier checkpoint" in err
    for name in ("a", "b"):
        shutil.copytree(small, reg / name)
        (reg / name / "tag.txt").write_text(name)  # copies of one content are one checkpoint to a rollback
        assert cli("activate", "--registry", str(reg), str(reg / name), capsys=capsys)[0] == 0
    code, doc, err = cli("rollback", "--registry", str(reg), capsys=capsys)
    assert code == 0, err
    assert doc["checkpoint"] == "a" and json.loads((reg / MANIFEST).read_text())["note"] == "rollback from b"
    assert cli("rollback", "--registry", str(reg), capsys=capsys)[1]["checkpoint"] == "b"  # type: ignore[index]
    # the previous one changed since: refused, not pinned to its new content
    (reg / "a" / "extra.txt").write_text("x")
    code, _, err = cli("rollback", "--registry", str(reg), capsys=capsys)
    assert code == 1 and "changed since it was active" in err
    assert json.loads((reg / MANIFEST).read_text())["checkpoint"] == "b"
    # the active checkpoint under another spelling (or another copy of the same content) is not "earlier"
    (reg / "a" / "extra.txt").unlink()
    shutil.copytree(small, reg / "c")
    (reg / "c" / "extra.txt").write_text("c")
    for name in ("c", "b"):
        assert cli("activate", "--registry", str(reg), str(reg / name), capsys=capsys)[0] == 0
    activate(reg, str(reg / "b"), sha256=checkpoint_sha256(reg / "b"))  # b again, by its absolute path
    assert cli("rollback", "--registry", str(reg), capsys=capsys)[1]["checkpoint"] == "c"  # type: ignore[index]


def test_a_rollback_does_not_undo_a_promotion_made_while_it_checked(
        tmp_path: Path, small: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by review: the rollback read the manifest, checked its checkpoint (seconds), then wrote over the
    nightly fine-tune's promotion of that moment, its note saying it rolled back from the one before."""
    reg = tmp_path / "reg"
    reg.mkdir()
    for name in ("a", "b", "c"):
        shutil.copytree(small, reg / name)
        (reg / name / "tag.txt").write_text(name)
    for name in ("a", "b"):
        activate(reg, name, sha256=checkpoint_sha256(reg / name))
    check = ModelRegistry.check

    def promote_meanwhile(self: ModelRegistry, path: Path, sha256: str = ""):  # type: ignore[no-untyped-def]
        activate(reg, "c", sha256=checkpoint_sha256(reg / "c"), note="nightly fine-tune")
        return check(self, path, sha256)

    monkeypatch.setattr(ModelRegistry, "check", promote_meanwhile)
    code, _, err = cli("rollback", "--registry", str(reg), capsys=capsys)
    assert code == 1 and "changed meanwhile" in err
    assert json.loads((reg / MANIFEST).read_text())["checkpoint"] == "c"


def test_the_history_survives_a_line_cut_short_and_bad_bytes(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    activate(tmp_path, "a")
    with (tmp_path / HISTORY).open("ab") as fh:
        fh.write(b'{"at": "2026", "checkpoint": "b", "sha')  # a full disk cut this one short
    activate(tmp_path, "c")
    assert [h["checkpoint"] for h in history(tmp_path)] == ["a", "c"]  # was: c swallowed by b's line
    with (tmp_path / HISTORY).open("ab") as fh:
        fh.write(b"\xff\xfe\n")
    assert [h["checkpoint"] for h in history(tmp_path)] == ["a", "c"]
    (tmp_path / MANIFEST).write_bytes(b"\xff{")
    code, doc, err = cli("show", "--registry", str(tmp_path), capsys=capsys)
    assert code == 0 and "not JSON" in doc["serving"]["error"] and len(doc["history"]) == 2
    code, _, err = cli("activate", "--registry", str(tmp_path / HISTORY), str(tmp_path), capsys=capsys)
    assert code == 1 and "refused" in err  # a registry that is a file


def test_show_says_what_a_server_would_serve(tmp_path: Path, small: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    reg = tmp_path / "reg"
    shutil.copytree(small, reg / "v1")
    activate(reg, "v1", sha256=checkpoint_sha256(reg / "v1"))
    (reg / LAST_GOOD).write_text(json.dumps({"checkpoint": "v1", "sha256": checkpoint_sha256(reg / "v1")}))
    activate(reg, "gone", note="a bad push")
    code, doc, err = cli("show", "--registry", str(reg), capsys=capsys)
    assert code == 0, err
    assert doc["active"]["checkpoint"] == "gone" and doc["last_good"]["checkpoint"] == "v1"
    assert doc["serving"] == {"checkpoint": str(reg / "v1"), "sha256": checkpoint_sha256(reg / "v1"),
                              "named_by": LAST_GOOD}
    assert [h.get("note", "") for h in doc["history"]] == ["", "a bad push"]
    (reg / HISTORY).write_text((reg / HISTORY).read_text() + "{not json\n")  # a line cut short
    assert len(history(reg)) == 2
    code, _, err = cli("show", "--registry", str(tmp_path / "none"), capsys=capsys)
    assert code == 1 and "no such registry" in err


def test_review_three_rollback_names_create_and_modes(tmp_path: Path, small: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the third review: a rollback through a symlink in the registry wrote one host's absolute
    path; --create left a registry behind after a refusal, and made missing parents; a checkpoint copied
    into the registry with mode 0700 was activated, and the servers of another user could not read it."""
    import os
    import stat

    reg = tmp_path / "reg"
    reg.mkdir()
    (tmp_path / "models").mkdir()
    (reg / "models").symlink_to(tmp_path / "models")
    for name in ("a", "b"):
        shutil.copytree(small, tmp_path / "models" / name)
        (tmp_path / "models" / name / "tag.txt").write_text(name)
        assert cli("activate", "--registry", str(reg), str(reg / "models" / name), capsys=capsys)[0] == 0
    assert cli("rollback", "--registry", str(reg), capsys=capsys)[0] == 0
    assert json.loads((reg / MANIFEST).read_text())["checkpoint"] == "models/a"  # as its history named it
    # --create: refused, nothing left; a missing parent is not made
    code, _, err = cli("activate", "--registry", str(tmp_path / "new"), str(tmp_path / "nowhere"), "--create",
                       capsys=capsys)
    assert code == 1 and not (tmp_path / "new").exists()
    code, _, err = cli("activate", "--registry", str(tmp_path / "no" / "such"), str(reg / "models" / "a"),
                       "--create", capsys=capsys)
    assert code == 1 and not (tmp_path / "no").exists()
    # a checkpoint inside the registry is made the group's
    shutil.copytree(small, reg / "c")
    os.chmod(reg / "c", 0o700)
    os.chmod(reg / "c" / "manifest.json", 0o600)
    assert cli("activate", "--registry", str(reg), str(reg / "c"), capsys=capsys)[0] == 0
    assert stat.S_IMODE((reg / "c").stat().st_mode) == 0o2775
    assert stat.S_IMODE((reg / "c" / "manifest.json").stat().st_mode) == 0o664
