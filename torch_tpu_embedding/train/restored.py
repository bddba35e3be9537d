"""What a ``tte.TrainPipeline`` restores: its ``state_dict`` checked before anything changes, and activations restored
into a step (pipelined execution): a checkpoint's activations looked up ahead, or those of a failed step's batch
trained again, given the gradient of a fresh lookup of the same ids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map

from torch_tpu_embedding._util.nest import flatten, path_name, rebuild

__all__ = ["failed_update", "host_copy", "restore", "saved_state", "state_problem"]

_KEYS = ("steps", "taken", "unfinished", "outputs_ahead", "pipeline_execution_with_tensor_core")


def saved_state(steps: int, trained_taken: int, unfinished: list[Any], outputs: Any, stale: bool) -> dict[str, Any]:
    """``TrainPipeline.state_dict``'s mapping (what :func:`state_problem` checks on load): ``taken`` counts the
    ``unfinished`` batches too (``trained_taken``: the batches taken and trained, or failed and listed first in
    ``unfinished``, not counted again)."""
    return {"steps": steps, "taken": trained_taken + len(unfinished), "unfinished": unfinished,
            "outputs_ahead": outputs, "pipeline_execution_with_tensor_core": stale}


def state_problem(state: Any, stale: bool) -> str | None:
    """Why ``TrainPipeline.load_state_dict`` refuses ``state`` (``None``: it loads); ``stale``: the pipeline's
    ``pipeline_execution_with_tensor_core``."""
    if not isinstance(state, Mapping):
        return f"The state must be a mapping (TrainPipeline.state_dict()'s). Received {type(state).__name__}."
    missing = [k for k in _KEYS if k not in state]
    if missing:
        return f"The state has no {missing}: it is not a TrainPipeline.state_dict()."
    if state["pipeline_execution_with_tensor_core"] != stale:
        return ("The state was saved by a pipeline with pipeline_execution_with_tensor_core="
                f"{state['pipeline_execution_with_tensor_core']!r}; this one has {stale}.")
    for key in ("steps", "taken"):
        if not isinstance(state[key], int) or isinstance(state[key], bool) or state[key] < 0:
            return f"The state's '{key}' must be an integer >= 0. Received {state[key]!r}."
    if not isinstance(state["unfinished"], list | tuple):
        return f"The state's 'unfinished' must be a list of batches. Received {type(state['unfinished']).__name__}."
    if state["taken"] < len(state["unfinished"]):
        return (f"The state's 'taken' ({state['taken']}) counts its 'unfinished' batches "
                f"({len(state['unfinished'])}) too, so it cannot be fewer.")
    return None


def failed_update(step: int) -> str:
    """Why ``TrainPipeline.state_dict`` refuses after an optimizer's ``step()`` raised in step ``step``."""
    return (f"TrainPipeline.state_dict(): an optimizer's step() raised in step {step}, so the tables and the "
            "optimizers' state may hold part of its update and are no checkpoint of a step. Resume from the last "
            "checkpoint, or train on (run() goes on from the next batch) and save after a step. Received: a call "
            "after a failed update")


class _Saved(torch.autograd.Function):
    """Activations restored from a checkpoint: the saved values, with the gradient of a fresh lookup of the same
    ids (a lookup's gradient rows depend on its ids and gains, never on the table's values)."""

    @staticmethod
    def forward(ctx: Any, fresh: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return saved.to(fresh.device, fresh.dtype).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _shapes(struct: Any) -> dict[Any, tuple[int, ...] | None]:
    return {path: tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for path, leaf in flatten(struct)}


def _described(shapes: dict[Any, tuple[int, ...] | None]) -> str:
    if list(shapes) == [()]:
        return f"one tensor of shape {list(shapes[()] or ())}"
    return ", ".join(f"`{path_name(p)}` {list(s) if s is not None else None}" for p, s in shapes.items())


def restore(fresh: Any, saved: Any) -> Any:
    """``fresh`` activations (a structure of tensors) with the values of ``saved`` (the same structure), in
    ``fresh``'s containers (an OrderedDict or a namedtuple of activations stays one, as the forward gives it)."""
    want, have = _shapes(fresh), _shapes(saved)
    if want != have:  # (resumed with another `concat`, or other features: else an error of this module's internals)
        raise ValueError(
            "The activations looked up ahead that TrainPipeline.load_state_dict() restored (the state's "
            f"'outputs_ahead') do not fit this pipeline's lookup of their batch: saved {_described(have)}; looked up "
            f"now {_described(want)}. Resume with the `concat` and the features the pipeline had when it was saved.")
    saved_leaves = dict(flatten(saved))
    values = {path: _Saved.apply(leaf, saved_leaves[path])  # type: ignore[no-untyped-call]
              if isinstance(leaf, torch.Tensor) else leaf
              for path, leaf in flatten(fresh)}
    return rebuild(fresh, values)


def host_copy(outputs: Any) -> Any:
    """Activations looked up ahead as a checkpoint keeps them: detached copies on the host."""
    return tree_map(lambda t: t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t, outputs)
