"""Optimizer slots: which state tensors a parameter has, and how they are created.

A parameter's state is its rule's slots (:meth:`RowSparseOptimizer.slot_specs`), plus ``ema`` (and,
for lazy tables, ``ema_last``: the call at which each row's average was last brought up to date)
with ``use_ema``, plus ``accumulated_gradients`` for a dense parameter with gradient accumulation,
plus ``step``. A table's pending accumulation buffers (``acc_ids``, ``acc_rows``) are made by
:mod:`._intake`.

On XLA, row slot ``k`` of a table gets extra *trash rows* so that every table-sized buffer has a
distinct size (see :func:`trash_rows`), and every slot is created with its table's layout on a
device mesh. Trash rows never reach a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torch_tpu_embedding._rows import table_info
from torch_tpu_embedding.optim._contract import SlotSpec, optimizer_class

__all__ = [
    "ACCUMULATION",
    "from_saved_ids",
    "lazy_table",
    "logical_rows",
    "make_state",
    "math_dtype",
    "rule_slots",
    "specs",
    "to_saved_ids",
    "trash_rows",
    "without_trash",
    "write_whole",
]

Tensor = torch.Tensor
#: a table's pending gradient-accumulation buffers (ids ``[k, cap]`` and rows ``[k, cap, D]``)
ACCUMULATION = ("acc_ids", "acc_rows")


def math_dtype(p: Tensor) -> torch.dtype:
    """The dtype of ``p``'s optimizer state and update arithmetic: float32 for 16-bit parameters.

    In float16 an Adagrad accumulator overflows to inf within a few hundred steps (the row then never
    moves again) and Adam's ``eps² = 1e-14`` is 0 (a row with a zero gradient gets 0/0); bfloat16 keeps
    about 3 significant digits. As FBGEMM does, 16-bit tables keep float32 slots and update in float32;
    only the weight is stored in 16 bits.
    """
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def lazy_table(p: Tensor, group: Mapping[str, Any]) -> bool:
    """``p`` is a table whose optimizer updates only its touched rows."""
    return table_info(p) is not None and optimizer_class(group["algorithm"]).is_lazy(group)


def logical_rows(p: Tensor) -> int:
    """Rows of ``p`` in a checkpoint: a table's ``num_embeddings`` (no padding), else dim 0."""
    info = table_info(p)
    return info.num_embeddings if info is not None else (p.shape[0] if p.dim() else 1)


def rule_slots(p: Tensor, group: Mapping[str, Any]) -> list[str]:
    """Names of the slots the rule reads and returns for ``p``."""
    cls = optimizer_class(group["algorithm"])
    return list(cls.slot_specs(tuple(p.shape), group, table_info(p) is not None))


def specs(p: Tensor, group: Mapping[str, Any]) -> dict[str, SlotSpec]:
    """Every state tensor of ``p`` except ``step`` and the accumulation buffers of tables."""
    cls = optimizer_class(group["algorithm"])
    out = dict(cls.slot_specs(tuple(p.shape), group, table_info(p) is not None))
    if group["use_ema"]:
        out["ema"] = SlotSpec(tuple(p.shape))
        if lazy_table(p, group):
            out["ema_last"] = SlotSpec((p.shape[0],), init=-1.0, dtype=torch.int32)
    if group["gradient_accumulation_steps"] and table_info(p) is None:
        out["accumulated_gradients"] = SlotSpec(tuple(p.shape))
    return out


def trash_rows(p: Tensor, k: int) -> int:
    """Extra rows for row-indexed slot ``k`` (1-based) of a table on XLA.

    XLA pairs donated buffers with outputs by byte size; equal-sized weight and slots can be
    mis-paired, and then whole tables are copied every step (measured: 6 table copies per Adam step,
    892 ms instead of 61 ms at 2M rows). Giving slot ``k`` ``k`` extra rows (``k × row block`` when
    sharded, to keep the split even) makes every table-sized buffer a distinct size. The extra rows
    also absorb the scatter at the padding sentinel id.
    """
    if table_info(p) is None or p.device.type != "xla":
        return 0
    from torch_tpu_embedding.xla.sharding import slot_extra_rows

    return slot_extra_rows(p, k)


def make_state(p: Tensor, group: Mapping[str, Any]) -> dict[str, Tensor]:
    """A new state for ``p``: every slot of :func:`specs` at its initial value, and ``step`` = 0."""
    all_specs = specs(p, group)
    fn = group.get("slot_creation_fn")
    made: Mapping[str, Any] = {}
    if fn is not None:
        names = rule_slots(p, group)
        made = fn(p, names, {n: all_specs[n].init for n in names})
        for name in names:
            s = made.get(name) if isinstance(made, Mapping) else None
            if not isinstance(s, Tensor) or tuple(s.shape) != all_specs[name].shape:
                raise ValueError(
                    f"slot_creation_fn must return a dict with a tensor of shape "
                    f"{all_specs[name].shape} for slot '{name}'. Received: {type(s).__name__}"
                    + (f" {tuple(s.shape)}" if isinstance(s, Tensor) else "")
                )
    state: dict[str, Tensor] = {}
    k = 0
    for name, spec in all_specs.items():
        shape = spec.shape
        if spec.rows and shape:
            k += 1
            shape = (shape[0] + trash_rows(p, k), *shape[1:])
        if name == "ema":  # Keras's first EMA update copies the weights
            # A new tensor, not a slice assignment from p: on XLA that ties the two as views
            # and the next step traces a different graph.
            if shape == tuple(p.shape):
                slot = p.detach().to(math_dtype(p), copy=True)
            else:
                pad = torch.zeros((shape[0] - p.shape[0], *shape[1:]), dtype=math_dtype(p), device=p.device)
                slot = torch.cat([p.detach().to(math_dtype(p)), pad])
        else:
            slot = torch.full(shape, spec.init, dtype=spec.dtype or math_dtype(p), device=p.device)
        if name in made:
            slot[: spec.shape[0]] = made[name].detach().to(device=p.device, dtype=slot.dtype)
        if p.device.type == "xla":  # created with the parameter's layout (SPMD)
            from torch_tpu_embedding.xla.sharding import shard_slot

            shard_slot(p, slot, spec.rows)
        state[name] = slot
    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    return state


def without_trash(slot: Tensor, n: int) -> Tensor:
    """The first ``n`` rows of a slot (the slot itself when it has no trash rows)."""
    return slot if slot.shape[0] == n else slot[:n]


def write_whole(slot: Tensor, value: Tensor) -> None:
    """Write ``value`` into the leading rows of ``slot`` by one whole-tensor ``copy_``.

    Not through a slice view: an in-place update of a view re-traces the base on XLA, and under
    SPMD the base then loses its sharding annotation (the next step compiles another graph).
    """
    if slot.dim() and value.shape[0] != slot.shape[0]:
        value = torch.cat([value, slot[value.shape[0] :]])
    slot.copy_(value)


def to_saved_ids(ids: Tensor, rows: int) -> Tensor:
    """Accumulation-buffer ids as saved: the padding sentinel (any id ``>= rows``) becomes ``-1``."""
    return torch.where(ids >= rows, torch.full_like(ids, -1), ids)


def from_saved_ids(ids: Tensor, sentinel: int) -> Tensor:
    """Saved accumulation-buffer ids back to device form: ``-1`` becomes the sentinel (on XLA ``-1``
    would wrap to the last row)."""
    ids = ids.to(torch.int64)
    return torch.where(ids < 0, torch.full_like(ids, sentinel), ids)
