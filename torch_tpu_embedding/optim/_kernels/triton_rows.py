"""The eager step's row writes on CUDA as Triton kernels: adding spread bag gradients, and copying updated rows.

On a CUDA table the eager step keeps static shapes (no host read, :mod:`~torch_tpu_embedding._rows.dedup`): the
ids of a step carry a sentinel tail (padding), written into the table's last row with the value that row gets
anyway. Through torch's ops that costs passes over ``[N, D]`` arrays: SGD's step made every id's row
(``gain · increment(g[bag])``), masked the padding (``where``) and added it (``index_add_``); the kernel row
update (:mod:`.row_update`) returned each updated slot, weight and EMA row, its tail made to carry the sink
row's bytes (``sink_rows``), and ``index_copy_`` wrote each. Measured on one H200 (torch 2.11, 4 tables × 2M
× 128, 16,384 bags × 20 ids; docs/benchmarks.md): ``index_copy_`` moved 1.4 TB/s, a third of the copy
bandwidth. Here:

* :func:`add_rows`: ``dst[ids[i]] += gains[i] · src[i // L]`` for every id that is not the sentinel, one
  kernel per piece: the ``[B, D]`` per-bag rows are read (they stay in L2), nothing ``[N, D]`` is written. The
  adds are atomic, as ``index_add_``'s are on CUDA (duplicates sum in no fixed order, there and here); under
  ``torch.use_deterministic_algorithms(True)``, where ``index_add_`` is deterministic, torch's ops run
  (:func:`adds`). Each product is rounded once and added, as ``spread`` and ``index_add_`` round it.
* :func:`copy_rows`: ``dst[ids[i]] = src[i]`` for every id that is not the sentinel: sorted distinct ids
  (``dedup_static``), so no row is written twice and the tail writes nothing (no sink-row value needed).

:func:`available` says whether they run (a CUDA tensor, Triton importable: torch's CUDA builds bring it, and
``TTE_TRITON`` not ``0``); elsewhere the callers take torch's ops. A launch that raises (a kernel Triton cannot
compile for this GPU or toolchain, resources the GPU lacks) writes nothing (Triton compiles and checks a launch
before the kernel runs): it warns once, the kernels are off for the rest of the process, and that write and every
later one take torch's ops, as with ``TTE_TRITON=0``. Triton's interpreter
(``TRITON_INTERPRET=1``) runs both on CPU tensors, as tests/optim/test_triton_rows.py does where no GPU is.

Example (on a GPU)::

    >>> import torch
    >>> if available(torch.device("cuda")):
    ...     t = torch.zeros(3, 2, device="cuda")
    ...     add_rows(t, torch.tensor([0, 3, 0], device="cuda"), torch.ones(3, 2, device="cuda"), None, 1)
    ...     assert t.tolist() == [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]  # id 3, the sentinel, adds nothing
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import increment_version

from torch_tpu_embedding._rows.row_grad import BagRows

try:  # an optional dependency: CUDA builds of torch install it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only torch without triton
    triton = None
    tl = None

__all__ = ["accepts_add", "add_pieces", "add_rows", "adds", "available", "copy_rows"]

Tensor = torch.Tensor

#: rows per program, and the widest column block (wider rows loop over blocks)
_BLOCK_ROWS = 16
_MAX_BLOCK_D = 256
#: the first launch that raised in this process (its error's text): the kernels are off from then on
_FAILED: list[str] = []


def available(device: torch.device) -> bool:
    """Whether this module's kernels run for tensors on ``device``: CUDA (or, under Triton's interpreter, the
    CPU), Triton importable, ``TTE_TRITON`` not ``0``, not while ``torch.compile`` traces, and no launch of theirs
    has raised in this process."""
    if triton is None or os.environ.get("TTE_TRITON", "1") == "0" or torch.compiler.is_compiling() or _FAILED:
        # (under torch.compile the step is traced: torch's ops there, compiled with the user's graph)
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def adds(device: torch.device) -> bool:
    """Whether :func:`add_rows` is to run for tensors on ``device``: :func:`available`, and torch not asked for
    deterministic algorithms (``torch.use_deterministic_algorithms``: CUDA's ``index_add_`` is deterministic
    then, the atomic adds here are not; the copies write distinct rows and stay)."""
    return available(device) and not torch.are_deterministic_algorithms_enabled()


if triton is not None:

    # (Triton reads the annotations: only its own are allowed, so the plain arguments have none)
    @triton.jit  # type: ignore[misc]
    def _add_rows_kernel(dst, ids, src, gains, n, bound, width, dst_stride, src_stride,  # type: ignore[no-untyped-def]
                         DIM: tl.constexpr, HAS_GAINS: tl.constexpr,  # noqa: N803
                         BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # noqa: N803
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_range = r < n
        at = tl.load(ids + r, mask=in_range, other=bound)
        real = in_range & (at < bound) & (at >= 0)
        bag = r // width
        if HAS_GAINS:
            gain = tl.load(gains + r, mask=real, other=0.0)
        for d0 in tl.static_range(0, DIM, BLOCK_D):
            c = d0 + tl.arange(0, BLOCK_D)
            m = real[:, None] & (c[None, :] < DIM)
            v = tl.load(src + bag[:, None] * src_stride + c[None, :], mask=m, other=0.0)
            if HAS_GAINS:
                v = gain[:, None] * v
            tl.atomic_add(dst + at[:, None] * dst_stride + c[None, :], v.to(dst.dtype.element_ty), mask=m,
                          sem="relaxed")

    @triton.jit  # type: ignore[misc]
    def _copy_rows_kernel(dst, ids, src, n, bound, dst_stride, src_stride,  # type: ignore[no-untyped-def]
                          DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):  # noqa: N803
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_range = r < n
        at = tl.load(ids + r, mask=in_range, other=bound)
        real = in_range & (at < bound) & (at >= 0)
        for d0 in tl.static_range(0, DIM, BLOCK_D):
            c = d0 + tl.arange(0, BLOCK_D)
            m = real[:, None] & (c[None, :] < DIM)
            v = tl.load(src + r[:, None] * src_stride + c[None, :], mask=m)
            tl.store(dst + at[:, None] * dst_stride + c[None, :], v.to(dst.dtype.element_ty), mask=m)


def _launched(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> bool:
    """``kernel[grid](*args, **meta)``; ``False`` where it raises, which writes nothing (Triton compiles the kernel
    and checks the launch before it runs; errors in a running kernel surface later, at a synchronisation, and are
    not caught here). The first such failure warns, and turns the kernels off for the process (:func:`available`)."""
    try:
        kernel[grid](*args, **meta)
    except Exception as e:  # (compile errors, OutOfResources, a missing or too old toolchain: Triton's own types)
        if not _FAILED:  # (the first only: the kernels are off from now on)
            _FAILED.append(f"{type(e).__name__}: {e}")
            warnings.warn(
                "torch_tpu_embedding: a Triton kernel of the CUDA step failed to compile or launch "
                f"({type(e).__name__}: {str(e)[:500]}). The step writes its rows with torch's ops from now on in this "
                "process, as it does with TTE_TRITON=0 (set it to skip the kernels from the start).", RuntimeWarning,
                stacklevel=3)
        return False
    return True


def _torch_add(dst: Tensor, ids: Tensor, src: Tensor, gains: Tensor | None, width: int) -> None:
    """:func:`add_rows`'s sum through torch's ops (after a launch failed in the middle of :func:`add_pieces`): each
    product rounded once, as the kernel's; padding (the sentinel) adds a zero row to the last row, as the eager
    path's masked ``index_add_`` does."""
    d, s = _rows_view(dst), _rows_view(_source(src))
    assert d is not None and s is not None
    ids = ids.reshape(-1)
    rows = s.index_select(0, torch.arange(ids.numel(), device=ids.device) // width)
    if gains is not None:
        rows = gains.reshape(-1, 1).to(rows.dtype) * rows
    real = (ids >= 0) & (ids < d.shape[0])
    with torch.no_grad():
        d.index_add_(0, ids.clamp(0, d.shape[0] - 1), torch.where(real[:, None], rows, 0).to(d.dtype))


def _rows_view(t: Tensor) -> Tensor | None:
    """``t`` as ``[rows, columns]`` with unit column stride (a 1-D slot as one column), or ``None``."""
    v = t.unsqueeze(1) if t.dim() == 1 else t.flatten(1) if t.dim() > 2 and (
        not t.shape[0] or t[0].is_contiguous()) else t  # (a flatten that copies would not write t)
    return v if v.dim() == 2 and (v.stride(1) == 1 or v.shape[1] == 1) else None


def _source(src: Tensor) -> Tensor:
    """``src [B, D]`` with unit column stride: one broadcast row (``loss = out.sum()``'s gradient, strides
    ``(0, 0)``) made a real row, still broadcast over the bags; other strides copied."""
    if src.dim() == 2 and src.shape[0] and src.stride(0) == 0 and src.stride(1) != 1:
        return src[:1].contiguous().expand(src.shape)
    return src if src.dim() != 2 or src.stride(1) == 1 or src.shape[1] <= 1 else src.contiguous()


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The tensors' GPU made current for a launch: Triton launches on the current device and its current stream
    (a table on ``cuda:1`` while ``cuda:0`` is current would be written from the wrong device); torch's ops guard
    their device themselves."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _block_d(dim: int) -> int:
    return min(_MAX_BLOCK_D, max(16, int(triton.next_power_of_2(dim))))


def accepts_add(dst: Tensor, ids: Tensor, src: Tensor, gains: Tensor | None, width: int) -> bool:
    """Whether :func:`add_rows` takes these tensors (checked before any piece of a step is added)."""
    d, s = _rows_view(dst), _rows_view(_source(src))
    return not (d is None or s is None or ids.dtype != torch.int64 or d.shape[1] != s.shape[1] or width < 1
                or ids.numel() > s.shape[0] * width or dst.dtype not in (torch.float32, torch.float64)
                or src.device != dst.device or ids.device != dst.device
                or (gains is not None and (gains.numel() != ids.numel() or gains.device != dst.device)))


def add_rows(dst: Tensor, ids: Tensor, src: Tensor, gains: Tensor | None, width: int) -> bool:
    """``dst[ids[i]] += gains[i] · src[i // width]`` (``gains`` ``None``: ``src[i // width]``) for each ``i`` whose
    id is a row of ``dst`` (the sentinel ``dst.shape[0]``, padding, adds nothing). ``dst [V, D]``; ``ids [B·L]``
    int64; ``src [B, D]`` (rows of any stride, a broadcast one included); ``gains [B·L]`` or ``None``. ``False``
    (nothing done) where the kernel cannot take the tensors (:func:`accepts_add`) or its launch failed
    (:func:`_launched`): the caller adds through torch."""
    if _FAILED or not accepts_add(dst, ids, src, gains, width):
        return False
    d, s = _rows_view(dst), _rows_view(_source(src))
    assert d is not None and s is not None
    n = ids.numel()
    if n == 0:
        return True
    ids_c = ids.contiguous()
    g = ids_c if gains is None else gains.reshape(-1).contiguous()
    src_stride = s.stride(0) if s.shape[0] > 1 else 0
    with _on(dst.device):
        if not _launched(_add_rows_kernel, (triton.cdiv(n, _BLOCK_ROWS),), d, ids_c, s, g, n, d.shape[0], width,
                         d.stride(0), src_stride, DIM=d.shape[1], HAS_GAINS=gains is not None,
                         BLOCK_R=_BLOCK_ROWS, BLOCK_D=_block_d(d.shape[1])):
            return False
    increment_version(dst)  # (written through its pointer: autograd's check of saved tensors sees the change)
    return True


def add_pieces(dst: Tensor, pieces: list[tuple[Tensor, Tensor | BagRows]], src: Callable[[Tensor], Tensor],
               at: Tensor | None = None) -> bool:
    """:func:`add_rows` of each piece ``(ids [n], rows)`` of a row gradient (``RowGrad.chunks()``): ``src`` of its
    bag rows ``dL/dout`` spread by its gains (a :class:`BagRows`), or of its rows (width 1), added at its ids, or
    at the same positions of ``at`` (``[Σn]``). Every piece checked before any is added: ``False``, nothing done
    (also where the first piece's launch failed); a launch failing after some pieces were added, the rest are added
    here through torch's ops."""
    todo: list[tuple[Tensor, Tensor, Tensor | None, int]] = []
    start = 0
    for ids, rows in pieces:
        where = ids if at is None else at[start : start + ids.numel()]
        start += ids.numel()
        if isinstance(rows, BagRows):
            gains = None if rows.unit and rows.width == 1 else rows.gains.reshape(-1)
            todo.append((where, src(rows.grad_out), gains, max(1, rows.width)))
        else:
            todo.append((where, src(rows), None, 1))
    if not all(accepts_add(dst, *t) for t in todo):
        return False
    for k, t in enumerate(todo):
        if not add_rows(dst, *t):  # (a launch failed: nothing of it written)
            if k == 0:
                return False  # nothing added: the caller adds every piece through torch
            for rest in todo[k:]:  # the pieces before it are added: the rest through torch, here
                _torch_add(dst, *rest)
            break
    return True


def copy_rows(dst: Tensor, ids: Tensor, src: Tensor, bound: int) -> bool:
    """``dst[ids[i]] = src[i]`` for each ``i`` whose id is below ``bound`` (the table's rows: the sentinel tail
    writes nothing). ``ids [N]`` int64, no row twice among the real ones; ``src [N, ...]`` shaped as ``dst``'s
    rows. ``False`` (nothing done) where the kernel cannot take the tensors or its launch failed: the caller copies
    through torch."""
    d, s = _rows_view(dst), _rows_view(src)
    if _FAILED or d is None or s is None or ids.dtype != torch.int64 or d.shape[1] != s.shape[1] \
            or s.shape[0] != ids.numel() or bound > d.shape[0] or src.device != dst.device or ids.device != dst.device:
        return False
    n = ids.numel()
    if n == 0:
        return True
    with _on(dst.device):
        if not _launched(_copy_rows_kernel, (triton.cdiv(n, _BLOCK_ROWS),), d, ids.contiguous(), s, n, bound,
                         d.stride(0), s.stride(0), DIM=d.shape[1], BLOCK_R=_BLOCK_ROWS, BLOCK_D=_block_d(d.shape[1])):
            return False  # (nothing written: the caller copies through torch)
    increment_version(dst)
    return True
