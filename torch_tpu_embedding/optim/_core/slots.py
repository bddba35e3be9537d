"""Optimizer slots: which state tensors a parameter has, and how they are created.

A parameter's state is its rule's slots (:meth:`RowSparseOptimizer.slot_specs`), plus ``ema`` (and,
for lazy tables, ``ema_last``: the call at which each row's average was last brought up to date)
with ``use_ema``, plus ``accumulated_gradients`` for a dense parameter with gradient accumulation,
plus ``step``. A table's pending accumulation buffers (``acc_ids``, ``acc_rows``) are made by
:mod:`~torch_tpu_embedding.optim._core.grad_intake`.

On XLA, row slot ``k`` of a table gets extra *trash rows* so that every table-sized buffer has a
distinct size (see :func:`trash_rows`), and every slot is created with its table's layout on a
device mesh. Trash rows never reach a checkpoint. They sit after the table's rows, or, for a table
trained through the id exchange, ``k`` after each chunk of the table's rows (:class:`SlotRows`), so
that every shard of a slot holds the slot rows of the same table shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torch_tpu_embedding._rows.placement import all_reduce_sum, device_backend, process_group_placement, reduction_group
from torch_tpu_embedding._rows.routing import slot_row
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.huge_pages import empty
from torch_tpu_embedding._util.registry import rule_of
from torch_tpu_embedding.optim._core.contract import SlotSpec, identity
from torch_tpu_embedding.optim._core.stacked_members import (
    check_created,
    created_member_slots,
    member_rows,
    member_specs,
)

__all__ = [
    "ACCUMULATION",
    "RowSpace",
    "SlotRows",
    "from_saved_ids",
    "lazy_table",
    "logical_rows",
    "make_state",
    "rule_slots",
    "slot_rows",
    "specs",
    "to_saved_ids",
    "trash_rows",
    "write_whole",
]

Tensor = torch.Tensor
#: a table's pending gradient-accumulation buffers (ids ``[k, cap]`` and rows ``[k, cap, D]``)
ACCUMULATION = ("acc_ids", "acc_rows")


def lazy_table(p: Tensor, group: Mapping[str, Any]) -> bool:
    """``p`` is a table whose optimizer updates only its touched rows."""
    return table_info(p) is not None and rule_of(group).is_lazy(group)


def logical_rows(p: Tensor) -> int:
    """Rows of ``p`` in a checkpoint: a table's ``num_embeddings`` (no padding), else dim 0."""
    info = table_info(p)
    return info.num_embeddings if info is not None else (p.shape[0] if p.dim() else 1)


def rule_slots(p: Tensor, group: Mapping[str, Any]) -> list[str]:
    """Names of the slots the rule reads and returns for ``p``."""
    cls = rule_of(group)
    return list(cls.slot_specs(tuple(p.shape), group, table_info(p) is not None))


def specs(p: Tensor, group: Mapping[str, Any]) -> dict[str, SlotSpec]:
    """Every state tensor of ``p`` except ``step`` and the accumulation buffers of tables."""
    cls = rule_of(group)
    # A stacked group keeps each table's whole-table slots: a leading [members] dim (optim/_members.py).
    out = member_specs(p, cls.slot_specs(tuple(p.shape), group, table_info(p) is not None))
    if group["use_ema"]:
        out["ema"] = SlotSpec(tuple(p.shape))
        if lazy_table(p, group):
            out["ema_last"] = SlotSpec((p.shape[0],), init=-1.0, dtype=torch.int32)
    if group["gradient_accumulation_steps"] and table_info(p) is None:
        out["accumulated_gradients"] = SlotSpec(tuple(p.shape))
    return out


@dataclasses.dataclass(frozen=True)
class SlotRows:
    """Where a table row's entries are in the table's row slots.

    ``numbers``: each row slot's number ``k`` (1-based; slot ``k`` has ``k`` trash rows per block).
    ``chunk_rows``: ``None`` when table row ``r`` is slot row ``r`` (trash rows at the end); else ``c``,
    the rows per chunk of the chunked layout (``k`` trash rows after each chunk of ``c`` rows: row
    ``r`` at ``(r // c)(c + k) + r % c``). The formulas hold for a whole table and for one shard of it.
    """

    numbers: Mapping[str, int]
    chunk_rows: int | None = None

    def at(self, name: str, rows: Tensor) -> Tensor:
        """Slot rows of table ``rows`` (the table's sentinel maps one past the slot's table rows)."""
        if self.chunk_rows is None:
            return rows
        return slot_row(rows, self.numbers[name], self.chunk_rows)

    def gather(self, name: str, slot: Tensor, rows: Tensor) -> Tensor:
        """``slot``'s entries of table ``rows`` (the sentinel clamped to a real row)."""
        return slot.index_select(0, self.at(name, rows).clamp(max=slot.shape[0] - 1))

    def table_order(self, name: str, slot: Tensor, n: int) -> Tensor:
        """``slot``'s entries of table rows ``0 .. n-1`` (``n``: the rows of the table or of its shard),
        trash dropped: a slice, or a reshape and a slice (local on every shard)."""
        if self.chunk_rows is None:
            return slot if slot.shape[0] == n else slot[:n]
        c, rest = self.chunk_rows, tuple(slot.shape[1:])
        return slot.reshape(n // c, c + self.numbers[name], *rest)[:, :c].reshape(n, *rest)

    def with_table_order(self, name: str, slot: Tensor, values: Tensor) -> Tensor:
        """``slot`` with the entries of table rows ``0 .. len(values)-1`` replaced by ``values`` (a new
        tensor; trash rows kept). Written back by one whole-tensor ``copy_`` (see :func:`write_whole`)."""
        n = values.shape[0]
        if self.chunk_rows is None:
            return values if slot.dim() == 0 or n == slot.shape[0] else torch.cat([values, slot[n:]])
        c, rest = self.chunk_rows, tuple(slot.shape[1:])
        blocks = slot.reshape(n // c, c + self.numbers[name], *rest)
        return torch.cat([values.reshape(n // c, c, *rest), blocks[:, c:]], dim=1).reshape(slot.shape)


def slot_rows(p: Tensor, group: Mapping[str, Any]) -> SlotRows:
    """The :class:`SlotRows` of parameter ``p``'s state (numbers in :func:`specs` order, as made)."""
    numbers: dict[str, int] = {}
    for name, spec in specs(p, group).items():
        if spec.rows and spec.shape:
            numbers[name] = len(numbers) + 1
    info = table_info(p)
    chunked = info is not None and info.layout is not None
    return SlotRows(numbers, p.shape[0] // info.layout.chunks if chunked and info and info.layout else None)


@dataclasses.dataclass(frozen=True)
class RowSpace:
    """The tensors an update reads and writes: a parameter and its state (:meth:`of`), or one shard's
    part of a row-sharded table and its slots inside a manual-sharding region (the owner-local path,
    with ``all_reduce`` summing over the shards). The row bookkeeping of ``optim/_core/update_paths.py`` runs on
    either without knowing which.
    """

    p: Tensor
    state: dict[str, Tensor]
    where: SlotRows
    num_rows: int  # logical rows of the whole parameter
    all_reduce: Callable[[Tensor], Tensor] = identity

    @staticmethod
    def of(p: Tensor, group: Mapping[str, Any], state: dict[str, Tensor]) -> RowSpace:
        """The whole parameter ``p`` with its ``state``.

        One rank's shard of a table sharded over a process group (``tte.distributed.shard``) counts the
        whole table's logical rows; when the rule keeps whole-table statistics (Adafactor) and the rows are
        split over the ranks, what it sums over rows is summed over the group too."""
        spread = process_group_placement(p)
        if spread is None:
            return RowSpace(p, state, slot_rows(p, group), logical_rows(p))
        pg = reduction_group(p)
        whole = pg is not None and any(not s.rows for s in specs(p, group).values())
        reduce: Callable[[Tensor], Tensor] = (lambda x: all_reduce_sum(x, pg)) if whole else identity
        return RowSpace(p, state, slot_rows(p, group), spread.rows, reduce)

    def gather(self, name: str, rows: Tensor) -> Tensor:
        """Slot ``name``'s entries of table ``rows`` (the sentinel reads a real row; its result is dropped)."""
        return self.where.gather(name, self.state[name], rows.clamp(max=self.p.shape[0] - 1))

    def table_order(self, name: str) -> Tensor:
        """Slot ``name`` without trash rows, in the parameter's row order (a row slot) or whole."""
        slot = self.state[name]
        if name not in self.where.numbers:
            return slot
        return self.where.table_order(name, slot, self.p.shape[0] if self.p.dim() else 1)

    def write(self, name: str, value: Tensor) -> None:
        """Write ``value`` (as :meth:`table_order` reads it) into slot ``name`` with one whole-tensor copy."""
        slot = self.state[name]
        write_whole(slot, self.where.with_table_order(name, slot, value) if name in self.where.numbers else value)


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
    return device_backend("xla").slot_extra_rows(p, k)


def make_state(p: Tensor, group: Mapping[str, Any]) -> dict[str, Tensor]:
    """A new state for ``p``: every slot of :func:`specs` at its initial value, and ``step`` = 0."""
    all_specs = specs(p, group)
    fn = group.get("slot_creation_fn")
    made: Mapping[str, Any] = {}
    if fn is not None and member_rows(p):  # a stacked group: once per table, as for tables of their own
        cls = rule_of(group)
        made = created_member_slots(p, fn, rule_slots(p, group), all_specs,
                                    lambda shape: cls.slot_specs(shape, group, True))
    elif fn is not None:
        names = rule_slots(p, group)
        made = fn(p, names, {n: all_specs[n].init for n in names})
        check_created(made, {n: all_specs[n].shape for n in names})
    state: dict[str, Tensor] = {}
    where = slot_rows(p, group)
    for name, spec in all_specs.items():
        shape = spec.shape
        if name in where.numbers:
            shape = (shape[0] + trash_rows(p, where.numbers[name]), *shape[1:])
        if name == "ema":  # Keras's first EMA update copies the weights
            # A new tensor, not a slice assignment from p: on XLA that ties the two as views
            # and the next step traces a different graph.
            if shape == tuple(p.shape):
                slot = p.detach().to(math_dtype(p), copy=True)
                if p.device.type == "xla":
                    # XLA's copy shares p's buffer until p changes: the first step would read one graph
                    # input for both and the next step two (a second graph). A fresh upload does not.
                    slot = slot.cpu().to(p.device)
            else:
                pad = torch.zeros(shape, dtype=math_dtype(p), device=p.device)
                # clone(): not a reshape view (on XLA a view stays tied to its base, which then becomes an
                # extra output of every step, and the slot is copied whole each step).
                slot = where.with_table_order(name, pad, p.detach().to(math_dtype(p))).clone()
        elif p.device.type == "cpu":  # on huge pages where large: a step reads its rows all over it, as the table's
            slot = empty(shape, spec.dtype or math_dtype(p), p.device).fill_(spec.init)
        else:
            slot = torch.full(shape, spec.init, dtype=spec.dtype or math_dtype(p), device=p.device)
        if name in made:
            value = made[name].detach().to(device=p.device, dtype=slot.dtype)
            slot = where.with_table_order(name, slot, value).clone() if name in where.numbers else value
        if p.device.type == "xla":  # created with the parameter's layout (SPMD)
            device_backend("xla").shard_slot(p, slot, spec.rows)
        state[name] = slot
    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    return state


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
