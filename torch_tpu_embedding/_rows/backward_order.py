"""Whether a backward ran on the CPU before the XLA runtime started: detected, so the next XLA lookup
with gradients can say what to do instead of failing inside PyTorch.

PyTorch's autograd engine sizes its per-device queues at the first backward of the process; if the
XLA runtime was not up then, every later XLA backward fails with an internal assert on
``device_ready_queues_``. Every backward that hands a table rows calls :func:`note_backward`; a
lookup on XLA that will be differentiated calls :func:`check_xla_backward` first.
"""

from __future__ import annotations

import sys

__all__ = ["check_xla_backward", "note_backward"]

# Whether a lookup's backward ran before the XLA runtime started ("early"), and whether it has started
# (monotonic: checked until it is seen started). PyTorch's autograd engine sizes its per-device queues at
# the first backward of the process; if the runtime was not up then, every later XLA backward fails with an
# internal assert on `device_ready_queues_`.
_BACKWARD = {"early": False, "started": False}


def _xla_started() -> bool:
    if not _BACKWARD["started"]:
        xla = sys.modules.get("torch_xla")  # only looked at when the program imported it: never imported here
        _BACKWARD["started"] = bool(xla is not None and xla._XLAC._xla_runtime_is_initialized())
    return _BACKWARD["started"]


def note_backward() -> None:
    """Called by every backward that hands a table rows: remember one that ran before the XLA runtime."""
    if not _BACKWARD["early"] and not _xla_started():
        _BACKWARD["early"] = True


def check_xla_backward(table: str) -> None:
    """Raise before an XLA lookup that will be differentiated if a backward ran before the XLA runtime
    started (its backward would fail with PyTorch's internal assert, far from the cause)."""
    if _BACKWARD["early"]:
        raise RuntimeError(
            f"Table `{table}` is looked up on XLA with gradients enabled, but a backward pass of this process "
            "ran on the CPU (through an embedding lookup) before the XLA runtime started. PyTorch's autograd "
            "engine sized its device queues at that first backward, so every backward on XLA in this process "
            "would fail with an internal assert (`device_ready_queues_`). Start the runtime before the first "
            "backward (`torch_xla.device()`, or `xr.use_spmd()` then `device_mesh()` under SPMD), or run the "
            "CPU part in a process of its own; look up under `torch.no_grad()` to evaluate without a backward."
        )
