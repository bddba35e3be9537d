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
"""

from __future__ import annotations

import torch

from torch_tpu_embedding.optim._kernels import c_add, c_rules

__all__ = ["gather_rows"]

Tensor = torch.Tensor

#: ids per thread below which the gather is not split over threads (as the row loops')
_MIN_ROWS_PER_THREAD = 2048


def gather_rows(weight: Tensor, ids: Tensor) -> Tensor:
    """``weight.index_select(0, ids)`` for ``ids [n]``: by the prefetching C loop where it applies (see the module's
    text), else by ``index_select``. Bitwise the same either way; no autograd (the lookup's forward calls it)."""
    lib = None if torch.compiler.is_compiling() else c_add.loaded()  # (traced: index_select, an op dynamo knows)
    if (lib is None or type(weight) not in (torch.Tensor, torch.nn.Parameter)
            or type(ids) is not torch.Tensor or weight.device.type != "cpu" or ids.device.type != "cpu"
            or weight.layout != torch.strided or weight.dim() != 2 or not weight.is_contiguous()
            or weight.is_quantized or weight.is_conj() or weight.is_neg()
            or ids.dtype != torch.int64 or ids.dim() != 1):
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
