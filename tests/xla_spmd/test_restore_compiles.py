"""A checkpoint with gradient accumulation loaded on the mesh: the steps after the load run one graph.

The pending accumulation buffers of a row-sharded table (through the id exchange) are restored as wide as the
step makes them. Before, they were as wide as the most entries one shard held, and the first step after the load
compiled a graph of its own: UncachedCompile [1, 2, 2]. Run with PJRT_DEVICE=CPU
CPU_NUM_DEVICES=4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import replicate, shard  # noqa: E402

DEV = torch_xla.device()


def _model() -> tuple[torch.nn.ModuleDict, Any]:
    torch.manual_seed(0)
    row = tte.TableConfig(1001, 8, name="row", placement="row")
    col = tte.TableConfig(64, 8, name="col", placement="column")
    col2 = tte.TableConfig(30, 8, name="col2", placement="column")  # stacked with `col`
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(row, max_ids_per_bag=3), "b": tte.FeatureConfig(row),
                                  "c": tte.FeatureConfig(col, max_ids_per_bag=2), "d": tte.FeatureConfig(col2)},
                                 device=DEV)
    head = torch.nn.Linear(8, 1).to(DEV)
    assert shard(ec) == {"row": "row", "col": "column", "col2": "column"}
    replicate(head)
    model = torch.nn.ModuleDict({"ec": ec, "head": head})
    opt = tte.optim.Adagrad(list(model.parameters()), lr=0.1, gradient_accumulation_steps=2)
    opt.init_state()
    torch_xla.sync()
    return model, opt


def _steps(model: torch.nn.ModuleDict, opt: Any, seed: int, n: int, loss: str = "square") -> list[int]:
    g = torch.Generator().manual_seed(seed)
    met.clear_all()
    compiles = []
    for _ in range(n):
        out = model["ec"]({"a": tte.Padded(torch.randint(0, 1001, (8, 3), generator=g)),
                           "b": torch.randint(0, 1001, (8,), generator=g),
                           "c": tte.Padded(torch.randint(0, 64, (8, 2), generator=g)),
                           "d": torch.randint(0, 30, (8,), generator=g)})
        getattr(model["head"](out["a"] * out["b"] + out["c"] * out["d"]), loss)().sum().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        compiles.append(met.counter_value("UncachedCompile") or 0)
    return compiles


def test_steps_after_loading_pending_accumulation_compile_once() -> None:
    model, opt = _model()
    # Another loss before the save: those graphs are not the ones counted after the load.
    _steps(model, opt, seed=1, n=3, loss="square")  # the window of the third call is pending
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    loaded, loaded_opt = _model()
    loaded.load_state_dict(saved["model"])
    loaded_opt.load_state_dict(saved["optimizer"])
    torch_xla.sync()  # the load's copies: a graph of their own
    assert _steps(loaded, loaded_opt, seed=2, n=3, loss="abs") == [1, 1, 1]
    _steps(model, opt, seed=2, n=3, loss="abs")  # the uninterrupted run
    for key, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key].cpu(), v.cpu(), rtol=1e-6, atol=1e-7, msg=key)
