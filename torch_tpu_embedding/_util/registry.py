"""The optimizer-name registry: which optimizer class a name (``"adam"``, ``"ftrl"``, ...) stands for.

It sits at the bottom of the package, beside the configs, because two layers need it: a
:class:`~torch_tpu_embedding.TableConfig` checks its ``optimizer`` string against
:data:`OPTIMIZER_NAMES`, and the optimizer core resolves each parameter group's ``algorithm`` to its
rule class once, when the group is added or loaded (:func:`resolve_rule`); the core's call sites read that
resolution (:func:`rule_of`). Each optimizer class enters itself when it is defined
(``RowSparseOptimizer.__init_subclass__``), so this module imports nothing of the package at run time.

Example::

    >>> from torch_tpu_embedding._util.registry import optimizer_class
    >>> optimizer_class("adagrad").__name__
    'Adagrad'
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from torch_tpu_embedding._util.validation import arg_error

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.base import RowSparseOptimizer

__all__ = ["OPTIMIZER_NAMES", "RULE_KEY", "optimizer_class", "optimizer_names", "register", "resolve_rule", "rule_of"]

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


#: the parameter-group key holding the group's resolved rule class (:func:`resolve_rule`). A class is callable,
#: so ``state_dict`` does not save it (it saves no callables); loading a state dict resolves again.
RULE_KEY = "_rule"


def resolve_rule(group: MutableMapping[str, Any]) -> type[RowSparseOptimizer]:
    """Resolve ``group["algorithm"]`` to its optimizer class and keep it in the group (under
    :data:`RULE_KEY`), replacing any earlier resolution: called when a group is added or loaded."""
    cls = group[RULE_KEY] = optimizer_class(group["algorithm"])
    return cls


def rule_of(group: Mapping[str, Any]) -> type[RowSparseOptimizer]:
    """The optimizer class whose rule ``group`` runs: its resolution by :func:`resolve_rule`. A group
    that was never resolved (a dict built outside an optimizer) is resolved by name here."""
    cls = group.get(RULE_KEY)
    if cls is not None:
        return cls  # type: ignore[no-any-return]
    return optimizer_class(group["algorithm"])
