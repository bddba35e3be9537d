"""``tte.TrainPipeline`` on a 4-device SPMD mesh (``after_step=torch_xla.sync``) == the same pipeline on the CPU, with
input prefetch and with pipelined execution (``pipeline_execution_with_tensor_core=True``), float32, SGD, Adagrad
and LazyAdam.

The tables: row-sharded (1001 rows: padded to 1024; its rows reached through the id exchange), column-sharded and
replicated, a replicated head. The CPU pipelines themselves equal the plain loop and TF's one-step-stale schedule
written out by hand (tests/train/test_pipeline.py); here every weight and optimizer slot of the mesh equals the CPU's
within test_spmd_training.py's float32 tolerance, and the two schedules differ by far more than it (so a mesh that
ran the other schedule fails). Run in its own process: PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns that XLA_USE_SPMD (set by the first) is deprecated
    xr.use_spmd()  # before any XLA tensor exists
import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, replicate, shard, sharding_spec  # noqa: E402

DEV = torch_xla.device()
D, STEPS = 8, 5
RTOL, ATOL = 1e-5, 3e-6  # tests/xla_spmd/test_spmd_training.py's float32 tolerance
OPTS = {"sgd": lambda ps: tte.optim.SGD(ps, lr=0.5), "adagrad": lambda ps: tte.optim.Adagrad(ps, lr=0.3),
        "lazy_adam": lambda ps: tte.optim.LazyAdam(ps, lr=0.05)}


def build(device: torch.device, opt: str) -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer]:
    torch.manual_seed(0)
    row = tte.TableConfig(1001, D, name="row", combiner="mean", placement="row")
    col = tte.TableConfig(50, D, name="col", combiner="sum", placement="column")
    rep = tte.TableConfig(30, D, name="rep", combiner="sqrtn", placement="replicated")
    ec = tte.EmbeddingCollection(
        {"a": tte.FeatureConfig(row, max_ids_per_bag=4), "b": tte.FeatureConfig(col),
         "c": tte.FeatureConfig(rep, max_ids_per_bag=2), "d": tte.FeatureConfig(row)}, device=device)
    head = torch.nn.Linear(4 * D, 1).to(device)
    if device.type == "xla":
        assert shard(ec, device_mesh()) == {"row": "row", "col": "column", "rep": "replicated"}
        replicate(head)
    model = torch.nn.ModuleDict({"ec": ec, "head": head})
    optimizer = OPTS[opt](list(ec.parameters()) + list(head.parameters()))
    optimizer.init_state()  # type: ignore[attr-defined]
    return model, optimizer


def batches() -> list[dict[str, Any]]:
    """Host batches of 8 (ids repeat across consecutive batches: 120 of `row`'s rows, 50 of `col`'s, 30 of `rep`'s)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 5, (8,), generator=g)
        out.append({"sparse": {"a": tte.Jagged(torch.randint(0, 120, (int(lengths.sum()),), generator=g), lengths=lengths),
                               "b": torch.randint(0, 50, (8,), generator=g),
                               "c": tte.Padded(torch.randint(0, 30, (8, 2), generator=g), torch.rand(8, 2, generator=g) > 0.3),
                               "d": torch.randint(0, 120, (8,), generator=g)},
                    "y": torch.rand(8, generator=g)})
    return out


def step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    out = model["ec"](batch["sparse"])
    x = torch.tanh(torch.cat([out["a"], out["b"], out["c"], out["d"]], dim=1))
    y = batch["y"].to(x.device)
    return torch.nn.functional.mse_loss(model["head"](x).squeeze(1), y)


def run(device: torch.device, opt: str, stale: bool) -> dict[str, torch.Tensor]:
    """STEPS steps through TrainPipeline (prefetch on); every weight (logical rows) and optimizer slot on the CPU."""
    model, optimizer = build(device, opt)
    xla = device.type == "xla"
    if xla:
        torch_xla.sync()
        met.clear_all()
    compiles: list[int] = []

    def after_step() -> None:
        torch_xla.sync()
        compiles.append(met.counter_value("UncachedCompile") or 0)

    pipe = tte.TrainPipeline(model, optimizer, step=step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=stale, after_step=after_step if xla else None)
    assert sum(1 for _ in pipe.run(batches())) == STEPS
    if xla:
        assert met.executed_fallback_ops() == []  # (no host read in a step)
        # One graph per kind of step: prefetch one from the first step on; pipelined execution one for step 0 (its
        # batch looked up in the step), one for the steady steps (their batch looked up in the step before), one for
        # the last (nothing left to look up ahead).
        assert compiles == ([1, 2, 2, 2, 3] if stale else [1] * STEPS), compiles
    assert not [t for t in threading.enumerate() if t.name == "tte-prefetch"]
    if xla:
        assert sharding_spec(model["ec"].embedding_tables["row"]).startswith("{devices=[4,1]")
        assert sharding_spec(model["ec"].embedding_tables["col"]).startswith("{devices=[1,4]")
    out = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    for key, slots in optimizer.state_dict()["state"].items():
        for slot, v in slots.items():
            if isinstance(v, torch.Tensor) and not slot.startswith("acc_"):  # (acc_*: sized by the padded batch)
                out[f"{key}/{slot}"] = v.detach().cpu()
    return out


_CPU: dict[tuple[str, bool], dict[str, torch.Tensor]] = {}


def cpu(opt: str, stale: bool) -> dict[str, torch.Tensor]:
    if (opt, stale) not in _CPU:
        _CPU[(opt, stale)] = run(torch.device("cpu"), opt, stale)
    return _CPU[(opt, stale)]


@pytest.mark.parametrize("stale", [False, True], ids=["prefetch", "pipelined"])
@pytest.mark.parametrize("opt", list(OPTS))
def test_the_mesh_equals_the_cpu_pipeline(opt: str, stale: bool) -> None:
    got, want = run(DEV, opt, stale), cpu(opt, stale)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k  # padding rows never leak
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=k)


@pytest.mark.parametrize("opt", list(OPTS))
def test_the_schedules_differ_beyond_the_tolerance(opt: str) -> None:
    """Pipelined execution ends elsewhere than prefetch on the CPU, by far more than the tolerance, in every table
    and the head: a mesh that looked up fresh tables (or the wrong batch) would fail the comparison above."""
    plain, stale = cpu(opt, False), cpu(opt, True)
    for k in ("ec.tables.row.weight", "ec.tables.col.weight", "ec.tables.rep.weight", "head.weight"):
        beyond = (plain[k] - stale[k]).abs() / (ATOL + RTOL * stale[k].abs())  # > 1: assert_close fails
        assert float(beyond.max()) > 20, (opt, k, float(beyond.max()))
