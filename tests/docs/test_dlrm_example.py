"""examples/dlrm_synthetic.py in eager CPU mode (no torch_xla): it learns, and its checkpoint loads."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import torch_tpu_embedding as tte

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "dlrm_synthetic.py"
SHORT = ["--device", "cpu", "--tables", "8", "--vocab", "20000,600", "--multi-hot", "2", "--batch", "256",
         "--steps", "100", "--log-every", "10"]


def run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLE), *SHORT, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def example() -> Any:
    """The example script as a module (its model and optimizers, built as it builds them)."""
    spec = importlib.util.spec_from_file_location("dlrm_synthetic", EXAMPLE)
    assert spec is not None and spec.loader is not None
    dlrm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dlrm)
    return dlrm


def losses(out: str) -> tuple[float, float]:
    first, last = re.search(r"loss first ([\d.]+) last ([\d.]+)", out).groups()  # type: ignore[union-attr]
    return float(first), float(last)


def test_dlrm_cpu_learns_and_checkpoint_loads(tmp_path: Path) -> None:
    ckpt = tmp_path / "dlrm.pt"
    out = run("--save", str(ckpt))
    assert "device=cpu devices=1" in out and "compiled graphs" not in out, out
    first, last = losses(out)
    assert last < first - 0.03, out

    dlrm = example()
    args = dlrm.parse_args(SHORT)
    model = dlrm.build_model(args, torch.device("cpu"))
    opt = dlrm.build_optimizers(model, args)[0]
    before = model.embeddings.tables.t0.weight.detach().clone()
    assert tte.checkpoint.load(ckpt, model=model, optimizer=opt) is None
    changed = (model.embeddings.tables.t0.weight.detach() != before).any(1)
    assert 0 < int(changed.sum()) < 20000  # lazy updates: only the rows the batches touched


def test_dlrm_cpu_per_table_optimizer_and_torch_dense_optimizer() -> None:
    out = run("--optimizer", "ftrl", "--dense-optimizer", "torch-adam")
    assert "optimizer=ftrl(lr=5.0) dense_optimizer=torch-adam" in out, out
    first, last = losses(out)
    assert last < first - 0.03, out


def test_dlrm_directory_checkpoint_holds_the_dense_optimizer(tmp_path: Path) -> None:
    """``--save <dir>``: save_distributed with the torch dense optimizer's state as its ``extra`` (published with
    the tables), which load_distributed returns and a torch optimizer loads."""
    ckpt = tmp_path / "dlrm"
    run("--dense-optimizer", "torch-adam", "--save", str(ckpt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dlrm"]  # nothing beside the directory
    dlrm = example()
    args = dlrm.parse_args([*SHORT, "--dense-optimizer", "torch-adam"])
    model = dlrm.build_model(args, torch.device("cpu"))
    opt, dense = dlrm.build_optimizers(model, args)
    extra = tte.checkpoint.load_distributed(ckpt, model=model, optimizer=opt)
    assert extra is not None and isinstance(dense, torch.optim.Adam)
    dense.load_state_dict(extra["dense_optimizer"])
    assert dense.state and all(int(s["step"]) > 0 for s in dense.state.values())
