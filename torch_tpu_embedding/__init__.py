"""torch_tpu_embedding: large embedding tables for PyTorch on Cloud TPU (and CPU/CUDA).

Tables are row-sparse end to end: lookups gather rows, the backward produces per-id gradient rows,
and the optimizers in :mod:`torch_tpu_embedding.optim` update only the rows a batch touched.
XLA-specific code lives in :mod:`torch_tpu_embedding.xla`, imported only when asked for.
"""

from torch_tpu_embedding import checkpoint, distributed, interop, optim
from torch_tpu_embedding._stock_guard import install_stock_optimizer_guard as _install_guard
from torch_tpu_embedding.clip import clip_grad_norm_
from torch_tpu_embedding.collection import EmbeddingCollection, EmbeddingTable, split_parameters
from torch_tpu_embedding.combiners import bag_gains
from torch_tpu_embedding.config import (
    COMBINERS,
    PLACEMENTS,
    FeatureConfig,
    TableConfig,
    default_initializer,
)
from torch_tpu_embedding.inputs import Jagged, Padded
from torch_tpu_embedding.optim import OPTIMIZER_NAMES

__all__ = [
    "COMBINERS",
    "OPTIMIZER_NAMES",
    "PLACEMENTS",
    "EmbeddingCollection",
    "EmbeddingTable",
    "FeatureConfig",
    "Jagged",
    "Padded",
    "TableConfig",
    "bag_gains",
    "checkpoint",
    "clip_grad_norm_",
    "distributed",
    "interop",
    "default_initializer",
    "optim",
    "split_parameters",
]

__version__ = "0.1.0"

_install_guard()
