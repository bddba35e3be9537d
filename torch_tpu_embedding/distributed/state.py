"""A table sharded over a process group, in ``state_dict`` as a DTensor ``Shard(0)`` of its logical rows.

``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load``, ``get_model_state_dict`` /
``set_model_state_dict``) takes a plain tensor for a replicated one: a state_dict holding each rank's
stored rows as plain tensors is saved from one rank only, and every rank loads those rows back
(measured: ``benchmarks/mp_dtensor.py``, docs/sharding.md). It reads a DTensor as the shards it is.

A rank stores its rows in the exchange's interleaved order (``"row"``) or the whole table (``"table"``),
neither of which is a ``Shard(0)`` of the logical table (contiguous blocks in rank order). So
:func:`to_logical_shard` moves the rows into those blocks (rank ``r``: logical rows
``[r·B, (r+1)·B)``, ``B = ceil(V / n)``, as ``torch.chunk`` and DTensor split) through the transport's
:func:`~torch_tpu_embedding.distributed.exchange.send_to_owners` (one ``all_reduce`` of the bucket size, then
equal-split ``all_to_all_single`` s of the rows and of their slots), and :func:`from_logical_shard`
moves them back. Each rank sends and receives at most its rows padded to the largest bucket: no rank ever
holds more of the table than its shard, its block and those buckets (a ``"table"`` owner: the table
it holds, and the buckets of it it sends).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torch_tpu_embedding.distributed.exchange import GroupSharding, agree_capacity, group_sharding, send_to_owners

__all__ = [
    "block_rows", "check_whole_tables", "from_logical_shard", "from_logical_slot", "gather_whole",
    "pending_from_logical", "pending_to_logical", "stored_from_whole", "to_logical_shard", "to_logical_slot",
    "whole_from_saved",
    "whole_to_saved",
]

Tensor = torch.Tensor


def block_rows(rows: int, world: int) -> int:
    """``B``: logical rows per rank of a DTensor ``Shard(0)`` of ``rows`` rows over ``world`` ranks."""
    return -(-rows // world)


def _owner_and_slot(ids: Tensor, s: GroupSharding) -> tuple[Tensor, Tensor]:
    """The rank storing each logical id of a sharded table, and its row there."""
    if s.placement == "table":
        return torch.full_like(ids, s.owner), ids
    per = s.ownership.rows_per_shard
    phys = s.ownership.physical_row(ids)
    return phys // per, phys % per


def _exchange(dest: Tensor, slot: Tensor, rows: Tensor, s: GroupSharding) -> tuple[Tensor, Tensor]:
    """Send ``rows[i]`` to rank ``dest[i]``, to land at its row ``slot[i]`` (the transport's
    :func:`~torch_tpu_embedding.distributed.exchange.send_to_owners`: one ``all_reduce`` of the bucket size, one
    ``all_to_all_single`` of the slots and one of the rows). Returns the slots (``-1``: padding), on the
    CPU, and rows this rank received."""
    got_slot, got_rows = send_to_owners(dest, (slot.to(rows.device), rows), (-1, 0), s.world, s.group, s.table)
    return got_slot.cpu(), got_rows


def to_logical_shard(local: Tensor, s: GroupSharding) -> DTensor:
    """This rank's stored rows ``local`` of a table laid out by ``s`` as a DTensor ``Shard(0)`` of the
    logical ``[V, D]`` table (rows moved to their logical block's rank; a collective: every rank calls
    it, in the same order)."""
    ids = s.local_logical_ids()
    real = ids < s.rows
    block = block_rows(s.rows, s.world)
    got_slot, got_rows = _exchange(ids[real] // block, ids[real] - (ids[real] // block) * block,
                                   local.detach()[real.to(local.device)], s)
    start = min(s.rows, s.rank * block)
    mine = torch.zeros(min(s.rows, start + block) - start, local.shape[1], dtype=local.dtype, device=local.device)
    keep = got_slot >= 0
    mine[got_slot[keep].to(local.device)] = got_rows[keep.to(local.device)]
    mesh = DeviceMesh.from_group(s.group, local.device.type)
    return DTensor.from_local(mine, mesh, [Shard(0)], run_check=False, shape=torch.Size((s.rows, local.shape[1])),
                              stride=(local.shape[1], 1))


def from_logical_shard(value: Any, s: GroupSharding, name: str, base: Tensor | None = None) -> Tensor:
    """The rows this rank stores of a table laid out by ``s``, from ``value``, a DTensor ``Shard(0)`` of its
    logical rows over the same group (a collective, as :func:`to_logical_shard`); padding rows zero.

    A plain tensor (not a DTensor) is this rank's stored rows, as ``state_dict()`` gives them without
    ``dtensor_state_dict`` and as they are loaded when every rank gives them: returned as it is, nothing moved,
    after the one agreement of a move (tag ``"plain"``), so that where one rank is given a DTensor and another a
    plain tensor every rank raises (RuntimeError: the ranks are at different exchanges) instead of the DTensor
    ranks waiting in the move for the others.

    Raises:
        ValueError: ``value`` is not a ``Shard(0)`` of ``[V, D]`` over this group's ranks, or a plain tensor of
            other rows than this rank stores (then, on the other ranks of the group, RuntimeError naming this
            rank: it takes part in the agreement as failed).
    """
    if isinstance(value, Tensor) and not isinstance(value, DTensor):
        stored = value.dim() >= 1 and value.shape[0] == s.local_rows
        agree_capacity(torch.zeros((), dtype=torch.int64, device=value.device), s.group, what="plain", table=s.table,
                       failed=not stored)  # refused here: the others raise there, naming this rank
        if not stored:
            raise ValueError(
                f"Table `{name}`: a plain tensor loaded into a table sharded over a process group with "
                f"dtensor_state_dict=True must be this rank's stored rows ({s.local_rows} rows here, as the state_dict "
                "of a model sharded without dtensor_state_dict holds them). Give its logical rows as the DTensor "
                "Shard(0) that model.state_dict() gives, or a whole table through "
                f"tte.interop.load_torchrec_state_dict. Received: a tensor of shape {tuple(value.shape)}"
            )
        return value
    if (not isinstance(value, DTensor) or tuple(value.placements) != (Shard(0),) or value.device_mesh.size() != s.world
            or value.shape[0] != s.rows):
        # This rank takes part in the move's one agreement as failed, instead of skipping the move: the other
        # ranks raise there (naming it) rather than wait for it, each in its own load_state_dict.
        local = value.to_local() if isinstance(value, DTensor) else base if base is not None else value
        s.move_failed(local.device if isinstance(local, Tensor) else torch.device("cpu"))
        raise ValueError(
            f"Table `{name}`: a DTensor loaded into a table sharded over a process group must be a Shard(0) of "
            f"its {s.rows} logical rows over the {s.world} ranks of its group. Received: {type(value).__name__} of "
            f"shape {tuple(value.shape)}, placements {getattr(value, 'placements', None)}"
        )
    mine = value.to_local()
    block = block_rows(s.rows, s.world)
    ids = torch.arange(mine.shape[0], dtype=torch.int64) + min(s.rows, s.rank * block)
    dest, slot = _owner_and_slot(ids, s)
    got_slot, got_rows = _exchange(dest, slot, mine, s)
    local = (torch.zeros(s.local_rows, mine.shape[1], dtype=mine.dtype, device=mine.device) if base is None
             else base.detach().reshape(s.local_rows, mine.shape[1]).to(mine.dtype).clone())  # padding: base's
    keep = got_slot >= 0
    local[got_slot[keep].to(local.device)] = got_rows[keep.to(local.device)]
    return local


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= max(d, 1)
    return tuple(reversed(stride))


def to_logical_slot(slot: Tensor, s: GroupSharding) -> DTensor:
    """:func:`to_logical_shard` of an optimizer slot whose dim 0 is the table's stored rows (``[local]`` or
    ``[local, ...]``): a DTensor ``Shard(0)`` of its logical rows, of the slot's trailing shape."""
    tail = tuple(slot.shape[1:])
    width = math.prod(tail)
    flat = to_logical_shard(slot.reshape(slot.shape[0], width), s)
    shape = (s.rows, *tail)
    return DTensor.from_local(flat.to_local().reshape(-1, *tail), flat.device_mesh, [Shard(0)], run_check=False,
                              shape=torch.Size(shape), stride=_contiguous(shape))


def from_logical_slot(value: Any, s: GroupSharding, name: str, base: Tensor | None = None) -> Tensor:
    """The inverse of :func:`to_logical_slot` (a collective): this rank's stored rows of the slot, its padding
    rows (never read) those of ``base``, the live slot (zeros without it)."""
    if not isinstance(value, DTensor):
        return from_logical_shard(value, s, name, base)  # a plain tensor agreed, anything else refused there
    tail = tuple(value.shape[1:])
    width = math.prod(tail)
    flat = DTensor.from_local(value.to_local().reshape(-1, width), value.device_mesh, list(value.placements),
                              run_check=False, shape=torch.Size((value.shape[0], width)), stride=(width, 1))
    return from_logical_shard(flat, s, name, base).reshape(-1, *tail)



def whole_to_saved(value: Tensor, s: GroupSharding) -> Tensor:
    """An optimizer slot of the whole table (not per row: Adafactor's ``c`` and ``r_sum``, a step counter) as
    saved: the same on every rank. DCP keeps one rank's copy of a plain tensor; a table-wise table's slot is
    live on its owner only (zero elsewhere), so it is broadcast from the owner (a collective: every rank calls
    it, in the same order). A row-wise table's is all-reduced by every step already: as is."""
    if s.placement != "table" or s.world == 1:
        return value
    out = value.detach().clone()
    dist.broadcast(out, src=dist.get_global_rank(s.group, s.owner), group=s.group)
    return out


def whole_from_saved(value: Tensor, s: GroupSharding, live: Tensor | None) -> Tensor:
    """The inverse of :func:`whole_to_saved`: the owner of a table-wise table takes the saved value; another
    rank keeps its own (``live``, never read there), so that its state is what it would have been."""
    if s.placement != "table" or s.rank == s.owner or live is None:
        return value
    return live


def pending_to_logical(ids: Tensor | None, rows: Tensor | None, k: int, width: int, dtype: torch.dtype,
                       s: GroupSharding) -> tuple[Tensor, Tensor]:
    """A pending accumulation window as the optimizer's ``state_dict`` holds it (``acc_ids [k, cap]``: this
    rank's stored rows, ``-1`` padding; ``acc_rows [k, cap, D]``; ``None``: none) as every rank's, gathered:
    ``[k, world · C]`` logical ids (``-1`` padding) and their rows, rank-major within each call's slot, on the
    CPU (a collective: one ``all_reduce`` of the capacity and two ``all_gather`` s; a window holds a few
    micro-batches' ids, never a table)."""
    device = torch.device("cpu") if rows is None else rows.device
    cap = torch.tensor([0 if ids is None else ids.shape[1]], dtype=torch.int64, device=device)
    dist.all_reduce(cap, op=dist.ReduceOp.MAX, group=s.group)
    c = int(cap.item())
    out_ids = torch.full((k, c), -1, dtype=torch.int64, device=device)
    out_rows = torch.zeros((k, c, width), dtype=dtype, device=device)
    if ids is not None and rows is not None and ids.numel():
        real = (ids >= 0) & (ids < s.local_rows)
        # each stored row's logical id, and -1 after them for the padding entries (a rank may store none)
        logical = torch.cat([s.local_logical_ids().to(device), torch.tensor([-1], device=device)])
        here = logical[torch.where(real, ids, torch.full_like(ids, s.local_rows))]
        out_ids[:, : ids.shape[1]] = torch.where(here < s.rows, here, torch.full_like(here, -1))
        out_rows[:, : ids.shape[1]] = rows.to(dtype)
    all_ids = [torch.empty_like(out_ids) for _ in range(s.world)]
    all_rows = [torch.empty_like(out_rows) for _ in range(s.world)]
    dist.all_gather(all_ids, out_ids, group=s.group)
    dist.all_gather(all_rows, out_rows, group=s.group)
    return torch.cat(all_ids, dim=1).cpu(), torch.cat(all_rows, dim=1).cpu()


def pending_from_logical(ids: Tensor, rows: Tensor, s: GroupSharding) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`pending_to_logical` (no collective: every rank holds the whole window): this
    rank's entries of each call's slot, in their order, as ``acc_ids [k, cap]`` of its stored rows (``-1``
    padding) and ``acc_rows`` (none on a rank that stores no row of the table: ``[k, 0]``).

    Raises:
        ValueError: an id outside ``[-1, rows)``, or shapes that are not ``[k, C]`` and ``[k, C, D]``.
    """
    if ids.dim() != 2 or rows.dim() != 3 or rows.shape[:2] != ids.shape or \
            bool(((ids < -1) | (ids >= s.rows)).any()):
        raise ValueError(f"Table `{s.table}`: a saved accumulation window must be ids [k, C] in [-1, {s.rows}) "
                         f"and rows [k, C, D]. Received: ids of shape {tuple(ids.shape)}, rows of shape "
                         f"{tuple(rows.shape)}")
    real = ids >= 0
    owner, slot = _owner_and_slot(torch.where(real, ids, torch.zeros_like(ids)), s)
    mine = real & (owner == s.rank) & (s.local_rows > 0)
    cap = int(mine.sum(dim=1).max()) if ids.numel() else 0
    k = ids.shape[0]
    out_ids = torch.full((k, cap), -1, dtype=torch.int64)
    out_rows = torch.zeros((k, cap, rows.shape[-1]), dtype=rows.dtype)
    for j in range(k):
        keep = mine[j]
        n = int(keep.sum())
        out_ids[j, :n] = slot[j][keep]
        out_rows[j, :n] = rows[j][keep]
    return out_ids, out_rows


def gather_whole(local: Tensor, s: GroupSharding) -> Tensor:
    """This rank's stored rows ``local`` of a table laid out by ``s`` as its whole ``[V, D]`` logical rows, on
    every rank (:func:`to_logical_shard`, then every rank's block gathered: collectives)."""
    return to_logical_shard(local, s).full_tensor()


def stored_from_whole(value: Tensor, s: GroupSharding, name: str, base: Tensor) -> Tensor:
    """The rows this rank stores of a table laid out by ``s``, from ``value``, its whole ``[V, D]`` logical rows
    given alike on every rank: this rank's logical block of it, moved as :func:`from_logical_shard` moves a
    saved one (a collective)."""
    rows, dim = int(value.shape[0]), int(value.shape[1])
    block = block_rows(rows, s.world)
    mine = value.detach().to(base.device)[min(rows, s.rank * block): min(rows, (s.rank + 1) * block)]
    mesh = DeviceMesh.from_group(s.group, base.device.type)
    logical = DTensor.from_local(mine.contiguous(), mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, dim)),
                                 stride=(dim, 1))
    return from_logical_shard(logical, s, name, base)


def check_whole_tables(model: torch.nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
    """``model``'s ``load_state_dict`` pre-hook (installed by ``tte.distributed.shard``): a plain tensor given for a
    table sharded over a process group without ``dtensor_state_dict`` must be this rank's stored rows. A whole
    ``[V, D]`` table (a checkpoint of the model before ``shard``) is refused here, before anything loads, instead of
    torch's size mismatch after every other entry has loaded. (A ``dtensor_state_dict`` table's load is a collective
    that refuses such a tensor on every rank alike: ``from_logical_shard``.)

    Raises:
        ValueError: an entry of other rows than this rank stores, naming the tables and the functions that load
            whole tables into a sharded model.
    """
    wrong = []
    for path, p in model.named_parameters():
        s = group_sharding(p)
        value = state_dict.get(prefix + path)
        if (s is not None and not s.dtensor_state_dict and isinstance(value, Tensor) and not isinstance(value, DTensor)
                and (value.dim() < 1 or value.shape[0] != s.local_rows)):
            wrong.append(f"`{prefix + path}` (table `{s.table}`: {s.local_rows} rows stored on rank {s.rank} of "
                         f"{s.world}, {s.rows} rows in all) of shape {tuple(value.shape)}")
    if wrong:
        raise ValueError(
            "Argument `state_dict` gives tables sharded over a process group (tte.distributed.shard) other rows than "
            "each rank stores: their state_dict entries hold each rank's stored rows. Nothing was loaded. To load "
            "whole [num_embeddings, D] tables (a state_dict of the model before shard) into a sharded model, use "
            "tte.interop.load_torchrec_state_dict(collection, {'embedding_bags.<table>.weight': whole, ...}) on "
            "every rank; a checkpoint of the sharded model: tte.distributed.save_sharded / load_sharded (or "
            "shard(..., dtensor_state_dict=True) with torch.distributed.checkpoint). Received: " + "; ".join(wrong)
        )
