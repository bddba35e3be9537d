"""The XLA device backend: what tensors on an XLA device need from torch_xla, whatever their placement.

Registered for the ``"xla"`` device type by :mod:`torch_tpu_embedding.xla` (``_rows.placement.register_device``)
and loaded on first use, so the optimizer core, stacking and the checkpoints reach these through
``device_backend("xla")`` and never import torch_xla: an XLA table's slots laid out like it
(:func:`~torch_tpu_embedding.xla.mesh.shard_slot`) with their trash rows
(:func:`~torch_tpu_embedding.xla.mesh.slot_extra_rows`), pending tensors computed in one graph
(:func:`~torch_tpu_embedding.xla.transfer.materialize`), and DCP's SPMD planners.

Example::

    >>> from torch_tpu_embedding._rows.placement import device_backend
    >>> backend = device_backend("xla")  # doctest: +SKIP  (imports torch_xla)
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from torch_tpu_embedding.xla import mesh, transfer

__all__ = ["XLA_DEVICE", "XlaDevice"]


class XlaDevice:
    """The :class:`~torch_tpu_embedding._rows.placement.DeviceBackend` of ``"xla"`` tensors."""

    def materialize(self, tensors: Sequence[torch.Tensor]) -> None:
        transfer.materialize(tensors)

    def slot_extra_rows(self, table: torch.Tensor, k: int) -> int:
        return mesh.slot_extra_rows(table, k)

    def shard_slot(self, param: torch.Tensor, slot: torch.Tensor, rows: bool) -> None:
        mesh.shard_slot(param, slot, rows)

    def dcp_planner(self, kind: str) -> Any:
        """torch_xla's ``SPMDSavePlanner`` / ``SPMDLoadPlanner`` (``kind``), a new instance."""
        return getattr(importlib.import_module("torch_xla.experimental.distributed_checkpoint"), kind)()


XLA_DEVICE = XlaDevice()
