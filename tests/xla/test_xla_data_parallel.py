"""Data parallel on XLA through torch.distributed's ``xla`` backend (torch_xla multi-process, not SPMD).

XLA:CPU gives every process a world size of 1, so the exchange is forced on (``should_exchange``
patched) in one process: every step then runs the static-shape exchange of
``torch_tpu_embedding/distributed/data_parallel.py`` with the ``xla`` backend's collectives (``xm.all_gather`` with one
replica). It must train as the CPU without an exchange, in one compiled graph, with no host fallback and
one host round trip in all (the size check of the first step). The multi-process arithmetic of the same
code is checked with gloo on 2 and 3 processes (tests/distributed/test_data_parallel.py::test_static_shape_exchange).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torch_xla")

import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.distributed.xla_backend  # noqa: E402,F401  (registers the "xla" backend)

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.distributed import grad_sync  # noqa: E402

OPTIMIZERS: dict[str, Any] = {
    "adagrad": lambda p: tte.optim.Adagrad(p, lr=0.1),
}


@pytest.fixture
def xla_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """An initialised ``xla`` process group (one process), the exchange forced on; yields a list that
    counts the all-gathers."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("xla", init_method="xla://")
    monkeypatch.setattr(grad_sync, "should_exchange", lambda *, spmd, group_size, local: not (spmd or local))
    calls: list[int] = []
    real = dist.all_gather_into_tensor

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "all_gather_into_tensor", counting)
    try:
        yield calls
    finally:
        dist.destroy_process_group()


def build(device: torch.device, name: str) -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer]:
    torch.manual_seed(0)
    t = tte.TableConfig(50, 8, name="t", combiner="mean")
    u = tte.TableConfig(20, 4, name="u")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=4), "b": tte.FeatureConfig(t),
                                  "c": tte.FeatureConfig(u)})
    model = torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(20, 1)}).to(device)
    return model, OPTIMIZERS[name](model.parameters())


def step(model: torch.nn.ModuleDict, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    a = torch.randint(0, 50, (32,), generator=g)
    out = model["ec"]({"a": tte.Jagged(a, lengths=torch.full((8,), 4)), "b": torch.randint(0, 50, (8,), generator=g),
                       "c": torch.randint(0, 20, (8,), generator=g)})
    y = model["head"](torch.cat([out["a"], out["b"], out["c"]], dim=1))
    opt.zero_grad()
    (y * y).mean().backward()
    opt.step()
    if next(model.parameters()).device.type == "xla":
        torch_xla.sync()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_exchange_through_the_xla_backend(xla_group: list[int], name: str) -> None:
    cpu, cpu_opt = build(torch.device("cpu"), name)
    tte.distributed.local_tables(cpu)  # the reference: no exchange
    xla, xla_opt = build(torch_xla.device(), name)
    xla_opt.init_state()
    torch_xla.sync()
    assert tte.distributed.exchange_group(xla["ec"].tables.t.weight) is not None
    g_cpu, g_xla = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    steps = 6
    for i in range(steps):
        if i == 2:  # the first steps compile (the second: its inputs are now step outputs)
            met.clear_all()
        step(cpu, cpu_opt, g_cpu)
        step(xla, xla_opt, g_xla)
    assert (met.counter_value("UncachedCompile") or 0) == 0
    assert met.executed_fallback_ops() == []
    # One ids and one rows gather per step (both tables in one buffer each), the sizes checked once.
    assert len(xla_group) == 2 * steps + 1
    for k, v in cpu.state_dict().items():
        torch.testing.assert_close(xla.state_dict()[k].cpu(), v, rtol=1e-5, atol=1e-6, msg=k)
    for key, slots in cpu_opt.state_dict()["state"].items():
        for slot, v in slots.items():
            torch.testing.assert_close(xla_opt.state_dict()["state"][key][slot].cpu(), v, rtol=1e-5, atol=1e-6,
                                       msg=f"{key}/{slot}")
