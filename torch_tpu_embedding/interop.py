"""Weights in and out of other layouts: TorchRec state_dicts, ``nn.EmbeddingBag``, FTRL ``linears`` modes.

Example::

    >>> sd = tte.interop.to_torchrec_state_dict(ec)          # {"embedding_bags.user.weight": [V, D], ...}
    >>> tte.interop.load_torchrec_state_dict(ec2, sd)
    >>> bag = tte.interop.to_embedding_bag(ec, "user")         # nn.EmbeddingBag(mode=the table's combiner)
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from torch_tpu_embedding._util.validation import arg_error
from torch_tpu_embedding.modules.collection import EmbeddingCollection, EmbeddingTable

__all__ = [
    "convert_ftrl_linears",
    "load_embedding_bag",
    "load_torchrec_state_dict",
    "to_embedding_bag",
    "to_torchrec_state_dict",
]


def _table(collection: EmbeddingCollection, name: str) -> EmbeddingTable:
    if name not in collection.tables:
        raise arg_error("table", f"must be one of {sorted(collection.tables.keys())}", name)
    return cast(EmbeddingTable, collection.tables[name])


def to_torchrec_state_dict(collection: EmbeddingCollection, prefix: str = "embedding_bags") -> dict[str, torch.Tensor]:
    """Tables keyed as TorchRec's ``EmbeddingBagCollection`` (``embedding_bags.<table>.weight``).

    Use ``prefix="embeddings"`` for TorchRec's (sequence) ``EmbeddingCollection``. Logical rows only.
    """
    out = {}
    for name, module in collection.tables.items():
        t = cast(EmbeddingTable, module)
        out[f"{prefix}.{name}.weight"] = t.logical_weight()
    return out


def load_torchrec_state_dict(
    collection: EmbeddingCollection, state_dict: Mapping[str, torch.Tensor], prefix: str = "embedding_bags"
) -> None:
    """Load TorchRec-layout weights; raises one ``ValueError`` listing missing, unexpected and misshapen tables."""
    want = {name: cast(EmbeddingTable, t) for name, t in collection.tables.items()}
    given = {}
    unexpected = []
    for key, value in state_dict.items():
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == prefix and parts[2] == "weight":
            given[parts[1]] = value
        else:
            unexpected.append(key)
    problems = []
    missing = sorted(set(want) - set(given))
    extra = sorted(set(given) - set(want))
    if missing:
        problems.append(f"missing tables {missing}")
    if extra or unexpected:
        problems.append(f"unexpected keys {sorted(unexpected + [f'{prefix}.{n}.weight' for n in extra])}")
    for name in sorted(set(want) & set(given)):
        shape = (want[name].config.num_embeddings, want[name].config.embedding_dim)
        if tuple(given[name].shape) != shape:
            problems.append(f"table '{name}' has shape {tuple(given[name].shape)} in the state_dict, expected {shape}")
    if problems:
        raise ValueError("TorchRec state_dict does not match the collection: " + "; ".join(problems))
    collection.load_state_dict({f"tables.{n}.weight": given[n] for n in want})


_BAG_MODES = {"sum": "sum", "mean": "mean"}


def to_embedding_bag(collection: EmbeddingCollection, table: str) -> nn.EmbeddingBag:
    """An ``nn.EmbeddingBag`` (CPU) holding the table's weights, with the table's combiner as its mode.

    ``sqrtn`` has no ``nn.EmbeddingBag`` mode: use ``mode="sum"`` with ``per_sample_weights`` of
    ``1/sqrt(bag length)`` yourself, or :func:`to_torchrec_state_dict`.
    """
    t = _table(collection, table)
    if t.config.combiner not in _BAG_MODES:
        raise ValueError(
            f"Table `{table}`: combiner '{t.config.combiner}' has no nn.EmbeddingBag mode (only 'sum' and 'mean')."
        )
    w = t.logical_weight().to("cpu", copy=True)
    return nn.EmbeddingBag.from_pretrained(w, freeze=False, mode=_BAG_MODES[t.config.combiner])


def load_embedding_bag(collection: EmbeddingCollection, table: str, module: nn.EmbeddingBag | nn.Embedding) -> None:
    """Copy an ``nn.EmbeddingBag`` / ``nn.Embedding`` weight ``[V, D]`` into ``table``."""
    t = _table(collection, table)
    shape = (t.config.num_embeddings, t.config.embedding_dim)
    if tuple(module.weight.shape) != shape:
        raise ValueError(f"Table `{table}` has shape {shape}; the module's weight is {tuple(module.weight.shape)}.")
    collection.load_state_dict({f"tables.{table}.weight": module.weight.detach()}, strict=False)


def convert_ftrl_linears(state_dict: Mapping[str, Any], multiply_linear_by_learning_rate: bool) -> dict[str, Any]:
    """An FTRL optimizer ``state_dict`` with ``linears`` converted to the other mode.

    TF's two FTRL forms keep ``z`` (``linears``) in different units: with
    ``multiply_linear_by_learning_rate`` the slot holds ``lr · z``. Conversion multiplies or divides by
    each group's learning rate, which must be a number (not a callable or schedule). Returns a new
    state_dict for ``FTRL(..., multiply_linear_by_learning_rate=<the new mode>)``.
    """
    out = copy.deepcopy(dict(state_dict))
    for group in out["param_groups"]:
        mode = group.get("multiply_linear_by_learning_rate")
        if group.get("algorithm") != "ftrl" or mode == multiply_linear_by_learning_rate:
            continue
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            lr = float(lr)
        if not isinstance(lr, (int, float)) or lr <= 0:
            raise arg_error("lr", "of the FTRL group must be a number > 0 to convert linears", lr)
        factor = lr if multiply_linear_by_learning_rate else 1.0 / lr
        for key in group["params"]:
            slots = out["state"].get(key)
            if slots is not None and "linears" in slots:
                slots["linears"] = slots["linears"] * factor
        group["multiply_linear_by_learning_rate"] = multiply_linear_by_learning_rate
    return out
