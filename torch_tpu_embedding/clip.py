"""``clip_grad_norm_`` that sees the tables' row-sparse gradients.

``torch.nn.utils.clip_grad_norm_`` reads ``.grad`` only; a table's gradient lives in its
:class:`~torch_tpu_embedding._rows.RowGrad`, so torch's function leaves the tables out of the norm and
never scales their update. This one has the same signature and return value and includes them.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable

import torch

from torch_tpu_embedding._dedup import coalesce_rows
from torch_tpu_embedding._dtypes import math_dtype
from torch_tpu_embedding._grad_sync import sync_row_grads
from torch_tpu_embedding._pg_exchange import all_reduce_sum, group_sharding
from torch_tpu_embedding._rows import refuse_stacked_view, table_info

__all__ = ["clip_grad_norm_"]

Tensor = torch.Tensor


@torch.no_grad()
def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Clip the gradient norm of ``parameters``, embedding tables included; returns the total norm.

    As ``torch.nn.utils.clip_grad_norm_``: the norm (of order ``norm_type``, ``inf`` allowed) over
    every gradient viewed as one vector, and every gradient scaled in place by
    ``min(max_norm / (total_norm + 1e-6), 1)``. A table's gradient counts as its densified ``[V, D]``
    gradient would: duplicate ids summed, rows not looked up zero. Its pending row gradient (the one
    the next optimizer ``step()`` applies) is replaced by the summed, scaled rows; a row-sharded table
    trained through the id exchange (SPMD) keeps its per-shard form, summed on each shard.

    Under data parallel (:mod:`torch_tpu_embedding.distributed`) the tables' row gradients are
    exchanged first, so the norm is the process group's global one, the same on every process
    (dense ``.grad`` must be global already: DDP's, or averaged by hand). Call it after
    ``backward()`` and before ``step()``, on every process.

    Args:
        parameters: tensors (or one tensor) whose gradients are clipped, e.g. ``model.parameters()``.
        max_norm: the largest norm allowed.
        norm_type: the order of the norm (``float("inf")`` for the largest absolute value).
        error_if_nonfinite: raise if the total norm is ``nan`` or ``inf``.
        foreach: as torch's (``None``: the foreach kernels where the device has them).

    Returns:
        The total norm of the gradients before clipping, a 0-d tensor.
    """
    if isinstance(parameters, Tensor):
        params = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        params = list(parameters)
        if is_generator and not params:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    for p in params:  # a stacked table's gradient is in its group's: silently 0 here otherwise
        refuse_stacked_view(p, "parameters", "clipped", "Its gradient is part of its group's.")
    tables = [p for p in params if table_info(p) is not None]
    dense = [p for p in params if table_info(p) is None]
    sync_row_grads([{"params": tables}])
    rows = [r for r in (_summed_rows(p) for p in tables) if r is not None]
    spread = [p for p in tables if group_sharding(p) is not None]
    if spread:  # tables sharded over a process group: every rank holds a part of the gradient
        total = _group_norm(params, tables, spread, float(norm_type), error_if_nonfinite, foreach)
    else:
        grads = [p.grad for p in dense if p.grad is not None] + rows
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total, foreach)
    if rows:
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for r in rows:
            r.mul_(coef.to(device=r.device, dtype=r.dtype))
    return total


def _group_norm(params: list[Tensor], tables: list[Tensor], spread: list[Tensor], norm_type: float,
                error_if_nonfinite: bool, foreach: bool | None) -> Tensor:
    """The norm over every gradient when some tables are sharded over a process group: the sharded tables'
    rows (each rank's own, after :func:`_summed_rows`) reduced over the group (a sum of ``|g|^p``, or a max
    for ``inf``); dense gradients and replicated tables' rows are global already and count once."""
    mine, is_table = {id(p) for p in spread}, {id(t) for t in tables}
    local = [p.grad for p in params if p.grad is not None and id(p) not in is_table]
    local += [r for r in (_pending(p) for p in tables if id(p) not in mine) if r is not None]
    theirs = [r for r in (_pending(p) for p in spread) if r is not None]
    sharding = group_sharding(spread[0])
    assert sharding is not None
    group = sharding.group
    dtype = next((g.dtype for g in local + theirs), torch.float32)
    norm = torch.nn.utils.get_total_norm(local, norm_type, False, foreach) if local else torch.zeros((), dtype=dtype)
    part = torch.nn.utils.get_total_norm(theirs, norm_type, False, foreach) if theirs else torch.zeros_like(norm)
    part = part.to(norm.dtype)
    if norm_type == float("inf"):
        out = part.reshape(1).clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX, group=group)
        total = torch.maximum(norm, out.reshape(()))
    else:
        total = (norm ** norm_type + all_reduce_sum(part ** norm_type, group)) ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    return total


def _pending(p: Tensor) -> Tensor | None:
    """Table ``p``'s pending gradient rows (one chunk after :func:`_summed_rows`), ``None`` without any."""
    info = table_info(p)
    assert info is not None
    return info.row_grad.collect()[1] if info.row_grad else None


def _summed_rows(p: Tensor) -> Tensor | None:
    """``p``'s pending row gradient with duplicate ids summed, put back as its only chunk (so the
    in-place scaling reaches the step); ``None`` without one."""
    info = table_info(p)
    assert info is not None
    rg = info.row_grad
    if not rg:
        return None
    if rg.owned:
        return _owned_rows(p)
    exchanged = rg.exchanged == len(rg)
    ids, rows = rg.collect()
    ids, rows = coalesce_rows(ids, rows.to(math_dtype(p)), p.shape[0])  # float32 for 16-bit tables
    rg.clear()
    rg.add(ids, rows)
    rg.exchanged = len(rg) if exchanged else 0
    return rg.collect()[1]  # the stored chunk itself: scaling it in place reaches the step


def _owned_rows(p: Tensor) -> Tensor:
    """As :func:`_summed_rows` for a table trained through the id exchange (SPMD, owner-local chunks
    ``ids [n, M]``, ``rows [n, M, D]``): duplicates are summed on each shard (a row lives on one shard),
    in one manual-sharding region, and the sums put back as the only owner-local chunk. A chunk whose
    lookup dropped ids counts zero, as in the step."""
    from torch_tpu_embedding.xla.manual import on_shards  # imports torch_xla: only on this SPMD path

    info = table_info(p)
    assert info is not None
    rg = info.row_grad
    sharding = info.sharding
    sentinel = p.shape[0] // sharding.num_shards  # shard-local padding row
    ids, rows, ok = rg.collect_owned()
    rows = torch.where(ok, rows.to(math_dtype(p)), torch.zeros((), dtype=math_dtype(p), device=rows.device))

    def on_shard(sharded: dict[str, Tensor], small: dict[str, Tensor], inputs: list[Tensor],
                 rep: list[Tensor | None]) -> list[Tensor]:
        return list(coalesce_rows(inputs[0], inputs[1], sentinel))

    uniq, summed = on_shards(on_shard, {}, {}, [ids, rows], [], mesh=sharding.mesh, axis=sharding.axis)
    rg.clear()
    rg.add_owned(uniq, summed, ok)
    return summed  # the stored chunk itself: scaling it in place reaches the step
