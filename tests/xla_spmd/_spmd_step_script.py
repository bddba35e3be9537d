"""20 training steps of a row-sharded table on a 4-device SPMD mesh (used by test_spmd_hlo.py).

Usage: python _spmd_step_script.py V OPTIMIZER [STEPS]; prints one JSON line: compiles, fallbacks and
the table's sharding spec before and after. Run with XLA_FLAGS=--xla_dump_to=... to inspect the HLO.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.runtime as xr

xr.use_spmd()
import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, replicate, shard, sharding_spec  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the optimizer registry
from optim_registry import SPMD_STEP, case  # noqa: E402

V, D, B, L = int(sys.argv[1]), 8, 64, 4
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 20
make = case(SPMD_STEP, sys.argv[2]).make  # an id of tests/optim_registry.py, target ``spmd_step``
dev = torch_xla.device()
mesh = device_mesh()
t = tte.TableConfig(V, D, name="t", combiner="mean", placement="row", initializer=torch.nn.init.zeros_)
ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=L), "b": tte.FeatureConfig(t)}, device=dev)
head = torch.nn.Linear(D, 1).to(dev)
shard(ec, mesh)
replicate(head, mesh)
opt = make(list(ec.parameters()) + list(head.parameters()))
opt.init_state()
torch_xla.sync()
w = ec.tables.t.weight
before = sharding_spec(w)
met.clear_all()
g = torch.Generator().manual_seed(0)
start = None
for i in range(steps):
    if i == 2:
        xm.wait_device_ops()
        start = time.perf_counter()
    a = torch.randint(0, V, (B * L,), generator=g)
    b = torch.randint(0, V, (B,), generator=g)
    out = ec({"a": tte.Jagged(a, lengths=torch.full((B,), L)), "b": b})
    (head(out["a"]) * head(out["b"])).sum().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
xm.wait_device_ops()
elapsed = time.perf_counter() - start if start is not None else 0.0
print(json.dumps({
    "compiles": met.counter_value("UncachedCompile") or 0,
    "fallbacks": sorted(met.executed_fallback_ops()),
    "before": before,
    "after": sharding_spec(w),
    "slots": {k: sharding_spec(v) for k, v in opt.state[w].items()},
    "step_ms": 1000 * elapsed / max(steps - 2, 1),
}))
