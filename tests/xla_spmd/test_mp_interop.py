"""Distributed checkpoints between a process group and torch_xla SPMD: a checkpoint saved by 4 gloo processes
(tte.distributed.shard; row- and table-wise tables, replicated ones, a DDP head) loads into an SPMD model on 4
devices (tte.checkpoint.load_distributed), and 5 more steps there equal one uninterrupted process (float64
<= 1e-10). The reverse (an SPMD-4 checkpoint into 3 gloo processes): tests/distributed/test_mp_from_spmd.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_xla")
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the process-group workers
import _mp_ckpt_worker as C  # noqa: E402
import _mp_worker as W  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from suite_helpers import free_port  # noqa: E402
from test_mp_shard import _close  # noqa: E402

SCRIPT = Path(__file__).with_name("_mp_interop_script.py")
ROOT = Path(__file__).parents[2]


def spmd(stage: str, folder: Path, devices: int = 4) -> str:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}
    env.pop("XLA_USE_SPMD", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(SCRIPT), stage, str(folder)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_process_group_checkpoint_into_spmd4(tmp_path: Path) -> None:
    mp.start_processes(C.save_worker, args=(4, free_port(), str(tmp_path)), nprocs=4, start_method="spawn")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "meta.pt", "rows-0.pt", "rows-1.pt", "rows-2.pt", "rows-3.pt", "tte_manifest.json"]
    assert spmd("load", tmp_path) == "ok 4"
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    ref = W.reference(W.CKPT, torch.float64)
    assert got["model"].keys() == ref["model"].keys()
    for k, v in ref["model"].items():
        _close(got["model"][k], v, 1e-10, k, torch.float64)
    assert got["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
    for key, slots in ref["optimizer"]["state"].items():
        assert got["optimizer"]["state"][key].keys() == slots.keys(), key
        for slot, v in slots.items():
            _close(got["optimizer"]["state"][key][slot], v, 1e-10, f"{key}/{slot}", torch.float64)
    assert got["optimizer"]["iterations"] == ref["optimizer"]["iterations"] == W.STEPS
