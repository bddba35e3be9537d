"""Stacked table groups on a 4-device mesh: each group laid out once (row, column or replicated), the same
numbers as unstacked tables on the CPU, one graph, and checkpoints (single file and distributed) that
load into unstacked collections. Run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from optim_registry import SPMD, OptimizerConfig, cases

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns that XLA_USE_SPMD (set by the first) is deprecated
    xr.use_spmd()  # before any XLA tensor exists
import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding._rows.tables import table_info  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, shard, sharding_spec  # noqa: E402

DEV = torch_xla.device()
xr.global_runtime_device_count()
D = 8
# (vocab, placement): two row groups of equal shape (the donation-pitfall case), a column group, a
# replicated group, and a row table alone in its key (not stacked).
TABLES = [(700, "row"), (700, "row"), (301, "row"), (50, "column"), (60, "column"), (30, "replicated"),
          (40, "replicated"), (90, "auto")]


def build(device: torch.device, stack: bool, make_opt: Any = None) -> tuple[tte.EmbeddingCollection, Any]:
    torch.manual_seed(0)
    configs = [tte.TableConfig(v, D, name=f"t{i}", placement=p, combiner=("sum", "mean")[i % 2])
               for i, (v, p) in enumerate(TABLES)]
    ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(c, max_ids_per_bag=2) for i, c in enumerate(configs)},
                                 device=device, stack_tables=stack)
    if device.type == "xla":
        placements = shard(ec, device_mesh())
        assert placements == {f"t{i}": p if p != "auto" else "replicated" for i, (_, p) in enumerate(TABLES)}
    opt = (make_opt or _lazy_adam_ema)(ec.parameters())
    opt.init_state()
    return ec, opt


def _lazy_adam_ema(params: Any) -> Any:
    return tte.optim.LazyAdam(params, lr=0.05, use_ema=True)


def _abs_accumulators(p: torch.Tensor, names: list[str], init: Any) -> dict[str, torch.Tensor]:
    return {n: 0.1 + p.detach().abs() for n in names}


#: options whose meaning is per table, inside groups laid out by row (owner-local, interleaved rows),
#: by column and replicated: whole-table statistics (Adafactor), clipnorm, slot_creation_fn
PER_TABLE = {
    "adafactor-clipnorm": lambda ps: tte.optim.Adafactor(ps, lr=0.1, clipnorm=0.05),
    "adafactor-accum": lambda ps: tte.optim.Adafactor(ps, lr=0.1, gradient_accumulation_steps=2),
    "adagrad-slotfn-clipnorm": lambda ps: tte.optim.Adagrad(ps, lr=0.1, clipnorm=0.05,
                                                            slot_creation_fn=_abs_accumulators),
}


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


def test_stacked_groups_sharded_match_unstacked_cpu() -> None:
    ec, opt = build(DEV, stack=True)
    # t7 ("auto", 90 rows) resolves to replicated and joins the replicated group (groups form after placement)
    assert {g: [m[0] for m in ms] for g, ms in ec.stacked_members().items()} == {
        "fused_0": ["t0", "t1", "t2"], "fused_1": ["t3", "t4"], "fused_2": ["t5", "t6", "t7"]}
    specs = {n: sharding_spec(t.weight) for n, t in ec.physical_tables().items()}
    assert specs["fused_0"].startswith("{devices=[4,1]") and specs["fused_1"].startswith("{devices=[1,4]")
    assert specs["fused_2"] == "{replicated}"
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
    cpu, cpu_opt = build(torch.device("cpu"), stack=False)
    train(cpu, cpu_opt, steps=6)
    want, got = comparable(cpu, cpu_opt), comparable(ec, opt)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def _dense_grad(ids: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """The ``[vocab, D]`` sum of a raw row gradient of any shape (padding ids ``>= vocab`` dropped)."""
    ids, rows = ids.cpu().reshape(-1), rows.cpu().reshape(-1, rows.shape[-1])
    keep = ids < vocab
    return torch.zeros(vocab, rows.shape[1], dtype=rows.dtype).index_add_(0, ids[keep], rows[keep])


def test_row_grads_through_the_exchange_are_in_each_tables_own_ids() -> None:
    """The row tables (t0, t1, t2) are owner-local, stacked in one group or each alone: each shard
    receives rows of its table or group; row_grads() reports t0, t1 and t2 by name, in their own
    (logical) ids — not the shards' rows — the same sums as unstacked CPU tables."""
    got = {}
    for key, device, stack in (("mesh stacked", DEV, True), ("mesh", DEV, False), ("cpu", torch.device("cpu"), False)):
        ec, _ = build(device, stack=stack)
        g = torch.Generator().manual_seed(5)
        inputs = {f"f{i}": tte.Jagged(torch.randint(0, v, (12,), generator=g), lengths=torch.full((6,), 2))
                  for i, (v, _) in enumerate(TABLES)}
        out = ec(inputs)
        sum((i + 1) * o.square().sum() for i, o in enumerate(out.values())).backward()
        got[key] = ec.row_grads()
        if device == DEV:
            w = ec.groups["fused_0"].weight if stack else ec.tables["t0"].weight
            assert table_info(w).owner_local  # type: ignore[union-attr]
    names = [f"t{i}" for i in range(len(TABLES))]
    assert list(got["mesh stacked"]) == list(got["mesh"]) == list(got["cpu"]) == names
    for key in ("mesh stacked", "mesh"):
        for i, (vocab, _) in enumerate(TABLES):
            ids, rows = got[key][f"t{i}"]
            # one contract on every layout (what the 4 shards received, in the table's own ids):
            # ids [N], rows [N, D], padding id num_embeddings with zero rows
            assert ids.dim() == 1 and rows.dim() == 2 and rows.shape[0] == ids.shape[0], (key, i, ids.shape, rows.shape)
            assert int(ids.cpu().max()) <= vocab and not rows.cpu()[ids.cpu() == vocab].any(), (key, i)
            torch.testing.assert_close(_dense_grad(ids, rows, vocab), _dense_grad(*got["cpu"][f"t{i}"], vocab),
                                       rtol=1e-5, atol=1e-6, msg=f"{key} t{i}")


def trained_like_unstacked_cpu(make_opt: Any, steps: int) -> tuple[tte.EmbeddingCollection, Any, dict[str, Any]]:
    """Groups on the mesh trained ``steps`` steps in one graph with no fallback, checked against
    unstacked tables on the CPU; returns the mesh's collection, optimizer and comparable state."""
    ec, opt = build(DEV, stack=True, make_opt=make_opt)
    torch_xla.sync()
    met.clear_all()
    compiles = train(ec, opt, steps=steps)
    assert compiles[-1] == compiles[1], compiles  # the steady loop compiles nothing more
    assert met.executed_fallback_ops() == []
    cpu, cpu_opt = build(torch.device("cpu"), stack=False, make_opt=make_opt)
    train(cpu, cpu_opt, steps=steps)
    want, got = comparable(cpu, cpu_opt), comparable(ec, opt)
    assert set(got) == set(want)
    for k in want:
        if "/acc_" not in k:  # pending accumulation buffers: capacity per group vs per table
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    return ec, opt, got


@pytest.mark.parametrize("cfg", cases(SPMD), ids=str)
def test_every_registry_configuration_stacked_on_the_mesh_matches_unstacked_cpu(cfg: OptimizerConfig) -> None:
    """Every optimizer × option of the registry's SPMD target (tests/optim_registry.py), trained in
    row (owner-local), column and replicated groups on 4 devices: the unstacked CPU numbers."""
    trained_like_unstacked_cpu(cfg.make, steps=4)


@pytest.mark.parametrize("name", list(PER_TABLE))
def test_per_table_options_sharded_match_unstacked_cpu(name: str, tmp_path: Path) -> None:
    """Every group (row: owner-local; column; replicated) keeps per-table statistics, clip norms and
    created slots: the same numbers as unstacked tables on the CPU, one graph, no fallback; its
    checkpoint loads into the unstacked CPU collection."""
    ec, opt, got = trained_like_unstacked_cpu(PER_TABLE[name], steps=5)
    assert table_info(ec.groups["fused_0"].weight).owner_local  # the row group trains through the exchange
    tte.checkpoint.save(tmp_path / "one.pt", model=ec, optimizer=opt)
    tte.checkpoint.save_distributed(tmp_path / "dist", model=ec, optimizer=opt)
    tte.checkpoint.convert_distributed(tmp_path / "dist", tmp_path / "converted.pt")
    for file in ("one.pt", "converted.pt"):  # whole-table slots split per table, as unstacked tables keep them
        back, back_opt = build(torch.device("cpu"), stack=False, make_opt=PER_TABLE[name])
        tte.checkpoint.load(tmp_path / file, model=back, optimizer=back_opt)
        for k, v in comparable(back, back_opt).items():
            assert torch.equal(v, got[k]), (file, k)


def test_checkpoints_of_sharded_groups_load_unstacked(tmp_path: Path) -> None:
    ec, opt = build(DEV, stack=True)
    train(ec, opt, steps=3)
    tte.checkpoint.save(tmp_path / "one.pt", model=ec, optimizer=opt)
    tte.checkpoint.save_distributed(tmp_path / "dist", model=ec, optimizer=opt)
    tte.checkpoint.convert_distributed(tmp_path / "dist", tmp_path / "converted.pt")
    expected = comparable(ec, opt)
    for name in ("one.pt", "converted.pt"):
        cpu, cpu_opt = build(torch.device("cpu"), stack=False)
        tte.checkpoint.load(tmp_path / name, model=cpu, optimizer=cpu_opt)
        got = comparable(cpu, cpu_opt)
        assert set(got) == set(expected), name
        for k, v in expected.items():
            assert torch.equal(got[k], v), (name, k)
    # and back into a stacked, sharded collection, shard by shard; training goes on identically
    ec2, opt2 = build(DEV, stack=True)
    tte.checkpoint.load_distributed(tmp_path / "dist", model=ec2, optimizer=opt2)
    train(ec, opt, steps=2, seed=7)
    train(ec2, opt2, steps=2, seed=7)
    for k, v in comparable(ec, opt).items():
        assert torch.equal(comparable(ec2, opt2)[k], v), k


def _auto_tables(stack: bool, device: torch.device) -> tte.EmbeddingCollection:
    """Three ``"auto"`` tables of one key: two below a 4 KiB replication threshold, one above it."""
    torch.manual_seed(0)
    configs = [tte.TableConfig(20, D, name="small_a"), tte.TableConfig(30, D, name="small_b", combiner="sum"),
               tte.TableConfig(512, D, name="big")]  # 640 B, 960 B, 16 KiB; all three: 35 KiB
    return tte.EmbeddingCollection({c.name: tte.FeatureConfig(c, max_ids_per_bag=2) for c in configs},
                                   device=device, stack_tables=stack)


def _auto_train(ec: tte.EmbeddingCollection, opt: Any, steps: int) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        inputs = {n: tte.Jagged(torch.randint(0, v, (12,), generator=g), lengths=torch.full((6,), 2))
                  for n, v in (("small_a", 20), ("small_b", 30), ("big", 512))}
        sum((i + 1) * o.square().sum() for i, o in enumerate(ec(inputs).values())).backward()
        opt.step()
        opt.zero_grad()
        if next(ec.parameters()).device.type == "xla":
            torch_xla.sync()


def test_auto_placement_is_decided_per_table_before_stacking(tmp_path: Path) -> None:
    """Stacking never moves a table to another placement: ``"auto"`` decides by each table's own size,
    then tables are grouped by the placement they got (here the big table leaves the group it was in)."""
    ec = _auto_tables(True, DEV)
    assert [m[0] for m in ec.stacked_members()["fused_0"]] == ["big", "small_a", "small_b"]  # by config (sorted keys)
    before = {k: v.cpu() for k, v in ec.state_dict().items()}
    placements = shard(ec, device_mesh(), replicate_below_bytes=4096)
    plain = _auto_tables(False, DEV)
    assert placements == shard(plain, device_mesh(), replicate_below_bytes=4096) == {
        "big": "row", "small_a": "replicated", "small_b": "replicated"}
    assert ec.stacked_members() == {"fused_0": (("small_a", 0, 20), ("small_b", 20, 30))}
    assert sharding_spec(ec.groups["fused_0"].weight) == "{replicated}"
    assert sharding_spec(ec.tables["big"].weight).startswith("{devices=[4,1]")
    for k, v in ec.state_dict().items():
        assert torch.equal(v.cpu(), before[k]), k  # re-stacking keeps every value
    opt = tte.optim.Adam(ec.parameters(), lr=0.05)
    opt.init_state()
    _auto_train(ec, opt, 3)
    cpu = _auto_tables(False, torch.device("cpu"))
    cpu_opt = tte.optim.Adam(cpu.parameters(), lr=0.05)
    _auto_train(cpu, cpu_opt, 3)
    want, got = comparable(cpu, cpu_opt), comparable(ec, opt)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    # A distributed checkpoint of these groups loads into the CPU default (one group of three tables).
    tte.checkpoint.save_distributed(tmp_path / "dist", model=ec, optimizer=opt)
    back = _auto_tables(True, torch.device("cpu"))
    back_opt = tte.optim.Adam(back.parameters(), lr=0.05)
    tte.checkpoint.load_distributed(tmp_path / "dist", model=back, optimizer=back_opt)
    for k, v in comparable(back, back_opt).items():
        assert torch.equal(v, got[k]), k


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_shard_called_again_with_another_threshold_re_lays_the_tables_out(stack: bool) -> None:
    """A second (and third) ``shard`` with another ``replicate_below_bytes`` moves tables between
    placements — already laid-out tensors are re-annotated, values kept — and trains as on the CPU."""
    ec = _auto_tables(stack, DEV)
    before = {k: v.cpu() for k, v in ec.state_dict().items()}
    for threshold, want in ((4096, {"big": "row", "small_a": "replicated", "small_b": "replicated"}),
                            (0, dict.fromkeys(("big", "small_a", "small_b"), "row")),
                            (1 << 20, dict.fromkeys(("big", "small_a", "small_b"), "replicated"))):
        assert shard(ec, device_mesh(), replicate_below_bytes=threshold) == want
        for name, t in ec.physical_tables().items():
            placement = want[name if t.members() is None else t.members()[0][0]]  # type: ignore[index]
            spec_ = sharding_spec(t.weight)
            assert spec_ == "{replicated}" if placement == "replicated" else spec_.startswith("{devices=[4,1]"), name
        for k, v in ec.state_dict().items():
            assert torch.equal(v.cpu(), before[k]), (threshold, k)
    if stack:
        assert list(ec.groups) == ["fused_0"] and len(ec.stacked_members()["fused_0"]) == 3
    opt = tte.optim.Adam(ec.parameters(), lr=0.05)
    opt.init_state()
    torch_xla.sync()
    met.clear_all()
    _auto_train(ec, opt, 3)
    assert met.counter_value("UncachedCompile") == 1 and met.executed_fallback_ops() == []
    cpu = _auto_tables(False, torch.device("cpu"))
    cpu_opt = tte.optim.Adam(cpu.parameters(), lr=0.05)
    _auto_train(cpu, cpu_opt, 3)
    want_state, got = comparable(cpu, cpu_opt), comparable(ec, opt)
    for k in want_state:
        torch.testing.assert_close(got[k], want_state[k], rtol=1e-5, atol=1e-6, msg=k)


def test_an_optimizer_built_before_shard_refuses_to_step() -> None:
    """``shard`` pads (and for the id exchange permutes) table rows into new parameters: an optimizer
    built before it would silently train nothing. It raises at its first step, naming the table."""
    ec = _auto_tables(False, DEV)
    stale = tte.optim.Adam(ec.parameters(), lr=0.05)
    shard(ec, device_mesh(), replicate_below_bytes=4096)  # big: row (rows permuted); small: replicated
    with pytest.raises(RuntimeError, match=r"table `big` that is no longer the table's: its rows were stored in the id exchange's order"):
        _auto_train(ec, stale, 1)
    ec.zero_grad()
    opt = tte.optim.Adam(ec.parameters(), lr=0.05)
    before = {k: v.cpu() for k, v in ec.state_dict().items()}
    _auto_train(ec, opt, 1)
    assert all(not torch.equal(v.cpu(), before[k]) for k, v in ec.state_dict().items())


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_torchrec_layout_of_sharded_tables(stack: bool) -> None:
    """``tte.interop`` on the mesh (row groups trained through the exchange: rows stored interleaved; column and
    replicated groups): each table whole, as the same training on the CPU gives; a CPU state_dict loads into it,
    and its lookups then equal the CPU's."""
    ec, opt = build(DEV, stack=stack)
    cpu, cpu_opt = build(torch.device("cpu"), stack=False)
    train(ec, opt, steps=2)
    train(cpu, cpu_opt, steps=2)
    got, want = tte.interop.to_torchrec_state_dict(ec), tte.interop.to_torchrec_state_dict(cpu)
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k], rtol=1e-5, atol=1e-6, msg=k)
    assert torch.equal(tte.interop.to_embedding_bag(ec, "t0").weight.detach(), got["embedding_bags.t0.weight"].cpu())
    fresh, _ = build(torch.device("cpu"), stack=False)
    tte.interop.load_torchrec_state_dict(ec, tte.interop.to_torchrec_state_dict(fresh))
    for k, v in tte.interop.to_torchrec_state_dict(fresh).items():
        assert torch.equal(tte.interop.to_torchrec_state_dict(ec)[k].cpu(), v), k
    g = torch.Generator().manual_seed(5)
    inputs = {f"f{i}": tte.Jagged(torch.randint(0, v, (12,), generator=g), lengths=torch.full((6,), 2))
              for i, (v, _) in enumerate(TABLES)}
    with torch.no_grad():
        out, ref = ec(inputs), fresh(inputs)
    for k in ref:
        torch.testing.assert_close(out[k].cpu(), ref[k], rtol=1e-6, atol=1e-6, msg=k)


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_clip_norm_type_0_counts_each_table_of_a_sharded_group(stack: bool) -> None:
    """``tte.clip_grad_norm_(norm_type=0)`` is torch's order 0 over each table's dense gradient: the count of
    tables with a nonzero entry (7 of 8: t1's gradient is zero). A group laid out by row (owner-local rows, its
    ids shard-local), by column or replicated counted as one tensor: 4 stacked."""
    for device in (torch.device("cpu"), DEV):
        ec, _ = build(device, stack)
        g = torch.Generator().manual_seed(1)
        out = ec({f"f{i}": tte.Jagged(torch.randint(0, v, (12,), generator=g), lengths=torch.full((6,), 2))
                  for i, (v, _) in enumerate(TABLES)})
        sum((0.0 if i == 1 else i + 1.0) * o.sum() for i, o in enumerate(out.values())).backward()
        assert float(tte.clip_grad_norm_(ec.parameters(), 1e9, norm_type=0).cpu()) == len(TABLES) - 1, device
