"""Puts tests/ on sys.path, so the suites in tests/xla and tests/xla_spmd (run as their own pytest
processes) import the optimizer registry (tests/optim_registry.py) like the CPU suite does."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
