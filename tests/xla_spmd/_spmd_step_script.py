"""Training steps of a row-sharded table on an SPMD mesh of CPU_NUM_DEVICES devices (used by test_spmd_hlo.py).

Usage: python _spmd_step_script.py V OPTIMIZER STEPS SLOTS [V OPTIMIZER STEPS SLOTS ...]: the runs one after
the other in this process (one torch_xla start-up), each with its own model; prints one JSON line per run:
compiles, fallbacks, the table's sharding spec before and after, its slots' specs, and the graph dumps its steps
added. 16 examples per device (a 4-id bag feature and a single-id feature of the table) plus a replicated dense
head. SLOTS: the exchange's n · capacity
(``max_unique_ids_per_shard = SLOTS / n``: the same bytes per device at every n); 0: the default capacity.
Run with XLA_FLAGS=--xla_dump_to=... to inspect the HLO.
"""

import glob
import json
import os
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

n = xr.global_runtime_device_count()
dev = torch_xla.device()
mesh = device_mesh()
# --xla_dump_to of XLA_FLAGS: the graphs each run compiled are the files it added there
DUMP = next((f.split("=", 1)[1] for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_dump_to=")),
            None)


def dumped() -> set[str]:
    return set(glob.glob(os.path.join(DUMP, "*SyncTensorsGraph*after_optimizations.txt"))) if DUMP else set()


def run(V: int, opt_id: str, steps: int, slots: int) -> dict[str, object]:
    D, B, L = 8, 16 * n, 4
    make = case(SPMD_STEP, opt_id).make  # an id of tests/optim_registry.py, target ``spmd_step``
    t = tte.TableConfig(V, D, name="t", combiner="mean", placement="row", initializer=torch.nn.init.zeros_,
                        max_unique_ids_per_shard=slots // n if slots else None)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=L), "b": tte.FeatureConfig(t)},
                                 device=dev)
    head = torch.nn.Linear(D, 1).to(dev)
    shard(ec, mesh)
    replicate(head, mesh)
    opt = make(list(ec.parameters()) + list(head.parameters()))
    opt.init_state()
    torch_xla.sync()
    w = ec.tables.t.weight
    before = sharding_spec(w)
    files = dumped()
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
    compiles = met.counter_value("UncachedCompile") or 0
    ec.check_ids()  # no id was dropped
    return {
        "compiles": compiles,
        "fallbacks": sorted(met.executed_fallback_ops()),
        "before": before,
        "after": sharding_spec(w),
        "slots": {k: sharding_spec(v) for k, v in opt.state[w].items()},
        "step_ms": 1000 * elapsed / max(steps - 2, 1),
        "dumps": sorted(dumped() - files),  # the graphs compiled by the steps (compiles are synchronous)
    }


args = sys.argv[1:]
for k in range(0, len(args), 4):
    v, opt_id, steps, slots = args[k : k + 4]
    print(json.dumps(run(int(v), opt_id, int(steps), int(slots))), flush=True)
