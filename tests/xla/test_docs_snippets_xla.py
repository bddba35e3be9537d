"""The ```python blocks of README.md and docs/*.md marked ``<!-- xla -->`` run on one XLA device.

Each file is run in a fresh process (``PJRT_DEVICE=CPU``, one device, no SPMD) by the docs harness
(``tests/docs/test_docs_snippets.py``): its unmarked blocks and its xla blocks, in order, in one namespace.
The CPU docs test skips these blocks and checks that this test covers every file holding one.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
HARNESS = ROOT / "tests" / "docs" / "test_docs_snippets.py"
_spec = importlib.util.spec_from_file_location("docs_snippets_harness", HARNESS)
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness  # dataclasses look their module up while the class is built
_spec.loader.exec_module(harness)

MARKER = "xla"
FILES = harness.marked_files(MARKER)

pytest.importorskip("torch_xla")


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_xla_blocks_run(path: Path, tmp_path: Path) -> None:
    harness.run_marked_file(path, MARKER, tmp_path)
