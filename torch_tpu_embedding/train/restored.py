"""Activations restored into a step (``tte.TrainPipeline``'s pipelined execution): a checkpoint's activations looked
up ahead, or those of a failed step's batch trained again, given the gradient of a fresh lookup of the same ids."""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu_embedding._util.nest import flatten, pick, rebuild

__all__ = ["restore"]


class _Saved(torch.autograd.Function):
    """Activations restored from a checkpoint: the saved values, with the gradient of a fresh lookup of the same
    ids (a lookup's gradient rows depend on its ids and gains, never on the table's values)."""

    @staticmethod
    def forward(ctx: Any, fresh: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return saved.to(fresh.device, fresh.dtype).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def restore(fresh: Any, saved: Any) -> Any:
    """``fresh`` activations (a structure of tensors) with the values of ``saved`` (the same structure), in
    ``fresh``'s containers (an OrderedDict or a namedtuple of activations stays one, as the forward gives it)."""
    values = {path: _Saved.apply(leaf, pick(saved, path))  # type: ignore[no-untyped-call]
              if isinstance(leaf, torch.Tensor) else leaf
              for path, leaf in flatten(fresh)}
    return rebuild(fresh, values)
