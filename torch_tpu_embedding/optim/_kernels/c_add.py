"""``Path.ADDITIVE``'s kernel on the CPU: ``p[id] += gain · (f · g[bag])``, one C loop over a piece's ids.

The eager additive step (:func:`.additive.update_additive`, SGD) makes ``increment(g) = f·g`` (``f = −lr``)
for every bag, spreads it over the bag's ids by their gains (``BagRows.spread``: an ``[n, D]`` array, one row
per id) and adds that with ``index_add_``: passes over memory for the product, the spread rows and the add,
and torch's ``index_add_`` on the CPU runs one ``add`` per id through a ``TensorIterator``. Where the rule's
increment is a scalar multiple of the gradient (:meth:`~.base.RowSparseOptimizer.increment_factor`), this
module does it in one C loop: per bag, ``f · g[bag]`` once into a ``D``-float scratch row, then for each of the
bag's ids ``gain · that`` added to its table row (sum bags of one id without weights, and rows that arrive
multiplied out, have no gain: ``f · g`` is added). Nothing ``[n, D]`` is written, each gradient row is read
once, and the table rows a few ids ahead are prefetched, at two distances as :mod:`.c_rules_source`'s loops do (the
rows are scattered over a large table: each is a cache miss). Measured at one thread, a 1 GB table: 4 pieces of
4,096 ids of 64 floats, 0.49–0.57 ms against 0.9–1.0 ms for the same loop compiled by inductor and 1.3 ms for the
increments and ``index_add_``; the SGD step at 20 ids per bag 62–64 → 40–41 ms (docs/benchmarks.md; measured with
the first-level prefetch alone, before the second distance was added).

The loop (source in :mod:`.c_add_source`) is in the kernels' one C library (:mod:`.c_library`: its compiler,
flags and verified kernel cache).

The result is bitwise the eager path's at any thread count (tests/optim/test_c_add.py): each product (``f · g``,
then ``gain ·`` it) and each sum is rounded once, as torch's ``mul`` and ``index_add_`` round them
(``-ffp-contract=off``: no FMA); the ids are added in the eager path's order (piece by piece,
bag by bag). Padding (the sentinel id, one past the last row) is skipped in the loop, as the eager path drops
it first. The C function first checks every id of the piece and writes nothing if one is outside the table's
rows and the sentinel.

It runs where the kernel row update would (:func:`.kernel_policy.usable`, its :func:`.kernel_policy.policy`:
from the optimizer's call ``TTE_KERNEL_AFTER`` on, for tables of ``TTE_KERNEL_MIN_ELEMENTS`` numbers or
more), on contiguous CPU float32 tables without ``loss_scale_factor``; everything else, or a loop that
cannot be compiled (one warning), takes the eager add.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import increment_version

from torch_tpu_embedding._util.registry import rule_of
from torch_tpu_embedding.optim._kernels import c_library, kernel_policy
from torch_tpu_embedding.optim._kernels.c_args import in_memory

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.grad_intake import Work

__all__ = ["AddRows", "Pieces", "add_piece", "add_rows_kernel", "loop"]

Tensor = torch.Tensor
#: ``(ids [B·L], g [B, D], gains [B, L] or None)`` pieces, added in order (see :func:`add_piece`)
Pieces = list[tuple[Tensor, Tensor, Tensor | None]]
#: ``fn(p, pieces)`` adds the step's increments to the rows ``ids`` of ``p``, piece by piece in order
AddRows = Callable[[Tensor, Pieces], None]


def loop() -> Callable[..., int] | None:
    """``tte_add_rows`` of :mod:`.c_add_source`, in :func:`.c_library.library` (loaded from its cache or compiled
    on the first call); ``None`` (after one warning) if it cannot be."""
    lib = c_library.library()
    return None if lib is None else lib.add


def add_rows_kernel(item: Work) -> AddRows | None:
    """The C add of ``item``'s increments, or ``None`` where this step takes the eager path."""
    p, group = item.p, item.group
    factor_of = rule_of(group).increment_factor
    if (item.divisor is not None or p.device.type != "cpu" or p.dtype != torch.float32 or p.dim() != 2
            or not p.is_contiguous() or not sys.platform.startswith(("linux", "darwin"))
            or not kernel_policy.usable(p) or kernel_policy.warming_up(item)):
        return None
    factor = factor_of(item.lr)
    if factor is None or factor.dtype != torch.float32 or factor.numel() != 1 or factor.device != p.device:
        return None
    fn = loop()
    if fn is None:
        return None
    f = factor.contiguous()

    def add(p: Tensor, pieces: Pieces) -> None:
        inc = torch.empty(p.shape[1], dtype=torch.float32)
        for ids, g, gains in pieces:
            if ids.numel():
                add_piece(fn, p, ids, g, gains, f, inc)
        increment_version(p)  # (written through its pointer: autograd's check of saved tensors sees the change)

    return add


def add_piece(fn: Callable[..., int], p: Tensor, ids: Tensor, g: Tensor, gains: Tensor | None, factor: Tensor,
              inc: Tensor) -> None:
    """Through the C loop ``fn``, for each bag ``b`` and each of its ids ``i`` in order, ``p[i] += gain · (factor ·
    g[b])``: ``g`` float32 ``[B, D]`` (any strides), ``ids`` int64 ``[B·L]``, ``gains`` float32 ``[B, L]`` (or
    ``None``: ``L`` is 1 and ``p[i] += factor · g[b]``), ``factor`` one float32, ``inc`` ``D`` floats of scratch.
    An id equal to ``p``'s row count (the sentinel) marks padding: skipped. Everything is checked here: the loop
    trusts its pointers."""
    rows, dim = p.shape
    ids = ids.contiguous()
    nbags = g.shape[0] if g.dim() == 2 else -1
    width = 1 if gains is None else (gains.shape[1] if gains.dim() == 2 else -1)
    if gains is not None:
        gains = gains.contiguous()
    tensors = (p, ids, g, factor, inc) + (() if gains is None else (gains,))
    if (ids.dtype != torch.int64 or ids.dim() != 1 or g.dtype != torch.float32 or g.dim() != 2 or g.shape[1] != dim
            or ids.numel() != nbags * width
            or (gains is not None and (gains.dtype != torch.float32 or gains.shape[0] != nbags))
            or factor.dtype != torch.float32 or factor.numel() != 1 or inc.dtype != torch.float32 or inc.numel() < dim
            or not p.is_contiguous() or p.dtype != torch.float32
            or not all(in_memory(t) for t in tensors)):
        got = None if gains is None else (gains.dtype, tuple(gains.shape))
        raise ValueError(f"add_piece: ids {ids.dtype} {tuple(ids.shape)}, rows {g.dtype} {tuple(g.shape)}, gains {got} "
                         f"for a {tuple(p.shape)} table; expected int64 [B·L], float32 [B, {dim}], float32 [B, L] or "
                         "None, all strided on the CPU")
    if fn(p.data_ptr(), rows, dim, ids.data_ptr(), nbags, width, g.data_ptr(), g.stride(0), g.stride(1),
          None if gains is None else gains.data_ptr(), factor.data_ptr(), inc.data_ptr()) != 0:
        raise IndexError(f"an id to update is outside the table's {rows} rows and its padding id {rows} (an "
                         "internal error: ids are checked at the lookup)")
