"""Adafactor (Keras semantics) with truly factored, lazy state for embedding tables."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from torch_tpu_embedding._util.validation import arg_error, check_bool, check_float32_normal, check_number
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._core.contract import RowContext, Slots, SlotSpec
from torch_tpu_embedding.optim._core.keywords import constructor_options

__all__ = ["Adafactor", "adafactor_rule"]


def adafactor_rule(
    w: torch.Tensor,
    g: torch.Tensor,
    slots: Slots,
    lr: torch.Tensor,
    step: torch.Tensor,
    hp: Mapping[str, Any],
    ctx: RowContext,
) -> tuple[torch.Tensor, Slots]:
    """Keras 3 ``Adafactor.update_step``; over touched rows for tables (docs/optimizers.md).

    ``w, g``: ``[..., m, n]`` (factored: slots ``r [..., m]``, ``c [..., n]``; tables also
    ``r_sum`` = Σ r over all rows) or rank < 2 (slot ``v`` like ``w``). With ``ctx.mask`` the rows
    are the touched rows of a table: RMS terms and the column mean run over them, the row mean over
    the whole table comes from ``r_sum``. With every row touched this is Keras on the dense gradient.
    Every sum over rows goes through ``ctx.all_reduce`` (rows split over shards: summed over them).
    In a stacked group (``ctx.segment``) every statistic is per member table: ``c [members, n]``,
    ``r_sum [members]``, the touched-row count, ``RMS(w)`` and ``RMS(u)`` — as for separate tables.
    """
    t = step.to(w.dtype)
    rho = torch.minimum(lr, torch.rsqrt(t)) if hp["relative_step"] else lr
    b2 = 1.0 - torch.pow(t, hp["beta_2_decay"])
    g2 = g * g + hp["epsilon_1"]
    mask = ctx.mask
    total = ctx.all_reduce
    stacked = ctx.segment is not None  # a stacked group: every statistic per member table

    def real(x: torch.Tensor) -> torch.Tensor:  # zero the static-shape padding rows (a scalar zero: no [U, D] made)
        if mask is None:
            return x
        return torch.where(mask.reshape(-1, *([1] * (x.dim() - 1))), x, 0.0)

    def part_all(x: torch.Tensor) -> torch.Tensor:  # Σ over this part's real rows and columns of x: () or [members]
        if stacked:  # each row summed, then its padding zeroed: the same sums as zeroing [U, D] first
            return ctx.part_sum(real(x.flatten(1).sum(-1)))  # (flatten, not reshape(U, -1): U may be 0)
        return real(x).sum()

    def sum_all(x: torch.Tensor) -> torch.Tensor:  # part_all summed over the shards
        return total(part_all(x))

    def part_rows(x: torch.Tensor) -> torch.Tensor:  # Σ over this part's real rows of x [U, *rest], per member
        return ctx.part_sum(real(x)) if stacked else real(x).sum(0)

    def each_row(v: torch.Tensor) -> torch.Tensor:  # a per-table scalar, broadcast against [U, D]
        return ctx.per_row(v).unsqueeze(-1) if stacked else v

    factored = "r" in slots
    if factored:
        r_old = slots["r"].to(w.dtype)
        # Stored precision (row_stat_dtype) decides r, so r_sum stays the sum of the stored values.
        r = (b2 * r_old + (1 - b2) * g2.mean(-1)).to(slots["r"].dtype).to(w.dtype)
    lazy = mask is not None and (ctx.part_count is not None or ctx.summed_count is not None)
    touched_rows: torch.Tensor | None = None
    if not lazy:
        n_elems: torch.Tensor | float = float(w.numel())
        count: torch.Tensor | None = None
        w2 = sum_all(w * w)
    else:
        # Every sum over rows that does not depend on the update (the touched rows, RMS(w)'s Σw², the column sum of
        # g² and r's change) in one collective where the rows are split over shards.
        touched_rows, (w2, *stats) = ctx.counted_sums(
            part_all(w * w), *((part_rows(g2), part_rows(r - r_old)) if factored else ()))
        assert touched_rows is not None  # (a context with a mask counts its rows)
        count = touched_rows.clamp(min=1).to(w.dtype)
        n_elems = count * (w.numel() // max(w.shape[0], 1))
    alpha = torch.clamp(torch.sqrt(w2 / n_elems), min=hp["epsilon_2"]) * rho
    new: Slots = {}
    if factored:
        c_old = slots["c"]
        if count is None:
            c = b2 * c_old + (1 - b2) * g2.mean(-2)
            r_mean = r.mean(-1, keepdim=True)
        else:
            col, r_change = stats
            assert touched_rows is not None
            per = count.unsqueeze(-1) if stacked else count
            c = b2 * c_old + (1 - b2) * col / per
            touched = (touched_rows > 0).unsqueeze(-1) if stacked else touched_rows > 0
            c = torch.where(touched, c, c_old)  # a step without touched rows keeps c
            r_sum = slots["r_sum"] + r_change
            new["r_sum"] = r_sum
            r_mean = r_sum / ctx.rows_of_table(w)
            if stacked:
                r_mean = ctx.per_row(r_mean)
        row_c = ctx.per_row(c) if stacked and count is not None else c[..., None, :]
        v = (r / r_mean)[..., None] * row_c
        new["r"], new["c"] = r, c
    else:
        v = b2 * slots["v"] + (1 - b2) * g2
        new["v"] = v
    # r_i·c_j/mean(r) underflows to 0 in float32 where row i and column j both hold only ε1 (ε1² = 1e-60 at the
    # default): the exact v is > 0 and u = 0 there, but g·rsqrt(0) = 0·inf would be NaN, and through RMS(u) the whole
    # update NaN. (Keras computes the same product: its float32 update NaNs there.)
    u = g * torch.rsqrt(v.clamp(min=torch.finfo(v.dtype).tiny))
    rms_u = torch.sqrt(sum_all(u * u) / n_elems)
    u = u / torch.clamp(each_row(rms_u) / hp["clip_threshold"], min=1.0)
    return w - each_row(alpha) * u, new


class Adafactor(RowSparseOptimizer):
    r"""Adafactor, as ``keras.optimizers.Adafactor``, with O(V + D) state for embedding tables.

    For a parameter of rank >= 2 (last two dims ``m × n``), with ``t`` the step and
    :math:`\epsilon_1, \epsilon_2, d` = ``epsilon_1, epsilon_2, clip_threshold``:

    .. math::
        \rho &= \min(\eta, 1/\sqrt t) \ (\texttt{relative\_step}) \ \text{or}\ \eta, \qquad
        \alpha = \max(\epsilon_2, \mathrm{RMS}(w))\,\rho, \qquad \beta_t = 1 - t^{\texttt{beta\_2\_decay}} \\
        r &\leftarrow \beta_t r + (1-\beta_t)\,\mathrm{mean}_j(g^2 + \epsilon_1), \qquad
        c \leftarrow \beta_t c + (1-\beta_t)\,\mathrm{mean}_i(g^2 + \epsilon_1) \\
        v_{ij} &= r_i c_j / \mathrm{mean}(r), \qquad u = g / \sqrt v, \qquad
        w \leftarrow w - \alpha\, u / \max(1, \mathrm{RMS}(u)/d)

    Rank < 2: ``v ← β_t v + (1−β_t)(g² + ε1)``. Dense parameters give Keras's numbers. Keras
    applies the cap ``min(lr, 1/√t)`` whether or not ``relative_step`` is set; here
    ``relative_step=False`` uses ``lr`` as given, as documented (the default matches Keras).

    **Embedding tables** (lazy, exact when every row is touched): the state is ``r [V]``,
    ``c [D]`` and ``r_sum`` (Σ r) — no ``[V, D]`` second moment (Keras stores one). A step updates
    ``r`` of the touched rows only; ``c`` averages ``g²`` over the touched rows; ``mean(r)`` is
    ``r_sum / V``, kept current in O(touched) work; ``RMS(w)`` and ``RMS(u)`` run over the touched
    rows. On batches that touch every row this is Keras on the densified gradient; otherwise rows
    not looked up keep their weights and statistics.

    Args:
        params: parameters or parameter groups (tables and/or dense parameters).
        lr: η (float, 0-d tensor or callable; default 0.001).
        beta_2_decay: exponent of the second-moment decay (<= 0; default -0.8).
        epsilon_1: added to ``g²`` (> 0; default 1e-30). epsilon_2: floor of the parameter
            scale (>= 0; default 1e-3). clip_threshold: ``d`` (> 0; default 1.0).
        relative_step: cap the step size by ``1/√t`` (default True).
        weight_decay: decoupled ``w ← w − w·wd·lr`` before the update (Keras).
        row_stat_dtype: storage dtype of a table's ``r`` (default: the table's dtype).
            ``torch.bfloat16`` halves it: a 1,000,000 × 64 float32 table then needs 0.78% of its
            bytes for optimizer state instead of 1.56%.
        clipvalue: clip the gradient to ``(−c, c)`` (Keras).
        {keras_extras}

    Example::

        >>> opt = tte.optim.Adafactor(model.parameters(), lr=0.01)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    algorithm = "adafactor"
    slot_names = ("r", "c", "r_sum", "v")  # those present depend on the parameter (slot_specs)

    def __init__(
        self,
        params: Iterable[Any],
        lr: Any = 0.001,
        beta_2_decay: float = -0.8,
        epsilon_1: float = 1e-30,
        epsilon_2: float = 1e-3,
        clip_threshold: float = 1.0,
        relative_step: bool = True,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
        *,
        row_stat_dtype: torch.dtype | None = None,
        skip_nonfinite: bool = False,
    ) -> None:
        # weight_decay as a group's (_options_to_hp); the Keras extras of the signature go to the core's extras.
        super().__init__(params, *constructor_options(type(self), locals()))

    rule = staticmethod(adafactor_rule)

    @classmethod
    def _options_to_hp(cls, group: dict[str, Any]) -> None:
        # As the constructor: Keras's decoupled w·wd·lr is TF's weight_decay_factor times the lr.
        if "weight_decay" in group:
            wd = group.pop("weight_decay")
            if wd is not None:
                check_number("weight_decay", wd, minimum=0.0)
            group["weight_decay_factor"] = wd
            group["multiply_weight_decay_factor_by_learning_rate"] = True if wd else None

    @classmethod
    def _validate(cls, hp: dict[str, Any]) -> None:
        hp["beta_2_decay"] = check_number("beta_2_decay", hp["beta_2_decay"], maximum=0.0)
        # epsilon_1 = 0 gives 0/0 = NaN in the factored second moment of a row whose gradient is 0.
        hp["epsilon_1"] = check_number("epsilon_1", hp["epsilon_1"], minimum=0.0, min_inclusive=False)
        check_float32_normal("epsilon_1", hp["epsilon_1"], "must be a float")
        hp["epsilon_2"] = check_number("epsilon_2", hp["epsilon_2"], minimum=0.0)
        hp["clip_threshold"] = check_number("clip_threshold", hp["clip_threshold"], minimum=0.0, min_inclusive=False)
        check_bool("relative_step", hp["relative_step"])
        dt = hp["row_stat_dtype"]
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise arg_error("row_stat_dtype", "must be a floating torch.dtype or None", dt)

    @classmethod
    def slot_specs(cls, shape: tuple[int, ...], hp: Mapping[str, Any], table: bool) -> dict[str, SlotSpec]:
        if len(shape) < 2:
            return {"v": SlotSpec(shape)}
        specs = {
            "r": SlotSpec(shape[:-1], dtype=hp["row_stat_dtype"] if table else None),
            "c": SlotSpec((*shape[:-2], shape[-1]), rows=False),
        }
        if table:
            specs["r_sum"] = SlotSpec((), rows=False)
        return specs
