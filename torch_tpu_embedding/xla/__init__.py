"""XLA-only helpers (torch_xla imported lazily, on first use of this package).

Nothing outside this package imports torch_xla, so ``import torch_tpu_embedding`` works without it.
"""

from __future__ import annotations

__all__: list[str] = []
