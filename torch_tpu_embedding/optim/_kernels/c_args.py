"""What the kernel library's C loops (:mod:`.c_add`, :mod:`.c_rules`, :mod:`.c_gather`) may be handed: tensors
whose values are the memory at their ``data_ptr()``. A loop reads and writes through the pointers it is given and
trusts them; its Python caller checks every tensor first.

Example::

    >>> import torch
    >>> in_memory(torch.ones(2)), in_memory(torch._efficientzerotensor(2))
    (True, False)
"""

from __future__ import annotations

import torch

__all__ = ["in_memory"]


def in_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s values are the memory at its ``data_ptr()``, as a C loop reads them: a strided CPU tensor,
    not a zero tensor (``torch._efficientzerotensor``: no memory, its pointer null) nor a negated or conjugated
    view (its memory holds the values before the sign), and aligned to its element type (``torch.frombuffer`` at an
    odd offset makes tensors torch reads as any other; a C loop's typed loads of them are undefined)."""
    return (t.is_cpu and t.layout == torch.strided and not t._is_zerotensor() and not t.is_neg()
            and not t.is_conj() and t.data_ptr() % t.element_size() == 0)
