"""A checkpoint with gradient accumulation loaded on the mesh: the steps after the load run one graph.

Restored pending accumulation buffers narrower than the step's (the most entries one shard of a row-sharded
table held; a checkpoint of the CPU or of another mesh size) are widened on the host at the first step, not
inside it: widened inside, the first step after the load compiled a graph of its own (UncachedCompile
[1, 2, 2]). Buffers read from a file get the layout the step gives its own. Run with PJRT_DEVICE=CPU
CPU_NUM_DEVICES=4.
"""

from __future__ import annotations

from pathlib import Path
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


def _model(device: torch.device = DEV, make_opt: Any = None) -> tuple[torch.nn.ModuleDict, Any]:
    torch.manual_seed(0)
    row = tte.TableConfig(1001, 8, name="row", placement="row")
    col = tte.TableConfig(64, 8, name="col", placement="column")
    col2 = tte.TableConfig(30, 8, name="col2", placement="column")  # stacked with `col`
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(row, max_ids_per_bag=3), "b": tte.FeatureConfig(row),
                                  "c": tte.FeatureConfig(col, max_ids_per_bag=2), "d": tte.FeatureConfig(col2)},
                                 device=device)
    head = torch.nn.Linear(8, 1).to(device)
    if device.type == "xla":
        assert shard(ec) == {"row": "row", "col": "column", "col2": "column"}
        replicate(head)
    model = torch.nn.ModuleDict({"ec": ec, "head": head})
    params = list(model.parameters())
    opt = make_opt(params) if make_opt else tte.optim.Adagrad(params, lr=0.1, gradient_accumulation_steps=2)
    opt.init_state()
    if device.type == "xla":
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
        if out["a"].device.type == "xla":
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


def _adam(params: Any) -> Any:
    return tte.optim.Adam(params, lr=0.05, gradient_accumulation_steps=2)


def test_pending_accumulation_of_a_column_group_loaded_from_a_file_compiles_once(tmp_path: Path) -> None:
    """A checkpoint file holds the pending buffers as host tensors. Restored without a layout, the stacked
    column group's buffers came out of the first step split along the embedding dimension and the second
    step compiled again: [1, 2, 2, 2] before the fix. (In memory the saving model's device tensors kept
    their layout, and nothing showed.)"""
    model, opt = _model(make_opt=_adam)
    _steps(model, opt, seed=1, n=3, loss="square")  # the third call's window is pending
    tte.checkpoint.save(tmp_path / "ck.pt", model=model, optimizer=opt)
    loaded, loaded_opt = _model(make_opt=_adam)
    tte.checkpoint.load(tmp_path / "ck.pt", model=loaded, optimizer=loaded_opt)
    torch_xla.sync()
    # (A loss of each test's own: the graphs after the load are new to this process, and counted.)
    assert _steps(loaded, loaded_opt, seed=2, n=4, loss="neg") == [1, 1, 1, 1]
    # The same numbers as the CPU's seven calls without a load (float32: a few ulp of the weights).
    ref, ref_opt = _model(torch.device("cpu"), make_opt=_adam)
    _steps(ref, ref_opt, seed=1, n=3, loss="square")
    _steps(ref, ref_opt, seed=2, n=4, loss="neg")
    for key, v in ref.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key].cpu(), v, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(("make_opt", "loss"), [(None, "sin"), (_adam, "cos")], ids=["adagrad", "adam"])
def test_pending_accumulation_saved_on_the_cpu_compiles_once(tmp_path: Path, make_opt: Any, loss: str) -> None:
    """Saved on the CPU, the row table's window is as wide as one call's ids (2x32). Restored on the mesh it
    was 8x13 (the saved width over the 4 shards, 8, or the most entries one shard owned, 13), where the step
    keeps 8x32 (4 sources x 8 entries per shard): widened inside the first step, that step was a graph of its
    own ([1, 2, 2, 2]). The saved width tells the step's only for a checkpoint of the same mesh size."""
    loaded, loaded_opt = _model(make_opt=make_opt)  # (the XLA runtime starts before the CPU's backward)
    ref, ref_opt = _model(torch.device("cpu"), make_opt=make_opt)
    _steps(ref, ref_opt, seed=1, n=3, loss="square")  # the third call's window is pending
    tte.checkpoint.save(tmp_path / "ck.pt", model=ref, optimizer=ref_opt)
    tte.checkpoint.load(tmp_path / "ck.pt", model=loaded, optimizer=loaded_opt)
    torch_xla.sync()
    assert _steps(loaded, loaded_opt, seed=2, n=4, loss=loss) == [1, 1, 1, 1]
    _steps(ref, ref_opt, seed=2, n=4, loss=loss)  # the CPU run without a load
    for key, v in ref.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key].cpu(), v, rtol=1e-5, atol=1e-6, msg=key)
