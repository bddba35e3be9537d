"""Weights in and out of other layouts: TorchRec state_dicts, ``nn.EmbeddingBag``, FTRL ``linears`` modes.

Example::

    >>> sd = tte.interop.to_torchrec_state_dict(ec)          # {"embedding_bags.user.weight": [V, D], ...}
    >>> tte.interop.load_torchrec_state_dict(ec2, sd)
    >>> bag = tte.interop.to_embedding_bag(ec, "user")         # nn.EmbeddingBag(mode=the table's combiner)

Tables sharded over a process group (``tte.distributed.shard``) are read and written as their whole logical
rows: :func:`to_torchrec_state_dict`, :func:`load_torchrec_state_dict`, :func:`to_embedding_bag` and
:func:`load_embedding_bag` are then collectives, which every rank calls in the same order.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import nn

from torch_tpu_embedding._rows.placement import (
    TablePlacement,
    all_true,
    is_dtensor,
    process_group_placement,
    stored_rows,
)
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


def _on_meta(name: str, table: nn.Module) -> str | None:
    """Why table ``name`` of the collection cannot be read or written: it is on the meta device, else ``None``."""
    if not table.weight.is_meta:
        return None
    return (f"table '{name}' is on the meta device in the collection (it holds no values yet: call "
            "model.to_empty(device=...) or tte.distributed.shard(model, device=...) first)")


def _spread(table: nn.Module) -> TablePlacement | None:
    """The layout of a table sharded over a process group, else ``None`` (stacked tables never are)."""
    return process_group_placement(table.weight) if isinstance(table, EmbeddingTable) else None


def _logical(table: EmbeddingTable) -> torch.Tensor:
    """The table's whole ``[num_embeddings, D]`` logical rows; for one sharded over a process group, gathered
    onto every rank (a collective)."""
    spread = _spread(table)
    return table.logical_weight() if spread is None else spread.gather_whole(table.weight.detach())


def _stored(table: EmbeddingTable, value: torch.Tensor, spread: TablePlacement) -> torch.Tensor:
    """The whole logical rows ``value`` (the same on every rank) as the rows this rank stores of a table
    sharded over a process group (a collective)."""
    return spread.stored_from_whole(value, table.name, table.weight)


def _agree(problems: list[str], spread: Any, what: str) -> None:
    """Over a process group (``spread``: the sharded tables' layouts), every rank raises or none does: the rows
    are then moved by collectives. Adds a problem on a rank whose own ``what`` is fine but another's is not."""
    layouts = list(spread)
    if layouts and not bool(all_true(torch.tensor(not problems), layouts[0].group)) and not problems:
        problems.append(f"another rank's {what} does not match the collection (that rank's error names the problem)")


def to_torchrec_state_dict(collection: EmbeddingCollection, prefix: str = "embedding_bags") -> dict[str, torch.Tensor]:
    """Tables keyed as TorchRec's ``EmbeddingBagCollection`` (``embedding_bags.<table>.weight``).

    Use ``prefix="embeddings"`` for TorchRec's (sequence) ``EmbeddingCollection``. Logical rows only, each
    table whole: a table sharded over a process group is gathered onto every rank (a collective). As
    ``state_dict()``, a value may share memory with the table.
    """
    return {f"{prefix}.{name}.weight": _logical(cast(EmbeddingTable, module))
            for name, module in collection.tables.items()}


def _problem(name: str, key: str, value: Any, shape: tuple[int, int], where: str = "in the state_dict") -> str | None:
    """What is wrong with ``value`` as table ``name``'s weight (``key`` ``where``), else ``None``."""
    if is_dtensor(value) or not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor, nn.Parameter):
        return (f"'{key}' is a {type(value).__name__}, not a plain tensor (gather a sharded value, e.g. a "
                "DistributedModelParallel state_dict's ShardedTensor or DTensor, into one tensor first)")
    if tuple(value.shape) != shape:
        return f"table '{name}' has shape {tuple(value.shape)} {where}, expected {shape}"
    if not value.dtype.is_floating_point:
        return f"table '{name}' has dtype {value.dtype} {where}, not a floating point dtype"
    if value.is_meta:
        return f"table '{name}' is on the meta device {where} (it holds no values)"
    return None


def load_torchrec_state_dict(
    collection: EmbeddingCollection, state_dict: Mapping[str, torch.Tensor], prefix: str = "embedding_bags"
) -> None:
    """Load TorchRec-layout weights (``<prefix>.<table>.weight``, plain ``[V, D]`` floating point tensors, cast
    to each table's dtype). Raises one ``ValueError`` listing missing, unexpected and misshapen tables, and then
    loads nothing. Tables sharded over a process group take their rows of the whole value: a collective, which
    every rank calls with the same state_dict (a rank whose state_dict does not match makes every rank raise)."""
    want = {name: cast(EmbeddingTable, t) for name, t in collection.tables.items()}
    given = {}
    unexpected = []
    head = prefix + "."
    for key, value in state_dict.items():
        name = key[len(head): -len(".weight")] if key.startswith(head) and key.endswith(".weight") else ""
        if name and "." not in name:  # (a table's name has no '.')
            given[name] = value
        else:
            unexpected.append(key)
    problems = []
    missing = sorted(set(want) - set(given))
    extra = sorted(set(given) - set(want))
    if missing:
        problems.append(f"missing tables {missing}")
    if extra or unexpected:
        problems.append(f"unexpected keys {sorted(unexpected + [f'{head}{n}.weight' for n in extra])}")
    for name in sorted(set(want) & set(given)):
        shape = (want[name].config.num_embeddings, want[name].config.embedding_dim)
        problem = _problem(name, f"{head}{name}.weight", given[name], shape) or _on_meta(name, want[name])
        if problem:
            problems.append(problem)
    if missing and not given and unexpected:
        problems.append(f"keys are read as '{head}<table>.weight': pass the prefix of your keys (prefix="
                        "'embeddings' for TorchRec's EmbeddingCollection), or strip your model's module path")
    elif unexpected and given:  # e.g. a whole model's state_dict: its dense layers' keys too
        problems.append(f"pass the tables' keys only: {{k: v for k, v in sd.items() if k.startswith({head!r})}}")
    spread = {n: s for n, s in ((n, _spread(t)) for n, t in want.items()) if s is not None}
    _agree(problems, spread.values(), "state_dict")
    if problems:
        raise ValueError("TorchRec state_dict does not match the collection: " + "; ".join(problems))
    values = {n: _stored(want[n], given[n], spread[n]) if n in spread else given[n] for n in want}
    with stored_rows():  # the sharded tables' values are their stored rows already (moved by _stored)
        collection.load_state_dict({f"tables.{n}.weight": v for n, v in values.items()})


_BAG_MODES = {"sum": "sum", "mean": "mean"}


def to_embedding_bag(collection: EmbeddingCollection, table: str) -> nn.EmbeddingBag:
    """An ``nn.EmbeddingBag`` (CPU) holding the table's weights, with the table's combiner as its mode.

    ``sqrtn`` has no ``nn.EmbeddingBag`` mode, and ``nn.EmbeddingBag`` takes ``per_sample_weights`` in mode
    ``"sum"`` only: a ``sqrtn`` bag (a weighted ``mean`` bag) is a ``mode="sum"`` bag of the same weight with
    ``per_sample_weights`` ``w / sqrt(Σ w²)`` (``w / Σ w``) over each bag, ``1 / sqrt(bag length)`` unweighted. A
    table sharded over a process group is gathered onto every rank (a collective).
    """
    t = _table(collection, table)
    if t.config.combiner not in _BAG_MODES:
        raise ValueError(
            f"Table `{table}`: combiner '{t.config.combiner}' has no nn.EmbeddingBag mode (only 'sum' and 'mean'). "
            "Use nn.EmbeddingBag(mode='sum') of its weight with per_sample_weights w / sqrt(sum of w²) over each bag "
            "(1 / sqrt(bag length) unweighted)."
        )
    if _on_meta(table, t):
        raise ValueError(f"Cannot build an nn.EmbeddingBag: {_on_meta(table, t)}.")
    w = _logical(t).to("cpu", copy=True)
    return nn.EmbeddingBag.from_pretrained(w, freeze=False, mode=_BAG_MODES[t.config.combiner])


def load_embedding_bag(collection: EmbeddingCollection, table: str, module: nn.EmbeddingBag | nn.Embedding) -> None:
    """Copy an ``nn.EmbeddingBag`` / ``nn.Embedding`` weight ``[V, D]`` into ``table`` (the other tables keep
    theirs; a table sharded over a process group takes its rows: a collective), cast to the table's dtype.

    Only the weight moves: the table keeps its own lookup and training rules. A module option those rules cannot
    reproduce gets one ``UserWarning`` naming each: an ``nn.EmbeddingBag`` ``mode`` other than the table's
    combiner (``"max"`` has none), ``padding_idx`` (the table looks up and trains that row as any other: leave
    the id out of its inputs), ``max_norm`` (rows are never renormalised) and ``scale_grad_by_freq``.

    Raises:
        TypeError: ``module`` is not an ``nn.EmbeddingBag`` or ``nn.Embedding`` (another module's ``[V, D]``
            weight, e.g. a tied output layer's, loads with ``collection.load_state_dict({"tables.<table>.weight":
            weight}, strict=False)``).
        ValueError: the weight's shape, dtype or device cannot be the table's; nothing is loaded.
    """
    t = _table(collection, table)
    shape = (t.config.num_embeddings, t.config.embedding_dim)
    spread = _spread(t)
    embedding = isinstance(module, (nn.EmbeddingBag, nn.Embedding))
    if not embedding:
        why: str | None = (
            f"Argument `module` must be an nn.EmbeddingBag or an nn.Embedding (another module's [V, D] weight loads "
            f"with collection.load_state_dict({{'tables.{table}.weight': weight}}, strict=False)). Received: "
            f"{type(module).__name__}"
        )
    else:
        why = _problem(table, "the module's weight", module.weight, shape, "in the module") or _on_meta(table, t)
        why = None if why is None else f"Cannot load the module's weight: {why}."
    problems = [] if why is None else [why]
    _agree(problems, [] if spread is None else [spread], "module")
    if problems:
        raise (TypeError if not embedding else ValueError)(problems[0])
    value = module.weight.detach() if spread is None else _stored(t, module.weight, spread)
    with stored_rows():  # (a sharded table's value: its stored rows, moved by _stored)
        collection.load_state_dict({f"tables.{table}.weight": value}, strict=False)
    lost = _options_lost(module, t.config.combiner)
    if lost:
        warnings.warn(
            f"load_embedding_bag: table `{table}` took the {type(module).__name__}'s weight, but not its "
            + "; ".join(lost) + ".", UserWarning, stacklevel=2,
        )


def _options_lost(module: nn.EmbeddingBag | nn.Embedding, combiner: str) -> list[str]:
    """The options of ``module`` whose lookup or training rule a table with ``combiner`` does not follow."""
    lost = []
    mode = getattr(module, "mode", None)  # nn.Embedding has none: it combines nothing
    if mode is not None and mode != combiner:
        lost.append(f"mode={mode!r} (the table combines its bags with combiner={combiner!r}"
                    + ("; no combiner takes a max" if mode == "max" else "") + ")")
    if module.padding_idx is not None:
        p = module.padding_idx
        lost.append(f"padding_idx={p} (the table looks up and trains row {p} as any other: leave id {p} out of the "
                    "inputs)")
    if module.max_norm is not None:
        lost.append(f"max_norm={module.max_norm} (the table never renormalises the rows it looks up)")
    if module.scale_grad_by_freq:
        lost.append("scale_grad_by_freq=True (row gradients are not scaled by the ids' frequency in the batch)")
    return lost


def convert_ftrl_linears(state_dict: Mapping[str, Any], multiply_linear_by_learning_rate: bool) -> dict[str, Any]:
    """An FTRL optimizer ``state_dict`` with ``linears`` converted to the other mode.

    TF's two FTRL forms keep ``z`` (``linears``) in different units: with
    ``multiply_linear_by_learning_rate`` the slot holds ``lr · z``. Conversion multiplies or divides by
    each group's learning rate, which must be a number (not a callable or schedule). Returns a new
    state_dict for ``FTRL(..., multiply_linear_by_learning_rate=<the new mode>)``.

    The factor is the group's ``lr`` as saved (the next step's, once a scheduler has stepped). The two modes
    train alike only at a constant learning rate: under a schedule they are two algorithms (as in TF), and a
    converted run follows the new mode from its first step on.
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
