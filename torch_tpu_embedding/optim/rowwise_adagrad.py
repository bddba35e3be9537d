"""Row-wise Adagrad: one accumulator per row (FBGEMM ``EXACT_ROWWISE_ADAGRAD``, TorchRec's ``RowWiseAdagrad``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Unpack

import torch

from torch_tpu_embedding._util.validation import check_float32_normal, check_number
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._core.contract import RowContext, Slots, SlotSpec, is_set
from torch_tpu_embedding.optim._core.extras import KerasExtras
from torch_tpu_embedding.optim._core.keywords import constructor_options

__all__ = ["RowWiseAdagrad", "rowwise_adagrad_rule"]


def rowwise_adagrad_rule(
    w: torch.Tensor,
    g: torch.Tensor,
    slots: Slots,
    lr: torch.Tensor,
    step: torch.Tensor,
    hp: Mapping[str, Any],
    ctx: RowContext,
) -> tuple[torch.Tensor, Slots]:
    """``g ← g + λ·w; m ← m + mean(g²); w ← w − lr·g / (√m + ε)``, the mean over all but dim 0.

    ``w, g``: ``[U, ...]`` rows (``m [U]``), or a 1-D / 0-d parameter (``m`` like ``w``: per element).
    """
    wd = hp["weight_decay"]
    if is_set(wd):
        g = g + wd * w  # L2 penalty in the gradient (FBGEMM's WeightDecayMode.L2, torch's weight_decay)
    g2 = g * g
    if w.dim() >= 2:
        g2 = g2.flatten(1).mean(1)  # flatten, not reshape(U, -1): U may be 0 (no lookup in a window)
    m = slots["accumulators"] + g2
    denom = torch.sqrt(m) + hp["eps"]
    if w.dim() >= 2:
        denom = denom.reshape(-1, *([1] * (w.dim() - 1)))
    return w - lr * g / denom, {"accumulators": m}


class RowWiseAdagrad(RowSparseOptimizer):
    r"""Row-wise Adagrad: Adagrad with one accumulator per embedding row.

    For a touched row with summed gradient :math:`g \in \mathbb{R}^D`:

    .. math::
        g &\leftarrow g + \lambda\, w \quad (\texttt{weight\_decay}\ \lambda) \\
        m &\leftarrow m + \tfrac{1}{D} \textstyle\sum_j g_j^2 \\
        w &\leftarrow w - \eta\, g / (\sqrt{m} + \epsilon)

    as FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` (``weight_decay`` in its L2 mode) and
    ``torchrec.optim.RowWiseAdagrad``. The state is one number per row — ``accumulators [V]``, O(V)
    instead of Adagrad's O(V·D) — so a 1,000,000 × 64 float32 table needs 4 MB of optimizer state
    instead of 256 MB. Rows not looked up in a step are not changed, nor are their accumulators.

    Dense parameters: one accumulator per row (dim 0) of a parameter of rank >= 2, the mean taken
    over all its other elements; one per element of a 1-D parameter (plain Adagrad with ε outside
    the square root).

    Args:
        params: parameters or parameter groups (tables and/or dense parameters).
        lr: learning rate η (float, 0-d tensor or callable; TorchRec's default 0.01).
        eps: ε > 0, added to √m (TorchRec's default 1e-10; FBGEMM's 1e-8).
        initial_accumulator_value: initial ``m`` (>= 0, default 0).
        weight_decay: λ >= 0, the L2 penalty added to the gradient before the update (default 0).
            For TF's decoupled decay use ``weight_decay_factor``.
        {tf_keywords}
        {slot_creation_fn} Here it gets the ``[rows]`` shape.
        {keras_extras}

    Example::

        >>> opt = tte.optim.RowWiseAdagrad(model.parameters(), lr=0.05)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    algorithm = "rowwise_adagrad"
    slot_names = ("accumulators",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = 0.01,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        weight_decay: float = 0.0,
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

    rule = staticmethod(rowwise_adagrad_rule)

    @classmethod
    def _validate(cls, hp: dict[str, Any]) -> None:
        hp["eps"] = check_number("eps", hp["eps"], minimum=0.0, min_inclusive=False)
        check_float32_normal("eps", hp["eps"], "must be a float")  # (√m + ε: m is 0 on a row of zeros from 0)
        hp["initial_accumulator_value"] = check_number(
            "initial_accumulator_value", hp["initial_accumulator_value"], minimum=0.0
        )
        hp["weight_decay"] = check_number("weight_decay", hp["weight_decay"], minimum=0.0)

    @classmethod
    def slot_specs(cls, shape: tuple[int, ...], hp: Mapping[str, Any], table: bool) -> dict[str, SlotSpec]:
        rows = shape[:1] if len(shape) >= 2 else shape  # one per row; per element below rank 2
        return {"accumulators": SlotSpec(rows, float(hp["initial_accumulator_value"]))}
