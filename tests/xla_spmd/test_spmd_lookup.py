"""A row-sharded table on 4 virtual devices (SPMD): same numbers as CPU, sharding kept, one compile.

Run in its own process: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 (SPMD mode is fixed per process).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns that XLA_USE_SPMD (set by the first) is deprecated
    xr.use_spmd()  # before any XLA tensor exists
import torch_tpu_embedding as tte  # noqa: E402

N = xr.global_runtime_device_count()
MESH = xs.Mesh(np.arange(N), (N,), ("x",))
DEV = torch_xla.device()
V, D = 64, 8


def build(device: torch.device):
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner="mean")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=4), "b": tte.FeatureConfig(t)},
                                 device=device)
    if device.type == "xla":
        xs.mark_sharding(ec.tables.t.weight, MESH, ("x", None))
    return ec


def run(device: torch.device, steps: int, compiles: list[int] | None = None):
    ec = build(device)
    opt = tte.optim.SGD(ec.parameters(), lr=0.5)
    opt.init_state()
    if device.type == "xla":
        torch_xla.sync()
        met.clear_all()
    outs = []
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        a = tte.Jagged(torch.randint(0, V, (10,), generator=g), lengths=torch.tensor([4, 3, 0, 3]))
        b = torch.randint(0, V, (4,), generator=g)
        out = ec({"a": a, "b": b})
        (out["a"] * out["b"]).sum().backward()
        opt.step()
        opt.zero_grad()
        if device.type == "xla":
            torch_xla.sync()
            if compiles is not None:
                compiles.append(met.counter_value("UncachedCompile"))
        outs.append(out["a"].detach().cpu())
    return ec, outs


def test_four_devices() -> None:
    assert N == 4


def test_row_sharded_matches_cpu_keeps_sharding_one_compile() -> None:
    _, cpu_outs = run(torch.device("cpu"), 6)
    compiles: list[int] = []
    ec, xla_outs = run(DEV, 6, compiles)
    assert met.executed_fallback_ops() == []
    # The first step sees the freshly marked input sharding; from the second on, one cached graph.
    assert compiles[1] <= 2 and compiles[-1] == compiles[1], compiles
    spec = torch_xla._XLAC._get_xla_sharding_spec(ec.tables.t.weight)
    assert spec.startswith("{devices=[4,1]"), spec  # still row-sharded after 6 in-place updates
    for c, x in zip(cpu_outs, xla_outs, strict=True):
        torch.testing.assert_close(x, c, rtol=1e-5, atol=1e-6)
    ec_cpu, _ = run(torch.device("cpu"), 6)
    torch.testing.assert_close(ec.tables.t.weight.detach().cpu(), ec_cpu.tables.t.weight.detach(),
                               rtol=1e-5, atol=1e-6)
