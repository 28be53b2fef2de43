"""Checkpoint round trip and refusal of tampered or mismatched files (policy/checkpoint.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gnn_helpers import ROOT

from policy.checkpoint import (
    MANIFEST_FILE,
    WEIGHTS_FILE,
    feature_schema,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from policy.errors import CheckpointError
from policy.features import READY_COLUMNS
from policy.model import ModelConfig, PlacementGNN

DEFAULT = ROOT / "policy" / "checkpoints" / "default"


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(1)
    # (an untrained model: without the record's empty list every input would count as never
    # trained, and be cut at load: policy/inputs.py)
    save_checkpoint(PlacementGNN(ModelConfig(hidden=16, layers=2)), tmp_path / "c",
                    training={"seed": 1, "untrained_inputs": []}, evaluation={"jct_ratio": 1.0})
    return tmp_path / "c"


def test_round_trip(ckpt: Path) -> None:
    loaded = load_checkpoint(ckpt)
    assert loaded.config == ModelConfig(hidden=16, layers=2)
    assert loaded.manifest["training"] == {"seed": 1, "untrained_inputs": []}
    assert loaded.manifest["feature_schema"] == feature_schema()
    torch.manual_seed(1)
    fresh = PlacementGNN(ModelConfig(hidden=16, layers=2))
    for k, v in fresh.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[k], v)
    assert loaded.version.startswith("gnn-")


def test_tampered_weights_are_refused(ckpt: Path) -> None:
    blob = bytearray((ckpt / WEIGHTS_FILE).read_bytes())
    blob[-1] ^= 0x01
    (ckpt / WEIGHTS_FILE).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="sha256 .* does not match"):
        load_checkpoint(ckpt)


def test_mismatched_feature_schema_is_refused(ckpt: Path) -> None:
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["feature_schema"]["version"] = 999
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"feature schema version 999 .* reads versions 3-{max(READY_COLUMNS)}"):
        load_checkpoint(ckpt)
    manifest["feature_schema"] = feature_schema()
    manifest["feature_schema"]["pair"] = manifest["feature_schema"]["pair"][:-1]
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="pair features"):
        load_checkpoint(ckpt)


def test_a_checkpoint_of_an_older_feature_schema_keeps_loading(tmp_path: Path) -> None:
    """Schema 4 appended one ready column: a schema-3 model reads the first nine, ignores the new
    one, and is saved again (e.g. fine-tuned) as schema 3; a schema-3 manifest that lists the new
    column is refused."""
    torch.manual_seed(2)
    save_checkpoint(PlacementGNN(ModelConfig(hidden=8, layers=1), schema_version=3), tmp_path / "v3")
    manifest = read_manifest(tmp_path / "v3")
    assert manifest["feature_schema"]["version"] == 3
    assert manifest["feature_schema"]["ready"] == feature_schema()["ready"][:READY_COLUMNS[3]]
    loaded = load_checkpoint(tmp_path / "v3")
    assert loaded.model.schema_version == 3
    h, s = torch.randn(4, 8), torch.randn(4, 8)
    x = torch.rand(4, READY_COLUMNS[4])
    y = x.clone()
    y[:, READY_COLUMNS[3]:] += 5.0
    assert torch.equal(loaded.model.task_part(h, s, x), loaded.model.task_part(h, s, y))
    save_checkpoint(loaded.model, tmp_path / "again")
    assert read_manifest(tmp_path / "again")["feature_schema"]["version"] == 3
    manifest["feature_schema"]["ready"] = feature_schema()["ready"]
    (tmp_path / "v3" / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="ready features"):
        load_checkpoint(tmp_path / "v3")


def test_an_older_schema_is_upgraded_for_training(tmp_path: Path) -> None:
    """``drl-trainer train --init`` of an older checkpoint trains this code's schema: the model
    gains the new ready columns with zero weights, so its outputs are unchanged at first and
    move once training moves those weights; it is saved as the current schema."""
    from policy.features import F_READY, FEATURE_SCHEMA_VERSION
    from policy.model import upgraded

    torch.manual_seed(4)
    old = PlacementGNN(ModelConfig(hidden=8, layers=1), schema_version=4)
    new = upgraded(old)
    assert new.schema_version == FEATURE_SCHEMA_VERSION and new.ready_in.in_features == F_READY
    assert upgraded(new) is new
    h, s = torch.randn(5, 8), torch.randn(5, 8)
    x = torch.rand(5, F_READY)
    # equal up to float rounding: a matmul over one more (zero) column may sum in another order
    assert torch.allclose(new.task_part(h, s, x), old.task_part(h, s, x), rtol=0, atol=1e-6)
    with torch.no_grad():
        new.ready_in.weight[:, -1] += 1.0
    assert not torch.allclose(new.task_part(h, s, x), old.task_part(h, s, x), rtol=0, atol=1e-3)  # read
    save_checkpoint(new, tmp_path / "up")
    assert read_manifest(tmp_path / "up")["feature_schema"]["version"] == FEATURE_SCHEMA_VERSION


def test_mismatched_model_config_is_refused(ckpt: Path) -> None:
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["model"]["hidden"] = 32
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="parameters do not match"):
        load_checkpoint(ckpt)


def test_weights_from_another_checkpoint_are_refused(ckpt: Path, tmp_path: Path) -> None:
    save_checkpoint(PlacementGNN(ModelConfig(hidden=16, layers=2)), tmp_path / "other")
    (ckpt / WEIGHTS_FILE).write_bytes((tmp_path / "other" / WEIGHTS_FILE).read_bytes())
    with pytest.raises(CheckpointError, match="different checkpoints"):
        load_checkpoint(ckpt)


def test_pickle_is_never_loaded(ckpt: Path) -> None:
    """A torch.save (pickle) file in place of the weights is refused, not unpickled."""
    torch.save(PlacementGNN(ModelConfig(hidden=16, layers=2)).state_dict(), ckpt / WEIGHTS_FILE)
    with pytest.raises(CheckpointError):
        load_checkpoint(ckpt)


def test_missing_and_garbage_manifests(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="not a readable JSON"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="format"):
        read_manifest(tmp_path)


# --- the committed default checkpoint (must-show, issue 4) --------------------------------------


def test_default_checkpoint_loads_and_matches_its_manifest() -> None:
    manifest = read_manifest(DEFAULT)
    assert manifest["feature_schema"] == feature_schema(manifest["feature_schema"]["version"])
    assert (DEFAULT / WEIGHTS_FILE).stat().st_size < 5 * 1024 * 1024
    loaded = load_checkpoint(DEFAULT)
    models = [loaded.model] + [m for _, m in loaded.members]
    prefixes = [f"m{i}." for i in range(len(models))] if loaded.members else [""]  # an ensemble's members
    assert {p + k: list(v.shape) for p, m in zip(prefixes, models, strict=True)
            for k, v in m.state_dict().items()} == manifest["parameters"]
    assert loaded.version == manifest["version"]
    # every model in it was trained by a recorded command, and it was scored where it was trained
    for member in manifest.get("members") or [manifest]:
        assert member["training"]["command"].startswith("drl-trainer train")
    assert "heldout" in manifest["evaluation"] and "train" in manifest["evaluation"]


def test_default_checkpoint_refuses_tampering(tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "default"
    shutil.copytree(DEFAULT, copy)
    blob = bytearray((copy / WEIGHTS_FILE).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (copy / WEIGHTS_FILE).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(copy)
    shutil.copy(DEFAULT / WEIGHTS_FILE, copy / WEIGHTS_FILE)
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["feature_schema"]["task"] = manifest["feature_schema"]["task"][::-1]
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="task features"):
        load_checkpoint(copy)


def _ensemble(tmp_path: Path) -> tuple[Path, list[PlacementGNN]]:
    from policy.checkpoint import save_ensemble

    models = []
    for i, (hidden, schema) in enumerate([(16, max(READY_COLUMNS)), (8, 4)]):
        torch.manual_seed(i)
        models.append(PlacementGNN(ModelConfig(hidden=hidden, layers=2), schema))
        save_checkpoint(models[-1], tmp_path / f"m{i}", training={"seed": i, "reserve_busy": i == 0,
                                                                   "untrained_inputs": []})
    save_ensemble([load_checkpoint(tmp_path / f"m{i}") for i in range(2)], tmp_path / "ens", name="vote")
    return tmp_path / "ens", models


def test_an_ensemble_round_trips_as_one_checkpoint(tmp_path: Path) -> None:
    """``save_ensemble``: one weights file and hash; each member back with its own config and
    feature schema; the placer takes its members, the ensemble's version and the first member's
    decoder settings; tampering and malformed member lists are refused; one model is no ensemble."""
    from policy.checkpoint import save_ensemble
    from policy.gnn import GNNPlacer

    path, models = _ensemble(tmp_path)
    loaded = load_checkpoint(path)
    assert loaded.version.startswith("vote-") and loaded.manifest["training"]["seed"] == 0
    got = [loaded.model] + [m for _, m in loaded.members]
    assert [m.config.hidden for m in got] == [16, 8] and [m.schema_version for m in got] == [max(READY_COLUMNS), 4]
    for want, have in zip(models, got, strict=True):
        for k, v in want.state_dict().items():
            assert torch.equal(have.state_dict()[k], v)
    assert [v for v, _ in loaded.members] == [load_checkpoint(tmp_path / "m1").version]
    placer = GNNPlacer.from_checkpoint(path)
    assert placer.version == loaded.version and len(placer.models) == 2 and placer.reserve_busy
    with pytest.raises(CheckpointError, match="two or more"):
        save_ensemble([loaded], tmp_path / "one")
    with pytest.raises(CheckpointError, match="single models"):
        save_ensemble([loaded, load_checkpoint(tmp_path / "m0")], tmp_path / "nested")
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    for members, match in [(manifest["members"][:1], "two or more"),
                           ([manifest["members"][0], {**manifest["members"][1], "feature_schema": 99}], "member 1"),
                           ([manifest["members"][0], {**manifest["members"][1], "model": {"hidden": 32, "layers": 2}}],
                            "parameters do not match")]:
        (path / MANIFEST_FILE).write_text(json.dumps({**manifest, "members": members}))
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(path)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    blob = bytearray((path / WEIGHTS_FILE).read_bytes())
    blob[-1] ^= 0x01
    (path / WEIGHTS_FILE).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="sha256 .* does not match"):
        load_checkpoint(path)


def test_a_row_bias_round_trips_and_older_configs_stay_as_written(tmp_path: Path) -> None:
    """A model with a row bias saves ``row_bias: true`` and its weight, and loads with both; a
    model without one writes the config the checkpoints before it wrote (no ``row_bias`` key);
    a config whose ``row_bias`` is not a boolean, or with a key this code does not know, is refused."""
    torch.manual_seed(4)
    model = PlacementGNN(ModelConfig(hidden=8, layers=1, row_bias=True), schema_version=4)
    with torch.no_grad():
        model.row_k.fill_(-2.5)
    save_checkpoint(model, tmp_path / "rb")
    manifest = read_manifest(tmp_path / "rb")
    assert manifest["model"] == {"hidden": 8, "layers": 1, "row_bias": True}
    assert manifest["parameters"]["row_k"] == [1]
    loaded = load_checkpoint(tmp_path / "rb").model
    x = torch.rand(5, READY_COLUMNS[4])
    assert torch.equal(loaded.row_bias(x), model.row_bias(x)) and float(loaded.row_bias(x).detach().abs().sum()) > 0
    save_checkpoint(PlacementGNN(ModelConfig(hidden=8, layers=1)), tmp_path / "plain")
    assert read_manifest(tmp_path / "plain")["model"] == {"hidden": 8, "layers": 1}
    for bad in ({"hidden": 8, "layers": 1, "row_bias": "yes"}, {"hidden": 8, "layers": 1, "depth": 2}):
        with pytest.raises(CheckpointError, match="model config"):
            ModelConfig.from_json(bad)


# A child process loads the checkpoint under a memory cap (the address space it had after
# importing torch plus 2 GiB) and a wall-clock guard: the code before the fix hung on a FIFO, read
# /dev/zero until memory ran out, and built the manifest's model before checking its shapes.
_LOAD_CAPPED = """
import resource, sys
from policy.checkpoint import load_checkpoint
from policy.errors import CheckpointError
with open("/proc/self/status") as fh:
    vm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), vm + (2 << 30)))
try:
    load_checkpoint(sys.argv[1])
except CheckpointError as exc:
    print("REFUSED", exc)
"""


def _load_in_child(path: Path) -> str:
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", _LOAD_CAPPED, str(path)], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {path} did not return (blocked reading it)")
    return out.stdout + out.stderr


@pytest.mark.parametrize("name", [WEIGHTS_FILE, MANIFEST_FILE])
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(ckpt: Path, name: str) -> None:
    import os

    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    out = _load_in_child(ckpt)
    assert "REFUSED" in out and "not a regular file" in out, out


def test_weights_linked_to_dev_zero_are_refused_not_read_forever(ckpt: Path) -> None:
    (ckpt / WEIGHTS_FILE).unlink()
    (ckpt / WEIGHTS_FILE).symlink_to("/dev/zero")
    out = _load_in_child(ckpt)
    assert "REFUSED" in out and "not a regular file" in out, out


def test_a_huge_model_config_is_refused_before_it_is_allocated(ckpt: Path) -> None:
    # hidden=100000 asks ~40 GB per hidden x hidden layer; the weights (and their hash) are intact
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    manifest["model"]["hidden"] = 100_000
    (ckpt / MANIFEST_FILE).write_text(json.dumps(manifest))
    out = _load_in_child(ckpt)
    assert "REFUSED" in out and "parameters do not match" in out, out
