"""The Keras base-optimizer extras, available on every optimizer of the package.

``clipnorm``, ``global_clipnorm``, ``use_ema`` / ``ema_momentum`` / ``ema_overwrite_frequency``,
``loss_scale_factor`` and ``gradient_accumulation_steps`` behave as in Keras 3
(``keras/src/optimizers/base_optimizer.py`` in Keras 3), in Keras's order:

1. ``loss_scale_factor`` s: ``g ← g / s``.
2. ``gradient_accumulation_steps`` k: calls whose ``(iterations + 1) % k != 0`` only accumulate;
   the others update with the mean ``(g + acc) / k``. Optimizer step counters (bias correction,
   Adafactor's ``t``) advance once per update, i.e. they see ``iterations // k`` as in Keras.
3. clipping: ``clipnorm`` (per parameter), ``global_clipnorm`` (all parameters jointly) or
   ``clipvalue`` — at most one.
4. decoupled weight decay, 5. the optimizer's rule, then weight clipping.
``skip_nonfinite`` (ours, not Keras): when any gradient of the call (after accumulation and
clipping) holds a NaN or inf, no parameter or slot changes; ``optimizer.skipped_steps`` counts such
calls. It is a device-side mask, so it costs no sync and no recompilation on XLA.

6. EMA: ``avg ← μ'·avg + (1−μ')·w`` after every call (μ' = 0 while ``iterations // k == 0``; a window
   ``skip_nonfinite`` drops counts none of its calls: ema.py);
   every ``ema_overwrite_frequency`` calls ``w ← avg``; ``finalize_variable_values()`` copies
   the averages into the parameters.

Tables stay lazy and exact. A clip norm is the norm of the row-sparse gradient (duplicates summed),
which equals the norm of the densified gradient. A row's weight does not change between the steps
that touch it, so its average is caught up when it is next touched — after ``n`` idle calls
``avg = w + μⁿ (avg − w)`` — and the whole table only at an overwrite or ``finalize``.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

from torch_tpu_embedding._util.validation import arg_error, check_bool, check_int, check_number

__all__ = [
    "EXTRA_DEFAULTS",
    "EXTRA_NAMES",
    "KerasExtras",
    "check_extras",
    "clip_by_norm",
    "ema_catch_up",
    "global_norm_scale",
    "unbounded_pair",
]

Tensor = torch.Tensor


class KerasExtras(TypedDict, total=False):
    """Keyword arguments every optimizer accepts (the Keras 3 base optimizer's options)."""

    clipnorm: float | None
    global_clipnorm: float | None
    use_ema: bool
    ema_momentum: float
    ema_overwrite_frequency: int | None
    loss_scale_factor: float | None
    gradient_accumulation_steps: int | None
    skip_nonfinite: bool


EXTRA_DEFAULTS: dict[str, Any] = {
    "clipnorm": None,
    "global_clipnorm": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
    "skip_nonfinite": False,
}
EXTRA_NAMES = tuple(EXTRA_DEFAULTS)


def check_extras(hp: dict[str, Any], given: dict[str, Any]) -> None:
    """Validate the extras in ``given`` and store them (with defaults) in ``hp``."""
    unknown = sorted(set(given) - set(EXTRA_DEFAULTS))
    if unknown:
        raise TypeError(f"Unexpected keyword argument(s) {unknown}; the optimizer extras are {list(EXTRA_NAMES)}.")
    for name, default in EXTRA_DEFAULTS.items():
        hp[name] = given.get(name, default)
    for name in ("clipnorm", "global_clipnorm"):
        if hp[name] is not None:
            hp[name] = check_number(name, hp[name], minimum=0.0)
    set_clips = [n for n in ("clipnorm", "clipvalue", "global_clipnorm") if hp.get(n) and not unbounded_pair(hp[n])]
    if len(set_clips) > 1:
        raise ValueError(
            "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: "
            f"clipnorm={hp['clipnorm']}, clipvalue={hp.get('clipvalue')}, "
            f"global_clipnorm={hp['global_clipnorm']}"
        )
    check_bool("use_ema", hp["use_ema"])
    check_bool("skip_nonfinite", hp["skip_nonfinite"])
    hp["ema_momentum"] = check_number("ema_momentum", hp["ema_momentum"], minimum=0.0, maximum=1.0)
    if hp["ema_overwrite_frequency"] is not None:
        check_int("ema_overwrite_frequency", hp["ema_overwrite_frequency"], minimum=1)
        if not hp["use_ema"]:
            raise arg_error("ema_overwrite_frequency", "requires `use_ema=True`", hp["ema_overwrite_frequency"])
    if hp["loss_scale_factor"] is not None:
        hp["loss_scale_factor"] = check_number(
            "loss_scale_factor", hp["loss_scale_factor"], minimum=0.0, min_inclusive=False
        )
    k = hp["gradient_accumulation_steps"]
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 2):
        raise ValueError(
            f"`gradient_accumulation_steps` must be an integer >= 2. Received: gradient_accumulation_steps={k}"
        )
    if not hp.get("use_gradient_accumulation", True):
        for name in ("clipnorm", "global_clipnorm"):
            if hp[name]:
                raise ValueError(
                    f"`{name}` needs the per-row gradient summed over duplicate ids; it cannot be used "
                    f"with `use_gradient_accumulation=False`. Received: {name}={hp[name]}"
                )


def unbounded_pair(clipvalue: Any) -> bool:
    """Whether ``clipvalue`` is a ``(None, None)`` pair: TF sets no gradient limit for it (no clipping)."""
    return isinstance(clipvalue, (tuple, list)) and len(clipvalue) == 2 and all(v is None for v in clipvalue)


def clip_by_norm(g: Tensor, clipnorm: float) -> Tensor:
    """Keras ``clipnorm``: ``g · c / max(‖g‖₂, c)`` (padding rows are zero and do not count)."""
    norm = torch.linalg.vector_norm(g)
    return g * (clipnorm / torch.clamp(norm, min=clipnorm))


def global_norm_scale(sq_norm: Tensor, clipnorm: float) -> Tensor:
    """Keras ``clip_by_global_norm`` factor ``c · min(1/‖G‖, 1/c)``; NaN when ‖G‖ is inf or NaN."""
    norm = torch.sqrt(sq_norm)
    return clipnorm * torch.clamp(1.0 / norm, max=1.0 / clipnorm) + (norm - norm)


def ema_catch_up(avg: Tensor, w: Tensor, idle: Tensor, momentum: float | Tensor) -> Tensor:
    """Average after ``idle`` calls in which the weight stayed ``w``: ``w + μ^idle (avg − w)``.

    ``avg, w``: ``[U, ...]``; ``idle``: ``[U]`` integer counts.
    """
    factor = torch.pow(momentum, idle.to(w.dtype))
    return w + factor.reshape(-1, *([1] * (w.dim() - 1))) * (avg - w)
