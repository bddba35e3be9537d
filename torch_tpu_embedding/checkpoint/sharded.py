"""The checkpoints of a model sharded over a process group, as the public functions reach them.

``tte.distributed`` writes and reads those directories itself (each rank its own rows: ``save_sharded``,
``load_sharded``); :func:`~torch_tpu_embedding.checkpoint.save_distributed`, ``load_distributed`` and
``convert_distributed`` hand such a model or directory to it through this interface, which that package
installs on import (:func:`install`), so that nothing in this package imports the process-group backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["ShardedCheckpoints", "install", "sharded"]


class ShardedCheckpoints(Protocol):
    """What the process-group backend does for the public checkpoint functions."""

    def owns(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` has tables sharded over a process group."""

    def save(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any,
             extra: dict[str, Any] | None) -> None:
        """Write ``model`` (and ``optimizer``) as each rank's rows, and ``extra`` (every rank calls it)."""

    def load(self, path: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any) -> dict[str, Any] | None:
        """Load a sharded or a ``save_distributed`` directory into ``model`` (and ``optimizer``); returns its
        ``extra``."""

    def load_file(self, path: str, read: Callable[[], tuple[dict[str, Any], str]], model: torch.nn.Module,
                  optimizer: Any, strict: bool) -> dict[str, Any] | None:
        """Load the ``tte.checkpoint.save`` file ``path`` (``read()``: its payload and its bytes' sha256) into
        ``model``, sharded here (and ``optimizer``): each rank its rows; returns its ``extra``."""

    def payload(self, path: str) -> dict[str, Any]:
        """A sharded directory as one ``tte.checkpoint.save`` payload (logical rows, CPU)."""


_INSTALLED: list[ShardedCheckpoints] = []


def install(impl: ShardedCheckpoints) -> None:
    """Install the process-group backend's checkpoints (``tte.distributed`` does on import)."""
    _INSTALLED[:] = [impl]


def sharded() -> ShardedCheckpoints:
    """The installed backend (``import torch_tpu_embedding`` installs it)."""
    if not _INSTALLED:
        raise RuntimeError("the process-group checkpoints are not installed: import torch_tpu_embedding.distributed")
    return _INSTALLED[0]
