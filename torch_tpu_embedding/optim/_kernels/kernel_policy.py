"""The kernel path's switch and policy: whether eager row updates take ``Path.KERNEL`` (and the C loops that run
where it would), from which optimizer call and for which tables, and the one warning when a kernel cannot be built.

``TTE_UPDATE_KERNEL=0`` in the environment, or :func:`set_enabled`, turns the path off. When the kernel is built
(:func:`set_policy`): compiling one costs seconds, paid where it is first used. So a table's update takes the
reference path while the optimizer's ``iterations`` (its call count, saved in its ``state_dict``) is below
``after`` (``TTE_KERNEL_AFTER``, default 50), and always where the table holds fewer than ``min_elements``
numbers (``TTE_KERNEL_MIN_ELEMENTS``, default 2**20: the saving per step is bounded by the numbers touched, so a
small table would take many steps to pay for one compile). Which path a step takes depends only on the call
count and the configuration, never on how long a compile took, so two runs with one seed are bitwise equal
(tests/optim/test_kernel_warmup.py); short runs, notebooks and test suites never compile. docs/benchmarks.md has
the measurements the defaults come from.

Where inductor has no C++ compiler (:func:`has_compiler`), or the process's first kernel fails to build
(:mod:`.row_update`), the path is not chosen again in this process (:func:`usable`), after one warning
(:func:`warn_once`, which :mod:`.c_library` also gives when the C library cannot be built).
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

import torch

from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.env import env_setting, switched_on

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.grad_intake import Work

__all__ = ["enabled", "give_up", "has_compiler", "policy", "set_enabled", "set_policy", "usable", "warming_up",
           "warn_once"]

Tensor = torch.Tensor

_ENABLED = switched_on("TTE_UPDATE_KERNEL")


def _env_count(name: str, default: int) -> int:
    name, value = env_setting(name)  # the variable read: the new name or the deprecated one
    text = (value or "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"environment variable {name} must be an int >= 0, got {text!r}")
    return int(text)


#: optimizer calls that take the reference path before the update kernel is built (see the module doc)
_AFTER = _env_count("TTE_KERNEL_AFTER", 50)
#: tables with fewer numbers than this always take the reference path
_MIN_ELEMENTS = _env_count("TTE_KERNEL_MIN_ELEMENTS", 2**20)
_WARNED = False
#: set when inductor found no C++ compiler: the kernel path is not chosen again in this process
_NO_COMPILER = False


class _NoCudaRuntimeLine(logging.Filter):
    """Drops torch's ``No CUDA runtime is found, using CUDA_HOME=...`` warning.

    ``torch.utils.cpp_extension`` logs it when imported on a machine with a CUDA toolkit but no CUDA
    device, and inductor imports it to build a CPU kernel: the only sign of an update-kernel compile was
    a line about CUDA, which this path does not use. Every other record of that logger passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


# Installed on import, before anything can import cpp_extension (it logs the line once, at import).
logging.getLogger("torch.utils.cpp_extension").addFilter(_NoCudaRuntimeLine())


def enabled() -> bool:
    """Whether eager row updates take the kernel path (``TTE_UPDATE_KERNEL``, :func:`set_enabled`)."""
    return _ENABLED


def set_enabled(on: bool) -> bool:
    """Turn the kernel path on or off for later steps; returns the previous setting."""
    global _ENABLED
    before, _ENABLED = _ENABLED, bool(on)
    return before


def policy() -> tuple[int, int]:
    """``(after, min_elements)``: the kernel path runs from the optimizer's call ``after`` on, for
    tables of at least ``min_elements`` numbers (``TTE_KERNEL_AFTER``, ``TTE_KERNEL_MIN_ELEMENTS``)."""
    return _AFTER, _MIN_ELEMENTS


def set_policy(after: int | None = None, min_elements: int | None = None) -> tuple[int, int]:
    """Set :func:`policy` for later steps (``None``: unchanged); returns the previous one.

    ``set_policy(0, 0)``: every eligible table takes the kernel path from its first step (and compiles
    there). A checkpoint resumed under the same policy takes the same paths (``iterations`` is saved).
    """
    global _AFTER, _MIN_ELEMENTS
    before = (_AFTER, _MIN_ELEMENTS)
    for name, value in (("after", after), ("min_elements", min_elements)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"set_policy: {name} must be an int >= 0, got {value!r}")
    _AFTER = before[0] if after is None else after
    _MIN_ELEMENTS = before[1] if min_elements is None else min_elements
    return before


def warming_up(item: Work) -> bool:
    """This step takes the reference path by :func:`policy` (the call count and the table's size alone)."""
    return item.clock.iterations < _AFTER or item.p.numel() < _MIN_ELEMENTS


def usable(p: Tensor) -> bool:
    """The kernel path may run for ``p``: an eager CPU / CUDA table with the path enabled, whose rows
    are slot rows (no interleaved row layout of the id exchange, :class:`~.slots.SlotRows`)."""
    if not _ENABLED or _NO_COMPILER or p.device.type not in ("cpu", "cuda"):
        return False
    if torch.compiler.is_compiling():
        # Inside the user's torch.compile the reference rule is traced into the user's graph (and
        # compiled with it); a compile of its own here would be a nested compile and split that graph.
        return False
    info = table_info(p)
    return info is None or info.layout is None


def give_up(why: str) -> None:
    """No kernel builds in this process (no compiler, or its first build failed: ``why``): every later step chooses
    the reference path (:func:`usable` is then False), after one warning."""
    global _NO_COMPILER
    _NO_COMPILER = True
    warn_once(why, stacklevel=3)  # (the warning names the line that gave up, as when it warned itself)


def has_compiler() -> bool:
    """Whether inductor has a C++ compiler; if not, warns once and every later step chooses the reference
    path (:func:`usable` is then False)."""
    missing = _missing_compiler()
    if missing is not None:
        give_up(missing)
    return missing is None


def _missing_compiler() -> str | None:
    """Why inductor has no C++ compiler to build a CPU kernel with (``None``: it has one)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch: the first compile tells
        return None
    try:
        get_cpp_compiler()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def warn_once(why: str, stacklevel: int = 2) -> None:
    """Warn, once per process, that a kernel could not be compiled or loaded (``why``) and the reference path
    runs; the warning names the line ``stacklevel - 1`` calls up (default: the caller's)."""
    global _WARNED
    if _WARNED:
        return
    _WARNED = True
    warnings.warn(
        "torch_tpu_embedding: a compiled kernel (the row update's, or the C library of SGD's add, the fused "
        f"row loops, the lookup's row gather and the id join) could not be compiled or loaded ({why}); eager "
        "updates (and the join of host ids bound for an accelerator) run the reference path (slower, same "
        "results). Set TTE_UPDATE_KERNEL=0 to skip the attempt.",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
