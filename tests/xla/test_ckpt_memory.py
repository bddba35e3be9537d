"""Saving checkpoints from an XLA device does not grow host memory (issue: a host copy per save).

``torch.save`` leaves a reference cycle holding every tensor it wrote; the host copies of device
tensors then live until the cycle collector runs — a table-sized buffer per save. Run in a fresh
subprocess so the resident set size is this workload's alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla")

ROOT = Path(__file__).parents[2]
SCRIPT = r"""
import gc, json, os, sys, tempfile
import torch, torch_xla
import torch_tpu_embedding as tte

gc.disable()  # as in a long run between automatic collections: only save() may collect
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
dev = torch_xla.device()
table = tte.TableConfig(1 << 19, 16, name="t")  # 32 MiB
ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(table)}, device=dev)
opt = tte.optim.Adam(ec.parameters(), lr=0.1)  # two more table-sized slots: 96 MiB per save
opt.init_state()
torch_xla.sync()
path = os.path.join(tempfile.mkdtemp(), "c.pt")
trace = []
for i in range(12):
    ec({"f": torch.arange(64) + 64 * i})["f"].sum().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
    tte.checkpoint.save(path, model=ec, optimizer=opt)
    trace.append(rss_mib())
print(json.dumps(trace))
"""


def test_repeated_saves_keep_host_memory_flat() -> None:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    for k in ("XLA_USE_SPMD", "CPU_NUM_DEVICES"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=600, check=True)
    trace = json.loads(out.stdout.strip().splitlines()[-1])
    # Each save copies 96 MiB to the host. Kept alive, 10 more saves would add ~960 MiB; the
    # allocator may keep a few copies' worth cached, never one per save.
    growth = trace[-1] - trace[1]
    assert growth < 3 * 96, [round(x) for x in trace]
