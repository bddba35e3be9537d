"""``Path.ADDITIVE``'s compiled kernel: an additive rule's increment and its scatter-add, one pass.

The eager additive step (:func:`._paths._update_additive`, SGD) makes ``increment(g) = (−lr)·g`` for
every looked-up id as a ``[n, D]`` array and adds it with ``index_add_``: two passes over the rows,
and torch's ``index_add_`` on the CPU runs one ``add`` per id through a ``TensorIterator``. Here the
same two lines — ``increment`` of the optimizer, then an accumulating ``index_put_`` — are compiled by
``torch.compile`` (inductor) into a C++ loop that reads each gradient row once and adds it to its
table row, without the ``[n, D]`` temporary (4 pieces of 4,096 ids of 64 floats, one thread, a 1 GB
table: 1.0 ms against 1.4 ms for the increments and ``index_add_``; the step: docs/benchmarks.md).

The result is bitwise the eager path's, at any thread count (tests/test_fused_add.py): every row
receives the same rounded products, summed in the same order. ``cpp.threads=1`` keeps the loop serial
(inductor would run a parallel loop with atomic adds, whose order for a repeated id changes from run to
run), and the pieces of a step, up to :data:`MAX_PIECES` per call, are each a loop of its own, in the
eager path's order (``max_fusion_size=1``: inductor fuses them into one loop that interleaves the
pieces otherwise). One call per step rather than one per piece: a call costs some 50–100 µs of Python.

It runs where the fused row update would (:func:`._fused_update.usable`, its :func:`~._fused_update.policy`:
from the optimizer's call ``TTE_FUSED_AFTER`` on, for tables of ``TTE_FUSED_MIN_ELEMENTS`` numbers or
more), on CPU float32 tables without ``loss_scale_factor``; everything else, pieces of fewer than 2 ids
(dynamic shapes specialise sizes 0 and 1), or a kernel that cannot be compiled, takes the eager add.
Shapes are dynamic: one compile per increment, count of pieces and layout of the gradient rows
(contiguous, a column slice of a wider gradient, broadcast), about 1.5 s each after the process's
first inductor compile (about 10 s).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from torch_tpu_embedding._registry import optimizer_class
from torch_tpu_embedding.optim import _fused_update

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._intake import Work

__all__ = ["MAX_PIECES", "AddRows", "Pieces", "add_rows_kernel"]

Tensor = torch.Tensor
#: ``(ids [n], g [n, D])`` pieces, added in order
Pieces = list[tuple[Tensor, Tensor]]
#: ``fn(p, pieces, lr)`` adds ``increment(g, lr)`` to the rows ``ids`` of ``p``, piece by piece in order
AddRows = Callable[[Tensor, Pieces, Tensor], None]

#: pieces per kernel call (more make more calls, in order); each count is a kernel of its own
MAX_PIECES = 8

_KERNELS: dict[tuple[Any, ...], Callable[..., None] | None] = {}
_COMPILER: list[bool] = []  # inductor's C++ compiler, once looked for


def add_rows_kernel(item: Work) -> AddRows | None:
    """The compiled add of ``item``'s increments, or ``None`` where this step takes the eager path."""
    p, group = item.p, item.group
    if (item.divisor is not None or p.device.type != "cpu" or p.dtype != torch.float32
            or not _fused_update.usable(p) or _fused_update.warming_up(item)):
        return None
    if not _COMPILER:
        _COMPILER.append(_fused_update.has_compiler())  # (without one: warns once, usable() is False from then on)
    if not _COMPILER[0]:
        return None
    increment = optimizer_class(group["algorithm"]).increment

    def eager(p: Tensor, run: Pieces, lr: Tensor) -> None:
        for ids, g in run:
            p.index_add_(0, ids, increment(g, lr))

    def compiled(p: Tensor, run: Pieces, lr: Tensor) -> None:
        key = (increment.__module__, increment.__qualname__, len(run))
        if key not in _KERNELS:
            _KERNELS[key] = _build(increment, len(run), len(_KERNELS))
        fn = _KERNELS[key]
        if fn is None:
            eager(p, run, lr)
            return
        # Detached: no view (the compiled code would guard on a view's base), no Parameter (dynamo keeps
        # a parameter's shape static: every table size would compile a kernel of its own).
        args = (p.detach(), [i.detach() for i, _ in run], [g.detach() for _, g in run], lr)
        try:
            _fused_update.call(fn, args)
        except Exception as e:  # raised before the kernel wrote anything: tracing, compiling, or a guard
            _KERNELS[key] = None
            text = str(e).strip()
            _fused_update.warn_once(f"{type(e).__name__}: {text.splitlines()[0] if text else ''}")
            eager(p, run, lr)

    def add(p: Tensor, pieces: Pieces, lr: Tensor) -> None:
        run: Pieces = []
        for ids, g in pieces:
            if ids.numel() < 2:  # dynamic shapes specialise sizes 0 and 1: no compile for no work
                if run:
                    compiled(p, run, lr)
                    run = []
                eager(p, [(ids, g)], lr)
                continue
            run.append((ids, g))
            if len(run) == MAX_PIECES:
                compiled(p, run, lr)
                run = []
        if run:
            compiled(p, run, lr)

    return add


def _build(increment: Callable[..., Tensor], pieces: int, n: int) -> Callable[..., None]:
    def add_rows(p: Tensor, ids: list[Tensor], gs: list[Tensor], lr: Tensor) -> None:
        for i, g in zip(ids, gs, strict=True):
            p.index_put_((i,), increment(g, lr), accumulate=True)

    # A code object of its own per increment and count (torch.compile counts recompiles per code object).
    code = add_rows.__code__.replace(co_name=f"add_rows_{n}_{pieces}")
    fn = types.FunctionType(code, add_rows.__globals__, code.co_name, add_rows.__defaults__, add_rows.__closure__)
    # max_fusion_size=1: each piece its own loop, in order (fused, inductor interleaves the pieces' adds).
    compiled: Callable[..., None] = torch.compile(
        fn, dynamic=True, fullgraph=True, options={"compile_threads": 1, "cpp.threads": 1, "max_fusion_size": 1})
    return compiled
