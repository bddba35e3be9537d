"""Optimizers with TPU-embedding semantics that update only the rows a batch touched.

Real ``torch.optim.Optimizer`` subclasses: they train embedding tables (row-sparse gradients from
:class:`~torch_tpu_embedding.EmbeddingCollection`) and ordinary dense parameters alike, on CPU,
CUDA and XLA with one code path. See ``docs/optimizers.md``.
"""

from torch_tpu_embedding.optim._base import RowContext, RowSparseOptimizer, SlotSpec, optimizer_class
from torch_tpu_embedding.optim._extras import KerasExtras
from torch_tpu_embedding.optim.adafactor import Adafactor, adafactor_rule
from torch_tpu_embedding.optim.adagrad import Adagrad, adagrad_rule
from torch_tpu_embedding.optim.adagrad_momentum import AdagradMomentum, adagrad_momentum_rule
from torch_tpu_embedding.optim.adam import Adam, LazyAdam, adam_rule
from torch_tpu_embedding.optim.ftrl import FTRL, ftrl_rule
from torch_tpu_embedding.optim.sgd import SGD, sgd_rule

__all__ = [
    "FTRL",
    "SGD",
    "Adafactor",
    "Adagrad",
    "AdagradMomentum",
    "Adam",
    "KerasExtras",
    "LazyAdam",
    "RowContext",
    "RowSparseOptimizer",
    "SlotSpec",
    "adafactor_rule",
    "adagrad_momentum_rule",
    "adagrad_rule",
    "adam_rule",
    "ftrl_rule",
    "optimizer_class",
    "sgd_rule",
]
