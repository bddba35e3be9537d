"""The library's on/off environment switches (``TTE_UPDATE_KERNEL``, ``TTE_HEAP_PRIME``, ``TTE_HUGE_PAGES``,
``TTE_KERNEL_CACHE``): one rule for which values turn a feature off; and the settings' deprecated names
(:data:`RENAMED`), still read where the new name is not set.

Example::

    >>> from torch_tpu_embedding._util.env import is_off
    >>> is_off(" Off "), is_off("1"), is_off("")
    (True, False, False)
"""

from __future__ import annotations

import os

__all__ = ["OFF", "RENAMED", "env_setting", "is_off", "switched_on"]

#: the values (after stripping and lower-casing) that turn a switch off
OFF = ("0", "false", "off", "no")

#: settings renamed: new name → its deprecated name, read when the new one is not set (the new one wins)
RENAMED = {
    "TTE_UPDATE_KERNEL": "TTE_FUSED_UPDATE",
    "TTE_KERNEL_AFTER": "TTE_FUSED_AFTER",
    "TTE_KERNEL_MIN_ELEMENTS": "TTE_FUSED_MIN_ELEMENTS",
}


def env_setting(name: str) -> tuple[str, str | None]:
    """``(the variable read, its value)``: ``name``, else its deprecated name (:data:`RENAMED`) when only
    that is set; the value ``None`` when neither is."""
    old = RENAMED.get(name)
    if name not in os.environ and old is not None and old in os.environ:
        return old, os.environ[old]
    return name, os.environ.get(name)


def is_off(value: str) -> bool:
    """Whether ``value`` turns a switch off (one of :data:`OFF`, any case, surrounding spaces ignored)."""
    return value.strip().lower() in OFF


def switched_on(name: str) -> bool:
    """The switch ``name`` of the environment (or its deprecated name): on unless set to one of :data:`OFF`."""
    value = env_setting(name)[1]
    return value is None or not is_off(value)
