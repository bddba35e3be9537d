"""tests/_mp_worker.py's model on a torch_xla SPMD mesh of CPU_NUM_DEVICES devices, float64, with the optimizer
configuration OPTIMIZER of tests/_mp_worker.py (default W.CKPT: Adafactor, global_clipnorm, EMA); table-wise
tables are row-sharded here (SPMD has no "table" placement).

Usage: python _mp_interop_script.py STAGE DIR [OPTIMIZER]
  save: 5 steps from the values W.Model(seed=0) starts from, tte.checkpoint.save_distributed(DIR/ckpt),
        5 more steps, tte.checkpoint.save(DIR/expected.pt): the uninterrupted run (tests/data/mp_spmd4/make.py)
  load: a model drawn from another seed loads DIR/ckpt (any kind of distributed checkpoint: a process group's
        too) with tte.checkpoint.load_distributed, trains steps 5..9, tte.checkpoint.save(DIR/resumed.pt)
"""

import os
import sys
from pathlib import Path

import torch
import torch_xla
import torch_xla.runtime as xr

xr.use_spmd()
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the model, batches and loop
import _mp_ckpt_worker as C  # noqa: E402
import _mp_worker as W  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import replicate, shard  # noqa: E402

STAGE, DIR = sys.argv[1], sys.argv[2]
OPTIMIZER = sys.argv[3] if len(sys.argv) > 3 else W.CKPT
DTYPE = torch.float64
dev = torch_xla.device()
model = C.model_with({"table": "row"}, DTYPE, seed=0 if STAGE == "save" else 9, device=dev)
placements = shard(model.ec)
assert placements["tw"] == "row" and placements["rep"] == "replicated", placements
replicate(model.head)
opt = W.make_opt(OPTIMIZER, model.parameters())
opt.init_state()
torch_xla.sync()


def train(steps: range) -> None:
    for step in steps:
        batch, y = W.global_batch(step, DTYPE)
        loss = ((model(batch) - y.to(dev)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_xla.sync()
    model.ec.check_ids()  # nothing dropped


if STAGE == "save":
    train(range(5))
    tte.checkpoint.save_distributed(os.path.join(DIR, "ckpt"), model=model, optimizer=opt)
    train(range(5, W.STEPS))
    tte.checkpoint.save(os.path.join(DIR, "expected.pt"), model=model, optimizer=opt)
else:
    tte.checkpoint.load_distributed(os.path.join(DIR, "ckpt"), model=model, optimizer=opt)
    torch_xla.sync()
    train(range(5, W.STEPS))
    tte.checkpoint.save(os.path.join(DIR, "resumed.pt"), model=model, optimizer=opt)
print("ok", xr.global_runtime_device_count())
