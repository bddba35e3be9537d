"""Large host tables and their optimizer slots on huge pages (``huge_pages.py``), and nothing else changes.

The advice is checked where the kernel records it: the ``hg`` flag of the memory mapping in
``/proc/self/smaps`` (Linux). Values are the same with and without it, bitwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding._util import huge_pages

SMAPS = Path("/proc/self/smaps")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_thp = pytest.mark.skipif(
    not SMAPS.exists() or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not set to never")
ROWS = (huge_pages.MIN_BYTES // (64 * 4)) + 4096  # just over MIN_BYTES at 64 float32 columns


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding the middle of ``t``'s memory carries the ``hg`` (MADV_HUGEPAGE) flag."""
    addr = t.untyped_storage().data_ptr() + t.untyped_storage().nbytes() // 2
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@linux_thp
def test_large_tables_and_slots_are_advised_small_ones_not() -> None:
    big = tte.TableConfig(ROWS, 64, name="big")
    big2 = tte.TableConfig(ROWS, 64, name="big2")  # stacked with big: the group's weight is advised
    small = tte.TableConfig(1000, 64, name="small", combiner="sum")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(big), "b": tte.FeatureConfig(big2),
                                  "c": tte.FeatureConfig(small)}, stack_tables=False)
    assert advised(ec.tables.big.weight) and advised(ec.tables.big2.weight)
    assert not huge_pages.advise(ec.tables.small.weight)  # under MIN_BYTES: left alone
    stacked = tte.EmbeddingCollection({"a": tte.FeatureConfig(big), "b": tte.FeatureConfig(big2)})
    (weight,) = [p for p in stacked.parameters() if p.numel() >= 2 * ROWS * 64]
    assert advised(weight)
    opt = tte.optim.LazyAdam(ec.parameters(), lr=0.1)
    opt.init_state()
    state = opt.state[ec.tables.big.weight]
    assert advised(state["momenta"]) and advised(state["velocities"])


@linux_thp
def test_turned_off_nothing_is_advised_and_the_values_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(3)
        ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(ROWS, 64, name="t"))})
        opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
        out = ec({"a": torch.tensor([1, 5, 5, ROWS - 1])})["a"]
        out.square().sum().backward()
        opt.step()
        return ec.tables.t.weight.detach(), opt.state[ec.tables.t.weight]["accumulators"]

    on = build()
    assert advised(on[0]) and advised(on[1])
    monkeypatch.setattr(huge_pages, "_ENABLED", False)
    assert not huge_pages.enabled()
    off = build()
    assert not advised(off[0]) and not advised(off[1])
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])


def test_the_environment_variable_turns_it_off() -> None:
    code = "from torch_tpu_embedding._util import huge_pages as h; print(h.enabled())"
    env = dict(os.environ, TTE_HUGE_PAGES="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_advice_off_the_host_or_on_meta() -> None:
    assert not huge_pages.advise(torch.empty(huge_pages.MIN_BYTES, dtype=torch.uint8, device="meta"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise: Linux")
def test_madvise_comes_from_the_process_itself_no_file_looked_up_no_process_started() -> None:
    """libc's ``madvise`` is taken from the symbols already loaded: ``ctypes.util.find_library`` (which runs
    ldconfig, else gcc or ld from the PATH, at import) is not called, and nothing is started."""
    code = ("import subprocess, ctypes.util, torch\n"
            "calls = []\n"
            "ctypes.util.find_library = lambda *a: calls.append(('find_library', a))\n"
            "real = subprocess.Popen.__init__\n"
            "def spawn(self, *a, **k):\n"
            "    calls.append(('Popen', a[:1]))\n"
            "    real(self, *a, **k)\n"
            "subprocess.Popen.__init__ = spawn\n"
            "from torch_tpu_embedding._util import huge_pages as h\n"
            "print(calls, h._MADVISE is not None)\n")
    env = dict(os.environ, TTE_HUGE_PAGES="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] True", out.stdout
