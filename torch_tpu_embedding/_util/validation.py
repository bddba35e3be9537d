"""Argument checks that raise errors in the house format.

Every message names the argument, states the rule and prints the received value:
``Argument `lr` must be >= 0. Received: -1``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

#: The smallest normal float32. XLA devices flush a smaller (subnormal) float32 number to 0 (the TPU, and XLA's CPU
#: client: measured), and float32 storage rounds one below 1.4e-45 to 0.
FLOAT32_NORMAL_MIN = float(torch.finfo(torch.float32).tiny)

__all__ = [
    "FLOAT32_NORMAL_MIN",
    "arg_error",
    "check_bool",
    "check_device",
    "check_float32_normal",
    "check_not_meta",
    "check_int",
    "check_number",
    "check_one_of",
]


def arg_error(name: str, rule: str, received: Any) -> ValueError:
    """Return (not raise) the standard ``ValueError`` for argument ``name``."""
    return ValueError(f"Argument `{name}` {rule}. Received: {received!r}")


def check_int(name: str, value: Any, *, minimum: int | None = None) -> int:
    """``value`` must be a Python int (not bool) and ``>= minimum``."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or (minimum is not None and value < minimum):
        rule = "must be an int" + (f" and must be >= {minimum}" if minimum is not None else "")
        raise arg_error(name, rule, value)
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise arg_error(name, "must be a boolean", value)
    return value


def check_device(name: str, value: Any) -> torch.device | None:
    """``value`` must be ``None``, a ``str`` or a ``torch.device`` naming a device torch knows; returns it as a
    ``torch.device`` (``None`` as is). torch's own error (``Invalid device string``, or a CUDA index for an int)
    names neither the argument nor the rule."""
    if value is None:
        return None
    if not isinstance(value, (str, torch.device)):
        raise arg_error(name, "must be None, a str or a torch.device", value)
    try:
        return torch.device(value)
    except RuntimeError as e:
        raise arg_error(name, f"must name a device torch knows ({e})", value) from None


def check_not_meta(table: str, feature: str, weight: torch.Tensor, ids_device: str) -> None:
    """A table on the meta device holds no values: a forward call would return meta tensors that fail far
    from here, or train nothing (ids on the meta device too fail deep in the bucketing)."""
    if weight.is_meta:
        raise RuntimeError(
            f"Table `{table}` is on the meta device (built with device='meta' or under torch.device('meta')) and "
            "holds no values yet: before a forward call, lay it out with tte.distributed.shard(model) (each rank "
            "draws its rows) or materialize it with model.to_empty(device=...) (drawn whole, as one process "
            f"draws it). Received: feature `{feature}`'s ids on {ids_device}"
        )


def check_number(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
) -> float:
    """``value`` must be a finite real number within the given bounds (numpy scalars included)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value >= minimum if min_inclusive else value > minimum
    if ok and maximum is not None:
        ok = value <= maximum if max_inclusive else value < maximum
    if not ok:
        parts = []
        if minimum is not None:
            parts.append(f"{'>=' if min_inclusive else '>'} {minimum}")
        if maximum is not None:
            parts.append(f"{'<=' if max_inclusive else '<'} {maximum}")
        rule = "must be a finite number" + (" and " + " and ".join(parts) if parts else "")
        raise arg_error(name, rule, value)
    return float(value)


def check_one_of(name: str, value: Any, allowed: tuple[Any, ...]) -> Any:
    if value not in allowed:
        raise arg_error(name, f"must be one of {allowed}", value)
    return value


def check_float32_normal(name: str, value: float, rule: str, *, squared: bool = False) -> None:
    """A positive hyper-parameter that an update divides by where a gradient is 0 (an epsilon, an initial
    accumulator; ``squared``: one the update squares first) must be at least the smallest normal float32: a smaller
    one is 0 on an XLA device, and such a coordinate is then updated by 0/0 = NaN. ``rule`` begins the message."""
    floor = math.sqrt(FLOAT32_NORMAL_MIN) if squared else FLOAT32_NORMAL_MIN
    v32 = torch.tensor(value, dtype=torch.float32)  # (as the update holds it: a float32 number, squared in float32)
    if not float(v32 * v32 if squared else v32) >= FLOAT32_NORMAL_MIN:
        what = "the square root of the smallest normal float32 (an XLA device flushes a smaller square" if squared \
            else "the smallest normal float32 (an XLA device flushes a smaller one"
        raise arg_error(name, f"{rule} >= {floor:.8g}, {what} to 0, and a coordinate whose gradient is 0 would then be "
                        "updated by 0/0 = NaN)", value)
