"""Writes the distributed checkpoint in this folder with the code of commit 073a801 (before row-sharded tables
trained through the id exchange: every table and slot stored in logical row order, trash rows at the end).
``tests/xla_spmd/test_dcp_resharding.py`` loads it with today's code (interleaved row order, chunked slots) on 4
devices and on the CPU and checks the loaded state and the training that follows against ``ref.pt`` and
``after.pt``, written here by the old code.

Run from the repository root of a checkout of 073a801 (only to regenerate, which would no longer test the old
code): ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python tests/data/pre_exchange/make.py``.
"""

from __future__ import annotations

import os
import sys

import torch_xla
import torch_xla.runtime as xr

xr.use_spmd()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/data: for `configs`
from pre_exchange.configs import build, step  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    model, opt = build(torch_xla.device(), spmd=True)
    torch_xla.sync()
    for s in range(3):  # 3 calls with k = 2: a pending accumulation buffer is saved too
        step(model, opt, s)
        torch_xla.sync()
    tte.checkpoint.save_distributed(os.path.join(HERE, "model.dcp"), model=model, optimizer=opt)
    tte.checkpoint.save(os.path.join(HERE, "ref.pt"), model=model, optimizer=opt)
    for s in range(3, 6):
        step(model, opt, s)
        torch_xla.sync()
    tte.checkpoint.save(os.path.join(HERE, "after.pt"), model=model, optimizer=opt)
    print("written")


if __name__ == "__main__":
    main()
