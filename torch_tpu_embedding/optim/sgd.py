"""SGD with TPU-embedding semantics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Unpack

import torch

from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._core.contract import RowContext, Slots
from torch_tpu_embedding.optim._core.extras import KerasExtras
from torch_tpu_embedding.optim._core.keywords import constructor_options

__all__ = ["SGD", "sgd_factor", "sgd_increment", "sgd_rule"]


def sgd_rule(
    w: torch.Tensor,
    g: torch.Tensor,
    slots: Slots,
    lr: torch.Tensor,
    step: torch.Tensor,
    hp: Mapping[str, Any],
    ctx: RowContext,
) -> tuple[torch.Tensor, Slots]:
    """``w ← w − lr·g`` (no slots)."""
    return w - lr * g, slots


def sgd_factor(lr: torch.Tensor) -> torch.Tensor:
    """``f`` with ``sgd_increment(g, lr) == f · g``: ``−lr``."""
    return -lr


def sgd_increment(g: torch.Tensor, lr: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``sgd_rule(w, g) − w`` to the bit: ``(−lr)·g`` (``w + (−lr)·g`` rounds as ``w − lr·g``; negation is
    exact). ``Path.ADDITIVE`` adds it per looked-up id: one pass over the rows, where ``sgd_rule(0, g)``
    is two. Written into ``out`` if given."""
    return sgd_factor(lr) * g if out is None else torch.mul(sgd_factor(lr), g, out=out)


class SGD(RowSparseOptimizer):
    r"""Stochastic gradient descent, as ``tf.tpu.experimental.embedding.SGD``.

    .. math::
        w \leftarrow w - \eta\, g

    where ``g`` is the gradient row of an id summed over the batch (all features sharing the table).
    Rows not looked up in a step are not changed.

    Args:
        params: parameters or parameter groups (tables and/or dense parameters).
        lr: learning rate η (float >= 0, 0-d tensor, or zero-argument callable). TF default 0.01.
        {tf_keywords}
        {keras_extras}

    Example::

        >>> opt = tte.optim.SGD(model.parameters(), lr=0.1)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    algorithm = "sgd"
    slot_names = ()
    additive = True  # eager steps without clipping or decay: one index_add_ of -lr·g per looked-up id
    increment = staticmethod(sgd_increment)
    increment_factor = staticmethod(sgd_factor)

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = 0.01,
        *,
        use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        clipvalue: Any = None,
        **extras: Unpack[KerasExtras],
    ) -> None:
        super().__init__(params, *constructor_options(type(self), locals()))

    rule = staticmethod(sgd_rule)
