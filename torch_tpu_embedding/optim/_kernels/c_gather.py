"""The lookup's row gather on eager CPU tables, ``weight[ids]``, as a C loop that prefetches rows a few ids ahead.

A lookup of one id per bag without weights (:mod:`torch_tpu_embedding.modules.lookup`) is a plain gather of
table rows. The rows are scattered over a large table, so each one is a cache miss (and a TLB miss). torch's
``index_select`` copies them one after another and waits for each miss. The loop here (source in
:mod:`.c_rules_source`) is built into the library of SGD's add, with its compiler, flags and verified kernel
cache (:func:`.c_add.library`). While it copies one row it prefetches the row :data:`.c_rules_source.PREFETCH_ROWS`
ids ahead. It copies bytes, so the result is bitwise ``index_select``'s for every dtype.

It runs only once this process has loaded the library (the kernel path of an optimizer's step loads it;
nothing is compiled for a lookup). It also needs a contiguous plain CPU table, int64 ids, and no
``torch.compile``. Everything else takes ``index_select`` as before. With several torch threads the ids are
split into one range per thread, run at once (:func:`.c_rules.in_parallel`).

A stacked group's join of its features' ids (:func:`join_ids`, ``modules/assembly.py``) is one pass of the same
library: the ids side by side, shifted to their tables' rows and checked, where ``torch.stack``, ``aminmax`` (and its
two host reads) and the add of the shifts made three passes and a fresh tensor each.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from torch_tpu_embedding.optim._kernels import c_add, c_rules
from torch_tpu_embedding.optim._kernels.c_args import in_memory

__all__ = ["gather_rows", "join_ids"]

Tensor = torch.Tensor

#: ids per thread below which the gather is not split over threads (as the row loops')
_MIN_ROWS_PER_THREAD = 2048


def gather_rows(weight: Tensor, ids: Tensor) -> Tensor:
    """``weight.index_select(0, ids)`` for ``ids [n]``: by the prefetching C loop where it applies (see the module's
    text), else by ``index_select``. Bitwise the same either way; no autograd (the lookup's forward calls it)."""
    lib = None if torch.compiler.is_compiling() else c_add.loaded()  # (traced: index_select, an op dynamo knows)
    if (lib is None or type(weight) not in (torch.Tensor, torch.nn.Parameter)
            or type(ids) is not torch.Tensor or not in_memory(weight) or not in_memory(ids)
            or weight.dim() != 2 or not weight.is_contiguous() or weight.is_quantized
            or ids.dtype != torch.int64 or ids.dim() != 1):  # (in_memory: a zero tensor's null pointer, say)
        return weight.index_select(0, ids)
    rows, row_bytes = weight.shape[0], weight.shape[1] * weight.element_size()
    ids = ids.contiguous()
    n = ids.shape[0]
    out = torch.empty(n, weight.shape[1], dtype=weight.dtype)
    threads = max(1, min(torch.get_num_threads(), n // _MIN_ROWS_PER_THREAD))
    bounds = [n * t // threads for t in range(threads + 1)]

    def part(t: int) -> int:
        a, b = bounds[t], bounds[t + 1]
        return lib.gather(out.data_ptr() + a * row_bytes, weight.data_ptr(), rows, row_bytes, ids.data_ptr() + 8 * a,
                          b - a)

    if any(c_rules.in_parallel(part, threads)):
        # (the same error index_select raises, with the offending id named)
        bad = ids[(ids < 0) | (ids >= rows)][0]
        raise IndexError(f"index {int(bad)} is out of bounds for dimension 0 with size {rows}")
    return out


def join_ids(values: Sequence[Tensor], shape: tuple[int, ...], shifts: Sequence[int], vocabs: Sequence[int]
             ) -> Tensor | None:
    """``F`` features' ids, each of ``shape`` (``[B, L]``, or ``[B]``: ``L`` is 1), side by side as ``[B, F, L]``
    int64, feature ``f``'s plus ``shifts[f]``, by one C pass that checks each id (before its shift) to lie in
    ``[0, vocabs[f])``. ``None`` where that does not apply (the library not loaded, ``torch.compile``, a value not a
    contiguous int64 CPU tensor of ``shape`` whose memory holds its values, no ids) or an id is outside its range:
    the caller then joins, checks and shifts with torch ops (``torch.stack``, ``aminmax``, ``add``), to the same ids,
    and raises its own error."""
    lib = None if torch.compiler.is_compiling() else c_add.loaded()
    if lib is None or not values or len(shape) not in (1, 2):
        return None
    b, width = shape[0], shape[1] if len(shape) == 2 else 1
    for v in values:
        if (type(v) is not torch.Tensor or v.dtype != torch.int64 or v.device.type != "cpu"
                or v.layout != torch.strided or v.shape != shape or not v.is_contiguous() or v.is_nested
                or v.is_neg() or v._is_zerotensor()):  # (values that are not the memory read, or no memory)
            return None
    f = len(values)
    if not b * width or len(shifts) != f or len(vocabs) != f:
        return None
    out = torch.empty(b, f, width, dtype=torch.int64)
    src = (ctypes.c_void_p * f)(*[v.data_ptr() for v in values])
    if lib.join_ids(out.data_ptr(), src, (ctypes.c_int64 * f)(*shifts), (ctypes.c_int64 * f)(*vocabs), f, b,
                    width) != 0:
        return None
    return out
