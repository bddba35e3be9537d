"""examples/tpu_train.py runs as documented on 4 virtual devices: one compiled graph, no host fallback, the
row-sharded table through the id exchange."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_xla")
ROOT = Path(__file__).parents[2]


def test_tpu_example_single_process_spmd(tmp_path: Path) -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_USE_SPMD", None)  # set by use_spmd() in this process; the child calls use_spmd() itself
    ckpt = tmp_path / "ckpt.pt"
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "tpu_train.py"), "--steps", "12",
                          "--users", "10001", "--optimizer", "adafactor", "--save", str(ckpt)],
                         env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    assert "devices=4" in out and "'user': 'row'" in out and "'item': 'column'" in out
    assert re.search(r"compiled graphs: 1; host fallbacks: \[\]", out), out
    # The row-sharded user table (and only it) trains through the id exchange: routed, no id dropped.
    m = re.search(r"^id exchange, largest per-shard load / capacity: user: (\d+) / (\d+)$", out, re.M)
    assert m and 0 < int(m.group(1)) <= int(m.group(2)), out
    saved = torch.load(ckpt, weights_only=False)
    assert saved["model"]["tables.user.weight"].shape == (10001, 16)  # padding rows (to 10240) not saved
    assert saved["optimizer"]["state"]["table:user"]["r"].shape == (10001,)
