"""Inputs a model never learned from, and cutting them off.

An input column that was 0 in every sample a model trained on gets no gradient, so its
first-layer weights stay at their random initialisation. Production may still send a value
there, and the model then adds an untrained random shift to that task's embedding. The lab's
training runs simulate no failed tries, no GPU requests and no pinned tasks (``trainer/train.py``
builds its ``SimConfig`` from the noise and the hold bound alone), so every checkpoint so far has
five such columns: ``task.gpus``, ``task.pinned``, ``ready.retry``, ``pool.failure_rate`` and
``pair.pinned_here``. Their weights are bit-identical to a fresh model's of the training seed.
A retried task reaches the default checkpoint with ``retry`` = 1 (a task a user cleared and
re-ran did too until the executor sent the try since the last clear,
``airflow_drl_executor.graph_builder.attempt``): one such task among fresh ones had its own
decision changed in 10-20% of requests (found by review, measured on simulator requests).

Cutting a column (zeroing its weights) makes the model read it as it did in training, whatever it
receives. On every input like its training data the outputs are unchanged, bit for bit. The
hard constraints (a GPU task only on a GPU pool, a pin) are applied outside the model
(``policy.features.pair_static``'s mask), so cutting ``gpus`` or ``pinned`` loses no constraint.

Which columns a checkpoint never learned from comes from its manifest's training record,
``untrained_inputs`` (``drl-trainer train`` and the nightly fine-tune write it). For a manifest
written before that record existed, trained from scratch, the weights tell: a column equal, bit
for bit, to a fresh model's of the record's ``seed`` was never trained.

Shapes: a group's first layer has weight ``[H, F]`` with one column per feature of
``policy.features``' ``TASK_FEATURES`` (``task_in``), ``READY_FEATURES`` (``ready_in``; an
older schema reads its leading columns), ``POOL_FEATURES`` (``pool_in[0]``) and
``PAIR_FEATURES`` (``head_pair``); a name is ``"<group>.<feature>"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from policy.errors import CheckpointError
from policy.features import PAIR_FEATURES, POOL_FEATURES, READY_FEATURES, TASK_FEATURES
from policy.model import PlacementGNN


def input_layers(model: PlacementGNN) -> dict[str, tuple[nn.Linear, Sequence[str]]]:
    """Each input group's first layer and the names of the columns it reads."""
    pool_in = model.pool_in[0]
    assert isinstance(pool_in, nn.Linear)
    return {
        "task": (model.task_in, TASK_FEATURES),
        "ready": (model.ready_in, READY_FEATURES[: model.ready_in.in_features]),
        "pool": (pool_in, POOL_FEATURES),
        "pair": (model.head_pair, PAIR_FEATURES),
    }


def _columns(model: PlacementGNN) -> dict[str, tuple[nn.Linear, int]]:
    return {f"{group}.{name}": (layer, j) for group, (layer, names) in input_layers(model).items()
            for j, name in enumerate(names)}


def unchanged_inputs(model: PlacementGNN, reference: PlacementGNN) -> list[str]:
    """The input columns whose weights in ``model`` are bit-identical to ``reference``'s."""
    ref = _columns(reference)
    with torch.no_grad():
        return [name for name, (layer, j) in _columns(model).items()
                if name in ref and torch.equal(layer.weight[:, j].cpu(), ref[name][0].weight[:, ref[name][1]].cpu())]


def cut_inputs(model: PlacementGNN, names: Iterable[str]) -> None:
    """Zero the weights of these input columns (in place): the model reads them as 0."""
    columns = _columns(model)
    names = list(names)
    unknown = [n for n in names if n not in columns]
    if unknown:
        raise CheckpointError(f"untrained_inputs names columns this model does not read: {unknown}")
    with torch.no_grad():
        for name in names:
            layer, j = columns[name]
            layer.weight[:, j] = 0.0
    model.untrained_inputs = tuple(names)


def untrained_since(model: PlacementGNN, initial: PlacementGNN, parent: PlacementGNN | None = None) -> list[str]:
    """What a training run records: the columns it never moved from ``initial`` and that
    ``parent`` (the model it started from, if any) had not learned either."""
    never = unchanged_inputs(model, initial)
    return never if parent is None else [n for n in never if n in parent.untrained_inputs]


def untrained_at_init(model: PlacementGNN, seed: int) -> list[str]:
    """The columns still at the initialisation a fresh model gets after ``torch.manual_seed(seed)``
    (how ``drl-trainer train`` starts a model without ``--init``); the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = PlacementGNN(model.config, model.schema_version)
    return unchanged_inputs(model, fresh)


def untrained_inputs_of(model: PlacementGNN, training: Mapping[str, Any] | None) -> list[str]:
    """The input columns ``model`` never learned from, by its training record (see the module
    docstring): the record's ``untrained_inputs``, else, for a model trained from scratch with
    a known seed, the columns still at that seed's initialisation; else none."""
    training = training or {}
    listed = training.get("untrained_inputs")
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise CheckpointError(f"training.untrained_inputs must be a list of column names, got {listed!r}")
        return listed
    seed = training.get("seed")
    if isinstance(seed, int) and not training.get("init") and "finetune" not in training:
        return untrained_at_init(model, seed)
    return []
