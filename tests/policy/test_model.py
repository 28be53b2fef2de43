"""Model shapes on tiny tensors, masking, and the numpy decode head (policy/model.py)."""

from __future__ import annotations

import numpy as np
import torch
from gnn_helpers import big_request, diamond_request

from policy.features import featurize
from policy.model import NEG_INF, ModelConfig, PlacementGNN, Step, collate, collate_steps


def _model(**kw: object) -> PlacementGNN:
    torch.manual_seed(0)
    return PlacementGNN(ModelConfig(**kw))  # type: ignore[arg-type]


def test_forward_shapes_and_mask() -> None:
    req, graphs = diamond_request()
    fb = featurize(req, graphs)
    model = _model(hidden=16, layers=2)
    bt = collate([fb, fb])
    assert bt.x.shape == (8, fb.runs[0].x.shape[1])
    assert bt.edge_index.shape == (2, 8)
    assert bt.ready_node.tolist() == [1, 2, 5, 6]
    assert bt.pool_x.shape == (2, 3, fb.pool_x.shape[1])
    logits, value = model(bt)
    assert logits.shape == (4, 3)
    assert value.shape == (2,)
    # c (rows 1 and 3) fits only the GPU pool: the others are masked
    gpu = [p.name for p in req.pools].index("gpu")
    for row in (1, 3):
        others = [j for j in range(3) if j != gpu]
        assert (logits[row, others] == NEG_INF).all()
        assert logits[row, gpu] > NEG_INF


def test_step_forward_segment_softmax() -> None:
    """Each step's choices (remaining row x feasible pool, plus stop) sum to probability one."""
    req, graphs = diamond_request()
    fb = featurize(req, graphs)
    gpu = [p.name for p in req.pools].index("gpu")
    steps = [
        Step(np.zeros(3), np.array([1, 0]), (1, gpu)),  # c to the GPU
        Step(np.eye(3)[gpu], np.array([0]), None),  # then hold b
    ]
    st = collate_steps([(fb, steps), (fb, steps[:1])])
    # step 0: c has 1 feasible pool, b has 3 -> 4 entries; step 1: b's 3
    assert st.entry_step.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert st.target.tolist()[1] == -1
    model = _model(hidden=8, layers=1)
    logp, entropy, value, _ = model.step_forward(st)
    assert logp.shape == (3,) and entropy.shape == (3,) and value.shape == (2,)
    assert (logp <= 0).all() and (entropy >= 0).all()
    # a step with one choice forced away (stop not allowed) still normalises
    st.stop_ok[:] = False
    st.target[1] = 4
    logp2 = model.step_forward(st).logp
    assert torch.isfinite(logp2).all()


def test_pool_marginal_sums_the_steps_choices_on_that_pool() -> None:
    """``logp_pool`` of a step is the log of the summed probabilities of its entries on the
    chosen pool (here c and b on the GPU), whichever row the step chose; stop is its own."""
    req, graphs = diamond_request()
    fb = featurize(req, graphs)
    gpu = [p.name for p in req.pools].index("gpu")
    steps = [Step(np.zeros(3), np.array([1, 0]), (1, gpu)), Step(np.eye(3)[gpu], np.array([0]), None)]
    st = collate_steps([(fb, steps)])
    model = _model(hidden=8, layers=1)
    scores = model.step_forward(st)
    on_gpu = [int(e) for e in torch.nonzero((st.entry_step == 0) & (st.entry_pool == gpu)).flatten()]
    assert len(on_gpu) == 2
    each = []
    for e in on_gpu:
        st.target[0] = e
        each.append(model.step_forward(st).logp[0])
        assert torch.allclose(model.step_forward(st).logp_pool, scores.logp_pool)
    assert torch.allclose(scores.logp_pool[0], torch.logsumexp(torch.stack(each), 0))
    assert scores.logp_pool[0] > scores.logp[0]
    assert torch.allclose(scores.logp_pool[1], scores.logp[1])  # stop


def test_gradients_reach_every_parameter() -> None:
    req, graphs = big_request(30, 6)
    model = _model()
    logits, value = model(collate([featurize(req, graphs)]))
    (torch.log_softmax(logits, -1)[:, 0].sum() + value.sum()).backward()
    for name, p in model.named_parameters():
        if name.startswith("stop"):
            continue  # only step_forward uses the stop head
        assert p.grad is not None, name


def test_numpy_head_matches_torch() -> None:
    req, graphs = big_request(50, 8)
    fb = featurize(req, graphs)
    model = _model()
    bt = collate([fb])
    with torch.no_grad():
        logits, _ = model(bt)
        h, s = model.encode_graph(bt.x, bt.edge_index, bt.node_run, bt.num_runs)
        q, g = model.encode_pools(bt.pool_x)
        a = model.task_part(h[bt.ready_node], s[bt.ready_run], bt.ready_x).numpy()
        b = model.pool_part(q, g)[0].numpy()
    c_t, w, b0 = model.head_arrays()
    z = np.maximum(a[:, None, :] + b[None] + fb.pair_x @ c_t, 0.0)
    np.testing.assert_allclose(z @ w + b0, logits.numpy(), rtol=1e-4, atol=1e-4)


def test_bigger_graph_same_parameters() -> None:
    """The model is size-agnostic: one set of weights for 4 or 2,000 tasks."""
    model = _model()
    req, graphs = big_request(2000, 16, seed=3)
    logits, _ = model(collate([featurize(req, graphs)]))
    assert logits.shape == (16, 3) and torch.isfinite(logits).all()
