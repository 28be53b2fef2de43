"""``drl-trainer ensemble``: several checkpoints written as one, scored as training scores one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from policy.catalogue import load_catalogue
from policy.checkpoint import load_checkpoint, save_checkpoint
from policy.inputs import cut_inputs
from policy.model import ModelConfig, PlacementGNN, upgraded
from trainer.cli import main
from trainer.train import Args, evaluate, settings_from

TRAINING = {"workflows": "etl", "heldout": "mlpipeline", "eval_runs": 3, "eval_streams": 1,
            "teachers": {"etl": "fifo+eft"}, "reserve_busy": 1, "threads": 1,
            # recorded on another checkout: the packaged catalogue of that name is read
            "pools": "/elsewhere/policy/catalogues/gpu-affinity.yaml"}


def _members(tmp_path: Path, training: dict[str, object] | None = None, n: int = 2) -> list[str]:
    paths = []
    for seed in range(n):
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
        main(["ensemble", *members, "--out", str(tmp_path / "bad"), "--row-bias", "-300"])
    assert not (tmp_path / "bad").exists()


def test_a_row_bias_prior_keeps_the_members_record_of_inputs_they_never_learned(tmp_path: Path) -> None:
    """was: ``PlacementGNN.with_row_bias`` built a new model without ``untrained_inputs``, so the
    ensemble written with ``--row-bias`` (the default since 2026-12-07) recorded none for its members: the
    same decisions (the weights were saved as zeros), but a reload, and the nightly fine-tune
    that starts from it, no longer knew those columns were never learned."""
    never = ["task.gpus", "ready.retry"]
    members = _members(tmp_path, {**TRAINING, "untrained_inputs": never})
    assert all(list(load_checkpoint(p).model.untrained_inputs) == never for p in members)
    assert main(["ensemble", *members, "--out", str(tmp_path / "ens"), "--row-bias", "-12"]) == 0
    ens = load_checkpoint(tmp_path / "ens")
    assert [m["training"]["untrained_inputs"] for m in ens.manifest["members"]] == [never, never]
    for model in (ens.model, *(m for _, m in ens.members)):
        assert list(model.untrained_inputs) == never
    # and an older schema's model given the current one keeps them too (``drl-trainer train --init``)
    old = PlacementGNN(ModelConfig(hidden=8, layers=2), schema_version=4)
    cut_inputs(old, never)
    new = upgraded(old)
    assert new is not old and new.schema_version > 4 and list(new.untrained_inputs) == never


def test_row_bias_does_not_let_an_ensemble_through_as_one_member(tmp_path: Path) -> None:
    """An ensemble named as a member is refused ("an ensemble's members must be single models"),
    but not with ``--row-bias``: ``with_row_bias`` (trainer/ensemble.py:353) rebuilds the
    Checkpoint without its ``members``, so ``save_ensemble``'s check sees a single model and the
    written ensemble silently keeps only the nested ensemble's *first* model (its other members
    are dropped while the version still says ``ensemble-...+row1``)."""
    m0, m1, m2 = _members(tmp_path, n=3)
    assert main(["ensemble", m0, m1, "--out", str(tmp_path / "E")]) == 0
    assert main(["ensemble", str(tmp_path / "E"), m2, "--out", str(tmp_path / "plain")]) == 2
    assert main(["ensemble", str(tmp_path / "E"), m2, "--out", str(tmp_path / "biased"),
                 "--row-bias", "1"]) == 2
    assert not (tmp_path / "biased").exists()


def test_the_members_are_checked_before_the_evaluation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--evaluate`` runs the whole evaluation (minutes: every training and held-out setting,
    teachers and baselines) before ``save_ensemble`` checks that there are two or more single
    models (trainer/ensemble.py:360 before :362): ``drl-trainer ensemble ONE --evaluate`` or one
    with an ensemble as a member scores it all, then ends with "an ensemble needs two or more
    checkpoints". The check belongs before any work."""
    import trainer.ensemble

    def evaluated(members):  # noqa: ANN001, ANN202
        raise AssertionError("evaluated an ensemble that is then refused")

    monkeypatch.setattr(trainer.ensemble, "evaluation_of", evaluated)
    m0, m1, m2 = _members(tmp_path, n=3)
    assert main(["ensemble", m0, "--out", str(tmp_path / "one"), "--evaluate"]) == 2
    assert "two or more" in capsys.readouterr().err
    assert main(["ensemble", m0, m1, "--out", str(tmp_path / "E")]) == 0
    assert main(["ensemble", str(tmp_path / "E"), m2, "--out", str(tmp_path / "nested"), "--evaluate"]) == 2


def test_out_may_not_be_one_of_the_members(tmp_path: Path) -> None:
    """``drl-trainer ensemble A B --out A`` writes the ensemble over checkpoint A (its manifest and
    weights replaced), destroying a member it was built from, and the ensemble's manifest then
    lists as its member a folder that now holds the ensemble. It should be refused with the
    path named, and A left as it was."""
    m0, m1 = _members(tmp_path, n=2)
    before = (Path(m0) / "manifest.json").read_bytes()
    try:
        code = main(["ensemble", m0, m1, "--out", m0])
    except SystemExit as exc:
        code = 2 if exc.code else 0
    assert code == 2
    assert (Path(m0) / "manifest.json").read_bytes() == before
    assert not load_checkpoint(m0).members


def test_evaluate_with_training_workflows_missing_here_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--evaluate`` re-reads the first member's recorded ``workflows``/``heldout``. It maps a
    ``pools`` path "recorded on another checkout" to the packaged catalogue, but a recorded
    workflow path that does not resolve here (the ledger's checkpoints record
    ``../shared/workflows/...``, relative to the checkout they were trained in, so any other
    working directory) escapes as a ValueError traceback from trainer/workloads.py
    (trainer/ensemble.py:331) instead of a one-line error naming the member and the path."""
    training = {"workflows": "etl;/elsewhere/shared/workflows/wfinstances/blast-chameleon-small-001.json",
                "eval_runs": 2, "eval_streams": 1, "threads": 1}
    m0, m1 = _members(tmp_path, training)
    try:
        code = main(["ensemble", m0, m1, "--out", str(tmp_path / "ens"), "--evaluate"])
        message = capsys.readouterr().err
    except SystemExit as exc:
        code, message = 2, str(exc.code)
    assert code == 2
    assert "blast-chameleon-small-001.json" in message and message.strip().count("\n") == 0, message
    assert not (tmp_path / "ens").exists()


def test_out_that_is_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--out`` naming an existing file (a typo, ``--out runs/e3.json``) ends in a
    ``FileExistsError`` traceback from ``Path.mkdir`` in policy/checkpoint.py ``_write``, reached
    from trainer/ensemble.py:362 with nothing checked first, instead of a one-line error."""
    m0, m1 = _members(tmp_path, n=2)
    out = tmp_path / "e3.json"
    out.write_text("{}")
    try:
        code = main(["ensemble", m0, m1, "--out", str(out)])
        message = capsys.readouterr().err
    except SystemExit as exc:
        code, message = 2, str(exc.code)
    assert code == 2 and str(out) in message, message
