"""Adam and LazyAdam with TPU-embedding semantics (optionally torch SparseAdam / tfa LazyAdam)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Unpack

import torch

from torch_tpu_embedding._util.validation import arg_error, check_bool, check_float32_normal, check_number
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._core.contract import RowContext, Slots
from torch_tpu_embedding.optim._core.extras import KerasExtras
from torch_tpu_embedding.optim._core.keywords import constructor_options

__all__ = ["Adam", "LazyAdam", "adam_rule"]


def adam_rule(
    w: torch.Tensor,
    g: torch.Tensor,
    slots: Slots,
    lr: torch.Tensor,
    step: torch.Tensor,
    hp: Mapping[str, Any],
    ctx: RowContext,
) -> tuple[torch.Tensor, Slots]:
    """TF SparseCore ``BuildAdamOptimizerComputation``; optional bias correction (docs/optimizers.md)."""
    b1, b2 = hp["betas"]
    eps = hp["eps"]
    m = b1 * slots["momenta"] + (1 - b1) * g
    v = b2 * slots["velocities"] + (1 - b2) * g * g
    if hp["bias_correction"]:
        t = step.to(w.dtype)  # bias corrections in the parameter dtype (not fp32) for fp64 tests
        # (betas as the update kernel's float64 data: in t's dtype, as a Python number's power of t is computed)
        p1, p2 = (torch.pow(b.to(t.dtype) if isinstance(b, torch.Tensor) else b, t) for b in (b1, b2))
        lr = lr * torch.sqrt(1 - p2) / (1 - p1)
    # eps inside the sqrt is the TPU default; outside matches SparseAdam / Keras.
    denom = torch.sqrt(v + eps * eps) if hp["sum_inside_sqrt"] else torch.sqrt(v) + eps
    return w - lr * m / denom, {"momenta": m, "velocities": v}


class Adam(RowSparseOptimizer):
    r"""Adam, as ``tf.tpu.experimental.embedding.Adam`` (lazy by default).

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g \\
        v &\leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        w &\leftarrow w - \eta_t\, m / \sqrt{v + \epsilon^2}
            \quad (\texttt{sum\_inside\_sqrt}) \quad\text{or}\quad w - \eta_t\, m / (\sqrt{v} + \epsilon)

    with :math:`\eta_t = \eta` (TPU: no bias correction) or, with ``bias_correction=True``,
    :math:`\eta_t = \eta \sqrt{1-\beta_2^t} / (1-\beta_1^t)` where ``t`` counts the steps in
    which this parameter had a gradient (as ``torch.optim.SparseAdam``). With
    ``bias_correction=True, sum_inside_sqrt=False`` the update is exactly SparseAdam's, and tfa LazyAdam's while
    the table has a gradient every step (tfa's ``t`` is the optimizer's global step).

    ``lazy_adam=True`` (default): rows not looked up in a step are not changed, nor are their
    slots. ``lazy_adam=False``: every row of a table is updated each step with ``g = 0`` where it
    was not looked up (moments decay, momentum keeps moving the weights) — O(V·D) per step.

    Args:
        lr: η (TF default 0.001). betas: (β1, β2), each in [0, 1): floats or one-element tensors (as
            torch.optim.Adam's; a tensor's value is read once, when the group is made, and the group holds
            floats: change ``group["betas"]`` to change them). eps: ε > 0 (TF default 1e-7).
        lazy_adam, sum_inside_sqrt, bias_correction: as above.
        {tf_keywords}
        {slot_creation_fn}
        {keras_extras}

    Example::

        >>> opt = tte.optim.Adam(model.parameters(), lr=1e-3)
    """

    algorithm = "adam"
    slot_names = ("momenta", "velocities")

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = 0.001,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-07,
        lazy_adam: bool = True,
        sum_inside_sqrt: bool = True,
        bias_correction: bool = False,
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

    rule = staticmethod(adam_rule)

    @classmethod
    def _validate(cls, hp: dict[str, Any]) -> None:
        betas = hp["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise arg_error("betas", "must be a pair (beta_1, beta_2)", betas)
        hp["betas"] = tuple(check_number(f"betas[{i}]", _beta_value(f"betas[{i}]", b), minimum=0.0, maximum=1.0,
                                         max_inclusive=False) for i, b in enumerate(betas))
        check_number("eps", hp["eps"], minimum=0.0, min_inclusive=False)
        # sqrt(v + eps²) (or sqrt(v) + eps) would be 0 for a row whose gradient is 0: the update 0/0 is NaN.
        inside = hp["sum_inside_sqrt"] is True
        rule = "must have a square that is > 0 in float32 and a normal float32 when `sum_inside_sqrt=True`: eps"
        check_float32_normal("eps", float(hp["eps"]), rule if inside else "must be a float", squared=inside)
        for name in ("lazy_adam", "sum_inside_sqrt", "bias_correction"):
            check_bool(name, hp[name])
        if not hp["lazy_adam"] and not hp["use_gradient_accumulation"]:
            raise ValueError(
                "When disabling lazy Adam (`lazy_adam=False`), gradient accumulation must be "
                "used. Set `use_gradient_accumulation` to True."
            )

    @classmethod
    def is_lazy(cls, hp: Mapping[str, Any]) -> bool:
        return bool(hp["lazy_adam"])


def _beta_value(name: str, b: Any) -> Any:
    """A one-element real tensor beta (torch.optim.Adam takes them) as its Python number, read once when the group is
    made: the group holds floats, which the update kernels take as data (on XLA too) and schedulers rewrite."""
    if not isinstance(b, torch.Tensor):
        return b
    if b.numel() != 1 or b.is_complex() or b.dtype == torch.bool:
        raise ValueError(f"Argument `{name}` must be a finite number in [0, 1): a float or a one-element real "
                         f"tensor. Received a {b.dtype} tensor of shape {tuple(b.shape)}")
    return b.detach().reshape(()).cpu().item()


class LazyAdam(Adam):
    r"""Lazy Adam: :class:`Adam` with ``lazy_adam=True`` fixed (the TPU default).

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        w &\leftarrow w - \eta_t\, m / \sqrt{v + \epsilon^2}
            \quad (\texttt{sum\_inside\_sqrt}) \quad\text{or}\quad w - \eta_t\, m / (\sqrt{v} + \epsilon)

    on the rows looked up in a step only: other rows, and their moments, do not change (a dense
    parameter is updated whole whenever it has a gradient). :math:`\eta_t = \eta` (TPU), or with
    ``bias_correction=True`` :math:`\eta \sqrt{1-\beta_2^t} / (1-\beta_1^t)`, ``t`` counting
    the steps in which the parameter had a gradient. Slots: ``momenta``, ``velocities``.

    For ``torch.optim.SparseAdam`` numbers pass ``bias_correction=True, sum_inside_sqrt=False`` (and its
    ``eps=1e-8``); tfa ``LazyAdam``'s too while the table has a gradient every step (tfa counts ``t`` by the
    optimizer's global step, ours by the steps with a gradient).

    Args:
        params: parameters or parameter groups (tables and/or dense parameters).
        lr: η (float, 0-d tensor or callable; TF default 0.001). betas: (β1, β2), each in [0, 1), as :class:`Adam`'s.
        eps: ε > 0 (TF default 1e-7). sum_inside_sqrt, bias_correction: as above.
        Others (keyword): as :class:`Adam`, except ``lazy_adam``, which is refused.

    Example::

        >>> opt = tte.optim.LazyAdam(model.parameters(), lr=1e-3)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    algorithm = "lazy_adam"
    _refused_options = ("lazy_adam",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = 0.001,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-07,
        sum_inside_sqrt: bool = True,
        bias_correction: bool = False,
        **kwargs: Any,
    ) -> None:
        if "lazy_adam" in kwargs:
            raise arg_error("lazy_adam", "is not an argument of LazyAdam (use Adam)", kwargs["lazy_adam"])
        super().__init__(
            params, lr, betas, eps, True, sum_inside_sqrt, bias_correction, **kwargs
        )
