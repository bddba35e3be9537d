"""Checkpoints that move between CPU, one XLA device and any sharded layout.

A checkpoint holds the *logical* state: one ``[num_embeddings, D]`` tensor per table and per row slot
(no device padding rows, no trash rows), keyed by table name, on the CPU. It loads into a model on
any device and any placement; :func:`save` writes atomically and the file loads with
``torch.load(weights_only=True)`` (no pickled code).

Example::

    >>> tte.checkpoint.save("ckpt.pt", model=ec, optimizer=opt, extra={"step": 1000})
    >>> extra = tte.checkpoint.load("ckpt.pt", model=ec2, optimizer=opt2)   # another device/layout
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

import torch

from torch_tpu_embedding._ckpt_check import CheckpointMismatchError, is_row_sparse, model_problems, optimizer_problems
from torch_tpu_embedding._ckpt_io import check_loadable, dcp_quiet, dcp_reader, read_dcp_metadata, write_atomic
from torch_tpu_embedding._fused import split_member_state
from torch_tpu_embedding._layout import Description, describe, from_logical, layout_of, to_logical

__all__ = [
    "FORMAT", "CheckpointMismatchError", "convert_distributed", "load", "load_distributed", "save", "save_distributed",
    "to_cpu",
]

#: written into every checkpoint; :func:`load` refuses other formats
FORMAT = "torch_tpu_embedding.checkpoint/1"


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and on the CPU (dicts, lists and tuples traversed).

    Device tensors and views are copied; a CPU tensor that owns its whole storage is returned as is
    (it shares memory with the model: write it out before training on, as :func:`save` does).

    A sharded XLA tensor is gathered to the host: fine for tables that fit in host memory; for
    larger ones use ``torch.distributed.checkpoint`` with torch_xla's SPMD planners (docs/checkpoints.md).
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        whole = (t.device.type == "cpu" and t.layout == torch.strided  # a sparse tensor has no one storage
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size())
        # A CPU tensor that owns its whole storage is written as is: copying it would double the
        # host memory of every save (and fragment the heap of a long run); views and device
        # tensors are copied (torch.save would write a view's whole storage).
        return t if whole else t.to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj


def _host_rows(t: torch.Tensor, n: int | None, layout: Description = None) -> torch.Tensor:
    """The ``n`` logical rows of ``t`` on the host: the whole tensor moves, then it is cut (and, when
    stored permuted, put in logical order: ``layout``) on the CPU.

    Slicing on an XLA device first would trace, compile and run a graph per tensor at every save.
    """
    host: torch.Tensor = to_cpu(t)
    if n is None:
        return host
    order, k = layout_of(layout)
    if order is not None:
        return to_logical(host, n, order, k)
    return host if n == host.shape[0] else host[:n].clone()


def _fused_sources(model: torch.nn.Module) -> dict[str, tuple[str, int, int]]:
    """``tables.<name>.weight`` keys of fused tables → (their group's parameter name, first row, rows)."""
    from torch_tpu_embedding._rows import table_info

    out = {}
    for pname, p in model.named_parameters():
        info = table_info(p)
        if info is not None and info.members is not None:
            prefix = pname[: -len(f"groups.{info.name}.weight")]
            for tname, off, n in info.members:
                out[f"{prefix}tables.{tname}.weight"] = (pname, off, n)
    return out


def _host_model_state(model: torch.nn.Module) -> dict[str, Any]:
    state = model.state_dict(keep_vars=True)
    whole = dict(model.named_parameters())
    fused = _fused_sources(model)
    hosts: dict[str, torch.Tensor] = {}  # a fused group's weight moves to the host once per save
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and _permuted(whole, k, fused):
            out[k] = to_cpu(v)  # the state_dict hook already gathered the logical rows on the host
            continue
        if k in fused:
            pname, off, n = fused[k]
            if pname not in hosts:
                hosts[pname] = to_cpu(whole[pname])
            out[k] = hosts[pname][off : off + n]  # views of one host tensor: written once
            continue
        source = whole.get(k, v)  # a table's weight: the physical parameter, cut to its logical rows
        n_rows = v.shape[0] if isinstance(v, torch.Tensor) and v.dim() and source.shape != v.shape else None
        out[k] = _host_rows(source, n_rows) if isinstance(v, torch.Tensor) else v
    return out


def _permuted(whole: Mapping[str, torch.Tensor], key: str, fused: Mapping[str, tuple[str, int, int]]) -> bool:
    """Whether model state ``key`` is a table (or a fused group's table) stored in a permuted row order."""
    from torch_tpu_embedding._rows import table_info

    source = whole.get(fused[key][0] if key in fused else key)
    info = None if source is None else table_info(source)
    return info is not None and info.layout is not None


def _host_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch_tpu_embedding.optim._base import RowSparseOptimizer

    if not isinstance(optimizer, RowSparseOptimizer):
        return dict(to_cpu(optimizer.state_dict()))
    physical = optimizer.physical_state()
    state: dict[str, dict[str, Any]] = {}
    for name, v in physical.tensors.items():
        key, slot = name.rsplit("/", 1)
        state.setdefault(key, {})[slot] = _host_rows(v, physical.logical_rows[name], physical.layouts.get(name))
    for key, bufs in physical.accumulation.items():
        state.setdefault(key, {}).update(bufs)
    _split_fused_entries(state, physical.members, physical.logical_rows)
    return {"state": state, "param_groups": physical.param_groups, "iterations": physical.iterations,
            "skipped_steps": optimizer.skipped_steps}


def _split_fused_entries(
    state: dict[str, Any], members: Mapping[str, Any], rows: Mapping[str, int | None], prefix: str = ""
) -> None:
    """Replace each fused group's optimizer entry in ``state`` by one entry per table, as an unfused
    optimizer saves them. ``members`` and ``rows`` are keyed ``<prefix><key>`` and
    ``<prefix><key>/<slot>`` (a slot with logical rows is cut per table)."""
    for key in [k for k in state if prefix + k in members]:
        row_slots = [slot for slot in state[key] if rows.get(f"{prefix}{key}/{slot}") is not None]
        parts = split_member_state(state.pop(key), members[prefix + key], row_slots)
        state.update({f"table:{t}": part for t, part in parts.items()})


def save(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``{"format", "model", "optimizer", "extra"}`` to ``path`` atomically (temp file + rename).

    Under multi-host SPMD call it from every process, each with a path on its own disk: reading a
    sharded tensor to the host is a computation over all devices, so a process that skips it
    stalls the others. Tables larger than one host's memory: :func:`save_distributed`.
    """
    payload = {
        "format": FORMAT,
        "model": None if model is None else _host_model_state(model),
        "optimizer": None if optimizer is None else _host_optimizer_state(optimizer),
        "extra": to_cpu(extra),
    }
    check_loadable(payload["extra"], "extra")  # before anything on disk changes
    check_loadable(payload, "checkpoint")
    write_atomic(payload, path)


def load(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> dict[str, Any] | None:
    """Load a :func:`save` file (``weights_only=True``) into ``model`` / ``optimizer``; returns ``extra``.

    Build the model on its device and layout first (and ``optimizer.init_state()`` on XLA); the
    tensors are copied into the existing parameters and slots, which keep their sharding.
    """
    target = os.fspath(path)
    if not os.path.exists(target):
        raise FileNotFoundError(f"No checkpoint at {target}")
    try:
        payload = torch.load(target, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged zip / pickle stream
        raise ValueError(f"{target} is not a readable checkpoint (truncated or corrupt): {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{os.fspath(path)} is not a torch_tpu_embedding checkpoint ({FORMAT}). Found: {found!r}")
    if model is not None and payload["model"] is None:
        raise ValueError(f"{target} holds no model state.")
    if optimizer is not None and payload["optimizer"] is None:
        raise ValueError(f"{target} holds no optimizer state.")
    # Everything is checked before anything is written: a load that fails changes nothing.
    problems = []
    if model is not None:
        problems += [f"model: {p}" for p in model_problems(model, payload["model"], strict)]
    if optimizer is not None:
        problems += [f"optimizer: {p}" for p in optimizer_problems(optimizer, payload["optimizer"])]
    if problems:
        raise CheckpointMismatchError(f"{target} does not match (nothing was loaded): " + "; ".join(problems))
    if optimizer is not None:  # other optimizers check their own state before writing it
        optimizer.load_state_dict(payload["optimizer"])
    if model is not None:
        model.load_state_dict(payload["model"], strict=strict)
    extra: dict[str, Any] | None = payload.get("extra")
    return extra


# ---------------------------------------------------------------------------------------------
# Distributed checkpoints (torch.distributed.checkpoint): huge tables, written shard by shard
# ---------------------------------------------------------------------------------------------
_META = "tte_meta.pt"


def _physical(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[
    dict[str, torch.Tensor], dict[str, int | None], dict[str, Any]
]:
    """Every model parameter/buffer and optimizer slot as it is on the device, plus the rest (with
    ``rest["layouts"]``: how each table-indexed tensor is stored, see ``_layout.describe``)."""
    from torch_tpu_embedding._rows import table_info

    tensors: dict[str, torch.Tensor] = {}
    rows: dict[str, int | None] = {}
    layouts: dict[str, Description] = {}
    members: dict[str, Any] = {}  # fused groups: their tables, for convert_distributed
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        info = table_info(p)
        tensors[f"model/{name}"] = p.detach()
        rows[f"model/{name}"] = None if info is None else info.num_embeddings
        if info is not None:
            layouts[f"model/{name}"] = describe(info.layout)
        if info is not None and info.members is not None:
            members[f"model/{name}"] = info.members
    rest: dict[str, Any] = {"members": members}
    if optimizer is not None:
        physical = _row_sparse(optimizer).physical_state()
        rest = {**physical.rest(),
                "members": {**members, **{f"optim/{k}": m for k, m in physical.members.items()}}}
        tensors.update({f"optim/{k}": v for k, v in physical.tensors.items()})
        rows.update({f"optim/{k}": v for k, v in physical.logical_rows.items()})
        layouts.update({f"optim/{k}": v for k, v in physical.layouts.items()})
    rest["layouts"] = layouts
    return tensors, rows, rest


def _row_sparse(optimizer: torch.optim.Optimizer) -> Any:
    if not is_row_sparse(optimizer):
        raise TypeError("Distributed checkpoints need a torch_tpu_embedding.optim optimizer.")
    return optimizer


def _dcp() -> Any:
    """``torch.distributed.checkpoint`` (untyped here: its names are not re-exported for mypy)."""
    return importlib.import_module("torch.distributed.checkpoint")


def _xla_planner(kind: str) -> Any:
    return getattr(importlib.import_module("torch_xla.experimental.distributed_checkpoint"), kind)()


def _uses_xla(tensors: dict[str, torch.Tensor]) -> bool:
    return any(t.device.type == "xla" for t in tensors.values())


def save_distributed(
    path: str | os.PathLike[str], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Write a ``torch.distributed.checkpoint`` directory: each device's shards of every table and slot.

    No table is gathered: on XLA the tensors are written shard by shard with torch_xla's
    ``SPMDSavePlanner``. Physical shapes include padding and trash rows, which are the same in every
    sharded layout (``torch_tpu_embedding.xla.ROW_ALIGNMENT``), so :func:`load_distributed` reshards
    in place (4 → 2 → 1 devices, row ↔ column); a CPU model or :func:`convert_distributed` reads the
    logical rows. On several hosts every process calls it (each writes its shards).
    """
    dcp = _dcp()
    tensors, rows, rest = _physical(model, optimizer)
    planner = _xla_planner("SPMDSavePlanner") if _uses_xla(tensors) else None
    target = os.fspath(path)
    os.makedirs(target, exist_ok=True)
    with dcp_quiet():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(target), planner=planner)
    members = rest.pop("members")
    layouts = rest.pop("layouts")
    # "layouts": the stored row order of each table-indexed tensor (absent in checkpoints written
    # before the id exchange: every tensor in logical order).
    meta = {"format": FORMAT, "rows": rows, "members": members, "layouts": layouts,
            "optimizer": to_cpu(rest) if optimizer is not None else None}
    write_atomic(meta, os.path.join(target, _META))


def _read_meta(path: str) -> Any:
    """``tte_meta.pt`` of a distributed checkpoint, read with ``weights_only=True`` (no pickled code)."""
    file = os.path.join(path, _META)
    if not os.path.exists(file):
        raise FileNotFoundError(f"No distributed checkpoint at {path} (no {_META})")
    try:
        meta = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # weights-only refusals and damaged files raise several types
        raise ValueError(f"{file} is not a readable checkpoint file (refused by weights_only loading, "
                         f"truncated or corrupt): {str(e).splitlines()[0]}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{file} is not a torch_tpu_embedding distributed checkpoint ({FORMAT}).")
    return meta


def _read(path: str, dest: dict[str, torch.Tensor]) -> None:
    dcp = _dcp()
    planner = _xla_planner("SPMDLoadPlanner") if _uses_xla(dest) else None
    with dcp_quiet():
        dcp.load(dest, storage_reader=dcp_reader(path), planner=planner)


def _saved_sizes(path: str) -> dict[str, torch.Size]:
    md = read_dcp_metadata(path)  # allow-listed unpickling: a crafted .metadata runs no code
    return {k: v.size for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}


def load_distributed(
    path: str | os.PathLike[str], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load a :func:`save_distributed` directory into ``model`` (and ``optimizer``) on any device/layout.

    Tensors whose physical shape matches the saved one are loaded in place, shard by shard (sharded
    XLA tensors through ``SPMDLoadPlanner``, which reshards). Others (a CPU model without padding
    rows) are read into host staging tensors and their logical rows copied. Build the model and
    call ``optimizer.init_state()`` first. Mismatched tables or slots raise one ``ValueError``.
    """
    target = os.fspath(path)
    meta = _read_meta(target)
    if optimizer is not None and hasattr(optimizer, "init_state"):
        optimizer.init_state()
    dest, rows, rest = _physical(model, optimizer)
    saved_layouts, layouts = meta.get("layouts", {}), rest["layouts"]
    saved = _saved_sizes(target)
    missing = sorted(set(dest) - set(saved))
    unexpected = sorted(k for k in set(saved) - set(dest) if optimizer is not None or k.startswith("model/"))
    problems = [f"missing {missing}"] if missing else []
    if unexpected:
        problems.append(f"unexpected {unexpected}")
    for k in sorted(set(dest) & set(saved)):
        n_saved, n_here = meta["rows"].get(k), rows[k]
        logical_saved = (n_saved, *saved[k][1:]) if n_saved is not None else tuple(saved[k])
        logical_here = (n_here, *dest[k].shape[1:]) if n_here is not None else tuple(dest[k].shape)
        if tuple(logical_saved) != tuple(logical_here):
            problems.append(f"{k} has shape {tuple(logical_saved)} saved, {tuple(logical_here)} here")
    if optimizer is not None and meta["optimizer"] is None:
        raise ValueError(f"{target} holds no optimizer state.")
    if optimizer is not None:  # hyper-parameters too, before any tensor is read in place
        from torch_tpu_embedding.optim._state_io import rest_problems

        problems += rest_problems(_row_sparse(optimizer), meta["optimizer"])
    if problems:
        raise CheckpointMismatchError(f"Distributed checkpoint {target} does not match (nothing was loaded): "
                                      + "; ".join(problems))
    wanted = {k: dest[k] for k in dest}
    staged: dict[str, torch.Tensor] = {}
    for k, t in dest.items():
        # Same shape and row order: read in place, shard by shard. Otherwise through the host.
        if tuple(t.shape) != tuple(saved[k]) or saved_layouts.get(k) != layouts.get(k):
            staged[k] = torch.empty(saved[k], dtype=t.dtype)
            wanted[k] = staged[k]
    _read(target, wanted)
    with torch.no_grad():
        for k, host in staged.items():
            t, n = dest[k], rows[k]
            if n is None:
                t.copy_(host.to(t.device))
                continue
            saved_order, saved_k = layout_of(saved_layouts.get(k))
            value = to_logical(host, n, saved_order, saved_k)
            order, slot_k = layout_of(layouts.get(k))
            current = t.detach().cpu() if order is not None or t.device.type == "cpu" else t
            # Copied from the host tensor itself: an XLA destination keeps its sharding (copying a
            # replicated device tensor into it would leave the table replicated).
            t.copy_(from_logical(value.to(current.device), current, order, slot_k))
    if optimizer is not None:
        _row_sparse(optimizer).load_physical_rest(meta["optimizer"])


def convert_distributed(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Turn a :func:`save_distributed` directory into one :func:`save` file (logical rows, CPU).

    Reads on the host without torch_xla; the result loads anywhere with :func:`load`.
    """
    target = os.fspath(path)
    meta = _read_meta(target)
    md = read_dcp_metadata(target)
    host: dict[str, torch.Tensor] = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "size")
    }
    _read(target, host)

    def logical(k: str) -> torch.Tensor:
        n = meta["rows"].get(k)
        order, slot_k = layout_of(meta.get("layouts", {}).get(k))
        return host[k] if n is None else to_logical(host[k], n, order, slot_k).clone()

    members = meta.get("members", {})
    model_sd: dict[str, torch.Tensor] = {}
    for k in host:
        if k.startswith("model/") and k in members:  # a fused group: its tables' weights
            prefix = k[len("model/"):].rsplit("groups.", 1)[0]
            value = logical(k)
            model_sd.update({f"{prefix}tables.{t}.weight": value[off : off + n] for t, off, n in members[k]})
        elif k.startswith("model/"):
            model_sd[k[len("model/"):]] = logical(k)
    optimizer_sd = None
    if meta["optimizer"] is not None:
        state: dict[str, dict[str, torch.Tensor]] = {}
        for k in host:
            if k.startswith("optim/"):
                key, slot = k[len("optim/"):].rsplit("/", 1)
                state.setdefault(key, {})[slot] = logical(k)
        for key, bufs in meta["optimizer"]["acc"].items():
            state.setdefault(key, {}).update(bufs)
        _split_fused_entries(state, members, meta["rows"], prefix="optim/")
        optimizer_sd = {"state": state, "param_groups": meta["optimizer"]["param_groups"],
                        "iterations": meta["optimizer"]["iterations"]}
    write_atomic({"format": FORMAT, "model": model_sd, "optimizer": optimizer_sd, "extra": None}, out)
