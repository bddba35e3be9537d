"""Row ownership and bucket capacity of the id exchange, under their first import path.

They are transport-neutral and live in :mod:`torch_tpu_embedding.routing` (the SPMD exchange and any
other transport share them); this module keeps ``torch_tpu_embedding.xla.ownership.default_capacity``
and the other names working (it serves every name of that module). It imports no torch_xla.

Example::

    >>> from torch_tpu_embedding.xla.ownership import default_capacity
    >>> default_capacity(576, 8)
    120
"""

# Every name of torch_tpu_embedding.routing, the same objects.
from torch_tpu_embedding._rows.routing import *  # noqa: F403
from torch_tpu_embedding._rows.routing import __all__ as __all__
