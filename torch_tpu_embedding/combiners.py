"""Combiners: how a bag of looked-up rows is reduced to one row (as TF's TPU embedding combiners).

For bag ``b`` with ids ``i_1..i_n``, weights ``w_1..w_n`` (default 1) and rows ``e_i``::

    sum  : out_b = Σ_k w_k e_{i_k}
    mean : out_b = Σ_k w_k e_{i_k} / Σ_k w_k
    sqrtn: out_b = Σ_k w_k e_{i_k} / sqrt(Σ_k w_k²)

Each id's *gain* is the factor multiplying its row (``w_k``, ``w_k/Σw``, ``w_k/sqrt(Σw²)``); the
backward gives id ``i_k`` the gradient ``gain_k · dL/dout_b``. Duplicate ids count separately,
negative weights are used as given, and an empty bag or a zero weight sum gives 0, never NaN.

Gains of 16-bit tables (float16, bfloat16) are computed in float32, as FBGEMM does: a float16 sum of
weights overflows at 65504 (``mean`` with two weights of 4e4, ``sqrtn`` with a weight of 300).

The normaliser of ``mean`` and ``sqrtn`` of a bag whose largest ``|w|`` is beyond ``2^±32`` is computed
on its weights scaled by a power of two near that magnitude, so ``Σw`` and ``Σw²`` cannot overflow (or
underflow) when every weight is finite (``mean`` of ``[3e38, 3e38]``, ``sqrtn`` of ``[1e20]`` give the
float64 result rounded, not 0). The gains are invariant to the scale, and the bags of ordinary
weights are not scaled: their gains are bitwise those of the plain formula.
"""

from __future__ import annotations

import functools
import math

import torch

from torch_tpu_embedding._util.dtypes import compute_dtype

__all__ = ["bag_gains", "full_mean_gain", "jagged_gains"]


def bag_gains(
    valid: torch.Tensor, weights: torch.Tensor | None, combiner: str, dtype: torch.dtype
) -> torch.Tensor:
    """Per-id gains ``[N, L]`` of padded bags.

    Args:
        valid: ``[N, L]`` bool, True at real ids.
        weights: ``[N, L]`` per-id weights or ``None`` (all 1). Values at padding are ignored.
        combiner: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
        dtype: the table's float dtype. The gains are in that dtype, or float32 for a 16-bit table.

    Example::

        >>> valid = torch.tensor([[True, True, False], [False, False, False]])
        >>> bag_gains(valid, None, "mean", torch.float32)
        tensor([[0.5000, 0.5000, 0.0000],
                [0.0000, 0.0000, 0.0000]])
    """
    dtype = compute_dtype(dtype)
    zero = torch.zeros((), dtype=dtype, device=valid.device)
    w = valid.to(dtype) if weights is None else torch.where(valid, weights.to(dtype), zero)
    if combiner == "sum":
        return w
    if weights is not None and combiner in ("mean", "sqrtn"):
        biggest = w.detach().abs().amax(dim=1, keepdim=True) if w.shape[1] else w.new_zeros(w.shape[0], 1)
        w = w * _power_of_two_scale(biggest)
    if combiner == "mean":
        total = w.sum(dim=1, keepdim=True)
        # T(x) = 0 if x == 0 else 1/x; the inner where keeps inf/NaN out of the graph.
        scale = torch.where(total == 0, zero, 1.0 / torch.where(total == 0, 1.0, total))
    elif combiner == "sqrtn":
        total = (w * w).sum(dim=1, keepdim=True)
        scale = torch.where(total == 0, zero, torch.rsqrt(torch.where(total == 0, 1.0, total)))
    else:
        raise ValueError(f"Argument `combiner` must be in ('mean', 'sum', 'sqrtn'). Received: {combiner!r}")
    return w * scale


def jagged_gains(
    bag: torch.Tensor, num_bags: int, weights: torch.Tensor | None, combiner: str, dtype: torch.dtype
) -> torch.Tensor:
    """Per-id gains ``[nnz]`` of jagged bags (:func:`bag_gains` without padding).

    Args:
        bag: ``[nnz]`` each id's bag, non-decreasing, in ``[0, num_bags)``.
        num_bags: the number of bags ``N``.
        weights: ``[nnz]`` per-id weights or ``None`` (all 1).
        combiner, dtype: as :func:`bag_gains`.
    """
    dtype = compute_dtype(dtype)
    w = torch.ones(bag.shape, dtype=dtype, device=bag.device) if weights is None else weights.to(dtype)
    if combiner == "sum":
        return w
    if combiner not in ("mean", "sqrtn"):
        raise ValueError(f"Argument `combiner` must be in ('mean', 'sum', 'sqrtn'). Received: {combiner!r}")
    zeros = torch.zeros(num_bags, dtype=dtype, device=bag.device)
    if weights is not None:
        biggest = zeros.scatter_reduce(0, bag, w.detach().abs(), "amax")
        w = w * _power_of_two_scale(biggest).index_select(0, bag)
    total = zeros.index_add(0, bag, w if combiner == "mean" else w * w)
    safe = torch.where(total == 0, 1.0, total)
    scale = torch.where(total == 0, 0.0, 1.0 / safe if combiner == "mean" else torch.rsqrt(safe))
    return w * scale.index_select(0, bag)


def _power_of_two_scale(biggest: torch.Tensor) -> torch.Tensor:
    """Per bag: 1 where its largest ``|w|`` (``biggest``) is within ``2^±32`` (a sum or sum of squares of
    such weights cannot overflow: the gains are bitwise the plain formula's), else ``2^-e`` with ``2^e``
    near ``biggest`` and ``e`` clamped so that ``2^±e`` is a normal number of its dtype (subnormals flush
    to 0 on TPUs). The scaled weights are at most 4 in magnitude; a constant (no gradient).
    """
    info = torch.finfo(biggest.dtype)
    low, high = math.log2(info.tiny), math.floor(math.log2(info.max)) - 1  # float32: -126, 126
    exponent = torch.floor(torch.log2(biggest)).clamp(min=low, max=high)
    # pow, not exp2: torch_xla 2.9 lowers pow, while exp2 runs on the host
    scale = torch.pow(2.0, -exponent)
    ordinary = (biggest >= 2.0**-32) & (biggest <= 2.0**32)
    return torch.where(ordinary, torch.ones((), dtype=scale.dtype, device=scale.device), scale)


@functools.lru_cache(maxsize=256)
def full_mean_gain(width: int, dtype: torch.dtype) -> float:
    """Every gain of full ``mean`` bags of ``width`` ids without weights, as :func:`bag_gains` computes it for a
    table of ``dtype`` (``1 / width`` by its ``reciprocal`` in the compute dtype, rounded once), as a Python
    number (exact: a float32 or float64 value); computed once per width and dtype."""
    return (1.0 / torch.full((), float(width), dtype=compute_dtype(dtype))).item()
