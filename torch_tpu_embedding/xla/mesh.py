"""The device mesh, and optimizer slots laid out like their table on it (torch_xla SPMD).

The transport side of a table's layout: :func:`device_mesh` builds the 1-D mesh, and the optimizer
core calls :func:`slot_extra_rows` and :func:`shard_slot` when it creates a slot, so no slot is ever
materialised whole on one device. A table's layout itself (:class:`~torch_tpu_embedding.xla.sharding.
TableSharding`: placement, mesh, axis, row block) is chosen and recorded on the table by
:func:`torch_tpu_embedding.xla.shard`; these functions read it from the table (``table_info(p).sharding``).

Example (single-process SPMD, 4 virtual CPU devices)::

    import torch_xla.runtime as xr
    xr.use_spmd()
    mesh = device_mesh()              # shape {"x": 4}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd
import torch_xla.runtime

from torch_tpu_embedding._rows.tables import table_info

if TYPE_CHECKING:
    from torch_tpu_embedding.xla.sharding import TableSharding

# torch_xla's partial type hints are not part of its API: treat its modules as untyped.
xs: Any = torch_xla.distributed.spmd
xr: Any = torch_xla.runtime
_XLAC: Any = torch_xla._XLAC  # type: ignore[attr-defined]
#: ``torch_xla.distributed.spmd.Mesh``
Mesh = Any

__all__ = ["Mesh", "device_mesh", "shard_slot", "sharding_spec", "slot_extra_rows"]


def device_mesh(axis: str = "x") -> Mesh:
    """A 1-D mesh over every device of every host (``xr.global_runtime_device_count()``)."""
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n,), (axis,))


def slot_extra_rows(table: torch.Tensor, k: int) -> int:
    """Trash rows of row-indexed optimizer slot ``k`` (1-based) of an XLA table.

    Distinct row counts keep every table-sized buffer a distinct size, so XLA cannot mis-pair
    donated buffers (which copies whole tables each step); on a mesh ``k`` row blocks keep a
    row-sharded slot evenly split and every layout's shapes equal (the table's row block,
    ``TableSharding.row_block``). At least
    one row, which absorbs scatters at the sentinel id.
    """
    info = table_info(table)
    layout = None if info is None else info.sharding
    if layout is not None:
        return k * int(layout.row_block)
    return k


def shard_slot(param: torch.Tensor, slot: torch.Tensor, rows: bool) -> None:
    """Give an optimizer slot its parameter's layout (``rows``: dim 0 indexes the parameter's rows).

    Tables follow their placement. A dense parameter's same-shaped slots copy its sharding and other
    slots are replicated; without this XLA may pick another layout for them after the first step,
    which changes the next step's input shardings and compiles a second graph. No-op outside SPMD.
    """
    if not xr.is_spmd() or slot.dim() == 0:
        return
    info = table_info(param)
    layout = None if info is None else cast("TableSharding", info.sharding)
    if layout is not None:
        xs.mark_sharding(slot, layout.mesh, layout.spec(slot.dim(), rows))
        return
    op = _XLAC._get_xla_op_sharding(param)
    if op is None:
        return
    if tuple(slot.shape) == tuple(param.shape):
        _XLAC._xla_mark_sharding(slot, op)
    else:
        xs.mark_sharding(slot, device_mesh(), (None,) * slot.dim())


def sharding_spec(t: torch.Tensor) -> str:
    """XLA's sharding annotation of ``t`` (``""`` when it has none), e.g. ``{devices=[4,1]0,1,2,3}``."""
    spec: str = _XLAC._get_xla_sharding_spec(t)
    return spec
