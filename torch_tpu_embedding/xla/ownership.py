"""Row ownership and bucket capacity of the id exchange, under their first import path.

They are transport-neutral and live in :mod:`torch_tpu_embedding.routing` (the SPMD exchange and any
other transport share them); this module keeps ``torch_tpu_embedding.xla.ownership.default_capacity``
and the other names working. It imports no torch_xla.

Example::

    >>> from torch_tpu_embedding.xla.ownership import default_capacity
    >>> default_capacity(576, 8)
    120
"""

from torch_tpu_embedding.routing import (
    SCHEMES,
    RowOwnership,
    capacity_for_load,
    default_capacity,
    slot_from_table_order,
    slot_row,
    slot_rows,
    slot_table_order,
)

__all__ = [
    "SCHEMES",
    "RowOwnership",
    "capacity_for_load",
    "default_capacity",
    "slot_from_table_order",
    "slot_row",
    "slot_rows",
    "slot_table_order",
]
