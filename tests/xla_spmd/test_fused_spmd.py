"""Fused table groups on a 4-device mesh: each group laid out once (row, column or replicated), the same
numbers as unfused tables on the CPU, one graph, and checkpoints (single file and distributed) that
load into unfused collections. Run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns that XLA_USE_SPMD (set by the first) is deprecated
    xr.use_spmd()  # before any XLA tensor exists
import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, shard, sharding_spec  # noqa: E402

DEV = torch_xla.device()
xr.global_runtime_device_count()
D = 8
# (vocab, placement): two row groups of equal shape (the donation-pitfall case), a column group, a
# replicated group, and a row table alone in its key (not fused).
TABLES = [(700, "row"), (700, "row"), (301, "row"), (50, "column"), (60, "column"), (30, "replicated"),
          (40, "replicated"), (90, "auto")]


def build(device: torch.device, fuse: bool) -> tuple[tte.EmbeddingCollection, Any]:
    torch.manual_seed(0)
    configs = [tte.TableConfig(v, D, name=f"t{i}", placement=p, combiner=("sum", "mean")[i % 2])
               for i, (v, p) in enumerate(TABLES)]
    ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(c, max_ids_per_bag=2) for i, c in enumerate(configs)},
                                 device=device, fuse_tables=fuse)
    if device.type == "xla":
        placements = shard(ec, device_mesh())
        assert placements == {f"t{i}": p if p != "auto" else "replicated" for i, (_, p) in enumerate(TABLES)}
    opt = tte.optim.LazyAdam(ec.parameters(), lr=0.05, use_ema=True)
    opt.init_state()
    return ec, opt


def train(ec: tte.EmbeddingCollection, opt: Any, steps: int, seed: int = 1) -> list[int]:
    compiles = []
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        inputs = {f"f{i}": tte.Jagged(torch.randint(0, v, (12,), generator=g), lengths=torch.full((6,), 2))
                  for i, (v, _) in enumerate(TABLES)}
        out = ec(inputs)
        sum((i + 1) * o.square().sum() for i, o in enumerate(out.values())).backward()
        opt.step()
        opt.zero_grad()
        if next(ec.parameters()).device.type == "xla":
            torch_xla.sync()
            compiles.append(met.counter_value("UncachedCompile") or 0)
    return compiles


def comparable(ec: tte.EmbeddingCollection, opt: Any) -> dict[str, torch.Tensor]:
    out = {k: v.detach().cpu() for k, v in ec.state_dict().items()}
    for key, slots in opt.state_dict()["state"].items():
        out.update({f"{key}/{s}": v.detach().cpu() for s, v in slots.items() if s not in ("ema", "ema_last")})
    return out


def test_fused_groups_sharded_match_unfused_cpu() -> None:
    ec, opt = build(DEV, fuse=True)
    assert {g: [m[0] for m in ms] for g, ms in ec.fused_members().items()} == {
        "fused_0": ["t0", "t1", "t2"], "fused_1": ["t3", "t4"], "fused_2": ["t5", "t6"]}
    specs = {n: sharding_spec(t.weight) for n, t in ec.physical_tables().items()}
    assert specs["fused_0"].startswith("{devices=[4,1]") and specs["fused_1"].startswith("{devices=[1,4]")
    assert specs["fused_2"] == specs["t7"] == "{replicated}"
    assert ec.groups["fused_0"].weight.shape[0] == 2048  # 1701 rows padded to a multiple of lcm(512, 4)
    for t in ec.physical_tables().values():
        for slot, v in opt.state[t.weight].items():
            if v.dim() == 2:
                assert sharding_spec(v) == sharding_spec(t.weight), slot
    torch_xla.sync()
    met.clear_all()
    compiles = train(ec, opt, steps=6)
    assert compiles[0] == 1 and compiles[-1] == 1, compiles
    assert met.executed_fallback_ops() == []
    cpu, cpu_opt = build(torch.device("cpu"), fuse=False)
    train(cpu, cpu_opt, steps=6)
    want, got = comparable(cpu, cpu_opt), comparable(ec, opt)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_checkpoints_of_sharded_groups_load_unfused(tmp_path: Path) -> None:
    ec, opt = build(DEV, fuse=True)
    train(ec, opt, steps=3)
    tte.checkpoint.save(tmp_path / "one.pt", model=ec, optimizer=opt)
    tte.checkpoint.save_distributed(tmp_path / "dist", model=ec, optimizer=opt)
    tte.checkpoint.convert_distributed(tmp_path / "dist", tmp_path / "converted.pt")
    expected = comparable(ec, opt)
    for name in ("one.pt", "converted.pt"):
        cpu, cpu_opt = build(torch.device("cpu"), fuse=False)
        tte.checkpoint.load(tmp_path / name, model=cpu, optimizer=cpu_opt)
        got = comparable(cpu, cpu_opt)
        assert set(got) == set(expected), name
        for k, v in expected.items():
            assert torch.equal(got[k], v), (name, k)
    # and back into a fused, sharded collection, shard by shard; training goes on identically
    ec2, opt2 = build(DEV, fuse=True)
    tte.checkpoint.load_distributed(tmp_path / "dist", model=ec2, optimizer=opt2)
    train(ec, opt, steps=2, seed=7)
    train(ec2, opt2, steps=2, seed=7)
    for k, v in comparable(ec, opt).items():
        assert torch.equal(comparable(ec2, opt2)[k], v), k
