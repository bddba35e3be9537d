"""glibc's malloc keeps an eager step's freed temporaries instead of unmapping them each step.

An eager training step on the CPU allocates batch-sized temporaries (activations, their gradient, the
caller's ``torch.cat`` of the features: 4 MiB each at 4,096 bags of 4 × 64 floats) and frees them all
at its end. glibc serves blocks under its *mmap threshold* from the heap and gives the heap's free top
back to the OS once it exceeds the *trim threshold*; both start low (128 KiB, 256 KiB) and adapt:
freeing a block that came from ``mmap`` raises the mmap threshold to its size and the trim threshold
to twice that. After a step frees its first 4 MiB block the trim threshold is about 8 MiB — and a step
whose temporaries add up to a little more hands them back every time and faults them in again the next
step, or not, depending on how the few small blocks of the step happen to lie (SGD at 1 id per bag
through the per-feature dict: 756–2,016 page faults a step and 5.4–6.8 ms in such runs, 4.3–4.5 ms
in the others; docs/benchmarks.md).

:func:`prime` allocates and frees one block of :data:`PRIME_BYTES` (just under glibc's largest
adaptive threshold, 32 MiB on 64-bit), as a program that once freed a 31 MiB tensor has done: glibc's
own adaptation then sets the mmap threshold to 31 MiB and the trim threshold to 62 MiB, so a step's
temporaries stay in the heap and the freed top is kept for the next step (at most 62 MiB). It touches
no page (the block is mapped and unmapped unwritten), and changes nothing where the thresholds are
already higher or fixed (``GLIBC_TUNABLES``, ``MALLOC_*_THRESHOLD_`` or ``mallopt``: glibc stops adapting),
nor under another allocator (jemalloc, tcmalloc). The library calls it once, when it allocates its first
large host table (:func:`~torch_tpu_embedding._util.huge_pages.empty`). ``TTE_HEAP_PRIME=0`` turns it off.

Example::

    >>> from torch_tpu_embedding._util import heap
    >>> heap.prime() in (True, False)  # False after the first call, off Linux/glibc, or turned off
    True
"""

from __future__ import annotations

import platform
import sys

import torch

from torch_tpu_embedding._util.env import switched_on

__all__ = ["PRIME_BYTES", "enabled", "prime"]

#: under glibc's DEFAULT_MMAP_THRESHOLD_MAX (4 MiB · sizeof(long)), chunk header and alignment included:
#: a freed mapped block larger than that leaves the thresholds as they were
PRIME_BYTES = 31 << 20
_ENABLED = switched_on("TTE_HEAP_PRIME")
_DONE = False


def enabled() -> bool:
    """Whether :func:`prime` acts: Linux with glibc, and ``TTE_HEAP_PRIME`` not ``0``."""
    return _ENABLED and sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def prime() -> bool:
    """Raise glibc's adaptive malloc thresholds once per process (see the module's text); ``True`` if this
    call allocated and freed the block."""
    global _DONE
    if _DONE or not enabled() or torch.compiler.is_compiling():
        return False
    _DONE = True
    block = torch.empty(PRIME_BYTES, dtype=torch.uint8)  # mapped by malloc, never written
    del block
    return True
