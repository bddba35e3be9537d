"""What an optimizer declares: its slots, its pure per-row rule, its name in the registry.

An optimizer of this package is a :class:`~torch_tpu_embedding.optim.RowSparseOptimizer` subclass
that sets ``algorithm`` (its registry name), ``slot_names``, and a pure function

``rule(w [U, D], g [U, D], slots, lr (0-d), step (0-d), hp, ctx) -> (w_new, slots_new)``

over the rows it is given: every row of a dense parameter, or the touched rows of a table. The rule
does no gathering, scattering or in-place writing; the core does that once for every optimizer and
every device. Adding an optimizer is one module (see ``docs/design.md``, "The optimizer core").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torch_tpu_embedding._validation import arg_error

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._base import RowSparseOptimizer

__all__ = [
    "RowContext",
    "Rule",
    "SlotSpec",
    "Slots",
    "common_defaults",
    "identity",
    "optimizer_class",
    "optimizer_names",
    "register",
]

Tensor = torch.Tensor
Slots = dict[str, Tensor]


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """One optimizer state tensor of a parameter.

    ``rows``: dim 0 indexes the parameter's rows — gathered and scattered per touched row, given
    trash rows on XLA, and trimmed to the table's logical rows in checkpoints. Otherwise the slot
    belongs to the whole parameter (e.g. Adafactor's column statistic) and is passed whole.
    """

    shape: tuple[int, ...]
    init: float = 0.0
    rows: bool = True
    dtype: torch.dtype | None = None  # None: the parameter's dtype (float32 for a 16-bit parameter)


def identity(x: Tensor) -> Tensor:
    """``x`` itself: ``RowContext.all_reduce`` when an update is not split over shards."""
    return x


@dataclasses.dataclass(frozen=True)
class RowContext:
    """What a rule may need beyond its rows: which of them are real, the table's size, and how to
    reduce over every row of the update.

    ``mask [U]`` is True for touched rows and False for the static-shape padding tail on XLA;
    ``count`` is the number of touched rows of the whole update. Both are ``None`` for a dense update
    (every row real). ``all_reduce(x)`` sums ``x`` over every part of the update: the identity, except
    when each shard of a row-sharded table updates its own rows (the owner-local path), where it is a
    sum over the shards — so ``all_reduce(f(rows).sum())`` is the sum over all touched rows on every
    device. Per-row rules ignore the context; rules with reductions over rows (Adafactor) use it.
    """

    mask: Tensor | None
    count: Tensor | None
    num_rows: int  # logical rows of the whole parameter
    all_reduce: Callable[[Tensor], Tensor] = identity


#: ``rule(w [U, D], g [U, D], slots, lr (0-d), step (0-d), hp, ctx) -> (w_new, slots_new)``
Rule = Callable[[Tensor, Tensor, Slots, Tensor, Tensor, Mapping[str, Any], RowContext], tuple[Tensor, Slots]]

_REGISTRY: dict[str, type[RowSparseOptimizer]] = {}


def register(cls: type[RowSparseOptimizer]) -> None:
    """Enter ``cls`` under ``cls.algorithm`` (called for every subclass that sets ``algorithm``)."""
    _REGISTRY[cls.algorithm] = cls


def optimizer_class(name: str) -> type[RowSparseOptimizer]:
    """The optimizer class registered under ``name`` (``"sgd"``, ``"adagrad"``, ...)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise arg_error("optimizer", f"must be one of {tuple(sorted(_REGISTRY))}", name) from None


def optimizer_names() -> tuple[str, ...]:
    """Every registered optimizer name, in registration order."""
    return tuple(_REGISTRY)


def common_defaults(
    lr: Any,
    use_gradient_accumulation: bool,
    clip_weight_min: float | None,
    clip_weight_max: float | None,
    weight_decay_factor: float | None,
    multiply_weight_decay_factor_by_learning_rate: bool | None,
    clipvalue: Any,
    slot_creation_fn: Any = None,
) -> dict[str, Any]:
    """The hyper-parameters every optimizer shares (TF's ``_Optimizer`` arguments), as a defaults dict."""
    return {
        "lr": lr,
        "use_gradient_accumulation": use_gradient_accumulation,
        "clip_weight_min": clip_weight_min,
        "clip_weight_max": clip_weight_max,
        "weight_decay_factor": weight_decay_factor,
        "multiply_weight_decay_factor_by_learning_rate": multiply_weight_decay_factor_by_learning_rate,
        "clipvalue": clipvalue,
        "slot_creation_fn": slot_creation_fn,
    }
