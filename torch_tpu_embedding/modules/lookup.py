"""The lookup: gather rows, combine them, and send the backward to the table's :class:`RowGrad`.

Autograd never produces a ``[V, D]`` gradient for a table: the backward returns ``None`` for the
table and instead records ``(ids, gain · dL/dout)`` — one row per looked-up id — in the table's
:class:`~torch_tpu_embedding._rows.row_grad.RowGrad`. The forward is ``F.embedding_bag`` (sum of
``gain · row``) off XLA; on XLA its mean mode and its backward run on the host
(measured on torch_xla 2.9: its sum mode also unrolls one loop per bag), so there it is gather +
weighted sum, which partitions well.

Per-id weights that require grad get ``d out[n] / d gains[n, l] = <weight[ids[n, l]], grad_out[n]>``;
autograd carries it through :func:`~torch_tpu_embedding.combiners.bag_gains` (mean, sqrtn) to the
weights, as ``nn.EmbeddingBag``'s ``per_sample_weights`` gets one. A frozen table (its weight's
``requires_grad`` False, or a stacked member frozen with ``ec.tables.<name>.requires_grad_(False)``) has no
row recorded, as a frozen torch parameter gets no ``.grad``; its per-id weights still get theirs.
16-bit tables combine in float32 (their gains are float32) and cast the output to the table's dtype.

Under ``torch.compile`` the backward hands its rows over through the custom operator
``torch_tpu_embedding::add_rows`` (:func:`add_rows`), registered as a side effect, so that dynamo
traces the backward into the graph (it traces an ``autograd.Function``'s backward only free of Python
side effects: a graph break per lookup otherwise) and the compiled backward still records the rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

from torch_tpu_embedding._rows.row_grad import RowGrad, row_grad_by_handle
from torch_tpu_embedding._rows.stock_guard import check_not_ddp_managed
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import compute_dtype
from torch_tpu_embedding.combiners import bag_gains, full_mean_gain, jagged_gains
from torch_tpu_embedding.optim._kernels.c_gather import gather_rows

__all__ = ["add_rows", "bags_lookup", "jagged_lookup", "keep_table", "lookup", "records_rows", "unused_bags"]


@torch.library.custom_op("torch_tpu_embedding::add_rows", mutates_args=())
def add_rows(handle: int, tables: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """``RowGrad.add(ids, rows)`` of the RowGrad whose ``handle`` is ``handle``, and its ``reached``
    updated with ``tables`` (names joined by ``.``, which no table name holds), from a compiled backward.

    Copies: a compiled graph may reuse the memory of its intermediates once this operator returns.
    """
    row_grad = row_grad_by_handle(handle)
    row_grad.add(ids.clone(), rows.clone())
    row_grad.reached.update(t for t in tables.split(".") if t)


@add_rows.register_fake
def _add_rows_fake(handle: int, tables: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
    return None


# Ordered side effect: AOTAutograd keeps it in the backward graph (it has no output to be used), in order.
_register_effectful_op(torch.ops.torch_tpu_embedding.add_rows.default, _EffectType.ORDERED)


def _hand_over(ctx: Any, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """The backward's ``(ids, rows)`` into ``ctx.row_grad`` (and its tables into ``reached``); while
    compiling, through :func:`add_rows`, which dynamo traces as an operator, not as a Python side effect."""
    if torch.compiler.is_compiling() and ctx.handle >= 0:  # (every table's RowGrad is registered)
        torch.ops.torch_tpu_embedding.add_rows(ctx.handle, ctx.tables_key, ids, rows)
        return
    ctx.row_grad.add(ids, rows)
    ctx.row_grad.reached.update(ctx.tables)


def keep_table(ctx: Any, tables: frozenset[str], weight: torch.Tensor) -> None:
    """What :func:`records_rows` reads, kept on the ``ctx`` of a lookup whose first input is the table's ``weight``
    (this module's lookups, and the sharded ones of the backends): ``tables``, the names recorded."""
    ctx.tables, ctx.weight_shape = tables, tuple(weight.shape)
    ctx.weight_info = table_info(weight)  # (its tables' names, for an error)


def _keep(ctx: Any, row_grad: RowGrad, tables: frozenset[str], frozen: torch.Tensor | None,
          weight: torch.Tensor) -> None:
    keep_table(ctx, tables, weight)
    ctx.row_grad, ctx.frozen = row_grad, frozen
    ctx.handle, ctx.tables_key = row_grad.handle, ".".join(sorted(tables))  # (for add_rows)


def records_rows(ctx: Any) -> bool:
    """Whether this backward adds the table's rows to its ``RowGrad``: as ``loss.backward()`` accumulates into
    a parameter's ``.grad`` (and ``backward(inputs=...)`` naming the table's weight), and not for a backward
    that accumulates nothing into the table: ``torch.autograd.grad`` (which leaves every ``.grad`` as it was)
    or ``backward(inputs=...)`` without the table's weight. A frozen weight gets no rows, as in torch.

    Raises ``RuntimeError`` when ``torch.autograd.grad`` asks for the table's weight itself: its gradient
    would be a ``[rows, D]`` tensor, which a table never gets (its gradient is row-sparse). ``ctx``: a lookup's,
    its first input the table's weight, with :func:`keep_table`'s attributes."""
    if not ctx.needs_input_grad[0]:
        return False
    if torch.compiler.is_compiling():  # (a compiled backward: no engine to ask; loss.backward() is what compiles)
        return True
    node = ctx.next_functions[0][0]
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError as e:  # torch refuses to answer for a leaf that torch.autograd.grad captures
        if node is None or node.next_functions:  # (not a leaf's: some other failure)
            raise
        info = ctx.weight_info
        names = ", ".join(f"`{t}`" for t in (sorted(ctx.tables) if info is None else info.tables))
        raise RuntimeError(
            f"Argument `inputs` of torch.autograd.grad holds the weight of embedding table(s) {names}: a table's "
            "gradient is row-sparse (one row per looked-up id), never a [rows, embedding_dim] tensor, so "
            "torch.autograd.grad cannot return it. Call loss.backward() and read EmbeddingCollection.row_grads() "
            "(each table's ids and gradient rows), or leave the table's weight out of `inputs` (the lookup's "
            f"outputs, the per-id weights and every other tensor can be asked for). Received: a weight of shape "
            f"{list(ctx.weight_shape)}"
        ) from e


def _gather(weight: torch.Tensor, safe: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``weight[safe]`` as ``[N, L, D]`` in ``dtype``."""
    n, width = safe.shape
    return weight.index_select(0, safe.reshape(-1)).view(n, width, weight.shape[1]).to(dtype)


class _RowSparseLookup(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, weight: torch.Tensor, ids: torch.Tensor, gains: torch.Tensor, row_grad: RowGrad,
        tables: frozenset[str], frozen: torch.Tensor | None, splits: tuple[int, ...], unit: bool, uniform: bool,
        full: bool, columns: int, constant: float | None,
    ) -> tuple[torch.Tensor, ...]:
        if full and uniform and ids.shape[1] == 1 and weight.device.type != "xla" and gains.dtype == weight.dtype:
            # One real id per bag and every gain 1 (sum, mean and sqrtn alike): the rows themselves, a plain
            # gather (measured 0.57 against 0.69 ms for embedding_bag, 16,384 rows of 64 from a 1 GB table),
            # prefetching on the CPU once the kernel library is loaded (bitwise index_select's).
            out = gather_rows(weight, ids.view(-1))
        else:
            out = _pooled(weight, ids, gains)
        # The weight is kept only when the gains need a gradient (it costs nothing otherwise).
        ctx.save_for_backward(ids, gains, weight if ctx.needs_input_grad[2] else None)
        _keep(ctx, row_grad, tables, frozen, weight)
        ctx.splits, ctx.unit, ctx.uniform, ctx.columns, ctx.constant = splits, unit, uniform, columns, constant
        ctx.rows = weight.shape[0]
        if not torch.compiler.is_compiling():  # (dynamo does not trace it: compiled, unused outputs get zeros)
            # A feature whose output the loss does not use gets None, not zeros: its ids are then not touched,
            # as when it is looked up alone (materialized zeros would touch them: Adam's moments decay).
            ctx.set_materialize_grads(False)
        if columns:  # bags batch-major ([B·F] rows): each feature's [B, D] a view of [B, F·D], in one op
            # (slices along dim 1, not unbind: on XLA the caller's torch.cat gradient is then one tensor)
            return tuple(torch.split(out.view(-1, columns * out.shape[1]), out.shape[1], dim=1))
        # One output per feature (views of ``out``): the backward then gets each feature's gradient as it is
        # (often a view of the gradient of the caller's torch.cat of the features), where a split of one
        # output would have its backward concatenate them into a new [N, D] tensor first.
        return tuple(out.split_with_sizes(list(splits))) if len(splits) > 1 else (out,)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, *grads: torch.Tensor
    ) -> tuple[None, None, torch.Tensor | None, None, None, None, None, None, None, None, None, None]:
        ids, gains, weight = ctx.saved_tensors
        if all(g is None for g in grads):  # (nothing the loss uses: no rows, no gradient for the weights)
            return None, None, None, None, None, None, None, None, None, None, None, None
        if any(g is None for g in grads):
            unused, grads = unused_bags(grads, (ids.shape[0],) if ctx.columns else ctx.splits, ctx.columns,
                                         ids.device)
            ids = torch.where(unused.unsqueeze(1), ctx.rows, ids)
        if ctx.columns:  # each feature's [B, D] gradient back into the bags' batch-major order
            grads = (_columns_whole(grads, broadcast=not ctx.needs_input_grad[2]),)
            ctx.splits = (ids.shape[0],)
        grad_out = None
        if records_rows(ctx):
            grad_out = _record_rows(ctx, ids, gains, grads)
        grad_gains = None
        if ctx.needs_input_grad[2]:  # <row, grad_out> per position; padding positions get 0 from bag_gains
            grad_out = _whole(grads) if grad_out is None else grad_out
            rows = _gather(weight, ids.clamp(max=weight.shape[0] - 1), gains.dtype)
            grad_gains = torch.bmm(rows, grad_out.to(gains.dtype).unsqueeze(-1)).squeeze(-1)
        return None, None, grad_gains, None, None, None, None, None, None, None, None, None


def unused_bags(grads: tuple[torch.Tensor | None, ...], splits: tuple[int, ...], columns: int,
                 device: torch.device) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """For outputs whose gradient is ``None`` (unused by the loss): ``[N]`` bool, True at their bags (bag ``n``
    is output ``n % columns``'s batch-major, else ``splits`` bags each in order), and the gradients with zeros
    in their place. Their ids are then made padding, so that none of their rows is touched. The gradients are
    ``[n, D]``, or ``[..., n, D]`` (bags on the next-to-last dimension: the device-major pieces of the SPMD
    exchange); the sharded lookups pass one "bag" per id position."""
    present = next(g for g in grads if g is not None)
    unused = torch.tensor([g is None for g in grads])  # made on the host, then moved: one transfer, on XLA too
    if columns:
        n = sum(splits) // columns
        per_bag = unused.repeat(n)
        sizes = (n,) * columns
    else:
        per_bag = unused.repeat_interleave(torch.tensor(splits))
        sizes = splits
    per_bag = per_bag.to(device)
    lead = present.shape[:-2]
    filled = tuple(g if g is not None else present.new_zeros(*lead, sizes[i], present.shape[-1])
                   for i, g in enumerate(grads))
    return per_bag, filled


def _pooled(weight: torch.Tensor, ids: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
    """``out[n] = Σ_l gains[n, l] · weight[ids[n, l]]``, padding (the sentinel) clamped to a real row of gain 0."""
    safe = ids.clamp(max=weight.shape[0] - 1)
    if gains.dtype != weight.dtype:  # a 16-bit table: combine in float32, then cast
        return torch.bmm(gains.unsqueeze(1), _gather(weight, safe, gains.dtype)).squeeze(1).to(weight.dtype)
    if weight.device.type != "xla" and ids.shape[1]:  # (bags of width 0: the product below, zeros)
        # One gather-and-sum, no [N·L, D] temporary (2.8× faster at 20 ids on the CPU); on XLA
        # embedding_bag falls back to the host, so there it is gather + weighted sum.
        return torch.nn.functional.embedding_bag(safe, weight, per_sample_weights=gains, mode="sum")
    if ids.shape[1] == 1:
        return weight.index_select(0, safe.reshape(-1)) * gains
    return torch.bmm(gains.unsqueeze(1), _gather(weight, safe, weight.dtype)).squeeze(1)


def _columns_whole(grads: tuple[torch.Tensor, ...], broadcast: bool = False) -> torch.Tensor:
    """``F`` features' ``[B, D]`` gradients as one ``[B·F, D]``, batch-major. When they tile one contiguous
    ``[B, F·D]`` tensor side by side, as the gradient of the caller's ``torch.cat(outputs, dim=1)`` does, that
    tensor viewed (no copy; its layout read from strides and offsets, no op); with ``broadcast``, when they are
    all one value broadcast (strides 0, as ``loss = out.sum()`` gives), that value broadcast (the row update
    reads it, no ``[B·F, D]`` is written); else one ``cat`` side by side.

    On XLA strides and offsets say nothing, so the gradients of the caller's ``torch.cat`` come here as its
    slices, in order; their ``cat`` along dim 1 is what XLA's simplifier folds back into the sliced tensor (a
    ``stack`` of them, as ``[B, 1, D]`` reshapes, it does not fold: the first compile at 100 features cost 4×
    one feature's; ``tests/xla/test_first_step_hlo.py``)."""
    first = grads[0]
    base = first._base
    n, d = first.shape
    if base is not None and base.is_contiguous() and base.shape == (n, len(grads) * d) and all(
            g._base is base and g.stride() == (len(grads) * d, 1)
            and g.storage_offset() == base.storage_offset() + i * d for i, g in enumerate(grads)):
        return base.view(n * len(grads), d)
    if broadcast and first.numel() and first.device.type != "xla" and not torch.compiler.is_compiling() and all(
            g.stride() == (0, 0) and g.data_ptr() == first.data_ptr() for g in grads):
        return first[:1, :1].expand(n * len(grads), d)
    return torch.cat(grads, 1).view(n * len(grads), d)


def _whole(grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return grads[0] if len(grads) == 1 else torch.cat(grads)


def _record_rows(ctx: Any, ids: torch.Tensor, gains: torch.Tensor, grads: tuple[torch.Tensor, ...]
                 ) -> torch.Tensor | None:
    """Add ``dL/de_{i_k} = gain_k · dL/dout_b`` to ``ctx.row_grad``, one row per (bag, position); padding rows
    are 0. Ids of frozen rows (a frozen member of a stacked group) become the sentinel with zero rows, as padding:
    no update, and nothing in what sums over rows where the sentinel entries are kept (XLA, an eager
    accelerator: ``clipnorm``, ``tte.clip_grad_norm_``). ``grads``: each feature's ``dL/dout`` (``ctx.splits``
    bags each). Returns them whole if it made that."""
    row_grad, frozen = ctx.row_grad, ctx.frozen
    sentinel = frozen.shape[0] if frozen is not None else 0
    if frozen is not None:
        hit = frozen[ids.clamp(max=sentinel - 1)]
        ids = torch.where(hit, sentinel, ids)
        gains = torch.where(hit, torch.zeros((), dtype=gains.dtype, device=gains.device), gains)
    dtype = grads[0].dtype  # the table's
    if row_grad.keep_factored and ids.device.type != "xla" and not torch.compiler.is_compiling():
        start = 0  # each feature's bags kept factored, as they came: no [N, D] concatenation
        for n, grad_out in zip(ctx.splits, grads, strict=True):  # multiplied out piecewise by the step
            row_grad.add_bags(ids[start : start + n], gains[start : start + n].to(dtype), grad_out, ctx.unit,
                              ctx.uniform, ctx.constant if frozen is None and gains.dtype == dtype else None)
            start += n
        row_grad.reached.update(ctx.tables)
        return None
    grad_out = _whole(grads)
    grad_rows = (gains.unsqueeze(-1) * grad_out.to(gains.dtype).unsqueeze(1)).to(dtype)
    _hand_over(ctx, ids.reshape(-1), grad_rows.reshape(-1, grad_out.shape[-1]))
    return grad_out


def lookup(
    weight: torch.Tensor, ids: torch.Tensor, gains: torch.Tensor, row_grad: RowGrad,
    tables: frozenset[str] = frozenset(), frozen: torch.Tensor | None = None,
    splits: tuple[int, ...] | None = None, unit: bool = False, uniform: bool = False, full: bool = False,
    columns: int = 0, constant: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """Combined lookup ``out[n] = Σ_l gains[n, l] · weight[ids[n, l]]``.

    Args:
        weight: the table ``[R, D]`` (``R`` physical rows; ids ``== R`` are padding).
        ids: ``[N, L]`` int64 ids.
        gains: ``[N, L]`` per-id factors from :func:`~torch_tpu_embedding.combiners.bag_gains`
            (0 at padding); float32 for a 16-bit table. Differentiable.
        row_grad: where the backward puts ``(ids [N·L], rows [N·L, D])``.
        tables: names of the tables looked up (recorded in ``row_grad.reached`` by the backward; frozen
            stacked tables excluded by the caller).
        frozen: ``[R]`` bool, True at rows that get no gradient (frozen members of a stacked group), or
            ``None``. A ``weight`` that does not require grad gets none at all.
        splits: the bags of each feature, in order (``None``: one, all ``N``).
        unit: every gain is 1 where the id is not padding (sum bags without per-id weights).
        uniform: within each bag every gain is one value where the id is not padding (bags without
            per-id weights, any combiner).
        full: no position is padding (every id is a real row; dense ids).
        constant: every gain is this number (or ``None``): the backward applies it to each bag, no pass over gains.
        columns: ``F > 0`` when the ``N = B·F`` bags are ``F`` features' bags batch-major (bag ``b`` of every
            feature, then bag ``b + 1``; ``splits`` unused): then each feature's ``[B, D]`` is returned.

    Returns:
        Each split's ``[n, D]`` activations (views of one ``[N, D]``; with ``columns``, each feature's
        ``[B, D]``, slices of one ``[B, F·D]``), differentiable (row-sparsely) with
        respect to ``weight``; they cannot be modified in place (as ``torch.split``'s outputs).
    """
    check_not_ddp_managed(weight)  # torch's DDP must not reduce a table (tte.distributed)
    out: tuple[torch.Tensor, ...] = _RowSparseLookup.apply(  # type: ignore[no-untyped-call]
        weight, ids, gains, row_grad, tables, frozen, (ids.shape[0],) if splits is None else tuple(splits), unit,
        uniform, full, columns, constant)
    return out


class _JaggedLookup(torch.autograd.Function):
    """As :class:`_RowSparseLookup` for jagged bags (eager devices): ``ids [nnz]`` in bag order, ``bag
    [nnz]`` each id's bag, ``offsets [N+1]``; no padding, so memory follows the ids, not the longest bag."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, weight: torch.Tensor, ids: torch.Tensor, gains: torch.Tensor, bag: torch.Tensor,
        offsets: torch.Tensor, row_grad: RowGrad, tables: frozenset[str], frozen: torch.Tensor | None,
        splits: tuple[int, ...],
    ) -> tuple[torch.Tensor, ...]:
        if gains.dtype == weight.dtype:
            out = torch.nn.functional.embedding_bag(ids, weight, offsets, mode="sum", per_sample_weights=gains,
                                                    include_last_offset=True)
        else:  # a 16-bit table: combine in float32, then cast
            rows = weight.index_select(0, ids).to(gains.dtype) * gains.unsqueeze(1)
            out = rows.new_zeros(offsets.numel() - 1, weight.shape[1]).index_add_(0, bag, rows).to(weight.dtype)
        ctx.save_for_backward(ids, gains, bag, weight if ctx.needs_input_grad[2] else None)
        _keep(ctx, row_grad, tables, frozen, weight)
        ctx.splits, ctx.rows = splits, weight.shape[0]
        if not torch.compiler.is_compiling():  # unused items get None, not zeros (as _RowSparseLookup)
            ctx.set_materialize_grads(False)
        return tuple(out.split_with_sizes(list(splits))) if len(splits) > 1 else (out,)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, *grads: torch.Tensor | None
    ) -> tuple[None, None, torch.Tensor | None, None, None, None, None, None, None]:
        ids, gains, bag, weight = ctx.saved_tensors
        if all(g is None for g in grads):  # (nothing the loss uses: no rows, no gradient for the weights)
            return None, None, None, None, None, None, None, None, None
        unused = None
        if any(g is None for g in grads):  # an item the loss does not use: its ids are not touched
            per_bag, grads = unused_bags(grads, ctx.splits, 0, ids.device)
            unused = per_bag.index_select(0, bag)  # per id: its bag's item is unused
        grad_out = _whole(grads)  # type: ignore[arg-type]
        per_id = grad_out.to(gains.dtype).index_select(0, bag)  # [nnz, D]: each id's bag's gradient
        if records_rows(ctx):
            frozen, at, own = ctx.frozen, ids, gains
            if frozen is not None:  # frozen members of a stacked group: their ids become the sentinel, zero rows
                at = torch.where(frozen[ids], frozen.shape[0], ids)
                own = torch.where(frozen[ids], torch.zeros((), dtype=gains.dtype, device=gains.device), gains)
            if unused is not None:
                at = torch.where(unused, ctx.rows, at)
            if not torch.compiler.is_compiling():  # rows as many as the data's ids: data parallel counts them
                ctx.row_grad.variable_rows = True
            _hand_over(ctx, at, (own.unsqueeze(1) * per_id).to(grad_out.dtype))
        grad_gains = None
        if ctx.needs_input_grad[2]:  # <row, grad_out of its bag> per id
            grad_gains = (weight.index_select(0, ids).to(gains.dtype) * per_id).sum(1)
        return None, None, grad_gains, None, None, None, None, None, None


def _trained(weight: torch.Tensor, tables: set[str]) -> tuple[torch.Tensor | None, frozenset[str]]:
    """``weight``'s frozen rows (``[R]`` bool, or ``None``) and those of ``tables`` that train (a stacked group's
    frozen members left out): what :func:`lookup` takes as ``frozen`` and ``tables``."""
    info = table_info(weight)
    if info is None:
        return None, frozenset(tables)
    return info.frozen_rows, frozenset(tables) - info.frozen_tables


def bags_lookup(
    weight: torch.Tensor, ids: torch.Tensor, w: torch.Tensor | None, combiner: str, row_grad: RowGrad,
    tables: set[str], full: bool, splits: tuple[int, ...] | None = None, columns: int = 0,
) -> tuple[torch.Tensor, ...]:
    """:func:`lookup` of padded bags ``ids [N, L]`` (padding: the sentinel ``weight.shape[0]``) with per-id
    weights ``w`` (or ``None``) under ``combiner``, for ``tables`` (those frozen in a stacked group get no rows);
    ``full``: no position is padding. ``splits`` and ``columns`` as :func:`lookup` takes them."""
    dtype, constant = weight.dtype, None
    if full and w is None and (ids.shape[1] == 1 or combiner == "sum"):
        # No padding and no weights (dense ids): every gain is 1, as bag_gains would find (no pass over the ids)
        gains = torch.ones(ids.shape, dtype=compute_dtype(dtype), device=ids.device)
    elif full and w is None and combiner == "mean" and ids.shape[1] and ids.device.type == "cpu" \
            and not torch.compiler.is_compiling():
        # Every gain is bag_gains' 1 / L (its reciprocal of the count, the same op, once per L): one fill, no passes
        # (L = 0: no gain at all, where 1 / 0 would make the backward's per-bag rows inf)
        constant = full_mean_gain(ids.shape[1], dtype)
        gains = torch.full(ids.shape, constant, dtype=compute_dtype(dtype))
    else:  # (padding holds the sentinel: Bags)
        gains = bag_gains(ids != weight.shape[0], w, combiner, dtype)
    frozen, training = _trained(weight, tables)
    return lookup(weight, ids, gains, row_grad, training, frozen, splits, unit=combiner == "sum" and w is None,
                  uniform=w is None, full=full, columns=columns, constant=constant)


def jagged_lookup(
    weight: torch.Tensor, ids: torch.Tensor, w: torch.Tensor | None, combiner: str, bag: torch.Tensor,
    offsets: torch.Tensor, row_grad: RowGrad, tables: set[str], splits: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The pooled ``[N, D]`` lookup of jagged bags (eager devices): ``ids [nnz]`` in bag order with per-id
    weights ``w`` (or ``None``) under ``combiner``, ``bag [nnz]`` each id's bag, ``offsets [N+1]``; for
    ``tables`` (those frozen in a stacked group get no rows), as :func:`bags_lookup` for padded bags. Returns
    each split's ``[n, D]`` (``splits``: the bags of each item, in order; ``None``: one, all ``N``)."""
    frozen, training = _trained(weight, tables)
    gains = jagged_gains(bag, offsets.numel() - 1, w, combiner, weight.dtype)
    check_not_ddp_managed(weight)
    out: tuple[torch.Tensor, ...] = _JaggedLookup.apply(  # type: ignore[no-untyped-call]
        weight, ids, gains, bag, offsets, row_grad, training, frozen,
        (offsets.numel() - 1,) if splits is None else tuple(splits))
    return out
