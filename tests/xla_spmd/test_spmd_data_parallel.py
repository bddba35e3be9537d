"""Under SPMD the data-parallel exchange (torch_tpu_embedding.distributed) never runs: the partitioner
already makes gradients global, and multi-host SPMD runs initialise a process group (gloo, for checkpoint
coordination) whose exchange would count every gradient once per host.

Here a gloo group of one process is initialised and its size read as 2 (what a 2-host run sees): the
decision is still "no exchange", ``data_parallel`` refuses, and a step makes no collective call. And
``tte.clip_grad_norm_`` clips a table whose gradient arrives owner-local (the id exchange of row-sharded
tables) as the CPU clips it. Run in its own process: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()  # before any XLA tensor exists
import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding._rows.tables import table_info  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, replicate, shard, shard_batch  # noqa: E402


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


def test_clip_grad_norm_of_a_routed_table() -> None:
    """``tte.clip_grad_norm_`` on a row-sharded table trained through the id exchange (its gradient arrives
    owner-local, per shard): the norm and the clipped Adagrad step equal the CPU's (whose clipping equals
    clipping by hand, tests/optim/test_clip.py), with duplicate ids across bags and features; the gradient stays
    owner-local for the step."""

    def build(device: torch.device) -> tuple[tte.EmbeddingCollection, torch.nn.Module]:
        torch.manual_seed(0)
        t = tte.TableConfig(64, 4, name="t", placement="row", combiner="mean")
        ec = tte.EmbeddingCollection({"bag": tte.FeatureConfig(t, max_ids_per_bag=3), "one": tte.FeatureConfig(t)},
                                     device=device)
        return ec, torch.nn.Linear(8, 1).to(device)

    cpu, cpu_head = build(torch.device("cpu"))
    xla, xla_head = build(torch_xla.device())
    assert set(shard(xla, device_mesh()).values()) == {"row"}
    replicate(xla_head)
    weight = xla.tables.t.weight
    assert table_info(weight).owner_local  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(3)
    runs = []
    for ec, head in ((cpu, cpu_head), (xla, xla_head)):
        opt = tte.optim.Adagrad([*ec.parameters(), *head.parameters()], lr=0.1)
        norms = []
        for step in range(2):
            g.manual_seed(10 + step)
            bag = torch.randint(0, 6, (16,), generator=g)  # few ids: duplicates
            one = torch.randint(0, 64, (8,), generator=g)
            one[1] = one[0] = bag[0]
            y = torch.randn(8, generator=g)
            dev = next(ec.parameters()).device
            dev_one = one.to(dev)
            out = ec({"bag": tte.Jagged(bag, lengths=torch.tensor([3, 1, 2, 0, 3, 3, 2, 2])),
                      "one": shard_batch(dev_one) if dev.type == "xla" else dev_one})
            loss = ((head(torch.cat([out["bag"], out["one"]], dim=1)).squeeze(1) - y.to(dev)) ** 2).mean()
            loss.backward()
            if dev.type == "xla":
                assert table_info(ec.tables.t.weight).row_grad.owned  # type: ignore[union-attr]
            norms.append(tte.clip_grad_norm_([*ec.parameters(), *head.parameters()], 0.05))
            if dev.type == "xla":
                assert table_info(ec.tables.t.weight).row_grad.owned  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            if dev.type == "xla":
                torch_xla.sync()
        runs.append(([float(n) for n in norms], {k: v.cpu() for k, v in ec.state_dict().items()}))
    (cpu_norms, cpu_state), (xla_norms, xla_state) = runs
    assert min(cpu_norms) > 0.05  # both steps clip
    assert xla_norms == pytest.approx(cpu_norms, rel=1e-5)
    for k, v in cpu_state.items():
        torch.testing.assert_close(xla_state[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("norm_type", [-math.inf, -2.0], ids=["-inf", "-2"])
def test_a_negative_norm_of_a_routed_table_sees_no_zero_row_of_the_tail(norm_type: float) -> None:
    """A negative ``norm_type`` on a row-sharded table trained through the id exchange (owner-local chunks, each
    shard's duplicate sum with a sentinel tail of zero rows): every row looked up, each summed row nonzero, the
    norm is the CPU's (which equals torch's dense gradient's, tests/optim/test_clip.py), not 0."""

    def build(device: torch.device) -> tte.EmbeddingCollection:
        torch.manual_seed(0)
        return tte.EmbeddingCollection({"f": tte.FeatureConfig(
            tte.TableConfig(8, 2, name="t", placement="row", combiner="sum"), max_ids_per_bag=3)}, device=device)

    xla = build(torch_xla.device())  # (sharded before any backward: the runtime starts first)
    shard(xla, device_mesh())
    assert table_info(xla.tables.t.weight).owner_local  # type: ignore[union-attr]
    norms = []
    for ec in (build(torch.device("cpu")), xla):
        device = next(ec.parameters()).device
        ids = torch.tensor([0, 1, 2, 3, 3, 4, 5, 6, 7, 7, 2])  # every row, duplicates
        out = ec({"f": tte.Jagged(ids, lengths=torch.tensor([3, 2, 3, 0, 3]))})["f"]
        (out * torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25], [4.0, 1.0], [2.0, 1.0]],
                            device=device)).sum().backward()
        if device.type == "xla":
            assert table_info(ec.tables.t.weight).row_grad.owned  # type: ignore[union-attr]
        norms.append(float(tte.clip_grad_norm_(ec.parameters(), 0.05, norm_type=norm_type).cpu()))
    assert norms[0] > 0.05  # (the CPU's: no row of its dense gradient is 0)
    assert norms[1] == pytest.approx(norms[0], rel=1e-6)
