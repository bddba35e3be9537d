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

The normaliser of ``mean`` and ``sqrtn`` is computed on the bag's weights scaled by a power of two near
their largest magnitude, so ``Σw`` and ``Σw²`` cannot overflow when every weight is finite (``mean`` of
``[3e38, 3e38]``, ``sqrtn`` of ``[1e20]`` give the float64 result rounded, not 0). Scaling by a power of
two is exact and the gains are invariant to it, so the gains of bags whose sums do not overflow are
bitwise those of the plain formula.
"""

from __future__ import annotations

import math

import torch

from torch_tpu_embedding._dtypes import compute_dtype

__all__ = ["bag_gains"]


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
        w = w * _power_of_two_scale(w)
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


def _power_of_two_scale(w: torch.Tensor) -> torch.Tensor:
    """Per bag ``[N, 1]``: ``2^-e`` with ``2^e`` near the bag's largest ``|w|``, ``e`` clamped so that
    ``2^±e`` is a normal number of ``w``'s dtype (subnormals flush to 0 on TPUs). The scaled weights are
    at most 4 in magnitude, so their sum and sum of squares stay finite; a constant (no gradient).
    """
    info = torch.finfo(w.dtype)
    biggest = w.detach().abs().amax(dim=1, keepdim=True) if w.shape[1] else w.new_zeros(w.shape[0], 1)
    low, high = math.log2(info.tiny), math.floor(math.log2(info.max)) - 1  # float32: -126, 126
    exponent = torch.floor(torch.log2(biggest)).clamp(min=low, max=high)
    return torch.exp2(-exponent)
