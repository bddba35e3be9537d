"""The update pipeline every path runs around an optimizer's pure rule, and the names of the paths.

:func:`pipeline` is clipvalue → decoupled weight decay → the rule → weight clipping (TF's order), on
whatever rows a path hands it; :func:`gated` keeps or drops a computed update (``skip_nonfinite``,
an exchange overflow). Which path a parameter takes, and the paths themselves, are :mod:`.update_paths`;
the compiled eager path (:mod:`.row_update`) and the moving average (:mod:`.ema`) run the same
two functions.

Example (one SGD row update, no options set)::

    >>> import torch
    >>> from torch_tpu_embedding.optim import SGD
    >>> from torch_tpu_embedding.optim._core.contract import RowContext
    >>> group = SGD([torch.zeros(1)], lr=0.1).param_groups[0]
    >>> w, _ = pipeline(torch.ones(1, 2), torch.ones(1, 2), {}, torch.tensor(0.1), torch.tensor(1), group,
    ...                 RowContext(mask=None, count=None, num_rows=1))
    >>> w
    tensor([[0.9000, 0.9000]])
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import torch

from torch_tpu_embedding._util.registry import rule_of
from torch_tpu_embedding.optim._core.contract import RowContext, Slots, is_set

__all__ = ["Path", "gated", "pipeline"]

Tensor = torch.Tensor


class Path(enum.Enum):
    """How a parameter's update runs (each path is described in ``_core.update_paths``)."""

    DENSE = "dense"
    ADDITIVE = "additive"
    NO_DEDUP = "no_dedup"
    ROWS = "rows"
    KERNEL = "kernel"
    ROW_CHUNKS = "row_chunks"
    OWNER_LOCAL = "owner_local"


def gated(gate: Tensor | None, new: Tensor, old: Tensor) -> Tensor:
    """``new`` where the update is kept (``gate`` True or absent), else ``old``."""
    return new if gate is None else torch.where(gate, new, old)


def pipeline(
    w: Tensor, g: Tensor, slots: Slots, lr: Tensor, step: Tensor, group: Mapping[str, Any], ctx: RowContext
) -> tuple[Tensor, Slots]:
    """clipvalue → decoupled weight decay → the rule → weight clipping (TF's order)."""
    clip = group["clipvalue"]
    if clip is not None:  # the constructor's (min, max) pair, or a number written into the group since: (-c, c)
        g = _clamp(g, clip[0], clip[1]) if isinstance(clip, (tuple, list)) else _clamp(g, -clip, clip)
    wd: Any = group.get("weight_decay_factor")
    if is_set(wd):
        if group.get("multiply_weight_decay_factor_by_learning_rate"):
            # (the update kernel's float64 tensor in the lr's dtype, as a Python number multiplies a 0-d tensor)
            wd = lr * (wd.to(lr.dtype) if isinstance(wd, Tensor) else wd)
        w = w - wd * w
    w, slots = rule_of(group).rule(w, g, slots, lr, step, group, ctx)
    lo, hi = group.get("clip_weight_min"), group.get("clip_weight_max")
    if lo is not None or hi is not None:
        w = _clamp(w, lo, hi)
    return w, slots


def _clamp(x: Tensor, lo: Any, hi: Any) -> Tensor:
    """``x.clamp(lo, hi)``; bounds that are not both numbers or both tensors (the update kernel's data, and a 0, 1 or
    ``None`` it keeps as a number) one at a time, the same values: ``torch.clamp`` takes no mix of the two."""
    if lo is None or hi is None or isinstance(lo, Tensor) == isinstance(hi, Tensor):
        return x.clamp(min=lo, max=hi)
    return x.clamp(min=lo).clamp(max=hi)
