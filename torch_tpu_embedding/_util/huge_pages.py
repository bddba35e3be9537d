"""Huge pages for large host tables: fewer TLB misses when a step touches rows all over a table.

An eager training step on the CPU reads and writes a few thousand rows scattered over tables of hundreds
of megabytes. With 4 KiB pages nearly every row is a TLB miss as well as a cache miss; with 2 MiB pages
(Linux transparent huge pages) one TLB entry covers 512 times the memory. Many distributions set
transparent huge pages to ``madvise``: a process gets them only for memory it marks with
``madvise(MADV_HUGEPAGE)``, and torch marks none unless ``THP_MEM_ALLOC_ENABLE=1`` is set.

:func:`advise` marks the 2 MiB-aligned interior of a new host tensor's memory, before its first write, so
the pages it faults in are huge; :func:`empty` allocates and advises. The library allocates so the tables
it makes (``table.host_empty``, the stacked groups) and the optimizers' slots, nothing else. Measured
(docs/benchmarks.md, 4 tables of 1,000,000 × 64 stacked, 1 id per bag, SGD, 1 thread): 4.12–4.23 →
3.51–3.71 ms a step. Values are unchanged; only the page size is.

``TTE_HUGE_PAGES=0`` turns it off. It does nothing off Linux, on other devices, for tensors under
:data:`MIN_BYTES`, and where the kernel's setting is ``never`` (the call then has no effect).

Example::

    >>> import torch
    >>> from torch_tpu_embedding._util.huge_pages import advise
    >>> t = torch.empty(64 << 20, dtype=torch.uint8)
    >>> advise(t) in (True, False)  # True where the kernel took the advice
    True
"""

from __future__ import annotations

import ctypes
import sys

import torch

from torch_tpu_embedding._util import heap
from torch_tpu_embedding._util.env import switched_on

__all__ = ["MIN_BYTES", "advise", "empty", "enabled"]

#: smaller tensors are left alone: their rows stay within the reach of the 4 KiB pages' TLB entries
#: (about 2,000 second-level entries, 8 MiB), and up to 2 MiB at each end cannot be a huge page
MIN_BYTES = 32 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14  # <linux/mman.h>
_ENABLED = switched_on("TTE_HUGE_PAGES")


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        # The process's own symbols, libc's among them (Python links it): no file is looked up or opened, and
        # no process started (ctypes.util.find_library runs ldconfig, else gcc or ld from the PATH).
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def enabled() -> bool:
    """Whether :func:`advise` marks memory (Linux, and ``TTE_HUGE_PAGES`` not ``0``)."""
    return _ENABLED and _MADVISE is not None


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under ``t``'s memory (a host tensor of at least :data:`MIN_BYTES`, best before its
    first write); ``True`` if the kernel took the advice. Never raises: a refusal leaves 4 KiB pages."""
    if not enabled() or torch.compiler.is_compiling() or t.device.type != "cpu" or t.is_meta:
        return False  # (a traced step has no memory to advise: a graph's buffers are its own)
    nbytes = t.untyped_storage().nbytes()
    if nbytes < MIN_BYTES:
        return False
    start = t.untyped_storage().data_ptr()
    lo = (start + _HUGE - 1) & ~(_HUGE - 1)
    hi = (start + nbytes) & ~(_HUGE - 1)
    assert _MADVISE is not None
    return hi > lo and _MADVISE(lo, hi - lo, _MADV_HUGEPAGE) == 0


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` (``None``: the default device), passed to
    :func:`advise` before anything writes it: a large host tensor's pages are huge from the first write on.
    The first large host tensor also primes glibc's malloc thresholds for the eager steps to come
    (:func:`~torch_tpu_embedding._util.heap.prime`)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    # (first: dynamo cannot trace untyped_storage().nbytes(), and a traced step has no memory of its own)
    if not torch.compiler.is_compiling() and out.device.type == "cpu" and out.untyped_storage().nbytes() >= MIN_BYTES:
        heap.prime()
    advise(out)
    return out
