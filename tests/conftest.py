"""Puts tests/ and its folders of CPU tests on sys.path, so that test modules in one folder import the
helpers (tests/optim_registry.py, the process-group workers) and each other's names, and the suites in
tests/xla and tests/xla_spmd (run as their own pytest processes) import them like the CPU suite does.

Eager row updates run the reference path (``Path.ROW_CHUNKS``) unless ``TTE_UPDATE_KERNEL`` is set:
the kernel path compiles one kernel per optimizer configuration (seconds each), and the suite builds
hundreds of configurations. tests/optim/test_kernel_update.py turns it on and checks it against the
reference path for every optimizer and option; ``TTE_UPDATE_KERNEL=1 bash scripts/test.sh`` runs the
whole suite on it. MKL runs its CPU-independent code path (``MKL_CBWR=COMPATIBLE``, below).
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TTE_UPDATE_KERNEL", "0")
# MKL chooses its kernels by CPU: on Intel CPUs with AVX-512 its sparse product (the kernel path's sum of
# duplicate ids) adds a row's terms in another order than index_add_ (up to 1.4e-6 on sums of order 1 in
# float32), and tests/optim/test_kernel_update.py compares the two paths exactly. The compatible code path
# computes the same on every CPU. Read when torch first calls MKL, so it is set before any test runs.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
# SGD's C add (optim/_kernels/c_library.py) keeps its compiled library for later processes; the suite's go to a
# directory of its own, removed at exit, not to ~/.cache.
if "TTE_KERNEL_CACHE" not in os.environ:
    os.environ["TTE_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="tte_kernels_")
    atexit.register(shutil.rmtree, os.environ["TTE_KERNEL_CACHE"], True)

import pytest  # noqa: E402  (after the environment above: torch reads it)
import torch  # noqa: E402

# tests/ (the helpers: optim_registry.py, keras_reference.py, the process-group workers, ...) and every folder of
# CPU tests (tests/optim, tests/distributed, ...: test modules import each other across folders, e.g.
# ``from test_stacked_groups import ...``), in front of sys.path. Test module names are unique across these
# folders (there is no __init__.py: pytest imports each by its basename). tests/xla and tests/xla_spmd run as
# their own pytest processes and put their own folder first when they import from it.
_TESTS = Path(__file__).parent
_NOT_ON_PATH = {"data", "xla", "xla_spmd", "__pycache__"}
_FOLDERS = [str(_TESTS)] + sorted(str(d) for d in _TESTS.iterdir() if d.is_dir() and d.name not in _NOT_ON_PATH)
for _i, _folder in enumerate(_FOLDERS):
    if _folder not in sys.path:
        sys.path.insert(_i, _folder)


@pytest.fixture(scope="session")
def compiler() -> None:
    """Skips a test that needs compiled kernels where torch.compile cannot build one for the CPU (no
    C++ compiler, no Python headers): the kernel paths then fall back, as their tests show."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(3))
    except Exception as e:
        pytest.skip(f"torch.compile cannot build a CPU kernel here: {type(e).__name__}: {str(e)[:200]}")
