"""Optimizers with TPU-embedding semantics that update only the rows a batch touched.

Real ``torch.optim.Optimizer`` subclasses: they train embedding tables (row-sparse gradients from
:class:`~torch_tpu_embedding.EmbeddingCollection`) and ordinary dense parameters alike, on CPU,
CUDA and XLA with one code path. See ``docs/optimizers.md``; how the core is laid out and how to add
an optimizer: ``docs/design.md``.
"""

import sys

from torch_tpu_embedding._util.registry import OPTIMIZER_NAMES as OPTIMIZER_NAMES
from torch_tpu_embedding._util.registry import optimizer_class as optimizer_class
from torch_tpu_embedding._util.registry import optimizer_names as optimizer_names
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer as RowSparseOptimizer
from torch_tpu_embedding.optim._core.contract import RowContext as RowContext
from torch_tpu_embedding.optim._core.contract import SlotSpec as SlotSpec
from torch_tpu_embedding.optim._core.extras import KerasExtras as KerasExtras
from torch_tpu_embedding.optim._state.torch_form import use_torch_layout as use_torch_layout

# The optimizers, one module each: importing a module registers its optimizers, in this order.
# isort: off
from torch_tpu_embedding.optim.sgd import *  # noqa: F403
from torch_tpu_embedding.optim.adagrad import *  # noqa: F403
from torch_tpu_embedding.optim.adagrad_momentum import *  # noqa: F403
from torch_tpu_embedding.optim.adam import *  # noqa: F403
from torch_tpu_embedding.optim.ftrl import *  # noqa: F403
from torch_tpu_embedding.optim.adafactor import *  # noqa: F403
from torch_tpu_embedding.optim.rowwise_adagrad import *  # noqa: F403
# isort: on

__all__ = sorted(
    {"KerasExtras", "OPTIMIZER_NAMES", "RowContext", "RowSparseOptimizer", "SlotSpec", "optimizer_class",
     "optimizer_names",
     "use_torch_layout"}
    | {name for n in OPTIMIZER_NAMES for name in sys.modules[optimizer_class(n).__module__].__all__}
)
del sys  # used above only: not part of the package's namespace
