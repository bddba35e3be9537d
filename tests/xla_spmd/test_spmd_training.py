"""Every placement × every optimizer on a 4-device SPMD mesh == the single-device CPU run.

One model holds a row-sharded table (with padding rows: 1001 rows → 1024), a column-sharded
table, a replicated table and a replicated dense head. 10 steps; weights and every optimizer slot
compared with the CPU run (float64: 1e-6 relative, float32: 1e-5). Run in its own process:
PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.
"""

from __future__ import annotations

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns that XLA_USE_SPMD (set by the first) is deprecated
    xr.use_spmd()  # before any XLA tensor exists
from optim_registry import SPMD, OptimizerConfig, cases  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding._rows.row_order import to_logical  # noqa: E402
from torch_tpu_embedding._rows.tables import table_info  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, replicate, shard, sharding_spec  # noqa: E402

DEV = torch_xla.device()
O = tte.optim  # noqa: E741
ROWS, COLS, REPS, D = 1001, 50, 30, 8


def build(device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    row = tte.TableConfig(ROWS, D, name="row", combiner="mean", placement="row", dtype=dtype)
    col = tte.TableConfig(COLS, D, name="col", combiner="sum", placement="column", dtype=dtype)
    rep = tte.TableConfig(REPS, D, name="rep", combiner="sqrtn", placement="replicated", dtype=dtype)
    ec = tte.EmbeddingCollection(
        {"a": tte.FeatureConfig(row, max_ids_per_bag=8), "b": tte.FeatureConfig(col),
         "c": tte.FeatureConfig(rep, max_ids_per_bag=2), "d": tte.FeatureConfig(row)},
        device=device,
    )
    head = torch.nn.Linear(D, 1).to(device=device, dtype=dtype)
    if device.type == "xla":
        mesh = device_mesh()
        assert shard(ec, mesh) == {"row": "row", "col": "column", "rep": "replicated"}
        replicate(head, mesh)
    return ec, head


def train(device: torch.device, cfg: OptimizerConfig, dtype: torch.dtype, steps: int = 10):
    ec, head = build(device, dtype)
    opt = cfg.make(list(ec.parameters()) + list(head.parameters()))
    opt.init_state()
    compiles = []
    if device.type == "xla":
        torch_xla.sync()
        met.clear_all()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        a = torch.randint(0, 600, (32,), generator=g)  # rows >= 600 of `row` are never looked up
        b = torch.randint(0, COLS, (8,), generator=g)
        c = torch.randint(0, REPS, (16,), generator=g)
        d = torch.randint(0, 600, (8,), generator=g)
        out = ec({"a": tte.Jagged(a, lengths=torch.tensor([4, 4, 8, 0, 4, 4, 4, 4])), "b": b,
                  "c": tte.Jagged(c, lengths=torch.full((8,), 2)), "d": d})
        loss = (head(out["a"]) * head(out["b"])).sum() + (out["c"] * out["d"]).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "xla":
            torch_xla.sync()
            compiles.append(met.counter_value("UncachedCompile"))
    return ec, head, opt, compiles


def comparable(ec, head, opt) -> dict[str, torch.Tensor]:
    out = {k: v.detach().cpu() for k, v in ec.state_dict().items()}
    out.update({f"head.{k}": v.detach().cpu() for k, v in head.state_dict().items()})
    for key, slots in opt.state_dict()["state"].items():
        for slot, v in slots.items():
            # Accumulation buffers are sized by the padded batch (device-dependent). A table's raw EMA rows and
            # ema_last are compared too (tests/ema_window_cases.py), and the caught-up averages below.
            if slot in ("acc_ids", "acc_rows"):
                continue
            out[f"{key}/{slot}"] = v.detach().cpu()
    if opt.param_groups[0]["use_ema"]:
        for name, table in ec.physical_tables().items():  # the average in the table's stored row order
            avg = opt.moving_average(table.weight).cpu()
            out[f"ema_now/{name}"] = to_logical(avg, table.config.num_embeddings, table.row_layout)
    return out


# float32: XLA compiles each step into fused loops whose rounding differs from the CPU's eager ops, and non-lazy
# Adam's m/√v on rows that were rarely looked up (small v) amplifies it: 1.5e-6 on `col` at aa591d9, 2.0e-6 once
# every update is gated by the id exchange's overflow flag (a select that changes XLA's fusion, not the values).
@pytest.mark.parametrize("dtype, rtol, atol", [(torch.float64, 1e-6, 1e-9), (torch.float32, 1e-5, 3e-6)],
                         ids=["float64", "float32"])
@pytest.mark.parametrize("cfg", cases(SPMD), ids=str)
def test_placements_match_single_device_cpu(cfg: OptimizerConfig, dtype: torch.dtype, rtol: float, atol: float) -> None:
    ec, head, opt, compiles = train(DEV, cfg, dtype)
    assert met.executed_fallback_ops() == []
    assert compiles[0] == 1 and compiles[-1] == 1, compiles  # one graph from the first step on
    specs = {n: sharding_spec(t) for n, t in ec.embedding_tables.items()}
    assert specs["row"].startswith("{devices=[4,1]") and specs["col"].startswith("{devices=[1,4]"), specs
    assert specs["rep"] == "{replicated}"
    # Padded to a multiple of lcm(512, 4) in every placement (same shapes in every layout), invisible below.
    assert {n: t.shape[0] for n, t in ec.embedding_tables.items()} == {"row": 1024, "col": 512, "rep": 512}
    xla = comparable(ec, head, opt)
    cpu = comparable(*train(torch.device("cpu"), cfg, dtype)[:3])
    assert set(xla) == set(cpu)
    for k in cpu:
        assert xla[k].shape == cpu[k].shape, k  # padding and trash rows never leak
        torch.testing.assert_close(xla[k], cpu[k], rtol=rtol, atol=atol, msg=k)
    for name_, t in ec.embedding_tables.items():
        for slot, v in opt.state[t].items():
            if v.dim() == 2 and not slot.startswith("acc_"):  # table-shaped slots carry the table's layout
                assert sharding_spec(v) == specs[name_], (name_, slot)


def test_batch_sharded_inputs_data_parallel() -> None:
    """Ids and dense features on the device, split over the mesh by batch (shard_batch): same numbers."""
    from torch_tpu_embedding.xla import shard_batch

    def run(device: torch.device):
        torch.manual_seed(0)
        t = tte.TableConfig(4001, D, name="t", placement="row", combiner="sum")
        ec = tte.EmbeddingCollection({"u": tte.FeatureConfig(t), "s": tte.FeatureConfig(t, max_sequence_length=3)},
                                     device=device)
        head = torch.nn.Linear(2 * D, 1).to(device)
        if device.type == "xla":
            shard(ec, device_mesh())
            replicate(head)
        opt = O.Adagrad(list(ec.parameters()) + list(head.parameters()), lr=0.1, gradient_accumulation_steps=2)
        opt.init_state()
        compiles = []
        if device.type == "xla":
            torch_xla.sync()
            met.clear_all()
        g = torch.Generator().manual_seed(3)
        for _ in range(8):
            u = torch.randint(0, 4001, (16,), generator=g).to(device)
            s = torch.randint(0, 4001, (16, 3), generator=g).to(device)
            x = torch.randn(16, D, generator=g).to(device)
            if device.type == "xla":
                u, s, x = shard_batch(u), shard_batch(s), shard_batch(x)
            out = ec({"u": u, "s": tte.Padded(s)})
            pred = head(torch.cat([out["u"] * x, out["s"].sum(1)], dim=1))
            pred.square().sum().backward()
            opt.step()
            opt.zero_grad()
            if device.type == "xla":
                torch_xla.sync()
                compiles.append(met.counter_value("UncachedCompile"))
        return ec, compiles

    ec, compiles = run(DEV)
    assert met.executed_fallback_ops() == []
    assert compiles[0] == 1 and compiles[-1] == 1, compiles
    assert sharding_spec(ec.tables.t.weight).startswith("{devices=[4,1]")
    ref, _ = run(torch.device("cpu"))
    torch.testing.assert_close(ec.state_dict()["tables.t.weight"].cpu(), ref.tables.t.weight.detach(),
                               rtol=1e-5, atol=1e-6)


def test_a_row_table_that_cannot_use_the_id_exchange_warns_and_still_trains_like_the_cpu() -> None:
    """On a 2-D mesh the id exchange is not available: shard() says so (the partitioner's lookup moves
    bytes that grow with the device count), and the table trains as on the CPU all the same."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    def run(device: torch.device, mesh: object = None) -> torch.Tensor:
        torch.manual_seed(0)
        ec = tte.EmbeddingCollection(
            {"f": tte.FeatureConfig(tte.TableConfig(3000, 8, name="t", placement="row"), max_ids_per_bag=3)},
            device=device)
        if mesh is not None:
            with pytest.warns(UserWarning, match=r"Row-sharded table\(s\) `t` cannot train through the id exchange "
                              r"on this mesh \(shape \{'x': 2, 'y': 2\}, sharded over axis 'x'\)"):
                assert shard(ec, mesh, axis="x") == {"t": "row"}
            assert not table_info(ec.tables.t.weight).sharding.exchange  # type: ignore[union-attr]
        opt = tte.optim.Adam(ec.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            ec({"f": tte.Padded(torch.randint(0, 3000, (8, 3), generator=g))})["f"].square().sum().backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
        return ec.state_dict()["tables.t.weight"].cpu()

    got = run(DEV, xs.Mesh(np.arange(4), (2, 2), ("x", "y")))
    torch.testing.assert_close(got, run(torch.device("cpu")), rtol=1e-5, atol=1e-6)
