"""Checkpoints of models sharded over a process group: each rank writes and reads only its own rows.

:func:`save_sharded` writes a directory: ``rows-<rank>.pt`` per rank (each row- or table-sharded table's
rows that rank stores, in ascending logical id, with their logical ids and the rows of every optimizer
row slot; the table's whole-table slots and ``step``) and ``meta.pt`` from rank 0 (the world size, each
sharded table's placement, and the rest of the model's and optimizer's ``state_dict``: dense layers,
replicated tables). :func:`load_sharded` loads it into a model sharded over any number of ranks, or into
one process: each rank memory-maps the row files and copies the rows it stores (a row is found by its
logical id), so no rank reads or holds a whole table.

Saves are crash-safe and loads verify before they write, as ``tte.checkpoint.save_distributed``'s
(``_ckpt_publish``): every rank writes into a sibling staging directory; when all files are on disk,
rank 0 writes ``meta.pt`` and a manifest (each file's size and sha256) and publishes the directory with
renames, so a process killed at any point leaves the old checkpoint or the new one, complete. A load
checks every file against the manifest before it changes anything (each rank reads every file once to
checksum it, in chunks: its memory stays its shard plus one chunk).

Pending gradient-accumulation buffers of sharded tables are not saved (save at the end of an
accumulation window).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_tpu_embedding._ckpt_publish import (
    SHARDED_META,
    prepare_staging,
    publish,
    resolve,
    staging_path,
    verify,
    write_manifest,
)
from torch_tpu_embedding._pg_exchange import GroupSharding, group_sharding
from torch_tpu_embedding._pg_state import stored_rows
from torch_tpu_embedding.collection import EmbeddingCollection
from torch_tpu_embedding.table import EmbeddingTable

__all__ = ["load_sharded", "save_sharded"]

Tensor = torch.Tensor
_SKIP = ("acc_ids", "acc_rows")


def _tables(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Every table of every collection in ``model``: name → (its ``state_dict`` key, the table module)."""
    out: dict[str, tuple[str, nn.Module]] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, EmbeddingCollection):
            for name, t in m.tables.items():
                out[name] = (f"{prefix}.tables.{name}.weight" if prefix else f"tables.{name}.weight", t)
    return out


def _sharded(model: nn.Module) -> dict[str, tuple[str, EmbeddingTable, GroupSharding]]:
    out: dict[str, tuple[str, EmbeddingTable, GroupSharding]] = {}
    for name, (key, t) in _tables(model).items():
        s = group_sharding(t.weight) if isinstance(t, EmbeddingTable) else None
        if s is not None and isinstance(t, EmbeddingTable):
            out[name] = (key, t, s)
    return out


def _stored_in_order(s: GroupSharding) -> tuple[Tensor, Tensor]:
    """``(logical ids ascending, the local rows holding them)`` of the real rows this rank stores."""
    ids = s.local_logical_ids()
    real = torch.nonzero(ids < s.rows).reshape(-1)
    order = torch.argsort(ids[real])
    return ids[real][order], real[order]


def _stored_state(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with sharded tables as their stored rows, even under ``dtensor_state_dict``
    (whose DTensor entries are collectives: rank 0 alone reads the state_dict here)."""
    with stored_rows():
        return dict(model.state_dict())


def save_sharded(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any = None) -> None:
    """Write ``model`` (and ``optimizer``), sharded by ``tte.distributed.shard``, to ``directory``: call it
    on every rank of the group. Each rank writes its own rows (``rows-<rank>.pt``); rank 0 writes the rest."""
    tables = _sharded(model)
    if not tables:
        raise ValueError("Argument `model` has no table sharded over a process group (tte.distributed.shard); "
                         "save it with tte.checkpoint.save.")
    first = next(iter(tables.values()))[2]
    rank, world, group = first.rank, first.world, first.group
    target = os.path.normpath(os.path.abspath(os.fspath(directory)))
    if rank == 0:
        prepare_staging(target)
    dist.barrier(group=group)
    staging = staging_path(target)
    part: dict[str, Any] = {}
    for name, (_, t, s) in tables.items():
        ids, pos = _stored_in_order(s)
        entry: dict[str, Any] = {"ids": ids, "weight": t.weight.detach().index_select(0, pos)}
        if optimizer is not None:
            state = optimizer.state.get(t.weight, {})
            local = t.weight.shape[0]
            entry["rows"] = {k: v.index_select(0, pos) for k, v in state.items()
                             if k not in _SKIP and v.dim() and v.shape[0] == local}
            entry["whole"] = {k: v.clone() for k, v in state.items()
                              if k not in _SKIP and not (v.dim() and v.shape[0] == local)}
        part[name] = entry
    torch.save(part, os.path.join(staging, f"rows-{rank}.pt"))
    dist.barrier(group=group)  # every rank's rows are written (rank 0 fsyncs them before publishing)
    if rank == 0:
        keys = {key for key, _, _ in tables.values()}
        meta: dict[str, Any] = {
            "world": world,
            "tables": {n: {"placement": s.placement, "rows": s.rows, "owner": s.owner}
                       for n, (_, _, s) in tables.items()},
            "model": {k: v for k, v in _stored_state(model).items() if k not in keys},
        }
        if optimizer is not None:
            sd = optimizer.state_dict()
            sd["state"] = {k: v for k, v in sd["state"].items() if k.split(":", 1)[-1] not in tables}
            meta["optimizer"] = sd
        torch.save(meta, os.path.join(staging, SHARDED_META))
        write_manifest(staging)
        publish(staging, target)
    dist.barrier(group=group)  # no rank returns before the checkpoint is published


def _gather(parts: list[dict[str, Any]], name: str, field: str, slot: str | None, need: Tensor) -> Tensor | None:
    """The rows of logical ids ``need`` from every rank's file (memory-mapped: only those rows are read)."""
    out: Tensor | None = None
    for part in parts:
        entry = part[name]
        src = entry[field] if slot is None else entry[field].get(slot)
        if src is None:
            continue
        ids: Tensor = entry["ids"]
        if out is None:
            out = torch.zeros((need.shape[0], *src.shape[1:]), dtype=src.dtype)
        if not ids.numel():
            continue
        at = torch.searchsorted(ids, need).clamp(max=ids.shape[0] - 1)
        hit = torch.nonzero(ids[at] == need).reshape(-1)
        out[hit] = src.index_select(0, at[hit])
    return out


def load_sharded(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any = None) -> None:
    """Load a :func:`save_sharded` directory into ``model`` (and ``optimizer``): sharded over any number of
    ranks (call it on every rank, after ``shard``, DDP and building the optimizer) or not sharded at all
    (one process: every table whole). Each rank reads only the rows it stores."""
    path = resolve(os.path.normpath(os.path.abspath(os.fspath(directory))))
    verify(path, required=(SHARDED_META,))  # every file whole and as saved, before anything is written
    meta = torch.load(os.path.join(path, SHARDED_META), weights_only=False)
    parts = [torch.load(os.path.join(path, f"rows-{r}.pt"), mmap=True, weights_only=True)
             for r in range(meta["world"])]
    tables = _tables(model)
    mine = _sharded(model)
    sd = _stored_state(model)
    sd.update(meta["model"])
    whole: dict[str, Tensor] = {}
    for name in meta["tables"]:
        if name not in mine:  # a table stored whole here: every logical row, through state_dict
            key, t = tables[name]
            rows = _gather(parts, name, "weight", None, torch.arange(meta["tables"][name]["rows"]))
            assert rows is not None
            sd[key] = rows.to(dtype=sd[key].dtype)
            whole[name] = rows
    with stored_rows():  # the sharded tables' entries are their stored rows (as _stored_state read them)
        model.load_state_dict(sd)
    for name, (_, t, s) in mine.items():
        ids, pos = _stored_in_order(s)
        rows = _gather(parts, name, "weight", None, ids)
        if rows is not None:
            with torch.no_grad():
                t.weight.index_copy_(0, pos, rows.to(t.weight.dtype))
    if optimizer is None:
        return
    optimizer.init_state()
    osd = optimizer.state_dict()
    state = dict(osd["state"])
    state.update(meta["optimizer"]["state"])
    for name, info in meta["tables"].items():
        src = parts[0 if info["placement"] == "row" else info["owner"]][name]
        if name not in mine:
            need = torch.arange(info["rows"])
            entry = {k: v.clone() for k, v in src["whole"].items()}
            for slot in src["rows"]:
                got = _gather(parts, name, "rows", slot, need)
                assert got is not None
                entry[slot] = got
            state[f"table:{name}"] = entry
    optimizer.load_state_dict({**meta["optimizer"], "state": state})
    for name, (_, t, s) in mine.items():
        info = meta["tables"][name]
        src = parts[0 if info["placement"] == "row" else info["owner"]][name]
        slots = optimizer.state[t.weight]
        ids, pos = _stored_in_order(s)
        for slot in src["rows"]:
            got = _gather(parts, name, "rows", slot, ids)
            if got is not None:
                slots[slot].index_copy_(0, pos, got.to(slots[slot].dtype))
        for slot, v in src["whole"].items():
            slots[slot].copy_(v)
