"""Optimizer state out: ``state_dict`` (the logical form) and the distributed-checkpoint form.

Saved state is *logical*: keyed by table name (``table:<name>``; dense parameters ``param:<name or
index>``), row slots cut to the table's ``num_embeddings`` (no padding or trash rows), and a stacked
group's state split per table, so it moves between CPU, one XLA device, any sharded layout, and
stacked or unstacked collections. Pending accumulation-buffer ids that are padding are saved as ``-1``.

:class:`PhysicalState` is the same state as it lives on the device (for ``torch.distributed.
checkpoint``, which writes each device's shards); its small remainder is restored by
:func:`.state_load.load_physical_rest`. The keys and the stacked groups' tables named here are the ones a load
reads back (:mod:`.state_load`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torch_tpu_embedding._rows.row_order import Description, describe, owned_to_logical, to_logical
from torch_tpu_embedding._rows.stacked_state import Members, split_member_state
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.registry import RULE_KEY
from torch_tpu_embedding.optim._core.slots import ACCUMULATION, logical_rows, slot_rows, specs, to_saved_ids

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.base import RowSparseOptimizer

__all__ = ["PhysicalState", "groups_by_param", "logical_keys", "members_of", "param_keys", "physical_state",
           "state_dict"]

Tensor = torch.Tensor


@dataclasses.dataclass
class PhysicalState:
    """An optimizer's state as it is on the device (for distributed checkpoints).

    ``tensors["<key>/<slot>"]`` is the slot itself (sharded, with trash and padding rows),
    ``logical_rows`` the same key's rows in :func:`state_dict` (``None``: saved whole) and ``layouts``
    how they are stored (``torch_tpu_embedding._rows.row_order.describe``; ``None``: in order). The rest is
    small and on the host: hyper-parameters (``param_groups`` as :func:`state_dict` saves them), the
    call counters, pending accumulation buffers by key, and each stacked group's tables by key.
    """

    tensors: dict[str, Tensor]
    logical_rows: dict[str, int | None]
    param_groups: list[dict[str, Any]]
    iterations: int
    accumulation: dict[str, dict[str, Tensor]]
    members: dict[str, Members]
    layouts: dict[str, Description] = dataclasses.field(default_factory=dict)
    #: calls that changed nothing, and of them those an exchange overflow dropped (``skipped_steps``)
    skipped_steps: int = 0
    overflowed_steps: int = 0

    def rest(self) -> dict[str, Any]:
        """What a distributed checkpoint stores beside the tensors (read back by
        :func:`.state_load.load_physical_rest`)."""
        return {"param_groups": self.param_groups, "iterations": self.iterations, "acc": self.accumulation,
                "skipped_steps": self.skipped_steps, "overflowed_steps": self.overflowed_steps}


def param_keys(opt: RowSparseOptimizer, *, group_as_one: bool = False) -> dict[int, str]:
    """Stable names by ``id(param)``: ``table:<name>`` for tables, else the given name or ``param:<i>``.

    ``i`` counts parameters in group order with a stacked group counted as its tables, so a dense
    parameter keeps its key whether the tables beside it are stacked or not (``group_as_one``: as
    checkpoints written before 2026-11-23 numbered them, a stacked group counted once).
    """
    keys: dict[int, str] = {}
    i = 0
    for group in opt.param_groups:
        names = group.get("param_names")
        for j, p in enumerate(group["params"]):
            info = table_info(p)
            if info is not None:
                keys[id(p)] = f"table:{info.name}"
            elif names is not None:
                keys[id(p)] = f"param:{names[j]}"
            else:
                keys[id(p)] = f"param:{i}"
            i += 1 if info is None or info.members is None or group_as_one else len(info.members)
    _check_distinct(opt, keys)
    return keys


def _check_distinct(opt: RowSparseOptimizer, keys: Mapping[int, str]) -> None:
    """Raise if two parameters (or tables of stacked groups) would be saved under one key: their state would
    overwrite each other's in :func:`state_dict` and a load could not tell them apart."""
    seen: set[str] = set()
    for p in (p for g in opt.param_groups for p in g["params"]):
        for key, _ in logical_keys(p, keys[id(p)], 0):
            if key not in seen:
                seen.add(key)
                continue
            what = (
                "tables of different EmbeddingCollections with one name (a table given no name is `table_<i>` in "
                "its collection). Give them distinct names (TableConfig(name=...)), or each collection an optimizer "
                "of its own" if key.startswith("table:") else
                "parameters given with one name (the named parameters of two modules, say). Give them distinct "
                "names, or pass the parameters without names"
            )
            raise ValueError(f"Two parameters of this optimizer would be saved under one key, {key!r}: {what}.")


def members_of(p: Tensor) -> Members | None:
    """The tables of ``p``'s stacked group (``None``: ``p`` is not a stacked group)."""
    info = table_info(p)
    return None if info is None else info.members


def logical_keys(p: Tensor, key: str, rows: int) -> list[tuple[str, int]]:
    """``p``'s keys in :func:`state_dict` with their logical rows (``p``'s ``key`` and ``rows``, or one
    per table of a stacked group)."""
    members = members_of(p)
    return [(key, rows)] if members is None else [(f"table:{name}", n) for name, _, n in members]


def groups_by_param(opt: RowSparseOptimizer) -> dict[int, dict[str, Any]]:
    """Each parameter's group, by ``id(param)``."""
    return {id(p): g for g in opt.param_groups for p in g["params"]}


def _saved_groups(opt: RowSparseOptimizer, keys: Mapping[int, str]) -> list[dict[str, Any]]:
    """The parameter groups as saved: hyper-parameters (not callables) and the params' logical keys."""
    groups = []
    for group in opt.param_groups:
        saved = {
            k: v
            for k, v in group.items()
            if k not in ("params", "slot_creation_fn", RULE_KEY) and not (callable(v) and not isinstance(v, Tensor))
        }
        saved["params"] = [k for p in group["params"] for k, _ in logical_keys(p, keys[id(p)], 0)]
        groups.append(saved)
    return groups


def state_dict(opt: RowSparseOptimizer) -> dict[str, Any]:
    """See :meth:`RowSparseOptimizer.state_dict`."""
    keys = param_keys(opt)
    group_of = groups_by_param(opt)
    state: dict[str, Any] = {}
    for p, s in opt.state.items():
        if id(p) not in keys:
            continue
        all_specs = specs(p, group_of[id(p)])
        numbers = slot_rows(p, group_of[id(p)]).numbers
        out: dict[str, Tensor] = {}
        for name, v in s.items():
            if name in ACCUMULATION:
                continue
            out[name] = _logical_slot(p, v, numbers[name]) if name in numbers else v
        out.update(_saved_accumulation(p, s))
        members = members_of(p)
        if members is None:
            state[keys[id(p)]] = out
            continue
        row_slots = [k for k, spec in all_specs.items() if spec.rows and spec.shape]
        parts = split_member_state(out, members, row_slots)
        state.update({f"table:{name}": part for name, part in parts.items()})
    return {"state": state, "param_groups": _saved_groups(opt, keys), "iterations": opt._run.iterations,
            "skipped_steps": opt.skipped_steps, "overflowed_steps": opt.overflowed_steps}


def physical_state(opt: RowSparseOptimizer) -> PhysicalState:
    """See :meth:`RowSparseOptimizer.physical_state`."""
    keys = param_keys(opt)
    group_of = groups_by_param(opt)
    tensors: dict[str, Tensor] = {}
    rows: dict[str, int | None] = {}
    layouts: dict[str, Description] = {}
    acc: dict[str, dict[str, Tensor]] = {}
    for p, s in opt.state.items():
        key = keys[id(p)]
        numbers = slot_rows(p, group_of[id(p)]).numbers
        info = table_info(p)
        n = logical_rows(p)
        saved = _saved_accumulation(p, s)
        if saved:
            acc[key] = {k: v.detach().cpu() for k, v in saved.items()}
        for name, v in s.items():
            if name in ACCUMULATION:
                continue
            tensors[f"{key}/{name}"] = v
            rows[f"{key}/{name}"] = n if name in numbers else None
            if name in numbers and info is not None:
                layouts[f"{key}/{name}"] = describe(info.layout, numbers[name])
    members = {keys[id(p)]: m for p in opt.state if (m := members_of(p)) is not None}
    return PhysicalState(tensors, rows, _saved_groups(opt, keys), opt._run.iterations, acc, members, layouts,
                         opt.skipped_steps, opt.overflowed_steps)


def _logical_slot(p: Tensor, slot: Tensor, k: int) -> Tensor:
    """Row slot ``k`` of ``p`` in logical order, cut to the logical rows (a view when stored in order;
    gathered on the host when the table is stored permuted)."""
    info = table_info(p)
    layout = None if info is None else info.layout
    return to_logical(slot if layout is None else slot.detach().cpu(), logical_rows(p), layout, k)


def _saved_accumulation(p: Tensor, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A table's pending accumulation buffers as saved: logical ids (``-1`` = padding) and their rows."""
    if "acc_ids" not in state:
        return {}
    info = table_info(p)
    ids, rows = state["acc_ids"], state["acc_rows"]
    if info is None or not info.owner_local or info.layout is None:
        return {"acc_ids": to_saved_ids(ids, logical_rows(p)), "acc_rows": rows}
    n = info.num_shards
    ids_l, rows_l = owned_to_logical(ids.detach().cpu(), rows.detach().cpu(), info.layout, p.shape[0], n)
    return {"acc_ids": to_saved_ids(ids_l, logical_rows(p)), "acc_rows": rows_l}
