"""Host tensors onto a device without a blocking copy.

On CUDA a blocking host-to-device copy synchronises the stream: the host waits for every kernel queued before
it, so a step's copies of its ids (and its counters) would keep the host from running ahead of the device. A
pinned copy (``pin_memory``, cached by torch's host allocator) travels asynchronously; torch keeps the pinned
block until the copy has run.

Example::

    >>> import torch
    >>> upload(torch.arange(3), torch.device("cpu")).tolist()
    [0, 1, 2]
"""

from __future__ import annotations

import torch

__all__ = ["upload"]


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: pinned and non-blocking from the host onto CUDA; a plain ``.to`` elsewhere (XLA's
    transfer is its own; a non-blocking copy from pageable memory to MPS can read the source after it is freed,
    pytorch/pytorch#139550). Onto the meta device, which moves no data, non-blocking as onto CUDA: the tests'
    stand-in accelerator sees the calls CUDA gets (tests/optim/test_sync_free_step.py). Under ``torch.compile`` a plain
    ``.to``, a copy of the graph (the compiled update kernel's constants are made on the device), as the tracer has no
    fake ``pin_memory`` (torch 2.9 raises "NYI: aten._pin_memory")."""
    if torch.compiler.is_compiling():
        return t.to(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=t.device.type == "cpu" and device.type == "meta")
