"""Running the pending work of many lazy XLA tensors as one graph."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch_xla

__all__ = ["materialize"]


def materialize(tensors: Sequence[torch.Tensor]) -> None:
    """Compute ``tensors`` (pending XLA results, e.g. slices of a parameter) in one graph.

    Read one at a time (``.cpu()``, ``torch.save``), each would be its own graph: one compile per
    distinct shape. ``state_dict`` of a stacked group hands out one copy of each table's rows this way.
    """
    if tensors:
        torch_xla._XLAC._xla_sync_multi(list(tensors), devices=[], wait=False)  # type: ignore[attr-defined]
