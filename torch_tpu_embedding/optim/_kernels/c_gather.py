"""The lookup's row gather on eager CPU tables, ``weight[ids]``, as a C loop that prefetches rows a few ids ahead.

A lookup of one id per bag without weights (:mod:`torch_tpu_embedding.modules.lookup`) is a plain gather of
table rows. The rows are scattered over a large table, so each one is a cache miss (and a TLB miss). torch's
``index_select`` copies them one after another and waits for each miss. The loop here (source in
:mod:`.c_rules_source`) is built into the library of SGD's add, with its compiler, flags and verified kernel
cache (:func:`.c_library.library`). While it copies one row it prefetches the row :data:`.c_rules_source.PREFETCH_ROWS`
ids ahead into the first-level cache and the row :data:`.c_rules_source.PREFETCH_FAR` ahead into the second, which keeps
more misses in flight (0.75 → 0.67 ms for 16,384 rows of 256 bytes, docs/benchmarks.md). It copies bytes, so the
result is bitwise ``index_select``'s for every dtype.

It runs only once this process has loaded the library (the kernel path of an optimizer's step loads it;
nothing is compiled for a lookup). It also needs a contiguous plain CPU table, int64 ids, and no
``torch.compile``. Everything else takes ``index_select`` as before. With several torch threads the ids are
split into one range per thread, run at once (:func:`.c_rules.in_parallel`).

A stacked group's join of its features' ids (:func:`join_ids`, ``modules/assembly.py``) is one pass of the same
library: the ids side by side, shifted to their tables' rows, padding written as the group's padding id and checked,
where ``torch.stack`` (of the ids and of their masks), ``aminmax`` (and its two host reads), the add of the shifts and a
``where`` made a pass and a fresh tensor each. Host ids bound for an accelerator come out int32 where the group's rows
allow (half the bytes to move; widened on the device), for CUDA in pinned memory, and their masks stay on the host
(what that saves and costs: docs/benchmarks.md, "host ids for an accelerator joined by one C pass"). Such ids take
this pass from a group's first call (:func:`join_library` builds the library then).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from torch_tpu_embedding.optim._kernels import c_library, c_rules, kernel_policy
from torch_tpu_embedding.optim._kernels.c_args import in_memory
from torch_tpu_embedding.optim._kernels.c_rules_source import JOIN_IDS

__all__ = ["gather_rows", "join_ids", "join_library"]

Tensor = torch.Tensor

#: ids per thread below which the gather is not split over threads (as the row loops')
_MIN_ROWS_PER_THREAD = 2048
#: ids per thread below which :func:`join_ids` is not split over threads (a copy: far cheaper per id than a row)
_MIN_IDS_PER_THREAD = 1 << 17


def gather_rows(weight: Tensor, ids: Tensor) -> Tensor:
    """``weight.index_select(0, ids)`` for ``ids [n]``: by the prefetching C loop where it applies (see the module's
    text), else by ``index_select``. Bitwise the same either way; no autograd (the lookup's forward calls it)."""
    lib = None if torch.compiler.is_compiling() else c_library.loaded()  # (traced: index_select, an op dynamo knows)
    if (lib is None or type(weight) not in (torch.Tensor, torch.nn.Parameter)
            or type(ids) is not torch.Tensor or not in_memory(weight) or not in_memory(ids)
            or weight.dim() != 2 or not weight.is_contiguous() or weight.is_quantized
            or ids.dtype != torch.int64 or ids.dim() != 1):  # (in_memory: a zero tensor's null pointer, misaligned ids)
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


def _pointers(values: Sequence[Tensor], dtype: torch.dtype, shape: tuple[int, ...]
              ) -> ctypes.Array[ctypes.c_void_p] | None:
    """The addresses of ``values``' memory, or ``None`` unless each is a contiguous CPU tensor of ``dtype`` and
    ``shape`` whose memory holds its values (not a negative view), exists (not a zero tensor's null pointer) and is
    aligned to its type (``torch.frombuffer`` at an odd offset: the C pass's int64 loads would be undefined).
    :func:`.c_args.in_memory`'s test, inlined: this runs per feature and step, and the call with its conjugate and
    zero-tensor reads (neither applies to int64 or bool ids: the null pointer tells the latter) cost the join a
    third more at 100 features (docs/benchmarks.md)."""
    tensor, strided, ptrs, size = torch.Tensor, torch.strided, [], dtype.itemsize
    for v in values:
        if (type(v) is not tensor or v.dtype is not dtype or not v.is_cpu or v.layout is not strided or v.is_nested
                or v.shape != shape or not v.is_contiguous() or v.is_neg()):
            return None
        ptr = v.data_ptr()
        if not ptr or ptr % size:  # (a zero tensor: no memory; misaligned: torch's ops read it, a C int64 load not)
            return None
        ptrs.append(ptr)
    return (ctypes.c_void_p * len(ptrs))(*ptrs)


@functools.lru_cache(maxsize=256)
def _layout(shifts: tuple[int, ...], vocabs: tuple[int, ...], sentinel: int
            ) -> tuple[ctypes.Array[ctypes.c_int64], ctypes.Array[ctypes.c_int64], bool]:
    """A group layout's shifts and row counts as C arrays, and whether every id its join can write fits int32 (made
    once)."""
    top = max([sentinel, *(s + v - 1 for s, v in zip(shifts, vocabs, strict=True))])
    low = min([sentinel, *shifts])
    fits = -(2**31) <= low and top < 2**31
    return (ctypes.c_int64 * len(shifts))(*shifts), (ctypes.c_int64 * len(vocabs))(*vocabs), fits


def join_library() -> c_library.Library | None:
    """The library for :func:`join_ids` of host ids bound for an accelerator (XLA, CUDA): loaded, or built on this
    first call of the process (about 2 s once per machine: the kernel cache keeps it), so that every step of a run
    takes one path; ``None`` under ``torch.compile``, with ``TTE_UPDATE_KERNEL=0`` (the kernel path off) or where it
    cannot be built (one warning; the torch ops join as before)."""
    if torch.compiler.is_compiling() or not kernel_policy.enabled():
        return None
    return c_library.library()


def join_ids(values: Sequence[Tensor], shape: tuple[int, ...], shifts: Sequence[int], vocabs: Sequence[int],
             masks: Sequence[Tensor] | None = None, sentinel: int = 0, narrow: bool = False, pinned: bool = False,
             lib: c_library.Library | None = None) -> Tensor | None:
    """``F`` features' ids, each of ``shape`` (``[B, L]``, or ``[B]``: ``L`` is 1), side by side as ``[B, F, L]``,
    feature ``f``'s plus ``shifts[f]``, by one C pass that checks each id (before its shift) to lie in
    ``[0, vocabs[f])``. With ``masks`` (one bool tensor of ``shape`` per feature) an id masked out is written as
    ``sentinel`` and not checked (it need not be an id). int64, or int32 where ``narrow`` and every id written fits
    (half the bytes to move to a device); in pinned memory where ``pinned`` (bound for CUDA: no copy into a pinned
    buffer after). ``lib``: the library to use (default: the one this process has loaded, if any).

    ``None`` where that does not apply (no library, ``torch.compile``, a value not a contiguous int64 CPU tensor of
    ``shape`` whose memory holds its values, a mask not a contiguous bool one, no ids) or an id is outside its range:
    the caller then joins, checks and shifts with torch ops (``torch.stack``, ``aminmax``, ``add``, ``where``), to the
    same ids, and raises its own error."""
    lib = None if torch.compiler.is_compiling() else c_library.loaded() if lib is None else lib
    if lib is None or not values or len(shape) not in (1, 2):
        return None
    b, width = shape[0], shape[1] if len(shape) == 2 else 1
    f = len(values)
    if width > JOIN_IDS:  # (a bag of more ids than the C pass's block)
        return None
    if masks is not None and len(masks) != f:
        return None
    src = _pointers(values, torch.int64, shape)
    keep = None if masks is None else _pointers(masks, torch.bool, shape)
    if src is None or (masks is not None and keep is None) or not b * width or len(shifts) != f or len(vocabs) != f:
        return None
    shift, vocab, fits = _layout(tuple(shifts), tuple(vocabs), sentinel)
    narrow = narrow and fits
    out = torch.empty(b, f, width, dtype=torch.int32 if narrow else torch.int64, pin_memory=pinned)
    threads = max(1, min(torch.get_num_threads(), b * f * width // _MIN_IDS_PER_THREAD))
    bounds = [b * t // threads for t in range(threads + 1)]

    def part(t: int) -> int:
        return lib.join_ids(out.data_ptr(), int(narrow), src, keep, shift, vocab, sentinel, f, bounds[t],
                            bounds[t + 1], width)

    return None if any(c_rules.in_parallel(part, threads)) else out
