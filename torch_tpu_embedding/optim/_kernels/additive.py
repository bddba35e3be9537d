"""``Path.ADDITIVE``: an additive rule's step (SGD's, without options that need summed rows) as ``increment(g)``
added per looked-up id, with no dedup, gather or scatter.

``increment(g)`` is ``rule(w, g) − w``, linear in ``g``. It is added per id in pieces: of :data:`ADDITIVE_CHUNK` ids on
the CPU (a few element-wise passes and one ``index_add_`` each, sized for its caches), where the kernel path would
run in one C loop per piece (:mod:`.c_add`, bitwise the same); of :data:`ADDITIVE_DEVICE_BYTES` of rows on an
eager accelerator, where one Triton kernel per feature group adds them from the lookup's factored rows
(:func:`.triton_rows.add_pieces`) if it can. :mod:`~torch_tpu_embedding.optim._core.update_paths` chooses the
path and calls :func:`update_additive`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from torch_tpu_embedding._rows.dedup import drop_sentinel, sink_padding, sinks_sentinel
from torch_tpu_embedding._rows.row_grad import BagRows
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.registry import rule_of
from torch_tpu_embedding.optim._kernels import triton_rows
from torch_tpu_embedding.optim._kernels.c_add import add_rows_kernel

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.grad_intake import Work

__all__ = ["ADDITIVE_CHUNK", "ADDITIVE_DEVICE_BYTES", "update_additive"]

Tensor = torch.Tensor


def update_additive(item: Work) -> None:
    """``p += increment(g)`` (``rule(w, g) − w``, linear in ``g``: ``additive``) per looked-up id, a piece at a
    time."""
    p, group, state, pieces = item.p, item.group, item.state, item.pieces
    assert pieces is not None
    increment = rule_of(group).increment
    dtype, lr = math_dtype(p), item.lr

    def delta(g: Tensor, out: Tensor | None = None) -> Tensor:
        g = g.to(dtype) if item.divisor is None else g.to(dtype) / item.divisor
        return increment(g, lr, out=out)

    if _compiled_additive(item) or _triton_additive(item, delta):
        return
    chunk, sentinel = _additive_chunk(p), p.shape[0]
    small: list[tuple[Tensor, Tensor, bool]] = []  # pieces of fewer rows, added together (see flush)

    sink = sinks_sentinel(p.device)  # (no read of which ids are padding)

    def add(ids: Tensor, rows: Tensor, padded: bool) -> None:
        if sink:
            ids, rows = sink_padding(ids, rows, sentinel)
        elif padded:  # (else no masked copy, nor a check per piece)
            ids, rows = drop_sentinel(ids, rows, sentinel)
        p.index_add_(0, ids, rows.to(p.dtype))

    def flush() -> None:
        # Several features' pieces (one chunk each at 1 id per bag) in one index_add_: each call costs a sort of
        # its ids and, with more than one thread, the pool's wake-ups (2 threads, 4 features of 4,096 bags:
        # 8.8 ms a step against 4.5 ms with their rows in one call).
        if len(small) == 1:
            add(*small[0])
        elif small:
            rows = [r for _, r, _ in small]
            out, at = _scratch(queued(), rows[0].shape[1], rows[0].dtype, rows[0].device), 0
            for r in rows:  # each copied to its place in the scratch buffer, unless it was written there
                if not _is_at(r, out, at):
                    out[at : at + r.shape[0]].copy_(r)
                at += r.shape[0]
            add(torch.cat([i for i, _, _ in small]), out, any(d for _, _, d in small))
        small.clear()

    def queued() -> int:
        return sum(i.numel() for i, _, _ in small)

    def alone(n: int) -> bool:  # more than half a chunk: added by itself (into the scratch buffer where made)
        return 2 * n > chunk

    def piece(ids: Tensor, rows: Tensor, padded: bool) -> None:
        """Rows of most of a chunk are added at once; fewer wait in ``small`` to be added with the next ones."""
        if alone(ids.numel()):
            flush()
            add(ids, rows, padded)
            return
        if small and queued() + ids.numel() > chunk:
            flush()
        small.append((ids, rows, padded))

    for ids, rows in pieces.chunks():
        # (under torch.compile no read of a tensor's value: drop_sentinel masks)
        padded = sink or torch.compiler.is_compiling() or (ids.numel() > 0 and bool((ids == sentinel).any()))
        if not isinstance(rows, BagRows):  # accumulated (or sparse COO) rows
            for a in range(0, ids.numel(), chunk):
                piece(ids[a : a + chunk], delta(rows[a : a + chunk]), padded)
            continue
        # Kept factored by the lookup: the increment is taken once per bag, of dL/dout, and spread over the
        # bag's ids by their gains (sum bags of one id without weights: each id's row is its bag's).
        width = max(1, rows.width)
        bags = max(1, chunk // width)
        for b in range(0, rows.gains.shape[0], bags):
            grad = rows.grad_out[b : b + bags]
            part_ids = ids[b * width : (b + grad.shape[0]) * width]
            if rows.unit and rows.width == 1:  # each id's row is its bag's (not bags of width 0: no ids)
                n = grad.shape[0]
                if alone(n):  # (a new tensor: into the scratch buffer measured 0.2-0.3 ms slower a step)
                    piece(part_ids, delta(grad), padded)
                    continue
                if small and queued() + n > chunk:
                    flush()
                # Written where flush adds the step's small pieces from (4 features of 4,096 ids: no copy there)
                at = queued()
                piece(part_ids, delta(grad, out=_scratch(at + n, grad.shape[1], dtype, grad.device)[at:]), padded)
                continue
            per_bag = delta(grad)
            out = None
            if alone(part_ids.numel()):  # spread into the scratch buffer (flush's until now)
                flush()
                dtype_out = torch.promote_types(per_bag.dtype, rows.gains.dtype)
                out = _scratch(part_ids.numel(), per_bag.shape[1], dtype_out, per_bag.device)
            piece(part_ids, rows.spread(per_bag, b, b + bags, out=out), padded)
    flush()
    state["step"].copy_(state["step"] + 1)


def _compiled_additive(item: Work) -> bool:
    """``Path.ADDITIVE`` through the C increment-and-add (:mod:`.c_add`), the chunks in the order of the eager
    path and each as the eager path makes its rows (so bitwise its result): accumulated rows and sum bags of one id
    without weights add ``increment(g)``, other bags ``gains · increment(dL/dout)`` per id. ``False``: nothing
    done, the eager path runs."""
    pieces = item.pieces
    assert pieces is not None
    kernel = add_rows_kernel(item)
    if kernel is None:
        return False
    p, todo = item.p, []
    for ids, rows in pieces.chunks():
        # Padding ids (the sentinel) stay: the loop skips them (no mask, nor a check per piece here).
        if isinstance(rows, BagRows):
            todo.append((ids, rows.grad_out.to(p.dtype), None if rows.unit and rows.width == 1 else rows.gains))
        else:
            todo.append((ids, rows.to(p.dtype), None))
    kernel(p, todo)
    item.state["step"].add_(1)  # (a CPU table: in place, one op)
    return True


def _triton_additive(item: Work, delta: Callable[[Tensor], Tensor]) -> bool:
    """``Path.ADDITIVE`` on CUDA through :func:`.triton_rows.add_rows`: per chunk, ``delta`` (the increment) of
    each bag's ``dL/dout`` (or of each accumulated row), then one kernel adds ``gain · it`` per id; the products
    and the atomic adds are the eager path's (``spread``, ``index_add_``). ``False``: nothing done (no Triton, a
    16-bit table, or tensors the kernel does not take), the eager path runs."""
    p, pieces = item.p, item.pieces
    assert pieces is not None
    if not (sinks_sentinel(p.device) and triton_rows.adds(p.device)) or math_dtype(p) != p.dtype \
            or not triton_rows.add_pieces(p.detach(), pieces.chunks(), delta):
        return False
    item.state["step"].copy_(item.state["step"] + 1)
    return True


#: Rows per piece of ``Path.ADDITIVE``: a few element-wise passes and one ``index_add_`` each, so larger
#: than the rule pipeline's chunks (measured at 1 and 20 ids per bag: 2,048 rows 1.3× slower than 16,384).
ADDITIVE_CHUNK = 16384
#: Bytes of a piece's rows on an eager accelerator without its add kernel (CUDA with ``TTE_TRITON=0``, a 16-bit table
#: or ``torch.use_deterministic_algorithms``; the meta device): there each piece's dozen ops cost host time and no
#: cache is to be kept, so pieces are larger (131,072 rows of 128 float32: issue [host]'s GPU step of 1,310,720 ids in
#: 10 pieces instead of 80). The reused buffer (``_scratch``) holds at most one piece per dtype and device.
ADDITIVE_DEVICE_BYTES = 64 << 20


def _additive_chunk(p: Tensor) -> int:
    """Rows per piece of ``Path.ADDITIVE`` for table ``p``: :data:`ADDITIVE_CHUNK` on the CPU, else as many as
    :data:`ADDITIVE_DEVICE_BYTES` of its rows in the update's dtype hold (at least :data:`ADDITIVE_CHUNK`)."""
    if p.device.type == "cpu":
        return ADDITIVE_CHUNK
    row = math.prod(p.shape[1:]) * math_dtype(p).itemsize
    return max(ADDITIVE_CHUNK, ADDITIVE_DEVICE_BYTES // max(1, row))


#: :func:`_scratch`'s buffer, one per dtype and device
_SCRATCH: dict[tuple[torch.dtype, torch.device], Tensor] = {}


def _is_at(rows: Tensor, buf: Tensor, at: int) -> bool:
    """Whether ``rows`` are ``buf[at : at + len(rows)]`` (the same memory, laid out alike)."""
    return (rows.is_contiguous() and buf.is_contiguous() and rows.dtype == buf.dtype and rows.device == buf.device
            and rows.data_ptr() == buf.data_ptr() + at * buf.stride(0) * buf.element_size())


def _scratch(rows: int, dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A ``[rows, dim]`` buffer, the same memory every piece and step: a new 4 MiB tensor each time is unmapped
    and mapped again by glibc (4,000 page faults a step at 20 ids per bag)."""
    buf = _SCRATCH.get((dtype, device))
    if buf is None or buf.numel() < rows * dim:
        buf = _SCRATCH[(dtype, device)] = torch.empty(max(rows, ADDITIVE_CHUNK) * dim, dtype=dtype, device=device)
    return buf[: rows * dim].view(rows, dim)
