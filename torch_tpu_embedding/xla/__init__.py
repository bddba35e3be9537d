"""XLA-only helpers: SPMD placement of tables and optimizer slots on a device mesh (docs/sharding.md).

Nothing outside this package imports torch_xla, so ``import torch_tpu_embedding`` works without it.
This package imports torch_xla on first use of one of its names (``shard``, ``device_mesh``, ...),
not at import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torch_tpu_embedding._rows.placement import DeviceBackend, register_device

if TYPE_CHECKING:
    from torch_tpu_embedding.xla.sharding import (
        DEFAULT_REPLICATE_BELOW_BYTES,
        TableSharding,
        choose_placement,
        device_mesh,
        replicate,
        shard,
        shard_batch,
        sharding_spec,
    )

__all__ = [
    "DEFAULT_REPLICATE_BELOW_BYTES",
    "TableSharding",
    "choose_placement",
    "device_mesh",
    "replicate",
    "shard",
    "shard_batch",
    "sharding_spec",
]


def _device() -> DeviceBackend:
    """The ``"xla"`` device backend (imports torch_xla on first use)."""
    backend: DeviceBackend = importlib.import_module("torch_tpu_embedding.xla.device").XLA_DEVICE
    return backend


register_device("xla", _device)


def __getattr__(name: str) -> Any:
    if name in __all__:
        try:
            module = importlib.import_module("torch_tpu_embedding.xla.sharding")
        except ImportError as e:
            raise ImportError(
                f"torch_tpu_embedding.xla.{name} needs torch_xla: pip install 'torch_tpu_embedding[xla]' "
                f"(torch==2.9.0 torch_xla==2.9.0). ({e})"
            ) from e
        return getattr(module, name)
    raise AttributeError(f"module 'torch_tpu_embedding.xla' has no attribute {name!r}")
