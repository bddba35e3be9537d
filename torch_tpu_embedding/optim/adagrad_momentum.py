"""Adagrad with momentum, TPU-embedding semantics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Unpack

import torch

from torch_tpu_embedding._util.validation import check_bool, check_float32_normal, check_number
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._core.contract import RowContext, Slots, is_number
from torch_tpu_embedding.optim._core.extras import KerasExtras
from torch_tpu_embedding.optim._core.keywords import constructor_options

__all__ = ["AdagradMomentum", "adagrad_momentum_rule"]


def adagrad_momentum_rule(
    w: torch.Tensor,
    g: torch.Tensor,
    slots: Slots,
    lr: torch.Tensor,
    step: torch.Tensor,
    hp: Mapping[str, Any],
    ctx: RowContext,
) -> tuple[torch.Tensor, Slots]:
    """TF SparseCore ``BuildAdagradMomentumOptimizerComputation`` (formulas: the class docstring)."""
    beta2 = hp["beta2"]
    a = slots["accumulators"]
    a = a + g * g if is_number(beta2, 1) else beta2 * a + (1 - beta2) * g * g
    s = g * torch.pow(a + hp["epsilon"], -1.0 / hp["exponent"])
    m = hp["momentum"] * slots["momenta"] + s
    update = hp["momentum"] * m + s if hp["use_nesterov"] else m
    return w - lr * update, {"accumulators": a, "momenta": m}


class AdagradMomentum(RowSparseOptimizer):
    r"""Adagrad with momentum, as ``tf.tpu.experimental.embedding.AdagradMomentum``.

    .. math::
        a &\leftarrow a + g^2 \ \ (\beta_2 = 1) \quad\text{or}\quad \beta_2 a + (1-\beta_2) g^2 \\
        s &= g\,(a + \epsilon)^{-1/p} \\
        m &\leftarrow \mu m + s \\
        w &\leftarrow w - \eta\,(\mu m + s)\ \text{(Nesterov)} \quad\text{or}\quad w - \eta m

    Slots ``accumulators`` and ``momenta`` start at 0 (ε is added inside the power, it is not an
    initial accumulator). Rows not looked up in a step are not changed, nor are their slots.

    Args:
        momentum: μ (default 0). use_nesterov: Nesterov form. exponent: p > 0 (default 2).
        beta2: accumulator decay in [0, 1] (1 = plain sum). epsilon: ε > 0 (default 1e-10).
        {tf_keywords}
        {slot_creation_fn}
        {keras_extras}
    """

    algorithm = "adagrad_momentum"
    slot_names = ("accumulators", "momenta")

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = 0.001,
        momentum: float = 0.0,
        use_nesterov: bool = False,
        exponent: float = 2,
        beta2: float = 1,
        epsilon: float = 1e-10,
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

    rule = staticmethod(adagrad_momentum_rule)

    @classmethod
    def _validate(cls, hp: dict[str, Any]) -> None:
        check_number("momentum", hp["momentum"], minimum=0.0)
        check_bool("use_nesterov", hp["use_nesterov"])
        check_number("exponent", hp["exponent"], minimum=0.0, min_inclusive=False)
        check_number("beta2", hp["beta2"], minimum=0.0, maximum=1.0)
        check_number("epsilon", hp["epsilon"], minimum=0.0, min_inclusive=False)
        check_float32_normal("epsilon", hp["epsilon"], "must be a float")  # (a + ε: a starts at 0)
