"""Checkpoint interchange: {CPU, XLA-1, SPMD-4 row, SPMD-4 column} × {same, other} save/load, then 5 more
steps, vs the uninterrupted run — for LazyAdam, FTRL and Adafactor, float32 and float64, optimizer state
included. Same layout: bitwise. Across layouts: float64 1e-6 relative, float32 1e-5.

Device count and SPMD mode are fixed per process: one process for the CPU and XLA-1 layouts and one for the
two SPMD-4 layouts save, then two such processes resume from every checkpoint (_ckpt_script.py).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from optim_registry import CKPT_MATRIX, ids

pytest.importorskip("torch_xla")
SCRIPT = Path(__file__).with_name("_ckpt_script.py")
ROOT = Path(__file__).parents[2]
LAYOUTS = ["cpu", "xla1", "row4", "col4"]
PROCESSES = [["cpu", "xla1"], ["row4", "col4"]]  # one torch_xla start-up (~7 s) per device count and mode
OPTS = ids(CKPT_MATRIX)  # lazy_adam, ftrl, adafactor (tests/optim_registry.py)


def worker(layouts: list[str], phase: str, folder: Path) -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    env.pop("XLA_USE_SPMD", None)
    env.pop("CPU_NUM_DEVICES", None)
    if layouts == ["row4", "col4"]:
        env["CPU_NUM_DEVICES"] = "4"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(SCRIPT), ",".join(layouts), phase, str(folder)], env=env,
                         capture_output=True, text=True, timeout=1200)  # two layouts a process
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt")
    for phase in ("save", "resume"):
        for layouts in PROCESSES:
            worker(layouts, phase, folder)
    return folder


def flat(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in state["model"].items()}
    out.update({f"opt/{k}/{s}": t for k, slots in state["optimizer"].items() for s, t in slots.items()})
    return out


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("source, target", list(itertools.product(LAYOUTS, LAYOUTS)))
def test_resume_anywhere_equals_uninterrupted(matrix: Path, source: str, target: str, opt: str, dtype: str) -> None:
    tag = f"{opt}.{dtype}"
    want = flat(torch.load(matrix / f"final-{source}-{tag}.pt", weights_only=True))
    got = flat(torch.load(matrix / f"resumed-{source}-{target}-{tag}.pt", weights_only=True))
    assert set(got) == set(want)
    assert got["model/ec.tables.big.weight"].shape == (1001, 8)  # logical rows only
    for k in want:
        assert got[k].shape == want[k].shape, k
        if source == target:
            assert torch.equal(got[k], want[k]), k  # same device and layout: bitwise
        elif dtype == "float64":
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-9, msg=k)
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
