"""glibc's adaptive malloc thresholds primed once (``heap.py``): a step's freed temporaries stay in the heap.

Each case runs in a new process (malloc's state is per process), and reads where glibc put a block from
the kernel's map of the process: in the heap, or mapped on its own. Whether a step's temporaries are
handed back and faulted in again also depends on how its small blocks lie (docs/benchmarks.md measures
that); the thresholds that decide it are what is checked here. The library primes when it allocates
its first large host table, not before, nor where ``TTE_HEAP_PRIME=0``.
"""

from __future__ import annotations

import doctest
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from torch_tpu_embedding._util import heap

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                           reason="glibc's malloc (Linux)")
REPO = Path(__file__).resolve().parents[2]

STEP = """
import torch
from torch_tpu_embedding._util import heap
{setup}

def heap_top():  # the end of the heap (the program break), from the kernel's map of the process
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            return int(line.split("-")[1].split()[0], 16)
    return 0

# An eager step's temporaries: 16 MiB of them, freed at its end.
x = torch.empty(16 << 20, dtype=torch.uint8)
in_heap = x.data_ptr() < heap_top()  # else glibc mapped it (mmap): unmapped when freed, faulted in anew
top = heap_top()
del x
print(in_heap, heap_top() == top, heap._DONE)  # kept: the heap's free top was not handed back
"""


def _run(setup: str, **env: str) -> tuple[bool, bool, bool]:
    """(in the heap, kept after the free, primed) in a new process."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
             and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", STEP.format(setup=setup)], env={**clean, **env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    in_heap, kept, primed = (w == "True" for w in out)
    return in_heap, kept, primed


@glibc
def test_primed_temporaries_stay_in_the_heap() -> None:
    """A new process maps a 16 MiB block and unmaps it when freed (glibc's mmap threshold starts at
    128 KiB); primed, the block comes from the heap and the heap keeps it when it is freed."""
    assert _run("") == (False, True, False)
    assert _run("assert heap.prime() and not heap.prime()  # once") == (True, True, True)


@glibc
@pytest.mark.parametrize("env", ["1", "0"])
def test_the_first_large_host_table_primes(env: str) -> None:
    """Building a model with a table of 32 MiB primes; tables under that, or ``TTE_HEAP_PRIME=0``, do not."""
    setup = ("import torch_tpu_embedding as tte\n"
             "small = tte.EmbeddingCollection({'f': tte.FeatureConfig(tte.TableConfig(1000, 8, name='s'))})\n"
             "assert not heap._DONE\n"
             "big = tte.EmbeddingCollection({'f': tte.FeatureConfig(tte.TableConfig(140000, 64, name='t'))})")
    in_heap, _, primed = _run(setup, TTE_HEAP_PRIME=env)
    assert in_heap is primed is (env == "1")


def test_off_where_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_ENABLED", False)
    monkeypatch.setattr(heap, "_DONE", False)
    assert not heap.enabled() and not heap.prime()


def test_the_docstring_example_runs() -> None:
    result = doctest.testmod(heap)
    assert result.attempted >= 2 and result.failed == 0
