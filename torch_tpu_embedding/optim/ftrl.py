"""FTRL-Proximal with TPU-embedding semantics."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Unpack

import torch

from torch_tpu_embedding._util.validation import arg_error, check_bool, check_float32_normal, check_number
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._core.contract import RowContext, Slots, is_number
from torch_tpu_embedding.optim._core.extras import KerasExtras
from torch_tpu_embedding.optim._core.keywords import constructor_options

__all__ = ["FTRL", "ftrl_rule"]


def ftrl_rule(
    w: torch.Tensor,
    g: torch.Tensor,
    slots: Slots,
    lr: torch.Tensor,
    step: torch.Tensor,
    hp: Mapping[str, Any],
    ctx: RowContext,
) -> tuple[torch.Tensor, Slots]:
    """TF SparseCore ``BuildFtrlOptimizerComputation``, both linear modes (formulas: the class docstring)."""
    p = hp["learning_rate_power"]
    l1, l2, beta = hp["l1_regularization_strength"], hp["l2_regularization_strength"], hp["beta"]
    n = slots["accumulators"]
    n_new = n + g * g
    pow_new = torch.pow(n_new, -p)
    delta = pow_new - torch.pow(n, -p)
    if hp["multiply_linear_by_learning_rate"]:  # linears hold lr·z: no division by lr
        z = slots["linears"] + lr * g - delta * w
        bound = lr * l1
        num = -z if is_number(l1, 0) else torch.minimum(torch.maximum(z, -bound), bound) - z
        den = pow_new + 2 * lr * l2 + beta
    else:
        z = slots["linears"] + g - delta * w / lr
        num = -z if is_number(l1, 0) else z.clamp(-l1, l1) - z
        den = (pow_new + beta) / lr + 2 * l2
    if hp["allow_zero_accumulator"]:
        # A coordinate that never saw a non-zero gradient (n = 0, beta = l2 = 0) has 0/0: keep 0.
        w_new = torch.where(den == 0, torch.zeros_like(num), num / torch.where(den == 0, 1.0, den))
    else:
        w_new = num / den
    return w_new, {"accumulators": n_new, "linears": z}


class FTRL(RowSparseOptimizer):
    r"""FTRL-Proximal (McMahan et al. 2013), as ``tf.tpu.experimental.embedding.FTRL``.

    With :math:`p` = ``learning_rate_power``, :math:`n` = ``accumulators``, :math:`z` = ``linears``:

    .. math::
        n' &= n + g^2, \quad \Delta = n'^{-p} - n^{-p} \\
        z &\leftarrow z + g - \Delta\, w / \eta \\
        w &\leftarrow \frac{\mathrm{clip}(z, -\lambda_1, \lambda_1) - z}{(n'^{-p} + \beta)/\eta + 2\lambda_2},
        \quad n \leftarrow n'

    With ``multiply_linear_by_learning_rate=True`` the slot holds :math:`\eta z` (same weights for a
    constant η, no division by η, so η may reach 0; checkpoints of ``linears`` differ by a factor
    η). Rows not looked up in a step are not changed, nor are their slots (a dense FTRL would zero
    never-touched coordinates; lazy FTRL keeps their initial values).

    Args:
        lr: η (TF default 0.001). learning_rate_power: p <= 0 (default -0.5).
        l1_regularization_strength, l2_regularization_strength, beta: >= 0 (default 0).
        initial_accumulator_value: initial n, > 0 (default 0.1; 0 allowed with
            ``allow_zero_accumulator=True``, where 0/0 weights are set to 0).
        multiply_linear_by_learning_rate: see above.
        {tf_keywords}
        {slot_creation_fn}
        {keras_extras}
    """

    algorithm = "ftrl"
    slot_names = ("accumulators", "linears")

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = 0.001,
        learning_rate_power: float = -0.5,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        beta: float = 0.0,
        initial_accumulator_value: float = 0.1,
        *,
        use_gradient_accumulation: bool = True,
        clip_weight_min: float | None = None,
        clip_weight_max: float | None = None,
        weight_decay_factor: float | None = None,
        multiply_weight_decay_factor_by_learning_rate: bool | None = None,
        slot_creation_fn: Any = None,
        clipvalue: Any = None,
        multiply_linear_by_learning_rate: bool = False,
        allow_zero_accumulator: bool = False,
        **extras: Unpack[KerasExtras],
    ) -> None:
        super().__init__(params, *constructor_options(type(self), locals()))

    rule = staticmethod(ftrl_rule)

    @classmethod
    def _validate(cls, hp: dict[str, Any]) -> None:
        check_number("learning_rate_power", hp["learning_rate_power"], maximum=0.0)
        for name in ("l1_regularization_strength", "l2_regularization_strength", "beta"):
            check_number(name, hp[name], minimum=0.0)
        check_bool("multiply_linear_by_learning_rate", hp["multiply_linear_by_learning_rate"])
        check_bool("allow_zero_accumulator", hp["allow_zero_accumulator"])
        v = hp["initial_accumulator_value"]
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        if hp["allow_zero_accumulator"]:
            if not ok or v < 0:
                raise arg_error("initial_accumulator_value", "must be a float >= 0", v)
        elif not ok or not v > 0:
            raise arg_error("initial_accumulator_value", "must be a positive float", v)
        else:  # (n^-p with n = 0 over a zero gradient: 0/0; allow_zero_accumulator=True sets that weight to 0)
            check_float32_normal("initial_accumulator_value", float(v),
                                 "must be a positive float (or 0 with `allow_zero_accumulator=True`)")

    @classmethod
    def slot_initial_values(cls, hp: Mapping[str, Any]) -> dict[str, float]:
        return {"accumulators": float(hp["initial_accumulator_value"]), "linears": 0.0}
