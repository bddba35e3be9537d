"""Values and utilities (private): argument checks, dtypes, nested feature structures, the optimizer-name
registry, input checks and forms, environment switches, host memory (malloc, huge pages), and files trusted
from disk only as checked through their descriptors (``private_files``: the kernel cache).

The bottom layer: it imports only torch (docs/design.md, "Layers").
"""
