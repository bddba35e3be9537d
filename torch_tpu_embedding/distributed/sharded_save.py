"""Saving a model sharded over a process group: each rank writes only its own rows (:func:`save_sharded`).

The directory holds ``rows-<rank>.pt`` per rank (the rows of each row- or table-sharded table that rank stores, in
ascending logical id, with their ids and the rows of every optimizer row slot; the table's whole-table slots and
``step``; its pending accumulation buffers, with logical ids) and ``meta.pt`` from rank 0 (the world size, each
sharded table's placement, rows and ``state_dict`` key, the rest of the model's and optimizer's ``state_dict``, and
``extra``). Rows are in logical order whatever the ownership scheme, written a window at a time
(``checkpoint/row_writer.py``; :func:`_in_order`): a save's memory grows by a window. Ranks write into a sibling
staging directory, which rank 0 seals (``meta.pt``, a manifest of each file's size and sha256) and publishes by
renames (``checkpoint/publish.py``): a process killed at any point leaves the old checkpoint or the new one.
``sharded_checkpoint.py`` reads it back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_tpu_embedding._rows.placement import stored_rows
from torch_tpu_embedding.checkpoint.agreement import Attempt, agree, given_on_every_rank
from torch_tpu_embedding.checkpoint.files import check_loadable
from torch_tpu_embedding.checkpoint.host import own_layout_state, to_cpu
from torch_tpu_embedding.checkpoint.logical_rows import ACC
from torch_tpu_embedding.checkpoint.publish import (
    SHARDED_META,
    begin_save,
    publish,
    staging_path,
    write_manifest,
)
from torch_tpu_embedding.checkpoint.row_writer import Rows, write_rows
from torch_tpu_embedding.distributed.exchange import GroupSharding, group_sharding
from torch_tpu_embedding.modules.collection import EmbeddingCollection
from torch_tpu_embedding.modules.table import EmbeddingTable

__all__ = ["all_tables", "group_sharded", "save_sharded", "stored_state"]

Tensor = torch.Tensor
#: Rows a save places at a time where it counts a table's real rows (a few int64 each).
_WINDOW = 8192


def all_tables(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Every table of every collection in ``model``: name → (its ``state_dict`` key, the table module).

    Raises:
        ValueError: two collections hold tables of one name (the files key each table by its name: the second
            took the first's place, whose stored rows were then saved as rank 0's, and loaded so on every rank).
    """
    out: dict[str, tuple[str, nn.Module]] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, EmbeddingCollection):
            for name, t in m.tables.items():
                key = f"{prefix}.tables.{name}.weight" if prefix else f"tables.{name}.weight"
                if name in out and out[name][1] is not t:
                    raise ValueError(
                        f"Argument `model` holds two tables named `{name}`, in different EmbeddingCollections (a table "
                        f"given no name is `table_<i>` in its collection), and a process-group checkpoint keys each "
                        f"table by its name. Give them distinct names (TableConfig(name=...)). Received: "
                        f"`{out[name][0]}` and `{key}`")
                out[name] = (key, t)
    return out


def group_sharded(model: nn.Module) -> dict[str, tuple[str, EmbeddingTable, GroupSharding]]:
    """The tables of ``model`` sharded over a process group: name → (``state_dict`` key, table, sharding)."""
    out: dict[str, tuple[str, EmbeddingTable, GroupSharding]] = {}
    for name, (key, t) in all_tables(model).items():
        s = group_sharding(t.weight) if isinstance(t, EmbeddingTable) else None
        if s is not None and isinstance(t, EmbeddingTable):
            out[name] = (key, t, s)
    return out


def _in_order(s: GroupSharding) -> Callable[[int, int], Tensor]:
    """``at(a, b)``: this rank's local rows holding the ``a``-th to ``b``-th of its rows in ascending logical id
    (padding rows last), worked out per window from the ownership (sorting the shard's ids would copy them).

    A row-sharded table's rank holds ``m`` blocks of ``run`` rows (``"interleaved"``; ``"range"`` and ``"mod"``:
    one block), block ``i``'s row ``j`` holding logical id ``j·stride + q_i`` with every ``q_i < stride``: in
    ascending order, row ``k`` is row ``k // m`` of the block with the ``(k % m)``-th smallest ``q``."""
    own = s.ownership
    if s.placement == "table" or own.scheme == "range":
        return lambda a, b: torch.arange(a, b, dtype=torch.int64)
    per, first = own.rows_per_shard, s.rank * own.rows_per_shard
    m = own.chunks // own.num_shards if own.scheme == "interleaved" else 1  # "mod": ids rank + j·n, ascending
    run = per // m
    order = torch.argsort(own.logical_id(torch.arange(first, first + per, run, dtype=torch.int64)))
    return lambda a, b: order[torch.arange(a, b, dtype=torch.int64) % m] * run + torch.arange(a, b) // m


def _logical(s: GroupSharding, local: Tensor) -> Tensor:
    """The logical ids of this rank's rows ``local`` (``>= s.rows``: padding rows)."""
    if s.placement == "table":
        return local
    return s.ownership.logical_id(local + s.rank * s.ownership.rows_per_shard)


def _real_rows(s: GroupSharding, at: Callable[[int, int], Tensor]) -> int:
    """How many of this rank's rows are real (not padding): a prefix in ascending order, counted per window."""
    n, total = 0, s.local_rows
    for a in range(0, total, _WINDOW):
        n += int((_logical(s, at(a, min(a + _WINDOW, total))) < s.rows).sum())
    return n


def _rows(n: int, src: Tensor, at: Callable[[int, int], Tensor]) -> Rows:
    """The first ``n`` rows of ``src`` in ascending logical id (``at``), written a window at a time."""
    def fill(a: int, b: int, out: Tensor) -> None:
        pos = at(a, b).to(src.device)
        if src.device.type == "cpu" and src.dtype == out.dtype:
            torch.index_select(src.detach(), 0, pos, out=out)
        else:
            out.copy_(src.detach().index_select(0, pos))
    return Rows((n, *src.shape[1:]), src.dtype, fill)


def _ids(n: int, s: GroupSharding, at: Callable[[int, int], Tensor]) -> Rows:
    """The logical ids of the first ``n`` rows in ascending order (``at``), written a window at a time."""
    def fill(a: int, b: int, out: Tensor) -> None:
        out.copy_(_logical(s, at(a, b)))
    return Rows((n,), torch.int64, fill)


def _logical_accumulation(state: dict[str, Tensor], s: GroupSharding, local: int) -> dict[str, Tensor]:
    """A sharded table's pending accumulation buffers with logical ids (``-1``: padding): the owner's
    buffers hold its local rows (``local``: padding)."""
    ids = state["acc_ids"].detach().cpu()
    valid = (ids >= 0) & (ids < local)
    logical = _logical(s, ids.clamp(0, local - 1)) if local else torch.zeros_like(ids)
    return {"acc_ids": torch.where(valid, logical, torch.full_like(ids, -1)),
            "acc_rows": state["acc_rows"].detach().cpu().clone()}


def stored_state(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with sharded tables as their stored rows, even under ``dtensor_state_dict``
    (whose DTensor entries are collectives: rank 0 alone reads the state_dict here)."""
    with stored_rows():
        return dict(model.state_dict())


def save_sharded(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any = None,
                 extra: dict[str, Any] | None = None) -> None:
    """Write ``model`` (and ``optimizer``), sharded by ``tte.distributed.shard``, to ``directory``: call it on every
    rank of the group (an optimizer on every rank or on none). Each rank writes its own rows (``rows-<rank>.pt``);
    rank 0 the rest, with its ``extra`` (as ``tte.checkpoint.save``'s: a training step, published with the rows;
    :func:`load_sharded` returns it). Pending accumulation buffers too: a run resumed mid-window goes on alike."""
    tables = group_sharded(model)
    if not tables:
        raise ValueError("Argument `model` has no table sharded over a process group (tte.distributed.shard); "
                         "save it with tte.checkpoint.save.")
    first = next(iter(tables.values()))[2]
    rank, world, group = first.rank, first.world, first.group
    target = os.path.realpath(os.fspath(directory))  # a symlinked directory: the save replaces what it points to
    lock = begin_save(target, rank == 0, group)  # a refusal on every rank, nothing changed
    with Attempt() as published:
        try:
            _write(target, rank, world, group, model, optimizer, tables, extra)
        finally:
            if lock is not None:
                lock.release()
    # No rank returns before the checkpoint is published, and rank 0's failure to publish it is raised on
    # every rank (none waits for it at its next collective).
    agree(published.error, group, done=f"the save did not finish: {target} holds the previous checkpoint or this "
          "one, complete", other=RuntimeError)


def _write(target: str, rank: int, world: int, group: Any, model: nn.Module, optimizer: Any,
           tables: dict[str, tuple[str, EmbeddingTable, GroupSharding]], extra: dict[str, Any] | None) -> None:
    """:func:`save_sharded`'s files, each rank's rows streamed a window at a time (``checkpoint/row_writer.py``:
    a save's memory grows by a window, never by a shard), published by rank 0."""
    staging = staging_path(target)
    with Attempt() as wrote:  # (a full disk, an unwritable directory: on some ranks only)
        extra = to_cpu(extra)
        check_loadable(extra, "extra")  # (what load_sharded could not read back: refused on the rank given it)
        part: dict[str, Any] = {}
        for name, (_, t, s) in tables.items():
            at = _in_order(s)
            n = _real_rows(s, at)
            entry: dict[str, Any] = {"ids": _ids(n, s, at), "weight": _rows(n, t.weight, at)}
            if optimizer is not None:
                state = optimizer.state.get(t.weight, {})
                local = t.weight.shape[0]
                entry["rows"] = {k: _rows(n, v, at) for k, v in state.items()
                                 if k not in ACC and v.dim() and v.shape[0] == local}
                entry["whole"] = {k: v for k, v in state.items()
                                  if k not in ACC and not (v.dim() and v.shape[0] == local)}
                if "acc_ids" in state:
                    entry["acc"] = _logical_accumulation(state, s, local)
            part[name] = entry
        write_rows(os.path.join(staging, f"rows-{rank}.pt"), part)
    # Every rank's rows are written (rank 0 fsyncs them before publishing), or none publishes.
    given = agree(wrote.error, group, optimizer is not None, done=f"nothing was published: {target} is as it was",
                  other=RuntimeError)
    given_on_every_rank(given, "optimizer", "save_sharded", f"nothing was published: {target} is as it was")
    if rank == 0:
        keys = {key for key, _, _ in tables.values()}
        meta: dict[str, Any] = {
            "world": world,
            "tables": {n: {"placement": s.placement, "rows": s.rows, "owner": s.owner, "key": key}
                       for n, (key, _, s) in tables.items()},
            "model": {k: v for k, v in stored_state(model).items() if k not in keys},
            "extra": extra,
        }
        if optimizer is not None:
            sd = own_layout_state(optimizer)  # (its state_dict() may be a collective: rank 0 alone is here)
            sd["state"] = {k: v for k, v in sd["state"].items() if k.split(":", 1)[-1] not in tables}
            meta["optimizer"] = sd
        torch.save(meta, os.path.join(staging, SHARDED_META))
        write_manifest(staging)
        publish(staging, target)
