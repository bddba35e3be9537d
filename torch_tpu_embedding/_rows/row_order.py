"""How a table's logical rows are stored: the row order of a table and of its optimizer slots.

Most tables store logical row ``i`` at row ``i`` (device padding rows after the last logical row) and
give row slot ``k`` (1-based, see ``optim/_core/slots.py``) its trash rows at the end. A row-sharded table
trained through the id exchange (``torch_tpu_embedding/xla/routed.py``) is stored in the
*interleaved* order of :class:`RowLayout` instead, so that every shard owns an even share of any id
range and an optimizer slot's shard ``d`` holds exactly the slot rows of table shard ``d``.

Checkpoints stay logical whatever the layout: :func:`to_logical` reads a stored table or slot in
logical order and :func:`from_logical` writes logical values into it. A layout is recorded in
distributed checkpoints as :func:`describe` (a tuple), so a reader without the model (a CPU process,
``convert_distributed``) can undo it. Pure torch: nothing here needs torch_xla.
"""

from __future__ import annotations

import dataclasses

import torch

from torch_tpu_embedding._rows.routing import RowOwnership, slot_row

__all__ = [
    "Description",
    "RowLayout",
    "describe",
    "from_logical",
    "layout_of",
    "logical_to_owned",
    "owned_logical_ids",
    "owned_to_logical",
    "to_logical",
]

Tensor = torch.Tensor
#: A stored tensor's layout as written in a checkpoint: ``None`` (logical order, trash at the end) or
#: ``(scheme, chunks, k)`` with ``k`` the row slot number (0: the table itself).
Description = tuple[str, int, int] | None


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """The interleaved row order (``torch_tpu_embedding.routing``, scheme ``"interleaved"``).

    The ``R`` physical rows are ``chunks`` chunks of ``c = R / chunks`` rows; logical row ``i`` is
    physical row ``rev(i % chunks) · c + i // chunks`` (``rev``: a bit reversal for a power of two, a
    mixed-radix digit reversal otherwise, see the ownership module). On ``n`` shards (``n`` dividing
    ``chunks``) shard ``d`` holds whole chunks; for ``n`` a power of two times ``chunks``' odd factor
    it owns the ids of one residue ``i % n``: TF's ``id mod n`` with the shards relabelled, and the
    same physical order for every such ``n`` (a distributed checkpoint reshards in place).

    Row slot ``k`` has ``k`` trash rows after each chunk (``R + k · chunks`` rows): physical table row
    ``r`` is slot row ``(r // c)(c + k) + r % c``, so on every such ``n`` a slot's shard ``d`` holds the
    slot rows of table shard ``d`` (its rows are updated where they live, with no communication).
    """

    chunks: int = 512
    scheme: str = "interleaved"

    def ownership(self, rows: int, num_shards: int = 1) -> RowOwnership:
        """The :class:`~torch_tpu_embedding.routing.RowOwnership` of a table of ``rows`` rows."""
        return RowOwnership(self.scheme, rows, num_shards, self.chunks)

    def table_rows(self, stored_rows: int, k: int) -> int:
        """``R``: table rows of a stored tensor of ``stored_rows`` rows (row slot ``k``; 0: the table)."""
        return stored_rows - k * self.chunks

    def positions(self, n: int, stored_rows: int, k: int = 0) -> Tensor:
        """Where logical rows ``0 .. n-1`` are in a stored table (``k = 0``) or row slot ``k``: ``[n]``."""
        rows = self.table_rows(stored_rows, k)
        phys = self.ownership(rows).physical_row(torch.arange(n, dtype=torch.int64))
        return phys if k == 0 else slot_row(phys, k, rows // self.chunks)

    def slot_rows(self, table_rows: Tensor, k: int, chunk_rows: int) -> Tensor:
        """Slot-``k`` rows of table rows (physical, or shard-local: the formula is the same)."""
        return slot_row(table_rows, k, chunk_rows)


def describe(layout: RowLayout | None, k: int = 0) -> Description:
    """The checkpoint form of a stored tensor's layout (``k``: its row slot number, 0 for the table)."""
    return None if layout is None else (layout.scheme, layout.chunks, k)


def layout_of(description: Description) -> tuple[RowLayout | None, int]:
    """The inverse of :func:`describe`: ``(layout, k)``."""
    if description is None:
        return None, 0
    scheme, chunks, k = description
    return RowLayout(int(chunks), str(scheme)), int(k)


def to_logical(t: Tensor, n: int, layout: RowLayout | None, k: int = 0) -> Tensor:
    """The ``n`` logical rows of a stored table (``k = 0``) or row slot ``k``, in logical order.

    Logical order: the first ``n`` rows (a view). Interleaved: a gather (run it on the host for a
    sharded tensor: on the device it would move whole rows between shards).
    """
    if layout is None:
        return t if n == t.shape[0] else t[:n]
    return t.index_select(0, layout.positions(n, t.shape[0], k).to(t.device))


def from_logical(values: Tensor, current: Tensor, layout: RowLayout | None, k: int = 0) -> Tensor:
    """``current`` (a stored table or row slot ``k``) with its logical rows replaced by ``values``
    (``[n, ...]``); padding and trash rows keep their values. A new tensor on ``values``' device."""
    n = values.shape[0]
    current = current.to(device=values.device, dtype=values.dtype)
    if layout is None:
        return values if n == current.shape[0] else torch.cat([values, current[n:]])
    return current.index_copy(0, layout.positions(n, current.shape[0], k).to(values.device), values)


def owned_to_logical(
    ids: Tensor, rows: Tensor, layout: RowLayout, table_rows: int, n: int
) -> tuple[Tensor, Tensor]:
    """Per-shard accumulation buffers in their saved (logical) form.

    ``ids [n·k, cap]`` shard-local rows (``table_rows / n`` = padding), ``rows [n·k, cap, D]``: shard
    ``d`` holds slots ``d·k .. d·k + k-1``. Returns ``ids [k, n·cap]`` logical (``-1`` = padding) and
    ``rows [k, n·cap, D]``, as a replicated buffer of ``k`` calls is saved.
    """
    k, cap = ids.shape[0] // n, ids.shape[1]
    local = ids.reshape(n, k, cap)
    logical = owned_logical_ids(local, layout, table_rows, -1)
    grads = rows.reshape(n, k, cap, -1) * (local < table_rows // n).unsqueeze(-1).to(rows.dtype)
    return logical.transpose(0, 1).reshape(k, n * cap), grads.transpose(0, 1).reshape(k, n * cap, -1)


def owned_logical_ids(local: Tensor, layout: RowLayout, table_rows: int, pad: int) -> Tensor:
    """Shard-local rows ``local [n, ...]`` (shard ``d``'s in row ``d``; ``table_rows / n`` = padding)
    -> logical ids (``pad`` at padding): shard ``d``'s row ``j`` is physical row ``d·table_rows/n + j``."""
    n = local.shape[0]
    per = table_rows // n
    shard = torch.arange(n, dtype=torch.int64, device=local.device).reshape(n, *([1] * (local.dim() - 1)))
    phys = shard * per + local.clamp(max=per - 1)
    return torch.where(local < per, layout.ownership(table_rows, n).logical_id(phys), torch.full_like(phys, pad))


def logical_to_owned(
    ids: Tensor, rows: Tensor, layout: RowLayout, table_rows: int, n: int
) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`owned_to_logical` for any saved buffer ``ids [k, cap]`` (logical, ``-1``
    = padding), ``rows [k, cap, D]``: each shard gets the entries it owns, packed to the front,
    ``[n·k, w]`` (shard-local rows, ``table_rows / n`` after them) and ``[n·k, w, D]``, ``w`` the most
    entries one shard owns in one call (at least 1). On the host: ``w`` depends on the values."""
    per = table_rows // n
    k, cap = ids.shape
    valid = ids >= 0
    phys = layout.ownership(table_rows).physical_row(ids.clamp(min=0).to(torch.int64))
    mine = valid.unsqueeze(0) & (phys // per == torch.arange(n, dtype=torch.int64).reshape(n, 1, 1))
    local = torch.where(mine, (phys % per).unsqueeze(0), torch.full_like(mine, per, dtype=torch.int64))
    grads = rows.unsqueeze(0) * mine.unsqueeze(-1).to(rows.dtype)
    width = max(1, int(mine.sum(-1).max()))
    order = torch.sort((~mine).to(torch.int8), dim=-1, stable=True).indices[..., :width]  # owned entries first
    local = local.gather(-1, order)
    grads = grads.gather(2, order.unsqueeze(-1).expand(*order.shape, grads.shape[-1]))
    return local.reshape(n * k, width), grads.reshape(n * k, width, -1)
