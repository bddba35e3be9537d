"""Adagrad with TPU-embedding semantics (no epsilon)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Unpack

import torch

from torch_tpu_embedding._util.validation import arg_error, check_float32_normal
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._core.contract import RowContext, Slots
from torch_tpu_embedding.optim._core.extras import KerasExtras
from torch_tpu_embedding.optim._core.keywords import constructor_options

__all__ = ["Adagrad", "adagrad_rule"]


def adagrad_rule(
    w: torch.Tensor,
    g: torch.Tensor,
    slots: Slots,
    lr: torch.Tensor,
    step: torch.Tensor,
    hp: Mapping[str, Any],
    ctx: RowContext,
) -> tuple[torch.Tensor, Slots]:
    """``a ← a + g²; w ← w − lr·g/√a`` (TPU: no epsilon; Keras uses √(a+1e-7))."""
    a = slots["accumulators"] + g * g
    return w - lr * g * torch.rsqrt(a), {"accumulators": a}


class Adagrad(RowSparseOptimizer):
    r"""Adagrad, as ``tf.tpu.experimental.embedding.Adagrad``.

    .. math::
        a \leftarrow a + g^2, \qquad w \leftarrow w - \eta\, g / \sqrt{a}

    Slot ``accumulators`` starts at ``initial_accumulator_value``. There is no epsilon (Keras and
    torch.optim.Adagrad add one). Rows not looked up in a step are not changed, nor are their slots.

    Args:
        params: parameters or parameter groups.
        lr: learning rate η (TF default 0.001).
        initial_accumulator_value: initial ``a`` (> 0, TF default 0.1).
        {tf_keywords}
        {slot_creation_fn}
        {keras_extras}

    Example::

        >>> opt = tte.optim.Adagrad(model.parameters(), lr=0.1)
    """

    algorithm = "adagrad"
    slot_names = ("accumulators",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = 0.001,
        initial_accumulator_value: float = 0.1,
        *,
        use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        slot_creation_fn: Any = None,
        clipvalue: Any = None,
        **extras: Unpack[KerasExtras],
    ) -> None:
        super().__init__(params, *constructor_options(type(self), locals()))

    rule = staticmethod(adagrad_rule)

    @classmethod
    def _validate(cls, hp: dict[str, Any]) -> None:
        v = hp["initial_accumulator_value"]
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < float(v) < math.inf:
            raise arg_error("initial_accumulator_value", "must be a positive float", v)
        check_float32_normal("initial_accumulator_value", float(v), "must be a positive float")

    @classmethod
    def slot_initial_values(cls, hp: Mapping[str, Any]) -> dict[str, float]:
        return {"accumulators": float(hp["initial_accumulator_value"])}
