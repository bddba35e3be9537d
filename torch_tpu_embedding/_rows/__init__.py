"""Row bookkeeping (private): rows, not tensors of a device.

Row gradients and the table registry (``grads``), dedup and the padding sentinel (``dedup``), the routing
plan of the id exchange (``routing``), a table's stored row order (``row_order``), a stacked group's state
per table (``stacked_state``), and the interfaces the backends implement (``placement``: a table's
placement, a device type's backend, data parallel's row-gradient sync) — so that nothing in this layer or
above it, up to the public face, imports a backend.
"""
