"""``drl-trainer explain`` (trainer/explain.py and the attribution it prints) and the featurizer's
``assigned`` (policy/features.py) against the decoder: each test failed on the code before its fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gnn_helpers import diamond_request

from policy.errors import SchemaError
from policy.features import PAIR_FEATURES, featurize
from policy.gnn import GNNPlacer, attribute
from policy.registry import DEFAULT_CHECKPOINT
from trainer.explain import draw, report

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def placer() -> GNNPlacer:
    """The shipped default checkpoint (trained with ``reserve_busy``)."""
    return GNNPlacer.from_checkpoint(DEFAULT_CHECKPOINT)


def test_explain_pair_attribution_is_chosen_minus_runner_up(placer: GNNPlacer) -> None:
    """``drl-trainer explain`` prints "pair features (chosen minus runner-up, gradient x input)",
    and ``Attribution.pair`` is documented as each feature's contribution to
    ``logit[chosen] - logit[runner_up]``. What a user sees for task b of the diamond (sent to
    cpu-large over gpu): ``finish_ratio -1.648``, as if the finish-time ratio had counted against
    cpu-large, when it is the runner-up's worse finish (its own logit lowered by 1.648) that
    favoured cpu-large: the runner-up's share is added instead of subtracted, since the gradient
    of the margin w.r.t. the runner-up's features already carries the minus sign. Expected: the
    same per-feature difference the decoder computed for the server's reason string
    (``pair_contrib[chosen] - pair_contrib[runner_up]``, each pool's own logit gradient x input)."""
    req, graphs = diamond_request()
    dec = placer.decode(req, graphs)
    row = 0  # task b: it fits every pool
    att = attribute(placer.models, dec, row)
    assert att.runner_up is not None and att.runner_up != att.chosen
    expected = dec.pair_contrib[row, att.chosen] - dec.pair_contrib[row, att.runner_up]
    got = np.array([att.pair[name] for name in PAIR_FEATURES])
    np.testing.assert_allclose(got, expected, atol=1e-3)


def test_explain_margin_of_a_task_only_one_pool_can_run_is_not_against_an_unusable_pool(placer: GNNPlacer) -> None:
    """Task c of the diamond needs a GPU: only the gpu pool may run it, and its reason says so
    ("only usable pool for ..."). ``drl-trainer explain`` nevertheless prints "margin over the
    runner-up: +1000000064.000 (logit units)": with no other pool offered at the step, the
    runner-up falls back to a pool the task does not fit, whose logit is the mask's -1e9.
    Expected (docs/policy.md: the runner-up is "the best other pool the decoding step offered"):
    no runner-up, or one the step offered, and a margin in logit units, not ~1e9."""
    req, graphs = diamond_request()
    dec = placer.decode(req, graphs)
    row = 1  # task c, gpus=1
    assert dec.batch.mask[row].tolist() == [False, False, True]
    att = attribute(placer.models, dec, row)
    assert att.runner_up is None or dec.probs[row, att.runner_up] > 0, (att.runner_up, dec.probs[row])
    text = report(req, dec, row, att, 3)
    assert abs(att.margin) < 1e6, text


def test_explain_png_is_written_at_the_path_asked(placer: GNNPlacer, tmp_path: Path) -> None:
    """``drl-trainer explain --png heatmap`` prints "wrote heatmap", but no file ``heatmap``
    exists: matplotlib's ``savefig`` infers the format from the extension and, finding none,
    appends ``.png`` (the heat map lands in ``heatmap.png``). Expected: the PNG written at exactly
    the path given (``--png``: "write the DAG heat map here")."""
    req, graphs = diamond_request()
    dec = placer.decode(req, graphs)
    att = attribute(placer.models, dec, 0)
    path = tmp_path / "heatmap"
    draw(dec, 0, att, req, str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heatmap"]
    assert path.read_bytes()[:8] == PNG


def test_explain_does_not_say_a_stop_held_a_task_the_policy_reserved(placer: GNNPlacer) -> None:
    """Both GPU slots busy: the default checkpoint (``reserve_busy``) chooses gpu for task c first
    (late binding: it holds gpu's next slot, not sent), then sends b; no stop is chosen. The
    report says "task c of run dag/diamond: held (stop chosen before it)", a stop that never
    happened (reserved rows get action -1 too, and ``_outcome`` reads every -1 as a stop).
    Expected: the outcome line does not claim a stop (it says the task was reserved on gpu)."""
    req, graphs = diamond_request(busy_gpu=2)
    dec = placer.decode(req, graphs)
    row = 1  # task c
    assert [s.action for s in dec.steps] == [(1, 2), (0, 1)], "c reserved on gpu, then b sent; no stop"
    assert dec.placed_order == [0]
    att = attribute(placer.models, dec, row)
    outcome = report(req, dec, row, att, 3).splitlines()[1]
    assert outcome.startswith("task c of run dag/diamond: ")
    assert "stop" not in outcome, outcome


def test_featurize_a_held_row_in_assigned_adds_no_backlog() -> None:
    """``featurize(assigned=...)`` counts each decoded row's choice as backlog for the rows decoded
    after it; ``policy/bench_model.py`` passes ``Decoded.actions``, where -1 is a held row. A -1
    is used as an index: ``placed[-1] += 1`` puts a phantom task on the *last* pool. With one of
    the two GPU slots busy and c (decoded first) held, b then sees the gpu pool full
    (has_free_slot 0, a queueing wait) though nothing was sent there. Expected: a held row adds no
    backlog (b's features as without ``assigned``), or the -1 is refused with a SchemaError."""
    req, graphs = diamond_request(busy_gpu=1)
    names = [p.name for p in req.pools]
    assert names[-1] == "gpu"
    plain = featurize(req, graphs)
    assert plain.order.tolist() == [1, 0], "c is decoded before b"
    try:
        held = featurize(req, graphs, assigned=[names.index("cpu-small"), -1])
    except SchemaError:
        return
    gpu, free = names.index("gpu"), PAIR_FEATURES.index("has_free_slot")
    assert held.pair_x[0, gpu, free] == plain.pair_x[0, gpu, free] == 1.0
    np.testing.assert_array_equal(held.pair_x, plain.pair_x)
