"""A table's weight written in place where torch would swap it: ``.to()`` / ``.double()`` and ``load_state_dict``
under ``torch.__future__.set_swap_module_params_on_conversion(True)``.

``torch.utils.swap_tensors`` refuses a tensor that has weak references, and a table's weight has them (the library's
record of it, cached lookup plans): with the flag on, every move, cast and load of a table failed ("Couldn't swap
EmbeddingTable.weight"). So a table writes its weight as torch writes parameters with the flag off (``.data =``
where the new tensor's type allows it, else a new Parameter; ``copy_`` on a load, the value itself with
``assign=True``), and the weight keeps its identity, as a swap would keep it. The flag itself is never changed: it
is process-wide, read by every thread's module conversions (turned off around a table's cast or load, another
thread's conversions meanwhile copied where their user had asked for swaps).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["apply_in_place", "load_in_place", "swapping"]


def swapping() -> bool:
    """Whether torch swaps a module's parameters on conversion and load (the flag is on)."""
    return torch.__future__.get_swap_module_params_on_conversion()


def _set_data(t: torch.Tensor, applied: torch.Tensor) -> bool:
    """torch's rule without the swap flag: a result of a compatible tensor type is written through ``.data``."""
    return bool(torch._has_compatible_shallow_copy_type(t, applied)
                and not torch.__future__.get_overwrite_module_params_on_conversion())


def apply_in_place(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``module._apply(fn)`` as torch runs it with the swap flag off: its children by their own ``_apply``, its
    parameters (with their ``.grad``) and its buffers."""
    for child in module.children():
        child._apply(fn)  # type: ignore[no-untyped-call]
    for key, param in module._parameters.items():
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        grad = param.grad
        if _set_data(param, applied):
            param.data = applied
            out = param
        else:
            out = nn.Parameter(applied, param.requires_grad)
            module._parameters[key] = out  # (the key exists: the dict's size is unchanged)
        if grad is not None:
            with torch.no_grad():
                grad_applied = fn(grad)
            if _set_data(grad, grad_applied) and out.grad is not None:
                out.grad.data = grad_applied
            else:
                out.grad = grad_applied.requires_grad_(grad.requires_grad)
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = fn(buf)


def load_in_place(module: nn.Module, name: str, load: Callable[[], None], state_dict: dict[str, Any], prefix: str,
                  local_metadata: dict[str, Any], strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                  error_msgs: list[str]) -> None:
    """Run ``load`` (torch's ``_load_from_state_dict`` of ``module`` with these arguments: its load pre-hooks, its
    other state, the check of its keys) with parameter ``name``'s value taken out of ``state_dict`` after the last
    pre-hook (the value the hooks made), then write that value as torch does with the swap flag off."""
    key, taken = prefix + name, []

    def take(_: nn.Module, sd: dict[str, Any], *__: Any) -> None:
        if key in sd:
            taken.append(sd.pop(key))

    handle = module.register_load_state_dict_pre_hook(take)  # type: ignore[no-untyped-call]  # (runs last)
    try:
        load()
    finally:
        handle.remove()
    if not taken:
        return
    value = state_dict[key] = taken[0]
    if strict and key in missing_keys:  # (torch's walk found no value: it was taken)
        missing_keys.remove(key)
    param = module._parameters[name]
    assert param is not None  # (a table's weight)
    if not torch.overrides.is_tensor_like(value):  # type: ignore[no-untyped-call]
        error_msgs.append(f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like object '
                          f"from checkpoint but received {type(value)}")
        return
    if value.shape != param.shape:
        error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, the "
                          f"shape in current model is {param.shape}.")
        return
    assign = local_metadata.get("assign_to_params_buffers", False)
    if param.is_meta and not value.is_meta and not assign:
        warnings.warn(f"for {key}: copying from a non-meta parameter in the checkpoint to a meta parameter in the "
                      "current model, which is a no-op. (Did you mean to pass `assign=True` to assign items in the "
                      "state dictionary to their corresponding key in the module instead of copying them in place?)",
                      stacklevel=2)
    try:
        with torch.no_grad():
            if assign:
                if not isinstance(value, nn.Parameter):
                    value = nn.Parameter(value, requires_grad=param.requires_grad)
                else:
                    value.requires_grad_(param.requires_grad)
                setattr(module, name, value)
            else:
                param.copy_(value)
    except Exception as ex:  # (torch's own wording: reported with the load's other errors)
        error_msgs.append(f'While copying the parameter named "{key}", whose dimensions in the model are '
                          f"{param.size()} and whose dimensions in the checkpoint are {value.size()}, an exception "
                          f"occurred : {ex.args}.")
