"""Loads the distributed checkpoint of tests/data/pre_exchange (written before the id exchange: logical row
order, trash rows at the end) with today's code (used by test_dcp_resharding.py).

Usage: python _pre_exchange_script.py STAGE DIR
  spmd4: 4 devices, row-sharded tables through the id exchange (interleaved order, chunked slots)
  spmd8: the same on 8 devices
  cpu:   a CPU model, no torch_xla
Each stage loads model.dcp → DIR/loaded-<stage>.pt, trains 3 more steps → DIR/trained-<stage>.pt.
"""

import os
import sys

STAGE, DIR = sys.argv[1], sys.argv[2]
if STAGE == "cpu":
    sys.modules["torch_xla"] = None  # type: ignore[assignment]  # the CPU path needs no torch_xla

import torch  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
sys.path.insert(0, DATA)
from pre_exchange.configs import build, step  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402

if STAGE != "cpu":
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()
    from torch_tpu_embedding.xla import sharding_spec

model, opt = build(torch_xla.device() if STAGE != "cpu" else torch.device("cpu"), spmd=STAGE != "cpu")
if STAGE != "cpu":
    torch_xla.sync()
    assert model["ec"].tables.big.row_layout is not None  # stored interleaved: the checkpoint's order is not
    before = sharding_spec(model["ec"].tables.big.weight)
tte.checkpoint.load_distributed(os.path.join(DATA, "pre_exchange", "model.dcp"), model=model, optimizer=opt)
if STAGE != "cpu":
    torch_xla.sync()
    assert sharding_spec(model["ec"].tables.big.weight) == before
tte.checkpoint.save(os.path.join(DIR, f"loaded-{STAGE}.pt"), model=model, optimizer=opt)
for s in range(3, 6):
    step(model, opt, s)
    if STAGE != "cpu":
        torch_xla.sync()
tte.checkpoint.save(os.path.join(DIR, f"trained-{STAGE}.pt"), model=model, optimizer=opt)
print("ok")
