"""The dtype arithmetic runs in: float32 for 16-bit tables, the table's own dtype otherwise.

One rule, used by the combiners (bags are summed in it), the optimizers (slots are kept and rows
updated in it), clipping and the gradient exchanges. In float16 an Adagrad accumulator overflows to
inf within a few hundred steps (the row then never moves again) and Adam's ``eps² = 1e-14`` is 0 (a
row with a zero gradient gets 0/0); bfloat16 keeps about 3 significant digits. As FBGEMM does, 16-bit
tables keep float32 slots and update in float32; only the weight is stored in 16 bits.

Example::

    >>> import torch
    >>> math_dtype(torch.zeros(2, 4, dtype=torch.bfloat16))
    torch.float32
"""

from __future__ import annotations

import torch

__all__ = ["compute_dtype", "dtype_kind", "math_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in for values of ``dtype``: float32 for 16-bit floats, else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def math_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of ``p``'s optimizer state and update arithmetic (:func:`compute_dtype` of its dtype)."""
    return compute_dtype(p.dtype)


def dtype_kind(dtype: torch.dtype) -> str:
    """The kind of ``dtype`` a checkpoint check compares: ``"bool"``, ``"complex"``, ``"floating point"``
    or ``"integer"`` (a saved tensor may change its width, not its kind)."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating point" if dtype.is_floating_point else "integer"
