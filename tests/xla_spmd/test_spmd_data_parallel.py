"""Under SPMD the data-parallel exchange (torch_tpu_embedding.distributed) never runs: the partitioner
already makes gradients global, and multi-host SPMD runs initialise a process group (gloo, for checkpoint
coordination) whose exchange would count every gradient once per host.

Here a gloo group of one process is initialised and its size read as 2 (what a 2-host run sees): the
decision is still "no exchange", ``data_parallel`` refuses, and a step makes no collective call. Run in its
own process: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before any XLA tensor exists
import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, shard  # noqa: E402


@pytest.fixture
def two_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A gloo group (one process) whose size reads as 2; yields the collectives called."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    calls: list[str] = []
    for name in ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: calls.append(_n))
    try:
        yield calls
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def test_spmd_is_never_exchanged(two_hosts: list[str]) -> None:
    assert tte.distributed.spmd_active()
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(64, 4, name="t"))}, device=torch_xla.device())
    shard(ec, device_mesh())
    weight = ec.tables.t.weight
    assert tte.distributed.exchange_group(weight) is None
    with pytest.raises(RuntimeError, match="not for torch_xla SPMD"):
        tte.distributed.data_parallel(ec)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    before = weight.detach().cpu().clone()
    ec({"f": torch.tensor([1, 2, 2, 5])})["f"].sum().backward()
    opt.step()
    torch_xla.sync()
    assert two_hosts == []  # no collective call
    assert not torch.equal(weight.detach().cpu(), before)  # and it trained
