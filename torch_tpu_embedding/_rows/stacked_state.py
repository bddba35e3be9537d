"""A stacked group's optimizer state, per table: split into its tables' states and joined back.

A group of stacked tables (``torch_tpu_embedding/modules/stacking.py``) has one weight and one set of slots,
``[Σ rows, ...]``; checkpoints keep state per table (``table:<name>``) so that they move between
stacked and unstacked collections. The optimizer's state I/O (``optim/_state/state_save.py`` and
``state_load.py``) and the checkpoint helpers call these functions on logical rows. A group is described by
its *members*: ``(table name, first row, rows)`` in stacking order.

Example::

    >>> import torch
    >>> members = (("a", 0, 2), ("b", 2, 1))
    >>> parts = split_member_state({"m": torch.arange(3.0), "step": torch.tensor(4)}, members, {"m"})
    >>> parts["b"]["m"].tolist(), int(parts["b"]["step"])
    ([2.0], 4)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch

__all__ = ["Members", "member_entries", "merge_member_state", "split_member_state"]

#: a stacked group's tables: ``(name, first row, rows)`` each, in stacking order
Members = tuple[tuple[str, int, int], ...]


def split_member_state(
    entry: Mapping[str, torch.Tensor], members: Members, row_slots: Collection[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """One group's optimizer state (logical rows) → ``{table name: state}``, as unstacked tables keep it.

    Row slots are cut per table; ``step`` is copied to every table; any other slot is a whole-table
    slot with a leading ``[members]`` dim (``optim/_core/stacked_members.py``): table ``i`` gets entry ``i``; a
    pending accumulation buffer keeps, per table, its own ids (re-based; ``-1`` elsewhere) and rows
    (zero elsewhere).
    """
    out: dict[str, dict[str, torch.Tensor]] = {}
    for i, (name, off, n) in enumerate(members):
        mine: dict[str, torch.Tensor] = {}
        acc = member_entries(entry["acc_ids"], entry["acc_rows"], off, n, -1) if "acc_ids" in entry else None
        for slot, v in entry.items():
            if acc is not None and slot in ("acc_ids", "acc_rows"):
                mine[slot] = acc[slot == "acc_rows"]
            elif slot in row_slots:
                mine[slot] = v[off : off + n]
            elif slot == "step":
                mine[slot] = v
            else:
                mine[slot] = v[i]
        out[name] = mine
    return out


def member_entries(
    ids: torch.Tensor, rows: torch.Tensor, offset: int, n: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of a group's row-indexed ``(ids [...], rows [..., D])`` that fall in a table's rows
    ``[offset, offset + n)``, re-based to the table's ids; the others become id ``pad`` with zero rows
    (shapes unchanged)."""
    inside = (ids >= offset) & (ids < offset + n)
    return torch.where(inside, ids - offset, torch.full_like(ids, pad)), rows * inside.unsqueeze(-1).to(rows.dtype)


def merge_member_state(
    parts: Mapping[str, Mapping[str, torch.Tensor]],
    members: Members,
    row_slots: Collection[str],
    current: Callable[[str, int, int], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_member_state`: per-table states → one group state (logical rows).

    A table with no saved state (it was never stepped) keeps the group's current rows
    (``current(slot, first row, rows)``) and its current entry of a whole-table slot
    (``current(slot, i, 1)``: entry ``i`` of the leading ``[members]`` dim). ``step`` is the largest
    of the tables' counts (they are equal when every table is looked up in every step).
    """
    slots = sorted({s for p in parts.values() for s in p})
    out: dict[str, torch.Tensor] = {}
    if "acc_ids" in slots:
        out.update(_merge_accumulation(parts, members))
    for slot in slots:
        if slot in ("acc_ids", "acc_rows"):
            continue
        if slot in row_slots:
            out[slot] = torch.cat([
                parts[name][slot] if slot in parts.get(name, {}) else current(slot, off, n).to(_device_of(parts, slot))
                for name, off, n in members
            ])
        elif slot == "step":
            out[slot] = torch.stack([parts[n][slot] for n, _, _ in members if slot in parts.get(n, {})]).amax(0)
        else:
            dev = _device_of(parts, slot)
            out[slot] = torch.stack([
                parts[name][slot] if slot in parts.get(name, {}) else current(slot, i, 1)[0].to(dev)
                for i, (name, _, _) in enumerate(members)
            ])
    return out


def _merge_accumulation(
    parts: Mapping[str, Mapping[str, torch.Tensor]], members: Members
) -> dict[str, torch.Tensor]:
    """Pending accumulation buffers ``[k, cap]`` / ``[k, cap, D]`` of the tables → the group's.

    Buffers split from a group (equal capacity, each position owned by at most one table) are
    summed back into the group's capacity; others are laid side by side (capacity = the sum).
    """
    got = [(parts[n]["acc_ids"], parts[n]["acc_rows"], off) for n, off, _ in members if "acc_ids" in parts.get(n, {})]
    ids = [torch.where(i >= 0, i + off, torch.full_like(i, -1)) for i, _, off in got]
    rows = [r for _, r, _ in got]
    if len({tuple(i.shape) for i in ids}) == 1 and int(torch.stack([i >= 0 for i in ids]).sum(0).max()) <= 1:
        owned = torch.stack([i >= 0 for i in ids]).any(0)
        summed = torch.stack([i.clamp(min=0) for i in ids]).sum(0)
        return {"acc_ids": torch.where(owned, summed, torch.full_like(summed, -1)),
                "acc_rows": torch.stack(rows).sum(0)}
    return {"acc_ids": torch.cat(ids, dim=1), "acc_rows": torch.cat(rows, dim=1)}


def _device_of(parts: Mapping[str, Mapping[str, torch.Tensor]], slot: str) -> torch.device:
    for p in parts.values():
        if slot in p:
            return p[slot].device
    return torch.device("cpu")
