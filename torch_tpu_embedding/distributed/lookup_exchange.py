"""One forward's exchange of every table it looks up over one process group: one agreement, three all-to-alls.

A forward call of a collection looks up all its process-group-sharded tables (a stacked group counts as one
table) together, each rank ``m`` tables over a group of ``n`` ranks:

1. :func:`plan`: each table's ids deduplicated and bucketed by owner (:func:`~torch_tpu_embedding._rows.routing.
   plan_routes`), then ONE :func:`~.exchange.agree_capacity` for all of them (one ``all_reduce`` of its fixed
   eight int64, one host read): the bucket size ``k`` is the largest load of any rank for any owner of ANY of
   the tables, and the tag names every table and whether it records gradients, so that ranks running other
   lookups raise on every rank, naming the tables;
2. :func:`fetch_rows`: ONE ``all_to_all_single`` of every table's ``[n, k]`` int32 local rows side by side,
   with each table's largest load on this rank (``m`` more int32 per destination: every rank then knows each
   table's own largest load, for ``largest_loads()``, without a second collective or a host read); each owner
   gathers its rows, and ONE ``all_to_all_single`` returns them as bytes: the tables differ in dim and dtype,
   so each table's ``[n, k, D_t]`` rows are viewed as ``uint8`` (no copy), set side by side and viewed back on
   arrival (bytes are exact in any dtype, so the rows are those of one exchange per table);
3. :func:`send_grads` (the backward, of the tables that record gradients only): each table's ``[n, k, D_t + 1]``
   gradient buckets, side by side as bytes, in ONE ``all_to_all_single``, with ``m`` bytes more per destination:
   whether this rank's loss used each table, so that an owner whose own loss left a table out still records the
   rows another rank's loss sent it (it reads those ``m`` flags: a host read only then).

Cost, per rank and step: ``n·k·(4·m + Σ_t (2·D_t + 1)·b_t) + 5·n·m`` bytes sent for ``b_t``-byte rows (the
backward's rows in the update's dtype), and 64 bytes for the agreement. ``k`` is shared: a table whose own
largest load is below it sends padding up to ``k`` (at most ``m`` times the bytes of one exchange per table at
its own size, when one table's load dominates the others'), for ``m`` times fewer collectives and host reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from torch_tpu_embedding._rows.routing import RoutePlan, bucket_rows, gather_owned_rows, plan_routes
from torch_tpu_embedding.distributed.exchange import GroupSharding, agree_capacity, exchange, lookups_named

__all__ = ["fetch_rows", "plan", "send_grads"]

Tensor = torch.Tensor


def plan(ids: Sequence[Tensor], shardings: Sequence[GroupSharding], grads: Sequence[bool], config: int = 0,
         disagree: Callable[[], None] | None = None) -> tuple[list[RoutePlan], int, Tensor]:
    """Each table's route plan of this rank's logical ``ids [N_t]`` at one capacity agreed for all:
    ``(plans, k, loads)``, ``loads [m]`` int32: each table's largest load on this rank (for :func:`fetch_rows`).

    ``grads``: whether each table's lookup records gradients (part of the agreement's tag); ``config``,
    ``disagree``: a training lookup's agreement on the ranks' optimizers (:func:`~.exchange.agree_capacity`).
    """
    n, s0 = shardings[0].world, shardings[0]
    fulls, rooms = [], []
    for t, sharding in zip(ids, shardings, strict=True):
        routed = sharding.route_ids(t.to(torch.int64))
        rooms.append(max(1, routed.shape[0]))  # every id fits at this capacity
        fulls.append(plan_routes(routed, sharding.ownership, rooms[-1]))
    dev = fulls[0].load.device
    loads = torch.stack([f.load.max() if n else torch.zeros((), dtype=torch.int32, device=dev) for f in fulls])
    if len(shardings) == 1:  # (the tag of one table's lookup, as every other agreement of the table names it)
        k = agree_capacity(loads.max(), s0.group, what="lookup", table=s0.table, grad=grads[0], config=config,
                           disagree=disagree)
    else:
        k = agree_capacity(loads.max(), s0.group, what="lookups", config=config, disagree=disagree,
                           table=lookups_named([(s.table, g) for s, g in zip(shardings, grads, strict=True)]))
    plans = []
    for full, room, sharding in zip(fulls, rooms, shardings, strict=True):
        # Each owner's ids are at the front of its bucket (ascending), so the buckets are cut to k columns and
        # the slots renumbered: slot = owner·room + rank becomes owner·k + rank; padding n·room becomes n·k.
        owner, rank = full.slot // room, full.slot % room
        slot = torch.where(owner < n, owner * k + rank, torch.full_like(full.slot, n * k))
        send = full.send[:, :k] if k <= room else torch.cat(
            [full.send, full.send.new_full((n, k - room), sharding.ownership.rows_per_shard)], dim=1)
        plans.append(RoutePlan(send.contiguous(), slot, full.load))
    return plans, k, loads


def fetch_rows(shards: Sequence[Tensor], sends: Sequence[Tensor], loads: Tensor, shardings: Sequence[GroupSharding]
               ) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """The forward's two all-to-alls, for every table: ``sends [n, k]`` local rows to their owners (with
    ``loads``), the owners' rows back.

    Returns ``(rows, asked, largest)``: each table's rows ``[n·k, D_t]`` in bucket order; each table's
    ``asked [n, k]`` int64, the local rows the other ranks asked this rank for (row ``s`` from rank ``s``;
    ``local_rows`` where nothing was asked); ``largest [m]`` int64, each table's largest load of any rank
    (on the device: read only when asked, ``largest_loads()``).
    """
    n, m, k = shardings[0].world, len(sends), sends[0].shape[1]
    group = shardings[0].group
    ids = torch.cat([*sends, loads.to(sends[0].dtype).unsqueeze(0).expand(n, m)], dim=1)
    got = exchange(ids, group)
    largest = got[:, m * k:].max(dim=0).values.to(torch.int64)
    asked, rows = [], []
    for t, (shard, sharding) in enumerate(zip(shards, shardings, strict=True)):
        per = sharding.ownership.rows_per_shard
        asked64 = got[:, t * k:(t + 1) * k].to(torch.int64)
        if shard.shape[0] != per:  # "table" off its owner: nothing is stored, nothing can have been asked
            asked64 = torch.full_like(asked64, per)
        rows.append(gather_owned_rows(shard, asked64) if shard.shape[0] else shard.new_zeros(n, k, shard.shape[1]))
        asked.append(torch.where(asked64 < per, asked64, torch.full_like(asked64, shard.shape[0])))
    back = _exchange_side_by_side(rows, group)
    return [b.reshape(-1, b.shape[-1]) for b in back], asked, largest


def send_grads(grads: Sequence[Tensor], slots: Sequence[Tensor], k: int, sharding: GroupSharding,
               reached: Tensor) -> tuple[list[Tensor], Tensor]:
    """The backward's all-to-all, for every table that records gradients: each position's gradient row
    ``grads[t] [N_t, D_t]`` summed into its bucket slot and sent to the owner, with ``reached [m]`` uint8 (whether
    this rank's loss used each table) sent to every rank. Returns the rows this rank owns, each ``[n·k, D_t]`` (in
    the order of the table's ``asked`` local rows of :func:`fetch_rows`), and ``[m]`` bool on the device: whether
    some rank's loss used each table (read only by a rank whose own loss left a table out)."""
    n = sharding.world
    buckets = [bucket_rows(g, s, n, k) for g, s in zip(grads, slots, strict=True)]
    got = _exchange_side_by_side([*buckets, reached.unsqueeze(0).expand(n, -1).contiguous()], sharding.group)
    return [b.reshape(-1, b.shape[-1]) for b in got[:-1]], got[-1].sum(0) > 0


def _exchange_side_by_side(parts: Sequence[Tensor], group: object) -> list[Tensor]:
    """One :func:`~.exchange.exchange` of ``parts`` (each ``[n, ...]``, of any dtype and row size): their
    bytes side by side, each rank's share ``[n, Σ bytes]``; returns each part as it arrived, in its shape and
    dtype. One part is sent as it is."""
    if len(parts) == 1:
        return [exchange(parts[0], group)]
    n = parts[0].shape[0]
    raw = [p.contiguous().view(torch.uint8).reshape(n, -1) for p in parts]
    got = exchange(torch.cat(raw, dim=1), group)
    out, at = [], 0
    for p, r in zip(parts, raw, strict=True):
        # (a copy at offset 0, whose rows start on the dtype's alignment: a slice of one rank's share (n = 1) is
        # already "contiguous" and would keep its offset and row stride, which need not divide the element size)
        out.append(got[:, at:at + r.shape[1]].clone(memory_format=torch.contiguous_format).view(p.dtype)
                   .reshape(p.shape))
        at += r.shape[1]
    return out
