"""``clip_grad_norm_`` that sees the tables' row-sparse gradients.

``torch.nn.utils.clip_grad_norm_`` reads ``.grad`` only; a table's gradient lives in its
:class:`~torch_tpu_embedding._rows.row_grad.RowGrad`, so torch's function leaves the tables out of the norm and
never scales their update. This one has the same signature and return value and includes them.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from collections.abc import Iterable

import torch

from torch_tpu_embedding._rows.dedup import coalesce_rows, is_static_device, sinks_sentinel
from torch_tpu_embedding._rows.placement import all_reduce_sum, process_group_placement, sync_row_grads
from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.row_order import owned_logical_ids
from torch_tpu_embedding._rows.tables import refuse_stacked_view, table_info
from torch_tpu_embedding._util.dtypes import math_dtype

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
    gradient would: duplicate ids summed, rows not looked up zero (a negative ``norm_type`` sees those
    zeros: ``-inf`` gives 0 unless every row was looked up, as torch's). Its pending row gradient (the
    one the next optimizer ``step()`` applies) is scaled where it is, each id's rows kept apart, so a
    clip that scales nothing (``max_norm`` above the norm) leaves the step bitwise unchanged, also for
    ``use_gradient_accumulation=False``, whose update depends on how the rows are split.

    Under data parallel (:mod:`torch_tpu_embedding.distributed`) the tables' row gradients are
    exchanged first, so the norm is the process group's global one, the same on every process
    (dense ``.grad`` must be global already: DDP's, or averaged by hand). Call it after
    ``backward()`` and before ``step()``, on every process.

    Args:
        parameters: tensors (or one tensor) whose gradients are clipped, e.g. ``model.parameters()``.
        max_norm: the largest norm allowed.
        norm_type: the order of the norm (``float("inf")`` for the largest absolute value). ``0``, as torch's,
            counts the gradient tensors that hold a nonzero entry, each table one tensor as its ``[V, D]``
            gradient, whether it is stacked in a group or not.
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
    # The exchange the optimizer's step would do (it is done once, by whoever comes first): a table whose
    # optimizer group has use_gradient_accumulation=False sends its rows as they are, others each rank's sums.
    raw = [p for p in tables if _row_grad(p).raw_exchange]
    sync_row_grads([{"params": [p for p in tables if not _row_grad(p).raw_exchange]},
                    {"params": raw, "use_gradient_accumulation": False}])
    coalesced = [(p, c) for p, c in ((p, _coalesced(p)) for p in tables) if c is not None]
    summed = [(p, _norm_rows(p, c, norm_type < 0)) for p, c in coalesced]
    spread = [p for p in tables if process_group_placement(p) is not None]
    if spread:  # tables sharded over a process group: every rank holds a part of the gradient
        total = _group_norm(params, summed, spread, float(norm_type), error_if_nonfinite, foreach)
    else:
        # A table looked up with empty bags only has no rows: its densified gradient is zeros, which add
        # nothing (torch's norm of an empty tensor raises for inf and negative orders).
        grads = [p.grad for p in dense if p.grad is not None]
        if norm_type == 0:  # a count of the gradient tensors with a nonzero entry: each table of a group counts
            grads += [t for p, c in coalesced for t in _table_terms(p, c)]
        else:
            grads += [r for _, r in summed if r.numel()]
        if norm_type < 0 and any(_has_zero_rows(p) for p, _ in summed):
            # A negative order (-inf: the smallest |g|) sees the zero rows of the dense [V, D] gradient
            # torch would hold, which the row-sparse form leaves out.
            grads.append(torch.zeros(1, dtype=summed[0][1].dtype, device=summed[0][1].device))
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total, foreach)
    if summed:
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for p, _ in summed:  # the pending rows themselves, not their sums: a coef of 1 changes nothing
            info = table_info(p)
            assert info is not None
            info.row_grad.scale_(coef, math_dtype(p))
    return total


def _row_grad(p: Tensor) -> RowGrad:
    info = table_info(p)
    assert info is not None
    return info.row_grad


def _has_zero_rows(p: Tensor) -> bool:
    """Whether table ``p``'s densified gradient has rows that no pending id reached (read on the host:
    only a negative ``norm_type`` asks)."""
    info = table_info(p)
    assert info is not None
    rg = info.row_grad
    if rg.owned:  # shard-local ids [n, M]: made global (shard d's rows start at d · R/n)
        ids, _, _ = rg.collect_owned()
        ids, local = ids.cpu(), p.shape[0] // info.num_shards
        real = (ids + torch.arange(ids.shape[0])[:, None] * local)[ids < local]
    else:
        ids = rg.ids().cpu()
        real = ids[ids < p.shape[0]]
    return int(torch.unique(real).numel()) < info.num_embeddings


def _group_norm(params: list[Tensor], summed: list[tuple[Tensor, Tensor]], spread: list[Tensor],
                norm_type: float, error_if_nonfinite: bool, foreach: bool | None) -> Tensor:
    """The norm over every gradient when some tables are sharded over a process group: the sharded tables'
    rows (each rank's own, duplicates summed by :func:`_coalesced`) reduced over the group (a sum of
    ``|g|^p``, or a max for ``inf``); dense gradients and replicated tables' rows are global already and
    count once."""
    if norm_type <= 0:
        # A negative (or 0) order needs every rank's count of untouched rows, which no collective here keeps.
        raise ValueError("clip_grad_norm_: norm_type must be > 0 when tables are sharded over a process group "
                         f"(tte.distributed.shard); received {norm_type}")
    mine = {id(p) for p in spread}
    local = [p.grad for p in params if p.grad is not None and table_info(p) is None]
    local += [r for p, r in summed if id(p) not in mine and r.numel()]  # (no rows: zeros, as in clip_grad_norm_)
    theirs = [r for p, r in summed if id(p) in mine and r.numel()]
    sharding = process_group_placement(spread[0])
    assert sharding is not None
    group = sharding.group
    # The reduced value's dtype from the parameters, alike on every rank: from the gradients a rank holds, a rank
    # with none (no dense gradient, no row of a table it owns) sent float32 where the others sent float64, and gloo
    # aborted the processes ("Received data size doesn't match expected size").
    kinds = [math_dtype(p) if table_info(p) is not None else p.dtype for p in params if p.is_floating_point()]
    dtype = functools.reduce(torch.promote_types, kinds)
    device = spread[0].device
    norm = torch.zeros((), dtype=dtype, device=device)
    if local:
        norm = torch.nn.utils.get_total_norm(local, norm_type, False, foreach).to(device=device, dtype=dtype)
    part = torch.zeros_like(norm)
    if theirs:
        part = torch.nn.utils.get_total_norm(theirs, norm_type, False, foreach).to(device=device, dtype=dtype)
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


def _coalesced(p: Tensor) -> tuple[Tensor, Tensor, int] | None:
    """``(ids, rows, sentinel)``: a copy of ``p``'s pending row gradient with duplicate ids summed (float32 for a
    16-bit table), ``None`` without one; the pending rows themselves are left as they are. ``ids`` are the
    table's (logical) ids ``[U]``, or for a table trained through the id exchange shard-local ``[n, M]``
    (:func:`_owned_rows`); ``sentinel``: the id of the padding entries."""
    info = table_info(p)
    assert info is not None
    rg = info.row_grad
    if not rg:
        return None
    if rg.owned:
        return _owned_rows(p)
    ids, rows = rg.collect()
    uniq, summed = coalesce_rows(ids, rows.to(math_dtype(p)), p.shape[0])
    return uniq, summed, int(p.shape[0])


def _norm_rows(p: Tensor, coalesced: tuple[Tensor, Tensor, int], distinct: bool = False) -> Tensor:
    """:func:`_coalesced`'s rows, for the norm. ``distinct``: only the rows of ids looked up (a negative
    ``norm_type`` sees a zero row: the sentinel tail a sync-free device keeps is dropped on an eager accelerator,
    by a host read, as :func:`_has_zero_rows` reads; on XLA, and on each shard of the id exchange, its rows are
    made ``+inf``: :func:`_no_tail`)."""
    uniq, summed, sentinel = coalesced
    if not distinct:
        return summed
    if _row_grad(p).owned:
        return _no_tail(uniq, summed, sentinel)
    if sinks_sentinel(p.device):
        return summed[uniq < sentinel]
    return _no_tail(uniq, summed, sentinel) if is_static_device(p.device) else summed


def _table_terms(p: Tensor, coalesced: tuple[Tensor, Tensor, int]) -> list[Tensor]:
    """The gradient tensors ``norm_type=0`` counts for ``p`` (torch counts those with a nonzero entry, one per
    tensor): its summed rows for one table; for a stacked group one ``[1]`` tensor per member table, 1 where
    the table's rows hold a nonzero entry (duplicates summed first: rows that cancel are zero, as in the dense
    gradient), so the count is the unstacked one. Static: masks combined, no rows selected."""
    info = table_info(p)
    assert info is not None
    uniq, summed, _ = coalesced
    if not info.members:
        return [summed] if summed.numel() else []
    if info.row_grad.owned:  # shard-local rows -> the group's logical ids (padding: past every member)
        assert info.layout is not None  # owner-local chunks exist only on tables so laid out
        uniq = owned_logical_ids(uniq, info.layout, int(p.shape[0]), int(p.shape[0]))
    nonzero = (summed != 0).any(-1)
    return [((uniq >= off) & (uniq < off + n) & nonzero).any().to(summed.dtype).reshape(1)
            for _, off, n in info.members]


def _no_tail(uniq: Tensor, summed: Tensor, sentinel: int) -> Tensor:
    """``summed`` with the rows of XLA's sentinel tail made ``+inf``: static (a mask would compile a graph per
    count), and such a row is no row's smallest ``|g|`` and adds 0 to a sum of ``|g|^p`` for ``p < 0`` (torch's
    dense gradient holds no such row)."""
    return torch.where((uniq < sentinel).unsqueeze(-1), summed, math.inf)


def _owned_rows(p: Tensor) -> tuple[Tensor, Tensor, int]:
    """As :func:`_coalesced` for a table trained through the id exchange (SPMD, owner-local chunks
    ``ids [n, M]``, ``rows [n, M, D]``): duplicates are summed on each shard (a row lives on one shard),
    in one manual-sharding region. A chunk whose lookup dropped ids counts zero, as in the step. The sentinel:
    each shard's local padding row."""
    info = table_info(p)
    assert info is not None and info.sharding is not None
    sharding = info.sharding
    sentinel = p.shape[0] // sharding.num_shards  # shard-local padding row
    ids, rows, ok = info.row_grad.collect_owned()
    rows = torch.where(ok, rows.to(math_dtype(p)), torch.zeros((), dtype=math_dtype(p), device=rows.device))

    def on_shard(sharded: dict[str, Tensor], small: dict[str, Tensor], inputs: list[Tensor],
                 rep: list[Tensor | None]) -> list[Tensor]:
        return list(coalesce_rows(inputs[0], inputs[1], sentinel))

    uniq, summed = sharding.on_shards(on_shard, {}, {}, [ids, rows], [])
    return uniq, summed, sentinel
