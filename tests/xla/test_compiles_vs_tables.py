"""The graphs XLA compiles until the first training step returns do not grow with the number of tables.

Default construction (``EmbeddingCollection(features)``: tables of one width stacked), the same total
rows and ids split over 1 or 20 tables, one feature each; counted from the start of a fresh process
(construction, slot creation and the first step's graph together; tables of distinct sizes, so that
per-table graphs could not share a cached compile), with and without ``init_state``; and the graphs
executed in that time.
``benchmarks/xla_tables.py`` names each such graph and times them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

pytest.importorskip("torch_xla")

ROOT = Path(__file__).parents[2]
SCRIPT = r"""
import json, sys
import torch, torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_tpu_embedding as tte

tables, init_state = int(sys.argv[1]), sys.argv[2] == "1"
rows, ids_per_example, batch = 2000 // tables, 20 // tables, 8
def compiles():
    return int(met.counter_value("UncachedCompile") or 0)
def executions():
    data = met.metric_data("ExecuteTime")
    return data[0] if data else 0
dev = torch_xla.device()
# distinct sizes: a graph built per table would not hit the compile cache of its neighbour's
features = {f"f{i:02d}": tte.FeatureConfig(tte.TableConfig(rows + i, 4, name=f"t{i}", combiner="mean"),
                                          max_ids_per_bag=ids_per_example) for i in range(tables)}
ec = tte.EmbeddingCollection(features, device=dev)
opt = tte.optim.Adam(ec.parameters(), lr=0.1)
if init_state:
    opt.init_state()
    torch_xla.sync()
    xm.wait_device_ops()
g = torch.Generator().manual_seed(0)
counts, runs = [], []
def traced():  # aten ops traced on XLA tensors so far (torch_xla's per-op counters)
    return sum(int(met.counter_value(n) or 0) for n in met.counter_names() if n.startswith("xla::"))
for step in range(3):
    before = traced()
    out = ec({f: tte.Padded(torch.randint(0, rows, (batch, ids_per_example), generator=g)) for f in features})
    torch.cat([out[f] for f in sorted(features)], dim=1).sum().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()
    xm.wait_device_ops()  # ExecuteTime is recorded when an execution finishes, asynchronously after sync()
    counts.append(compiles())
    runs.append(executions())
    ops = traced() - before
print(json.dumps({"until_first_step": counts[0], "executions_until_first_step": runs[0], "later": counts[-1] - counts[0],
                  "params": len(list(ec.parameters())), "ops_per_step": ops}))
"""


@cache  # both tests read the fresh-process counts of (1, init_state) and (20, init_state): one run each
def _compiles(tables: int, init_state: bool) -> dict[str, int]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    for k in ("XLA_USE_SPMD", "CPU_NUM_DEVICES", "XLA_PERSISTENT_CACHE_PATH"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tables), "1" if init_state else "0"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, int] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("init_state", [True, False], ids=["init_state", "lazy_slots"])
def test_graphs_compiled_until_the_first_step_returns_do_not_grow_with_tables(init_state: bool) -> None:
    one, twenty = _compiles(1, init_state), _compiles(20, init_state)
    assert twenty["params"] == one["params"] == 1  # stacked: the default construction
    assert one["until_first_step"] >= 1
    assert twenty["until_first_step"] <= one["until_first_step"], (one, twenty)
    assert twenty["executions_until_first_step"] <= one["executions_until_first_step"], (one, twenty)
    # Steps 2 and 3: with init_state the first step's graph is the steady one; without, the first step
    # creates the slots in its graph and the second, which reads them, compiles once more (both T).
    assert twenty["later"] <= one["later"] == (0 if init_state else 1), (one, twenty)


def test_the_traced_step_does_not_grow_with_the_features_of_a_group() -> None:
    """The steady step's traced ops (what XLA compiles, by torch_xla's per-op counters): one assembly and one
    lookup per stacked group, whatever its number of features (measured: 121 ops at 1 and at 20 features;
    before the assembly, 120 and 138). The features' output views and the caller's ``torch.cat`` are not
    counted there; 2 ops of slack."""
    one, twenty = _compiles(1, True), _compiles(20, True)
    assert twenty["ops_per_step"] <= one["ops_per_step"] + 2, (one, twenty)

