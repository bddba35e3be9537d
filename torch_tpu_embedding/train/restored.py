"""Activations restored into a step (``tte.TrainPipeline``'s pipelined execution): a checkpoint's activations looked
up ahead, or those of a failed step's batch trained again, given the gradient of a fresh lookup of the same ids."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["detached", "restore"]


class _Saved(torch.autograd.Function):
    """Activations restored from a checkpoint: the saved values, with the gradient of a fresh lookup of the same
    ids (a lookup's gradient rows depend on its ids and gains, never on the table's values)."""

    @staticmethod
    def forward(ctx: Any, fresh: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return saved.to(fresh.device, fresh.dtype).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def restore(fresh: Any, saved: Any) -> Any:
    """``fresh`` activations (a structure of tensors) with the values of ``saved`` (the same structure)."""
    if isinstance(fresh, torch.Tensor):
        out: torch.Tensor = _Saved.apply(fresh, saved)  # type: ignore[no-untyped-call]
        return out
    if isinstance(fresh, dict):
        return {k: restore(v, saved[k]) for k, v in fresh.items()}
    if isinstance(fresh, (list, tuple)):
        items = [restore(v, s) for v, s in zip(fresh, saved, strict=True)]
        return items if isinstance(fresh, list) else tuple(items)
    return fresh
