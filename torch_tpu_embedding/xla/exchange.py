"""The id exchange of a row-sharded table under SPMD: each device sends its ids to the shards that own
them and gets the rows back; the backward sends gradient rows to the owners, where the optimizer
updates them with no further communication.

Per device and step, with ``N`` ids per device, ``n`` shards and bucket capacity ``k`` (unique ids
one device may send to one shard), the exchange moves ``n·k`` ids and ``2·n·k`` rows of ``D`` values
in three ``all-to-all`` s: ids out, rows back, gradient rows out: ``n·k·(4 + 8·D)`` bytes for float32
rows. ``n·k`` is ``N`` plus the headroom buckets need
(:func:`~torch_tpu_embedding.routing.default_capacity`: 1.2–1.7 × N at ``N = 576``,
``n = 2…8``; the headroom shrinks as ``√(n/N)``), not ``n`` times the batch. (The partitioner's
default for a row-sharded lookup all-gathers every id of the global batch and all-reduces
``[global ids, D]`` rows: linear in ``n``.)

Shapes are device-major (:mod:`torch_tpu_embedding.xla.manual`): ``ids [n, N]`` sharded on dim 0
holds device ``d``'s ids in row ``d`` — a batch-sharded ``[n·B, L]`` input reshaped to ``[n, B·L]``.

The bookkeeping (ownership, capacity, the per-device routing plan, the bucket sums) is
:mod:`torch_tpu_embedding.routing`, shared with any other transport; this module is the SPMD transport:
it runs those per-device steps on each shard in a manual-sharding region and moves the buckets by
resharding. Steps (each a function here; :func:`exchange_lookup` chains the forward)::

    routing = route_ids(ids, ownership, capacity, mesh)      # dedup, bucket by owner, ids all-to-all
    rows = rows_at_positions(all_to_all(gather_owned(table, routing), mesh, to_dst=False), routing)
    ...                                                      # combine, loss, backward: grad [n, N, D]
    local_ids, local_rows = exchange_grad(grad, routing)     # owner d: [n·k] local rows, [n·k, D]
    shard_local(adam_on_shard, [table, m, v], [local_ids, local_rows, routing.overflow], mesh=mesh)

Overflow is never silent: an id that does not fit in its bucket is counted in
``routing.overflow[s, d]`` (device ``s`` to shard ``d``), its positions get zero rows and its gradient
is not sent. A caller raises at the next sync point and gates the update (``overflow == 0``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torch_tpu_embedding._rows import routing as plan
from torch_tpu_embedding._rows.routing import RowOwnership
from torch_tpu_embedding._util.validation import check_int
from torch_tpu_embedding.xla.manual import Mesh, all_to_all, enter, leave, spec

__all__ = [
    "Routing",
    "exchange_grad",
    "exchange_lookup",
    "gather_owned",
    "largest_load",
    "route_ids",
    "rows_at_positions",
    "total_overflow",
]


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where every id of a step went; what the rows back and the backward need.

    Attributes:
        send: ``[n_src, n_dst, k]`` int32, sharded on dim 0: the local rows (at the owner ``d``) of
            the unique ids device ``s`` requests from shard ``d``, in ascending order; unused slots
            hold the local sentinel ``R/n``.
        recv: the same values sharded on dim 1 (after the ``all-to-all``): owner ``d`` holds
            ``recv[:, d]``.
        slot: ``[n, N]`` int64, sharded on dim 0: position ``i`` of device ``s`` reads bucket slot
            ``slot[s, i]`` of the flattened ``[n_dst·k]`` buckets; ``n·k`` for padding and overflow.
        load: ``[n_src, n_dst]`` int32: unique ids device ``s`` had for shard ``d`` (before capacity).
        overflow: ``[n_src, n_dst]`` int32: those that did not fit (``max(load - k, 0)``).
        ownership, capacity, mesh, axis: the configuration.
    """

    send: torch.Tensor
    recv: torch.Tensor
    slot: torch.Tensor
    load: torch.Tensor
    overflow: torch.Tensor
    ownership: RowOwnership
    capacity: int
    mesh: Any
    axis: str


def route_ids(
    ids: torch.Tensor, ownership: RowOwnership, capacity: int, mesh: Mesh, axis: str = "x"
) -> Routing:
    """Dedup each device's ids, bucket them by owner and send each bucket to its owner.

    Args:
        ids: ``[n, N]`` int device-major ids (row ``d``: device ``d``'s ids), sharded on dim 0. Ids
            outside ``[0, ownership.rows)`` are padding (not routed, zero rows).
        ownership: the table's :class:`~torch_tpu_embedding.routing.RowOwnership`.
        capacity: ``k``, unique ids one device may send to one shard.

    Returns:
        The :class:`Routing` (one ``all-to-all`` of ``[n, n, k]`` int32 ids).
    """
    check_int("capacity", capacity, minimum=1)
    n = ownership.num_shards
    if ids.dim() != 2 or ids.shape[0] != n or int(mesh.shape()[axis]) != n:
        raise ValueError(
            f"route_ids: ids must be [n, N] with n = {n} shards (mesh axis '{axis}': "
            f"{int(mesh.shape()[axis])} devices). Received: {tuple(ids.shape)}"
        )
    m = ids.shape[1]
    mine = plan.plan_routes(enter(ids, spec(axis, 0, 2), mesh)[0], ownership, capacity)
    send_g = leave(mine.send.unsqueeze(0), spec(axis, 0, 3), (n, n, capacity), mesh)
    load_g = leave(mine.load.unsqueeze(0), spec(axis, 0, 2), (n, n), mesh)
    return Routing(
        send=send_g,
        recv=all_to_all(send_g, mesh, axis),
        slot=leave(mine.slot.unsqueeze(0), spec(axis, 0, 2), (n, m), mesh),
        load=load_g,
        overflow=(load_g - capacity).clamp(min=0),
        ownership=ownership,
        capacity=capacity,
        mesh=mesh,
        axis=axis,
    )


def gather_owned(table: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Owner-local gather: ``[n_src, n_dst, k, D]`` rows sharded on dim 1 (shard ``d`` reads its own
    rows for every source; unused slots are zero). No communication."""
    mesh, axis = routing.mesh, routing.axis
    n, cap = routing.ownership.num_shards, routing.capacity
    if table.shape[0] != routing.ownership.rows:
        raise ValueError(
            f"gather_owned: the table has {table.shape[0]} rows, the routing {routing.ownership.rows}."
        )
    shard = enter(table, spec(axis, 0, table.dim()), mesh)  # [R/n, D]
    want = enter(routing.recv, spec(axis, 1, 3), mesh)  # [n_src, 1, k]
    rows = plan.gather_owned_rows(shard, want)
    return leave(rows, spec(axis, 1, 4), (n, n, cap, table.shape[1]), mesh)


def rows_at_positions(rows_back: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The row of every position: ``rows_back [n_src, n_dst, k, D]`` sharded on dim 0 (after the
    return ``all-to-all``) -> ``[n, N, D]`` sharded on dim 0 (zero rows at padding and overflow)."""
    mesh, axis = routing.mesh, routing.axis
    n, cap = routing.ownership.num_shards, routing.capacity
    d = rows_back.shape[-1]
    flat = enter(rows_back, spec(axis, 0, 4), mesh).reshape(n * cap, d)
    slot = enter(routing.slot, spec(axis, 0, 2), mesh)[0]
    out = plan.rows_at_positions(flat, slot)
    return leave(out.unsqueeze(0), spec(axis, 0, 3), (n, slot.shape[0], d), mesh)


def exchange_lookup(
    table: torch.Tensor,
    ids: torch.Tensor,
    ownership: RowOwnership,
    capacity: int,
    mesh: Mesh,
    axis: str = "x",
) -> tuple[torch.Tensor, Routing]:
    """Rows ``[n, N, D]`` (sharded on dim 0) of device-major ``ids [n, N]`` from a row-sharded
    ``table [R, D]`` stored in ``ownership``'s physical order, and the :class:`Routing` for the
    backward. Two ``all-to-all`` s: ``[n, n, k]`` int32 ids out, ``[n, n, k, D]`` rows back."""
    routing = route_ids(ids, ownership, capacity, mesh, axis)
    back = all_to_all(gather_owned(table, routing), mesh, axis, to_dst=False)
    return rows_at_positions(back, routing), routing


def exchange_grad(grad: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Send per-position gradient rows to the owners (one ``all-to-all`` of ``[n, n, k, D]``).

    Args:
        grad: ``[n, N, D]`` sharded on dim 0: the gradient of every position's row.

    Returns:
        ``(ids [n, n·k] int64, rows [n, n·k, D])`` sharded on dim 0: row ``d`` holds the local row
        ids of shard ``d`` (``R/n`` = padding) and their gradient, each source's duplicates already
        summed (different sources may still send the same row: the update sums them).
    """
    mesh, axis = routing.mesh, routing.axis
    n, cap = routing.ownership.num_shards, routing.capacity
    d = grad.shape[-1]
    g = enter(grad, spec(axis, 0, 3), mesh)[0]  # [N, D]
    slot = enter(routing.slot, spec(axis, 0, 2), mesh)[0]
    out = leave(plan.bucket_rows(g, slot, n, cap).unsqueeze(0), spec(axis, 0, 4), (n, n, cap, d), mesh)
    got = enter(all_to_all(out, mesh, axis), spec(axis, 1, 4), mesh)  # [n_src, 1, k, D]
    ids = enter(routing.recv, spec(axis, 1, 3), mesh)  # [n_src, 1, k]
    ids_g = leave(ids.reshape(1, n * cap).to(torch.int64), spec(axis, 0, 2), (n, n * cap), mesh)
    rows_g = leave(got.reshape(1, n * cap, d), spec(axis, 0, 3), (n, n * cap, d), mesh)
    return ids_g, rows_g


def largest_load(routing: Routing) -> torch.Tensor:
    """0-d int32: the most unique ids any device had for any shard this step — the capacity that
    would have sufficed (read it at a sync point to size ``capacity``)."""
    return routing.load.max()


def total_overflow(routing: Routing) -> torch.Tensor:
    """0-d int32: ids dropped this step over all (source, destination) pairs; 0 when all fit."""
    return routing.overflow.sum()
