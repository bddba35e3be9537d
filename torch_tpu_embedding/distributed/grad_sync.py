"""Data parallel's transport: the row gradients of replicated tables made global over a process group.

Under ``torch.distributed`` (torchrun, DDP) every process holds every table and trains on its share of
the global batch. A table's gradient lives in its :class:`~torch_tpu_embedding._rows.row_grad.RowGrad`, never in
``.grad``, so torch's data-parallel machinery does not see it. Here each process's ``(ids [n], rows
[n, D])`` of a table are gathered across the process group, concatenated in rank order and averaged as
DDP averages (each rank's rows divided by the world size before the sum). The optimizer's dedup then
makes a row touched by several ranks one update, so every replica applies the same update: one process
on the global batch, when each rank's loss is the mean over its equal share of the batch (as DDP
assumes). The user-facing side (which tables, which group, the DDP wrapper) is
:mod:`torch_tpu_embedding.distributed`.

When: the first consumer of a step's table gradients — a :mod:`torch_tpu_embedding.optim`
optimizer's ``step()`` or :func:`torch_tpu_embedding.clip_grad_norm_` — calls
:func:`sync_row_grads`, which exchanges what is not yet exchanged (so clipping and then stepping
exchanges once).

Which group: the one marked by ``tte.distributed.data_parallel`` (:func:`mark`), else the default group
when ``torch.distributed`` is initialised with more than one process; never under torch_xla SPMD, where
the partitioner already makes gradients global (multi-host SPMD runs call ``init_process_group`` for
checkpoint coordination; exchanging there would count every gradient once per host). Tables marked
local are never exchanged.

How (:func:`static_route` chooses): on the CPU (gloo), where reading the host costs nothing, each
rank first sums its duplicate ids, the ranks exchange their row counts (read on the host), pad to the
largest and gather. On every other device (CUDA/NCCL, XLA multi-process) a per-step read would stall
the host on the device, so the ranks gather the raw rows as the backward made them, padding kept, at
sizes taken from their shapes; those must be equal on every rank (the same batch size and padded
width per feature), which is checked once per shape, the only host round trip. Jagged (unpadded)
bags, whose row counts follow each rank's data, take the first route on any eager device. One
gather of ids and one of rows per dtype carries every table of a step.

Example (one process: nothing to exchange, so a no-op)::

    >>> import torch
    >>> sync_row_grads([{"params": [torch.zeros(2, requires_grad=True)]}])
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from torch_tpu_embedding._rows.dedup import coalesce_rows, is_static_device, sync_free
from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.stock_guard import OUTSIDE_A_LOOKUP, check_not_ddp_managed, ddp_message
from torch_tpu_embedding._rows.tables import GROUP_NOT_PICKLED, exchange_mark, set_exchange_mark, table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding.distributed.exchange import agree_capacity

__all__ = [
    "LOCAL",
    "agreement_device",
    "check_not_ddp_managed",
    "count_forward",
    "ddp_message",
    "exchange_group",
    "mark",
    "should_exchange",
    "spmd_active",
    "static_route",
    "sync_row_grads",
]

Tensor = torch.Tensor

#: the mark of a table whose row gradients are never exchanged (``tte.distributed.local_tables``)
LOCAL = "local"
#: how many times :func:`mark` ran: what a cache of which tables are exchanged keys on (optim_agreement.py)
MARKED = [0]
# Per-group state is held weakly by the group object, not by ``id(group)``: a group destroyed and another made at
# its address would inherit it (a count left by a forward whose backward never ran, a size check the other
# ranks' new groups have not made) and the ranks would disagree or wait.
#: process group → the static-shape exchanges' per-table sizes checked equal on every rank of it
_CHECKED_SIZES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # type: ignore[no-untyped-call]
#: device types whose exchange sums duplicates and reads the ranks' row counts on the host each step
#: (:func:`static_route`): the CPU, where a host read stalls nothing. Remove "cpu" to exchange CPU
#: tables as accelerators do (the tests do); add "cuda" to let CUDA ranks send row counts that differ.
DEDUP_DEVICE_TYPES: set[str] = {"cpu"}
#: rows multiplied out at a time when a factored (SGD) gradient is summed per id before the exchange
_PIECE_ROWS = 8192
#: process group → training forwards of its data-parallel tables since its last exchange of their row
#: gradients: part of every agreement, so that ranks whose micro-batches per step differ raise (:func:`count_forward`)
_FORWARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # type: ignore[no-untyped-call]


def count_forward(group: Any) -> int:
    """One more training forward of ``group``'s data-parallel tables; returns how many since the group's last
    exchange of their row gradients (this one included)."""
    n: int = _FORWARDS.get(group, 0) + 1  # type: ignore[no-untyped-call]
    _FORWARDS[group] = n
    return n


def agreement_device(backend: str, device: torch.device) -> torch.device:
    """Where the agreement's numbers are reduced: on the host wherever the group's ``backend`` (as
    ``torch.distributed.get_backend_config`` gives it) reduces host tensors: gloo (``"cpu:gloo,cuda:gloo"``),
    MPI, or torch's default ``"cpu:gloo,cuda:nccl"``. Reading the result back then waits for no device (a CUDA
    or XLA step keeps its device queue full). Else (``"cuda:nccl"``, ``"xla:xla"``) on the tables' ``device``:
    one device read per training forward.

    Example::

        >>> agreement_device("cpu:gloo,cuda:nccl", torch.device("cuda", 0))
        device(type='cpu')
        >>> agreement_device("cuda:nccl", torch.device("cuda", 0))
        device(type='cuda', index=0)
    """
    spec = backend.lower().replace(" ", "")
    host = spec in ("gloo", "mpi") or any(part.startswith("cpu:") for part in spec.split(","))
    return torch.device("cpu") if host or device.type == "cpu" else device


def mark(table: Tensor, group: Any) -> None:
    """Exchange ``table``'s row gradients over ``group`` (a process group), never (:data:`LOCAL`), or as
    by default (``None``: the default group; an earlier :data:`LOCAL` mark is lifted). The mark is the table's:
    a copy of its module (``copy.deepcopy``, pickle) keeps it (``EmbeddingTable.__getstate__``)."""
    MARKED[0] += 1
    if group is not None:
        set_exchange_mark(table, group)
    elif isinstance(exchange_mark(table), str):
        set_exchange_mark(table, None)


def spmd_active() -> bool:
    """Whether torch_xla's SPMD mode is on in this process (never imports torch_xla)."""
    runtime = sys.modules.get("torch_xla.runtime")
    return bool(runtime is not None and runtime.is_spmd())


def should_exchange(*, spmd: bool, group_size: int, local: bool) -> bool:
    """The rule: exchange a table's row gradients over a group of ``group_size`` processes unless
    SPMD is on (gradients are global already) or the table was opted out (``tte.distributed.local_tables``)."""
    return not spmd and not local and group_size > 1


def exchange_group(table: Tensor) -> Any:
    """The process group ``table``'s row gradients are exchanged over, or ``None`` (no exchange).

    The group marked by ``tte.distributed.data_parallel`` (:func:`mark`), else the default group when
    ``torch.distributed`` is initialised; ``None`` under SPMD, for tables marked :data:`LOCAL`
    (``tte.distributed.local_tables``) or sharded over a process group (their gradient goes to the owners),
    and for groups of one process (:func:`should_exchange`).
    """
    marked = exchange_mark(table)
    info = table_info(table)
    if marked == GROUP_NOT_PICKLED:
        names = [f"`{n}`" for n in (info.tables if info is not None else [])]
        what = f"Table {names[0]}" if len(names) == 1 else f"Tables {', '.join(names)} (stacked together)"
        raise RuntimeError(
            f"{what}: unpickled from a model whose tables' row gradients were exchanged over a process group "
            "other than the default one (tte.distributed.data_parallel(model, process_group=...)), and a "
            "process group cannot be pickled. Call tte.distributed.data_parallel(model, process_group=...) on the "
            "unpickled model (broadcast=False keeps its values) before training it, or "
            "tte.distributed.local_tables(model) to train each process's tables alone."
        )
    local = marked == LOCAL or (info is not None and info.sharding is not None
                                and info.sharding.over_process_group)
    group = None if local else marked
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    size = dist.get_world_size(group) if group is not None else 1
    return group if should_exchange(spmd=spmd_active(), group_size=size, local=local) else None


# ---------------------------------------------------------------------------------- the exchange
def static_route(device: torch.device, variable_rows: bool = False) -> bool:
    """Whether tables on ``device`` are exchanged at static sizes (no host read after a shape's first
    step) rather than deduplicated first with each rank's row counts read on the host (every step).

    Static on XLA always, and on eager devices not in :data:`DEDUP_DEVICE_TYPES` (CUDA: a host read
    there waits for the device) unless ``variable_rows``: some table's rows came from jagged bags,
    whose count differs from rank to rank, so only the counted route can agree on the sizes.
    """
    if is_static_device(device):
        return True
    return device.type not in DEDUP_DEVICE_TYPES and not variable_rows


def sync_row_grads(param_groups: Iterable[Mapping[str, Any]]) -> None:
    """Make the pending row gradients of the tables in ``param_groups`` global (data parallel).

    ``param_groups``: dicts with ``"params"``, as an optimizer's; a group with
    ``use_gradient_accumulation=False`` sends every looked-up row (its update applies duplicates one by
    one), others first sum each rank's duplicate ids. A no-op without an initialised process group.
    Every process of a group must call it with the same tables in the same order (the optimizer's
    ``step()`` and :func:`~torch_tpu_embedding.clip_grad_norm_` do). Only rows not yet exchanged are
    sent.

    Raises:
        RuntimeError: a table has a dense ``.grad`` under an initialised process group (torch's
            ``DistributedDataParallel`` reduced it, see :class:`DistributedDataParallel`; or a loss term used its
            weight outside a lookup).
    """
    if not (dist.is_available() and dist.is_initialized()) or spmd_active():
        return
    buckets: dict[tuple[int, torch.device], tuple[Any, list[tuple[Tensor, RowGrad, bool]]]] = {}
    seen: set[int] = set()
    for group in param_groups:
        dedup = group.get("use_gradient_accumulation", True) is not False
        for p in group["params"]:
            info = table_info(p)
            if info is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.grad is not None and not p.grad.is_sparse:  # (the two ways a table gets one, the likelier first)
                raise RuntimeError(f"{ddp_message(info)} Or else {OUTSIDE_A_LOOKUP}")
            pg = exchange_group(p)
            if pg is not None:
                buckets.setdefault((id(pg), p.device), (pg, []))[1].append((p, info.row_grad, dedup))
    for pg, items in buckets.values():
        _exchange(items, pg)


def _local_rows(p: Tensor, rg: RowGrad, world: int, dedup: bool, static: bool) -> tuple[Tensor, Tensor] | None:
    """This rank's not-yet-exchanged rows of ``p``, divided by ``world``; ``None`` without any.

    With ``dedup`` on the counted route: duplicate ids summed and padding dropped (fewer rows to send
    and to dedup after the exchange; a factored gradient is multiplied out piece by piece). Otherwise,
    and on the ``static`` route: the rows as the backward made them, padding kept.
    """
    local = rg.local_part()
    if not local:
        return None
    sentinel, dtype = p.shape[0], math_dtype(p)  # float32 for 16-bit tables, as the update
    if static or not dedup:
        ids, rows = local.collect()
    elif len(local) == 1 and not rg.keep_factored and not sync_free(p.device):
        ids, rows = local.collect()
        ids, rows = coalesce_rows(ids, rows.to(dtype), sentinel)
    else:  # (also an accelerator's one chunk: its coalesce_rows keeps all N entries, a sentinel tail)
        ids, inv = torch.unique(local.ids(), return_inverse=True)
        rows = torch.zeros(ids.shape[0], p.shape[1], dtype=dtype, device=p.device)
        for pos, _, part in local.pieces(_PIECE_ROWS):
            rows.index_add_(0, inv[pos : pos + part.shape[0]], part.to(dtype))
        if ids.numel() and int(ids[-1]) == sentinel:
            ids, rows = ids[:-1], rows[:-1]
    return ids, rows.to(dtype) / world


def _gather(flat: Tensor, group: Any, world: int) -> Tensor:
    """``all_gather`` of a 1-D tensor of equal length on every rank: ``[world · n]``, rank order."""
    out = torch.empty(world * flat.shape[0], dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(out, flat, group=group)
    return out


def _padded(parts: list[Tensor], size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``parts`` concatenated and padded with zeros to ``size``."""
    pad = size - sum(t.shape[0] for t in parts)
    if pad or not parts:
        parts = [*parts, torch.zeros(pad, dtype=dtype, device=device)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for k in sizes:
        out.append(at)
        at += k
    return out


def _exchange(items: list[tuple[Tensor, RowGrad, bool]], group: Any) -> None:
    """Gather the tables' local rows over ``group``; each table gets them as one exchanged chunk.

    One buffer of ids for every table and one of rows per dtype: rank ``r``'s block holds its
    tables in order, padded to the largest block.
    """
    world = dist.get_world_size(group)
    device = items[0][0].device
    forwards: int = _FORWARDS.pop(group, 0)  # type: ignore[no-untyped-call]
    static = static_route(device, any(rg.variable_rows for _, rg, _ in items))
    local = [_local_rows(p, rg, world, dedup, static) for p, rg, dedup in items]
    # Per table, the number of ids this rank sends plus one (0: no gradient at all, as in a step
    # where no backward reached the table): every rank then agrees on which tables get one.
    mine = [0 if x is None else x[0].shape[0] + 1 for x in local]
    sent = [x[0].to(torch.int64) for x in local if x is not None]
    own = sum(x[0].shape[0] for x in local if x is not None)  # the ids this rank sends
    if static:
        _check_equal_sizes(mine, group, world, device)
        counts = [mine] * world
        head, block = 0, own  # (every rank's sizes are equal: checked just above)
        all_ids = _gather(_padded(sent, block, torch.int64, device), group, world) if block else None
    else:
        # The counted route's first collective is the step's agreement (what every training forward of these
        # tables makes, of the same size): a rank still at a forward meets it and both raise, naming the cause.
        # It agrees on the largest id block; each rank's counts travel at the head of its block of ids.
        head = len(items)
        where = agreement_device(dist.get_backend_config(group), device)
        block = agree_capacity(torch.tensor(head + own, device=where), group, what="step", forwards=forwards)
        mine_t = torch.tensor(mine, dtype=torch.int64, device=device)
        all_ids = _gather(_padded([mine_t, *sent], block, torch.int64, device), group, world)
        counts = all_ids.view(world, block)[:, :head].tolist()
    n = [[max(c - 1, 0) for c in row] for row in counts]  # ids per rank and table
    dims = [p.shape[1] for p, _, _ in items]
    dtypes = [math_dtype(p) for p, _, _ in items]
    id_at = [[r * block + head + at for at in _offsets(row)] for r, row in enumerate(n)]
    rows_of: list[Tensor | None] = [None] * len(items)
    row_at: list[list[int]] = [[0] * len(items) for _ in range(world)]
    for dtype in dict.fromkeys(dtypes):
        members = [t for t, d in enumerate(dtypes) if d == dtype]
        sizes = [[row[t] * dims[t] for t in members] for row in n]
        cap = max(sum(row) for row in sizes)
        if not cap:
            continue
        parts = [x[1].reshape(-1) for t, x in enumerate(local) if x is not None and t in members]
        gathered_rows = _gather(_padded(parts, cap, dtype, device), group, world)
        for r, row in enumerate(sizes):
            for t, at in zip(members, _offsets(row), strict=True):
                row_at[r][t] = r * cap + at
        for t in members:
            rows_of[t] = gathered_rows
    for t, (_, rg, _) in enumerate(items):
        if not any(counts[r][t] for r in range(world)):
            continue
        blocks = [r for r in range(world) if n[r][t]]
        if not blocks:  # every rank had a gradient with no ids
            rg.set_local(torch.zeros(0, dtype=torch.int64, device=device),
                         torch.zeros(0, dims[t], dtype=dtypes[t], device=device))
            continue
        assert all_ids is not None and rows_of[t] is not None
        rows_all = rows_of[t]
        ids_t = torch.cat([all_ids[id_at[r][t] :][: n[r][t]] for r in blocks])
        rows_t = torch.cat([rows_all[row_at[r][t] :][: n[r][t] * dims[t]] for r in blocks])  # type: ignore[index]
        rg.set_local(ids_t, rows_t.view(-1, dims[t]))


def _check_equal_sizes(mine: list[int], group: Any, world: int, device: torch.device) -> None:
    """Static-size exchange: every rank must send the same number of rows per table (checked once per
    shape: one host round trip; a rank whose shape repeats trusts the earlier check)."""
    checked: set[tuple[int, ...]] = _CHECKED_SIZES.setdefault(group, set())  # type: ignore[no-untyped-call]
    if tuple(mine) in checked:
        return
    theirs = _gather(torch.tensor(mine, dtype=torch.int64).to(device), group, world).cpu().view(world, -1)
    if not bool((theirs == theirs[0]).all()):
        remedy = "" if is_static_device(device) else (
            f" Or let the ranks differ at a host read per step: "
            f"torch_tpu_embedding.distributed.grad_sync.DEDUP_DEVICE_TYPES.add({device.type!r}).")
        raise RuntimeError(
            f"Data parallel on {device.type} exchanges row gradients at static sizes, which must be the same on "
            "every process (the same batch size and padded width per feature). Per process and table: "
            f"{theirs.tolist()}.{remedy}"
        )
    checked.add(tuple(mine))
