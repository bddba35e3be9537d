"""torch_tpu_embedding: large embedding tables for PyTorch on Cloud TPU (and CPU/CUDA).

Tables are row-sparse end to end: lookups gather rows, the backward produces per-id gradient rows,
and the optimizers in :mod:`torch_tpu_embedding.optim` update only the rows a batch touched.
XLA-specific code lives in :mod:`torch_tpu_embedding.xla`, imported only when asked for.
"""

import sys as _sys

from torch_tpu_embedding import checkpoint, distributed, interop, optim, routing, xla
from torch_tpu_embedding._rows.stock_guard import install_stock_optimizer_guard as _install_guard
from torch_tpu_embedding.clip import clip_grad_norm_
from torch_tpu_embedding.combiners import bag_gains
from torch_tpu_embedding.config import (
    COMBINERS,
    PLACEMENTS,
    FeatureConfig,
    TableConfig,
    default_initializer,
)
from torch_tpu_embedding.inputs import Jagged, Padded
from torch_tpu_embedding.modules.collection import EmbeddingCollection, EmbeddingTable, split_parameters
from torch_tpu_embedding.optim import OPTIMIZER_NAMES
from torch_tpu_embedding.train import TrainPipeline

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
    "TrainPipeline",
    "bag_gains",
    "checkpoint",
    "clip_grad_norm_",
    "distributed",
    "interop",
    "default_initializer",
    "optim",
    "routing",
    "split_parameters",
    "xla",
]

__version__ = "0.1.0"

# Models pickled whole (``torch.save(model)``) before the modules moved into subpackages name their classes
# and state hooks by the old module paths; those paths stay importable as the modules that now hold them.
from torch_tpu_embedding.modules import collection as _collection  # noqa: E402
from torch_tpu_embedding.modules import screening as _screening  # noqa: E402
from torch_tpu_embedding.modules import stacking as _stacking  # noqa: E402
from torch_tpu_embedding.modules import table as _table  # noqa: E402

for _old, _module in (("collection", _collection), ("table", _table), ("_fused", _stacking),
                      ("_screening", _screening)):
    _sys.modules.setdefault(f"{__name__}.{_old}", _module)

_install_guard()
