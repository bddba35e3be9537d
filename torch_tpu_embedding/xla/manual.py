"""Shard-local computation under torch_xla SPMD: manual-sharding regions, the all-to-all, small
all-reduces, and the owner-local update of a row-sharded table and its optimizer slots.

Layout convention: a *device-major* tensor ``[n, ...]`` is sharded on dim 0 over the mesh axis, and
row ``d`` is what device ``d`` holds. Inside a manual-sharding region
(``xs.enable_manual_sharding`` … ``xs.disable_manual_sharding``) every op is per device and the SPMD
partitioner adds no collective; outside, resharding a ``[n_src, n_dst, ...]`` tensor from dim 0 to dim
1 compiles to one ``all-to-all`` (``xm.all_to_all`` itself fails under SPMD: the program has one
replica). Facts of torch_xla 2.9 that shape the code: a tensor that already carries a sharding on its
device data cannot be annotated again, so regions are entered on ``t + 0`` (an IR value; XLA removes
the add); there is no partition id in Python, so a shard that needs its index gets it from an input.

Example: SGD on the rows each shard owns (``local_ids [n, M]``, ``local_rows [n, M, D]`` from
:func:`~torch_tpu_embedding.xla.exchange.exchange_grad`), plus a value summed over all shards (the
squares of the received rows; a global clip norm would square the rows after :func:`coalesce_rows`)::

    def sgd(shards, inputs, rep):            # traced once, run by every device on its own shard
        (w,), (ids, rows), (lr,) = shards, inputs, rep      # w [R/n, D], ids [M], rows [M, D]
        sq = all_reduce((rows * rows).sum(), mesh)           # one scalar all-reduce
        w1, _ = local_row_update(lambda w0, g, s: (w0 - lr * g, s), w, {}, ids, rows, chunk_rows)
        return [w1], [sq]

    (sq,) = shard_local(sgd, [table], [local_ids, local_rows], [lr], mesh=mesh)  # sq [n], equal
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd

from torch_tpu_embedding._rows.dedup import coalesce_rows
from torch_tpu_embedding._rows.routing import slot_row

# torch_xla's partial type hints are not part of its API: treat its modules as untyped.
xs: Any = torch_xla.distributed.spmd
_XLAC: Any = torch_xla._XLAC  # type: ignore[attr-defined]
#: ``torch_xla.distributed.spmd.Mesh``
Mesh = Any
#: ``rule(w [U, D], g [U, D], slots {name: [U, ...]}) -> (w', slots')``: a per-row optimizer rule.
RowRule = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
#: ``fn(table_shards, inputs, replicated) -> (new_shards, outputs)``, see :func:`shard_local`.
ShardFn = Callable[
    [list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
]

__all__ = [
    "RowRule",
    "ShardFn",
    "all_reduce",
    "all_to_all",
    "annotate",
    "enter",
    "leave",
    "local_row_update",
    "on_shards",
    "reshard",
    "shard_local",
    "spec",
]


def spec(axis: str, dim: int | None, ndim: int) -> tuple[str | None, ...]:
    """Partition spec of an ``ndim``-d tensor split over ``axis`` on ``dim`` (``None``: replicated)."""
    return tuple(axis if i == dim else None for i in range(ndim))


def annotate(t: torch.Tensor, partition: tuple[str | None, ...], mesh: Mesh) -> None:
    """Give ``t`` the layout ``partition`` (``xs.mark_sharding``; device data is laid out anew)."""
    # What xs.mark_sharding does, minus its per-call `import torchax` attempt (about 1.7 ms of host
    # time per call in torch_xla 2.9 when torchax is not installed: 20-30 ms per exchange step).
    _XLAC._xla_mark_sharding(t, mesh.get_op_sharding(partition))


def enter(t: torch.Tensor, partition: tuple[str | None, ...], mesh: Mesh) -> torch.Tensor:
    """The local shard of ``t`` laid out as ``partition``, inside a manual-sharding region
    (``xs.enable_manual_sharding``). A 0-d tensor enters as itself (replicated)."""
    if t.dim() == 0:
        return enter(t.reshape(1), (None,), mesh).reshape(())
    if t.dtype == torch.bool:  # `t + 0` would promote it to an integer
        return enter(t.to(torch.uint8), partition, mesh).bool()
    u = t + 0  # device data that carries a sharding cannot be annotated again
    annotate(u, partition, mesh)
    out: torch.Tensor = _XLAC._spmd_full_to_shard_shape(u)
    return out


def leave(
    t: torch.Tensor, partition: tuple[str | None, ...], full_shape: Sequence[int], mesh: Mesh
) -> torch.Tensor:
    """The global tensor of shape ``full_shape`` whose shards (laid out as ``partition``) are ``t``
    (``xs.disable_manual_sharding``). A replicated ``partition`` (all ``None``) declares ``t`` the same
    on every shard."""
    if t.dim() == 0:
        return leave(t.reshape(1), (None,), (1,), mesh).reshape(())
    if t.dtype == torch.bool:
        return leave(t.to(torch.uint8), partition, full_shape, mesh).bool()
    _XLAC._mark_manual_sharding(t, _XLAC.OpSharding([], [], [], xs.ShardingType.MANUAL))
    out: torch.Tensor = _XLAC._spmd_shard_to_full_shape(
        t, mesh.get_op_sharding(partition), tuple(full_shape), t.dtype
    )
    return out


def reshard(t: torch.Tensor, partition: tuple[str | None, ...], mesh: Mesh) -> torch.Tensor:
    """``t`` with the layout ``partition``: the partitioner moves the data (an IR value is annotated)."""
    u = t + 0
    annotate(u, partition, mesh)
    return u


def all_to_all(t: torch.Tensor, mesh: Mesh, axis: str = "x", *, to_dst: bool = True) -> torch.Tensor:
    """Exchange ``t [n_src, n_dst, ...]`` between devices: one ``all-to-all``.

    ``to_dst``: ``t`` is sharded on dim 0 (device ``s`` holds its buckets ``t[s, :]``); the result is
    sharded on dim 1 (device ``d`` holds ``t[:, d]``, every source's bucket for it). ``to_dst=False``
    moves the other way. Values and global shape are unchanged; only who holds what.
    """
    return reshard(t, spec(axis, 1 if to_dst else 0, t.dim()), mesh)


def _groups(mesh: Mesh, axis: str) -> list[list[int]]:
    """Device ids of the groups along ``axis`` (one group on a 1-D mesh)."""
    ids = np.asarray(mesh.get_logical_mesh())
    k = list(mesh.axis_names).index(axis)
    return np.moveaxis(ids, k, -1).reshape(-1, ids.shape[k]).tolist()  # type: ignore[no-any-return]


def all_reduce(x: torch.Tensor, mesh: Mesh, axis: str = "x", op: str = "sum") -> torch.Tensor:
    """Inside a manual-sharding region: ``x`` reduced over the shards of ``axis`` (``op``: ``"sum"``,
    ``"max"``, ``"min"``), the same value on every shard. For small values: a global gradient norm, a
    ``[D]`` column statistic, an overflow count."""
    if op not in ("sum", "max", "min"):
        raise ValueError(f"Argument `op` must be one of ('sum', 'max', 'min'). Received: {op!r}")
    out: torch.Tensor = _XLAC._xla_spmd_all_reduce(op, x, 1.0, _groups(mesh, axis))
    return out


def shard_local(
    fn: ShardFn,
    tables: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor] = (),
    replicated: Sequence[torch.Tensor] = (),
    *,
    mesh: Mesh,
    axis: str = "x",
) -> list[torch.Tensor]:
    """Run ``fn`` on every shard with no communication, and write its new shards back in place.

    Args:
        fn: ``fn(table_shards, inputs, replicated) -> (new_shards, outputs)``, traced once and run
            by every device on its own data. ``new_shards[i]`` replaces ``table_shards[i]`` (same
            shape and dtype). ``outputs`` are per-device values (any shapes). It may call
            :func:`all_reduce`.
        tables: tensors row-sharded over ``axis`` (a table and its optimizer slots); ``fn`` sees
            shard ``d`` of each on device ``d`` and they are updated in place (``copy_``), keeping
            their sharding.
        inputs: device-major tensors ``[n, ...]`` sharded on dim 0; ``fn`` sees row ``d`` (``[...]``).
        replicated: small tensors every shard needs whole (a learning rate, a step count).

    Returns:
        ``outputs``, each stacked device-major as ``[n, ...]`` (sharded on dim 0).

    Slots whose shards must line up with the table's shards: see
    :func:`~torch_tpu_embedding.routing.slot_row`.
    """
    n = int(mesh.shape()[axis])
    loc_tables = [enter(t, spec(axis, 0, t.dim()), mesh) for t in tables]
    loc_inputs = [enter(t, spec(axis, 0, t.dim()), mesh)[0] for t in inputs]
    loc_rep = [enter(t, spec(axis, None, t.dim()), mesh) for t in replicated]
    new, outputs = fn(loc_tables, loc_inputs, loc_rep)
    if len(new) != len(tables):
        raise ValueError(f"shard_local: fn returned {len(new)} shards for {len(tables)} tables.")
    for t, old, s in zip(tables, loc_tables, new, strict=True):
        if s.shape != old.shape or s.dtype != old.dtype:
            raise ValueError(
                f"shard_local: fn returned a shard {tuple(s.shape)} {s.dtype} for one of "
                f"{tuple(old.shape)} {old.dtype}."
            )
        with torch.no_grad():
            t.copy_(leave(s, spec(axis, 0, t.dim()), t.shape, mesh))
    return [
        leave(o.unsqueeze(0), spec(axis, 0, o.dim() + 1), (n, *o.shape), mesh) for o in outputs
    ]


#: ``fn(sharded, small, inputs, replicated) -> outputs``, see :func:`on_shards`.
OnShard = Callable[
    [dict[str, torch.Tensor], dict[str, torch.Tensor], list[torch.Tensor], list[torch.Tensor | None]],
    list[torch.Tensor],
]


def on_shards(
    fn: OnShard,
    sharded: Mapping[str, torch.Tensor],
    small: Mapping[str, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    replicated: Sequence[torch.Tensor | None],
    *,
    mesh: Mesh,
    axis: str = "x",
) -> list[torch.Tensor]:
    """Run ``fn`` on every shard in one manual-sharding region and write its state back in place.

    Args:
        fn: ``fn(sharded, small, inputs, replicated) -> outputs``, traced once and run by every device
            on its own data. It updates the ``sharded`` and ``small`` dicts (in place, or by assigning
            new values of the same shapes and dtypes) and returns per-device ``outputs``. It may call
            :func:`all_reduce`.
        sharded: row-sharded tensors (a table, its slots, per-shard buffers): ``fn`` sees shard ``d``.
            Each is written back with one ``copy_`` (keeping its sharding).
        small: replicated state (a step counter, a statistic over all rows): ``fn`` sees it whole and
            must leave the same value on every shard (computed from all-reduced values).
        inputs: device-major ``[n, ...]`` tensors sharded on dim 0: ``fn`` sees row ``d``.
        replicated: read-only values every shard needs (``None`` passes through).

    Returns:
        ``outputs``, each stacked device-major as ``[n, ...]`` (sharded on dim 0).
    """
    n = int(mesh.shape()[axis])
    loc = {k: enter(t, spec(axis, 0, t.dim()), mesh) for k, t in sharded.items()}
    loc_small = {k: enter(t, spec(axis, None, t.dim()), mesh) for k, t in small.items()}
    loc_inputs = [enter(t, spec(axis, 0, t.dim()), mesh)[0] for t in inputs]
    loc_rep = [None if t is None else enter(t, spec(axis, None, t.dim()), mesh) for t in replicated]
    outputs = fn(loc, loc_small, loc_inputs, loc_rep)
    with torch.no_grad():
        for (k, t), dim in [*((kt, 0) for kt in sharded.items()), *((kt, None) for kt in small.items())]:
            new = (loc if dim == 0 else loc_small)[k]
            local_shape = (t.shape[0] // n, *t.shape[1:]) if dim == 0 else tuple(t.shape)
            if tuple(new.shape) != local_shape or new.dtype != t.dtype:
                raise ValueError(f"on_shards: fn left `{k}` as {tuple(new.shape)} {new.dtype}; expected "
                                 f"{local_shape} {t.dtype}.")
            t.copy_(leave(new, spec(axis, dim, t.dim()), t.shape, mesh))
    return [leave(o.unsqueeze(0), spec(axis, 0, o.dim() + 1), (n, *o.shape), mesh) for o in outputs]


def local_row_update(
    rule: RowRule,
    table: torch.Tensor,
    slots: Mapping[str, tuple[torch.Tensor, int]],
    ids: torch.Tensor,
    rows: torch.Tensor,
    chunk_rows: int,
    gate: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One shard's sparse update, for use inside :func:`shard_local`: dedup → gather → rule → scatter.

    Args:
        rule: the per-row optimizer rule.
        table: the local table shard ``[r, D]`` (``r`` rows; ``r`` is the sentinel).
        slots: ``name -> (slot shard, k)``: row slot ``k`` in the chunked layout of
            :func:`~torch_tpu_embedding.routing.slot_row` (``[r + k·r/c, ...]``).
        ids: ``[M]`` local row ids (duplicates allowed; ``r`` = padding).
        rows: ``[M, D]`` gradient rows; duplicates are summed before the rule.
        chunk_rows: ``c``, table rows per chunk.
        gate: optional 0-d bool: ``False`` leaves every row unchanged (e.g. an overflowed step).

    Returns:
        The new table shard and slot shards (out of place; :func:`shard_local` writes them back).
    """
    sentinel = table.shape[0]
    uniq, g = coalesce_rows(ids.to(torch.int64), rows, sentinel)  # static shapes: sentinel tail, zero rows
    w0 = table.index_select(0, uniq.clamp(max=sentinel - 1))
    at = {name: slot_row(uniq, k, chunk_rows) for name, (_, k) in slots.items()}
    s0 = {name: s.index_select(0, at[name].clamp(max=s.shape[0] - 1)) for name, (s, _) in slots.items()}
    w, s1 = rule(w0, g.to(table.dtype), s0)
    if gate is not None:
        w = torch.where(gate, w, w0)
        s1 = {k: torch.where(gate, s1[k], s0[k]) for k in s0}
    # The sentinel's rows map one past the end: XLA's scatter drops them.
    new_slots = {name: s.index_copy(0, at[name], s1[name].to(s.dtype)) for name, (s, _) in slots.items()}
    return table.index_copy(0, uniq, w.to(table.dtype)), new_slots
