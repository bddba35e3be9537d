"""Values and utilities (private): argument checks, dtypes, nested feature structures, the optimizer-name
registry, input checks and forms, environment switches, and host memory (malloc, huge pages).

The bottom layer: it imports only torch (docs/design.md, "Layers").
"""
