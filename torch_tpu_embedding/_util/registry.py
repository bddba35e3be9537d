"""The optimizer-name registry: which optimizer class a name (``"adam"``, ``"ftrl"``, ...) stands for.

It sits at the bottom of the package, beside the configs, because two layers need it: a
:class:`~torch_tpu_embedding.TableConfig` checks its ``optimizer`` string against
:data:`OPTIMIZER_NAMES`, and the optimizer core looks each parameter group's rule up by name. Each
optimizer class enters itself when it is defined (``RowSparseOptimizer.__init_subclass__``), so this
module imports nothing of the package at run time.

Example::

    >>> from torch_tpu_embedding._util.registry import optimizer_class
    >>> optimizer_class("adagrad").__name__
    'Adagrad'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch_tpu_embedding._util.validation import arg_error

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.base import RowSparseOptimizer

__all__ = ["OPTIMIZER_NAMES", "optimizer_class", "optimizer_names", "register"]

#: every optimizer name a ``TableConfig.optimizer`` string may give: the package's own optimizers, in
#: registration order (``tests/optim/test_optim_registry.py`` checks that ``torch_tpu_embedding.optim``
#: registers exactly these first). A new optimizer module adds its name here.
OPTIMIZER_NAMES: tuple[str, ...] = (
    "sgd", "adagrad", "adagrad_momentum", "adam", "lazy_adam", "ftrl", "adafactor", "rowwise_adagrad",
)

_REGISTRY: dict[str, type[RowSparseOptimizer]] = {}


def register(cls: type[RowSparseOptimizer]) -> None:
    """Enter ``cls`` under ``cls.algorithm`` (called for every subclass that sets ``algorithm``)."""
    _REGISTRY[cls.algorithm] = cls


def optimizer_class(name: str) -> type[RowSparseOptimizer]:
    """The optimizer class registered under ``name`` (``"sgd"``, ``"adagrad"``, ...)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise arg_error("optimizer", f"must be one of {tuple(sorted(_REGISTRY))}", name) from None


def optimizer_names() -> tuple[str, ...]:
    """Every registered optimizer name, in registration order (subclasses defined outside the package
    included; :data:`OPTIMIZER_NAMES` holds the package's own)."""
    return tuple(_REGISTRY)
