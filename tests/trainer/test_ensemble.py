"""``drl-trainer ensemble``: several checkpoints written as one, scored as training scores one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policy.catalogue import load_catalogue
from policy.checkpoint import load_checkpoint, save_checkpoint
from policy.model import ModelConfig, PlacementGNN
from trainer.cli import main
from trainer.train import Args, evaluate, settings_from

TRAINING = {"workflows": "etl", "heldout": "mlpipeline", "eval_runs": 3, "eval_streams": 1,
            "teachers": {"etl": "fifo+eft"}, "reserve_busy": 1, "threads": 1,
            # recorded on another checkout: the packaged catalogue of that name is read
            "pools": "/elsewhere/policy/catalogues/gpu-affinity.yaml"}


def _members(tmp_path: Path, training: dict[str, object]) -> list[str]:
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        path = tmp_path / f"m{seed}"
        save_checkpoint(PlacementGNN(ModelConfig(hidden=8, layers=2)), path, training=training)
        paths.append(str(path))
    return paths


def test_an_evaluated_ensemble_records_its_scores_on_its_first_member_s_settings(tmp_path: Path) -> None:
    members = _members(tmp_path, TRAINING)
    assert main(["ensemble", *members, "--out", str(tmp_path / "ens"), "--evaluate"]) == 0
    ens = load_checkpoint(tmp_path / "ens")
    evaluation = ens.manifest["evaluation"]
    assert set(evaluation) == {"train", "heldout"}
    assert set(evaluation["train"]["etl"]) == {"drl", "fifo+eft", "random"}
    assert set(evaluation["heldout"]["mlpipeline"]) == {"drl", "srpt+eft", "random"}
    assert ens.manifest["ensemble_command"].startswith("drl-trainer ensemble ")
    assert ens.manifest["ensemble_command"].endswith(" --evaluate")
    # the recorded figure is the ensemble's (mean logits), not its first member's alone
    args = Args(workflows="etl", heldout="mlpipeline", eval_runs=3, eval_streams=1, reserve_busy=1)
    settings = settings_from("mlpipeline", args.seed + 1)
    with_members = evaluate(ens.model, settings, load_catalogue(args.pools), args, members=[ens.members[0][1]])
    alone = evaluate(ens.model, settings, load_catalogue(args.pools), args)
    assert evaluation["heldout"]["mlpipeline"]["drl"] == with_members["mlpipeline"]["drl"]
    assert evaluation["heldout"]["mlpipeline"]["drl"] != alone["mlpipeline"]["drl"]


def test_an_ensemble_of_members_without_training_settings_is_not_evaluated(tmp_path: Path) -> None:
    members = _members(tmp_path, {})
    with pytest.raises(SystemExit, match="names no training settings"):
        main(["ensemble", *members, "--out", str(tmp_path / "ens"), "--evaluate"])
    assert not (tmp_path / "ens").exists()
    assert main(["ensemble", *members, "--out", str(tmp_path / "ens")]) == 0  # not evaluated: written
    assert load_checkpoint(tmp_path / "ens").manifest["evaluation"] == {}



def test_a_row_bias_prior_is_given_to_every_member(tmp_path: Path) -> None:
    """``--row-bias K``: every member gains a row bias of weight K and keeps its other weights;
    the member versions and training records say so, and so does the command; a weight outside
    the bias's range is refused before anything is written."""
    members = _members(tmp_path, TRAINING)
    assert main(["ensemble", *members, "--out", str(tmp_path / "ens"), "--row-bias", "-12"]) == 0
    ens = load_checkpoint(tmp_path / "ens")
    plain = [load_checkpoint(p) for p in members]
    for model, before in zip([ens.model, *(m for _, m in ens.members)], plain, strict=True):
        assert model.config.row_bias and float(model.row_k.detach()[0]) == -12.0
        state = model.state_dict()
        assert all(torch.equal(v, state[k]) for k, v in before.model.state_dict().items())
    listed = ens.manifest["members"]
    assert [m["version"] for m in listed] == [f"{c.version}+row-12" for c in plain]
    assert all(m["training"]["row_bias_prior"] == -12.0 and m["model"]["row_bias"] for m in listed)
    assert " --row-bias -12" in ens.manifest["ensemble_command"]
    with pytest.raises(SystemExit, match="within"):
        main(["ensemble", *members, "--out", str(tmp_path / "bad"), "--row-bias", "-100"])
    assert not (tmp_path / "bad").exists()
