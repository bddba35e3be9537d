"""Checkpoints that move between CPU, one XLA device and any sharded layout.

A checkpoint holds the *logical* state: one ``[num_embeddings, D]`` tensor per table and per row slot
(no device padding rows, no trash rows), keyed by table name, on the CPU. It loads into a model on
any device and any placement; :func:`save` writes atomically and the file loads with
``torch.load(weights_only=True)`` (no pickled code).

Example::

    >>> tte.checkpoint.save("ckpt.pt", model=ec, optimizer=opt, extra={"step": 1000})
    >>> extra = tte.checkpoint.load("ckpt.pt", model=ec2, optimizer=opt2)   # another device/layout
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

__all__ = ["FORMAT", "load", "save", "to_cpu"]

#: written into every checkpoint; :func:`load` refuses other formats
FORMAT = "torch_tpu_embedding.checkpoint/1"


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and copied to the CPU (dicts, lists and tuples traversed).

    A sharded XLA tensor is gathered to the host: fine for tables that fit in host memory; for
    larger ones use ``torch.distributed.checkpoint`` with torch_xla's SPMD planners (docs/checkpoints.md).
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj


def save(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``{"format", "model", "optimizer", "extra"}`` to ``path`` atomically (temp file + rename).

    On several hosts call it from one process (``torch_xla.runtime.process_index() == 0``).
    """
    payload = {
        "format": FORMAT,
        "model": None if model is None else to_cpu(model.state_dict()),
        "optimizer": None if optimizer is None else to_cpu(optimizer.state_dict()),
        "extra": to_cpu(extra),
    }
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)  # a reader sees the old file or the new one, never half of one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> dict[str, Any] | None:
    """Load a :func:`save` file (``weights_only=True``) into ``model`` / ``optimizer``; returns ``extra``.

    Build the model on its device and layout first (and ``optimizer.init_state()`` on XLA); the
    tensors are copied into the existing parameters and slots, which keep their sharding.
    """
    payload = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{os.fspath(path)} is not a torch_tpu_embedding checkpoint ({FORMAT}). Found: {found!r}")
    if model is not None:
        if payload["model"] is None:
            raise ValueError(f"{os.fspath(path)} holds no model state.")
        model.load_state_dict(payload["model"], strict=strict)
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"{os.fspath(path)} holds no optimizer state.")
        optimizer.load_state_dict(payload["optimizer"])
    extra: dict[str, Any] | None = payload.get("extra")
    return extra
