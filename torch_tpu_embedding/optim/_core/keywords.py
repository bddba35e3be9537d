"""The constructor keywords every optimizer shares, written once: TF's ``_Optimizer`` arguments and the
Keras extras — how a constructor's arguments become the core's defaults and extras
(:func:`constructor_options`), and their documentation (:func:`fill_doc`; as torch.optim joins
its shared doc strings into each optimizer's ``__doc__``).

The constructors keep their explicit signatures (for users and IDEs) and hand them over whole::

    super().__init__(params, *constructor_options(type(self), locals()))
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch_tpu_embedding.optim._core.contract import common_defaults
from torch_tpu_embedding.optim._core.extras import EXTRA_NAMES

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.base import RowSparseOptimizer

__all__ = ["constructor_options", "fill_doc"]

#: the arguments of :func:`~.contract.common_defaults` (TF's ``_Optimizer`` arguments, ``lr`` first)
_COMMON = tuple(inspect.signature(common_defaults).parameters)
#: TF's defaults of the common arguments, for a constructor that does not take them all (Adafactor)
_TF_DEFAULTS: dict[str, Any] = dict.fromkeys(_COMMON[1:], None) | {"use_gradient_accumulation": True}
#: entries of a constructor's ``locals()`` that are not options (``__class__``: the cell of ``super()``)
_NOT_OPTIONS = frozenset({"self", "params", "extras", "__class__"})


def constructor_options(
    cls: type[RowSparseOptimizer], args: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(defaults, extras)`` for ``RowSparseOptimizer.__init__`` from an optimizer constructor's
    arguments ``args`` (its ``locals()``, taken first thing).

    The options are rewritten as a parameter group's are (``cls._options_to_hp``: Adafactor's
    ``weight_decay``); the Keras extras — named in the signature (Adafactor) or passed through
    ``**extras`` (checked by the core, which refuses unknown ones) — go to ``extras``; the defaults are
    TF's common arguments (:func:`~.contract.common_defaults`, those the constructor does not take at
    their TF defaults) followed by the optimizer's own, in signature order.
    """
    given = {k: v for k, v in args.items() if k not in _NOT_OPTIONS}
    cls._options_to_hp(given)
    extras = dict(args.get("extras") or {})
    extras.update({k: given.pop(k) for k in EXTRA_NAMES if k in given})
    defaults = common_defaults(**{**_TF_DEFAULTS, **{k: given.pop(k) for k in _COMMON if k in given}})
    defaults.update(given)
    return defaults, extras


#: TF's ``_Optimizer`` keyword arguments (every optimizer but Adafactor)
_tf_keywords_doc = r"""use_gradient_accumulation: True sums the per-row gradients of duplicate ids before the
            update (exact); False skips the dedup (identical for SGD).
        clip_weight_min, clip_weight_max: clamp updated rows after the update.
        weight_decay_factor, multiply_weight_decay_factor_by_learning_rate: decoupled decay
            ``w ← w − λ·w`` of the updated rows before the update (λ times lr if the flag is set).
        clipvalue: clip the summed gradient to ``(−c, c)`` or ``(min, max)``."""

#: TF's ``slot_variable_creation_fn`` (optimizers with slots)
_slot_creation_fn_doc = r"""slot_creation_fn: ``fn(param, slot_names, initial_values) -> {name: tensor}`` to create
            the slots yourself (TF's ``slot_variable_creation_fn``)."""

#: the Keras 3 base optimizer's options (:class:`~.extras.KerasExtras`), and ``skip_nonfinite``
_keras_extras_doc = r"""clipnorm, global_clipnorm, use_ema, ema_momentum, ema_overwrite_frequency,
        loss_scale_factor, gradient_accumulation_steps: the Keras extras (docs/optimizers.md; at most
            one of ``clipnorm``, ``clipvalue`` and ``global_clipnorm``).
        skip_nonfinite: drop the whole update of a call whose gradients hold NaN/inf
            (``skipped_steps`` counts them)."""

#: marker in a class docstring -> the shared block written there
_DOCS = {
    "{tf_keywords}": _tf_keywords_doc,
    "{slot_creation_fn}": _slot_creation_fn_doc,
    "{keras_extras}": _keras_extras_doc,
}


def fill_doc(doc: str | None) -> str | None:
    """``doc`` with each marker line (``{tf_keywords}``, ``{slot_creation_fn}``, ``{keras_extras}``)
    replaced by its shared block (called for every optimizer class as it is defined)."""
    if doc is None:  # python -OO
        return None
    for marker, block in _DOCS.items():
        doc = doc.replace(marker, block)
    return doc
