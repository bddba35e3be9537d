"""Row ownership, bucket capacity and the routing plan of the id exchange, under their public path.

They live in :mod:`torch_tpu_embedding._rows.routing` (row bookkeeping, shared by the SPMD exchange and the
process-group one); this module serves every name of that module, the same objects.

Example::

    >>> from torch_tpu_embedding.routing import default_capacity
    >>> default_capacity(576, 8)
    120
"""

from torch_tpu_embedding._rows.routing import *  # noqa: F403
from torch_tpu_embedding._rows.routing import __all__ as __all__
