"""``Path.ADDITIVE``'s kernel on the CPU: ``p[ids[k]] += f · g[k]``, one C loop over a piece's ids.

The eager additive step (:func:`._paths._update_additive`, SGD) makes ``increment(g) = f·g`` (``f = −lr``)
for every looked-up id as a ``[n, D]`` array and adds it with ``index_add_``: two passes over the rows, and
torch's ``index_add_`` on the CPU runs one ``add`` per id through a ``TensorIterator``. Where the rule's
increment is a scalar multiple of the gradient (:meth:`~._base.RowSparseOptimizer.increment_factor`), this
module adds ``f · g[k]`` to row ``ids[k]`` in one C loop that reads each gradient row once, writes no
temporary, and prefetches the table row a few ids ahead (the rows are scattered over a large table: each
is a cache miss). Measured on 4 pieces of 4,096 ids of 64 floats, one thread, a 1 GB table: 0.49–0.57 ms,
against 0.9–1.0 ms for the same loop compiled by inductor and 1.3 ms for the increments and ``index_add_``
(docs/benchmarks.md has the step).

The loop is compiled once per process with the system's C compiler (``CC``, else ``cc``, ``gcc`` or
``clang``; about 0.2 s) and called through :mod:`ctypes`. The result is bitwise the eager path's at any
thread count (tests/test_fused_add.py): each element is rounded once in the product and once in the sum,
as torch's ``mul`` and ``index_add_`` round them (``-ffp-contract=off``: no fused multiply-add), the ids of a
piece are added in order, and the pieces in the eager path's order. Padding (the sentinel id, one past the
last row) is skipped in the loop, as the eager path drops it first. The C function first checks every id
of the piece and writes nothing if one is outside the table's rows and the sentinel.

It runs where the fused row update would (:func:`._fused_update.usable`, its :func:`~._fused_update.policy`:
from the optimizer's call ``TTE_FUSED_AFTER`` on, for tables of ``TTE_FUSED_MIN_ELEMENTS`` numbers or
more), on contiguous CPU float32 tables without ``loss_scale_factor``; everything else, or a loop that
cannot be compiled (one warning), takes the eager add.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import increment_version

from torch_tpu_embedding._registry import optimizer_class
from torch_tpu_embedding.optim import _fused_update

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._intake import Work

__all__ = ["AddRows", "Pieces", "add_rows_kernel", "c_compiler", "loop"]

Tensor = torch.Tensor
#: ``(ids [n], g [n, D])`` pieces, added in order
Pieces = list[tuple[Tensor, Tensor]]
#: ``fn(p, pieces, lr)`` adds ``increment(g, lr)`` to the rows ``ids`` of ``p``, piece by piece in order
AddRows = Callable[[Tensor, Pieces, Tensor], None]

#: ids ahead whose table row is prefetched (4, 8 and 16 measured alike; none is 10-15% slower)
PREFETCH = 8

_SOURCE = r"""
#include <stdint.h>
/* p[ids[k]] += f * g[k] for k in [0, n), in order, skipping ids == rows (padding, the sentinel);
   -1 (nothing written) if an id is outside [0, rows]. */
int tte_add_rows(float *restrict p, int64_t rows, int64_t d, const int64_t *restrict ids, int64_t n,
                 const float *restrict g, int64_t gs0, int64_t gs1, const float *restrict factor) {
  for (int64_t k = 0; k < n; ++k)
    if (ids[k] < 0 || ids[k] > rows) return -1;
  const float f = *factor;
  for (int64_t k = 0; k < n; ++k) {
    if (k + %(ahead)d < n && ids[k + %(ahead)d] < rows) {
      const char *next = (const char *)(p + ids[k + %(ahead)d] * d);
      for (int64_t b = 0; b < d * (int64_t)sizeof(float); b += 64) __builtin_prefetch(next + b, 1, 3);
    }
    if (ids[k] == rows) continue;
    float *row = p + ids[k] * d;
    const float *gk = g + k * gs0;
    if (gs1 == 1)
      for (int64_t j = 0; j < d; ++j) row[j] += f * gk[j];
    else
      for (int64_t j = 0; j < d; ++j) row[j] += f * gk[j * gs1];
  }
  return 0;
}
""" % {"ahead": PREFETCH}

#: the compiled loop (``None``: it could not be compiled), once per process
_LOOP: list[Callable[..., int] | None] = []


def c_compiler() -> str | None:
    """The C compiler the loop is built with: ``CC``, else the first of ``cc``, ``gcc``, ``clang`` on the PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(cc) or cc
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def loop() -> Callable[..., int] | None:
    """``tte_add_rows`` of :data:`_SOURCE`, compiled on the first call; ``None`` (after one warning) if it cannot
    be."""
    if not _LOOP:
        try:
            _LOOP.append(_build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _LOOP.append(None)
            text = str(e).strip()
            _fused_update.warn_once(f"{type(e).__name__}: {text.splitlines()[0] if text else ''}")
    return _LOOP[0]


def _build() -> Callable[..., int]:
    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install cc, gcc or clang)")
    # -ffp-contract=off: a product and a sum, each rounded, as torch's mul and index_add_ (a fused multiply-add
    # would round once and differ in the last bit). -march=native only where the compiler takes it.
    flags = ["-O3", "-ffp-contract=off", "-fPIC", "-shared"]
    with tempfile.TemporaryDirectory(prefix="tte_add_rows_") as tmp:
        src, lib = os.path.join(tmp, "add_rows.c"), os.path.join(tmp, "add_rows.so")
        with open(src, "w") as f:
            f.write(_SOURCE)
        errors = ""
        for extra in (["-march=native"], []):
            run = subprocess.run([cc, *flags, *extra, src, "-o", lib], capture_output=True, text=True, timeout=120)
            if run.returncode == 0:
                break
            errors = run.stderr.strip()
        else:
            raise RuntimeError(f"{os.path.basename(cc)} failed: {errors.splitlines()[0] if errors else 'no output'}")
        fn = ctypes.CDLL(lib).tte_add_rows  # (the mapping outlives the deleted file)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, i64, ptr]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def add_rows_kernel(item: Work) -> AddRows | None:
    """The C add of ``item``'s increments, or ``None`` where this step takes the eager path."""
    p, group = item.p, item.group
    factor_of = optimizer_class(group["algorithm"]).increment_factor
    if (item.divisor is not None or p.device.type != "cpu" or p.dtype != torch.float32 or p.dim() != 2
            or not p.is_contiguous() or not sys.platform.startswith(("linux", "darwin"))
            or not _fused_update.usable(p) or _fused_update.warming_up(item)):
        return None
    factor = factor_of(item.lr)
    if factor is None or factor.dtype != torch.float32 or factor.numel() != 1 or factor.device != p.device:
        return None
    fn = loop()
    if fn is None:
        return None

    def add(p: Tensor, pieces: Pieces, lr: Tensor) -> None:
        f, (rows, dim) = factor_of(lr), p.shape
        assert f is not None
        f = f.contiguous()
        for ids, g in pieces:
            if ids.numel():
                add_piece(fn, p, rows, dim, ids, g, f)
        increment_version(p)  # (written through its pointer: autograd's check of saved tensors sees the change)

    return add


def add_piece(fn: Callable[..., int], p: Tensor, rows: int, dim: int, ids: Tensor, g: Tensor, factor: Tensor) -> None:
    """``p[ids[k]] += factor · g[k]`` through the C loop ``fn``: ``ids`` int64 ``[n]`` (``rows``, the sentinel, marks
    padding: skipped), ``g`` float32 ``[n, dim]`` (any strides), ``factor`` one float32. The shapes and dtypes are
    checked here: the loop trusts its pointers."""
    ids = ids.contiguous()
    if (ids.dtype != torch.int64 or ids.dim() != 1 or g.dtype != torch.float32 or tuple(g.shape) != (ids.numel(), dim)
            or factor.dtype != torch.float32 or factor.numel() != 1 or not factor.is_contiguous()):
        raise ValueError(f"add_piece: ids {ids.dtype} {tuple(ids.shape)}, rows {g.dtype} {tuple(g.shape)}, factor "
                         f"{factor.dtype} {tuple(factor.shape)}; expected int64 [n], float32 [n, {dim}], float32 []")
    if fn(p.data_ptr(), rows, dim, ids.data_ptr(), ids.numel(), g.data_ptr(), g.stride(0), g.stride(1),
          factor.data_ptr()) != 0:
        raise IndexError(f"an id to update is outside the table's {rows} rows and its padding id {rows} (an "
                         "internal error: ids are checked at the lookup)")
