"""The host form of a model and an optimizer: what :func:`torch_tpu_embedding.checkpoint.save` writes.

Logical rows only (no padding or trash rows, logical row order), on the CPU, one entry per table
(a stacked group's weight and optimizer state are cut per table).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torch_tpu_embedding._rows.placement import process_group_placement, stored_rows
from torch_tpu_embedding._rows.row_order import Description, layout_of, to_logical
from torch_tpu_embedding._rows.stacked_state import split_member_state
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._state import state_save

__all__ = ["host_model_state", "host_optimizer_state", "own_layout_state", "refuse_process_group_shards",
           "split_stacked_entries", "to_cpu"]


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


def refuse_process_group_shards(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse a one-file save of tables sharded over a process group: each process holds only its rows of them,
    and the file would silently keep this process's (one that loads at no other world size, and into no model
    where the other ranks' rows are wanted back)."""
    for arg, params in (("model", [] if model is None else list(model.parameters())),
                        ("optimizer", [] if optimizer is None else
                         [p for g in optimizer.param_groups for p in g["params"]])):
        names = sorted({info.name for p in params if process_group_placement(p) is not None
                        and (info := table_info(p)) is not None})
        if names:
            tables = ", ".join(f"`{n}`" for n in names)
            raise ValueError(
                f"Argument `{arg}` holds tables sharded over a process group (tte.distributed.shard), of which this "
                "process stores only its own rows: tte.checkpoint.save writes one process's state to one file and "
                "would keep those alone. Call tte.checkpoint.save_distributed(directory, model=..., optimizer=...) on "
                "every rank (tte.checkpoint.convert_distributed(directory, file) then makes one file of every rank's "
                "rows). "
                f"Received: tables {tables}")


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


def _stacked_sources(model: torch.nn.Module) -> dict[str, tuple[str, int, int]]:
    """``tables.<name>.weight`` keys of stacked tables → (their group's parameter name, first row, rows)."""
    out = {}
    for pname, p in model.named_parameters():
        info = table_info(p)
        if info is not None and info.members is not None:
            prefix = pname[: -len(f"groups.{info.name}.weight")]
            for tname, off, n in info.members:
                out[f"{prefix}tables.{tname}.weight"] = (pname, off, n)
    return out


def host_model_state(model: torch.nn.Module) -> dict[str, Any]:
    state = model.state_dict(keep_vars=True)
    whole = dict(model.named_parameters())
    stacked = _stacked_sources(model)
    hosts: dict[str, torch.Tensor] = {}  # a stacked group's weight moves to the host once per save
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) and _permuted(whole, k, stacked):
            out[k] = to_cpu(v)  # the state_dict hook already gathered the logical rows on the host
            continue
        if k in stacked:
            pname, off, n = stacked[k]
            if pname not in hosts:
                hosts[pname] = to_cpu(whole[pname])
            out[k] = hosts[pname][off : off + n]  # views of one host tensor: written once
            continue
        source = whole.get(k, v)  # a table's weight: the physical parameter, cut to its logical rows
        n_rows = v.shape[0] if isinstance(v, torch.Tensor) and v.dim() and source.shape != v.shape else None
        out[k] = _host_rows(source, n_rows) if isinstance(v, torch.Tensor) else v
    return out


def _permuted(whole: Mapping[str, torch.Tensor], key: str, stacked: Mapping[str, tuple[str, int, int]]) -> bool:
    """Whether model state ``key`` is a table (or a stacked group's table) stored in a permuted row order."""
    source = whole.get(stacked[key][0] if key in stacked else key)
    info = None if source is None else table_info(source)
    return info is not None and info.layout is not None


def host_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if not isinstance(optimizer, RowSparseOptimizer):
        return dict(to_cpu(optimizer.state_dict()))
    physical = optimizer.physical_state()
    state: dict[str, dict[str, Any]] = {}
    for name, v in physical.tensors.items():
        key, slot = name.rsplit("/", 1)
        state.setdefault(key, {})[slot] = _host_rows(v, physical.logical_rows[name], physical.layouts.get(name))
    for key, bufs in physical.accumulation.items():
        state.setdefault(key, {}).update(bufs)
    split_stacked_entries(state, physical.members, physical.logical_rows)
    return {"state": state, "param_groups": physical.param_groups, "iterations": physical.iterations,
            "skipped_steps": physical.skipped_steps, "overflowed_steps": physical.overflowed_steps}


def own_layout_state(optimizer: Any) -> dict[str, Any]:
    """``optimizer``'s ``state_dict`` in this package's layout (``table:<name>`` keys, a sharded table's slots as
    its stored rows), as checkpoints hold it, whatever ``optimizer.state_dict()`` gives: with
    ``tte.optim.use_torch_layout`` that is torch.optim's layout (keys by position) and, for a table sharded with
    ``dtensor_state_dict``, a collective (its slots moved into DTensors), which one rank alone must not start.
    No collective: read past the state-dict hooks, as ``host_optimizer_state`` reads it."""
    if not isinstance(optimizer, RowSparseOptimizer):
        return dict(optimizer.state_dict())
    with stored_rows():
        return state_save.state_dict(optimizer)


def split_stacked_entries(
    state: dict[str, Any], members: Mapping[str, Any], rows: Mapping[str, int | None], prefix: str = ""
) -> None:
    """Replace each stacked group's optimizer entry in ``state`` by one entry per table, as an unstacked
    optimizer saves them. ``members`` and ``rows`` are keyed ``<prefix><key>`` and
    ``<prefix><key>/<slot>`` (a slot with logical rows is cut per table)."""
    for key in [k for k in state if prefix + k in members]:
        row_slots = [slot for slot in state[key] if rows.get(f"{prefix}{key}/{slot}") is not None]
        parts = split_member_state(state.pop(key), members[prefix + key], row_slots)
        state.update({f"table:{t}": part for t, part in parts.items()})
