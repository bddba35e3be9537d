"""``Optimizer.state`` of the optimizers of :mod:`torch_tpu_embedding.optim`: torch.optim's
``defaultdict(dict)`` keyed by parameter, which explains a stacked table's weight instead of answering ``{}``.

Example::

    >>> import torch
    >>> state = StateMapping(dict)
    >>> state[torch.zeros(1)], bool(StateMapping(dict))
    ({}, True)
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from torch_tpu_embedding._rows.tables import stacked_rows

__all__ = ["StateMapping"]


class StateMapping(defaultdict[Any, Any]):
    """``Optimizer.state`` (a ``defaultdict(dict)`` keyed by parameter) that explains, rather than
    answering ``{}``, when asked for a stacked table's weight: its slots are its group's.

    Always true: every slot is made on first use, so there is never state to create by stepping.
    ``torch.distributed.checkpoint.state_dict``'s helpers step an optimizer whose ``state`` is false
    with a ``zeros_like`` gradient per parameter (a ``[V, D]`` one per table) at lr 0, which moves
    FTRL's weights; they skip an optimizer whose ``state`` is true.
    """

    def __bool__(self) -> bool:
        return True

    def __missing__(self, key: Any) -> Any:
        rows = stacked_rows(key) if isinstance(key, torch.Tensor) else None
        if rows is not None:
            raise KeyError(
                f"Table `{rows.table}` is stacked in group `{rows.group}`: its optimizer state is in "
                f"opt.state[ec.groups.{rows.group}.weight] (its rows [{rows.offset}, {rows.offset + rows.rows})"
                f" of each row slot), and per table in opt.state_dict()['state']['table:{rows.table}']."
            )
        # defaultdict's own __missing__, spelled out: dynamo cannot trace ``super()`` in a dict
        # subclass's __missing__ (a graph break in a compiled step's first call).
        if self.default_factory is None:
            raise KeyError(key)
        value = self.default_factory()
        self[key] = value
        return value
