"""The library's on/off environment switches (``TTE_FUSED_UPDATE``, ``TTE_HEAP_PRIME``, ``TTE_HUGE_PAGES``,
``TTE_KERNEL_CACHE``): one rule for which values turn a feature off.

Example::

    >>> from torch_tpu_embedding._util.env import is_off
    >>> is_off(" Off "), is_off("1"), is_off("")
    (True, False, False)
"""

from __future__ import annotations

import os

__all__ = ["OFF", "is_off", "switched_on"]

#: the values (after stripping and lower-casing) that turn a switch off
OFF = ("0", "false", "off", "no")


def is_off(value: str) -> bool:
    """Whether ``value`` turns a switch off (one of :data:`OFF`, any case, surrounding spaces ignored)."""
    return value.strip().lower() in OFF


def switched_on(name: str) -> bool:
    """The switch ``name`` of the environment: on unless set to one of :data:`OFF`."""
    return not is_off(os.environ.get(name, "1"))
