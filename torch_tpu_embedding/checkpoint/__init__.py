"""Checkpoints that move between CPU, one XLA device and any sharded layout (docs/checkpoints.md).

The public functions are those of :mod:`torch_tpu_embedding.checkpoint.api`; the other modules of this package
are its parts (files on disk, published directories, DCP, the host form, checks, logical rows).
"""

from torch_tpu_embedding.checkpoint.api import *  # noqa: F403
from torch_tpu_embedding.checkpoint.api import __all__ as __all__
