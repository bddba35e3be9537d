"""A load into a model built on the meta device and not drawn yet (``device="meta"``, deferred initialization) is
refused, naming the tables and the dense tensors and what draws them; after ``to_empty`` the same load loads.

A copy into a meta tensor writes nothing: before, ``tte.checkpoint.load`` returned as if it had loaded (the tables
and the optimizer's slots still on the meta device, not even torch's warning), and ``load_distributed`` raised
``CheckpointCorruptError`` ("Default process group has not been initialized ... some tensors may have been read").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte


def _model(device: str | None = None, stack: bool | None = None) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    a = tte.TableConfig(10, 4, name="a", dtype=torch.float64)
    b = tte.TableConfig(7, 4, name="b", dtype=torch.float64)  # stacked with `a` by default
    ec = tte.EmbeddingCollection({"fa": tte.FeatureConfig(a), "fb": tte.FeatureConfig(b)}, device=device,
                                 stack_tables=stack)
    return torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(4, 1, dtype=torch.float64, device=device)})


@pytest.mark.parametrize("stack", [None, False], ids=["stacked", "unstacked"])
@pytest.mark.parametrize("kind", ["file", "distributed"])
def test_a_load_into_tables_on_the_meta_device_is_refused(tmp_path: Path, kind: str, stack: bool | None) -> None:
    source = _model()
    opt = tte.optim.Adagrad(source.parameters(), lr=0.1)
    out = source["ec"]({"fa": torch.tensor([1, 2]), "fb": torch.tensor([3, 3])})
    source["head"](out["fa"] + out["fb"]).sum().backward()
    opt.step()
    save, load = ((tte.checkpoint.save, tte.checkpoint.load) if kind == "file" else
                  (tte.checkpoint.save_distributed, tte.checkpoint.load_distributed))
    save(tmp_path / "ck", model=source, optimizer=opt)
    model = _model("meta", stack)
    meta_opt = tte.optim.Adagrad(model.parameters(), lr=0.1)
    want = (r"does not match \(nothing was loaded\): .*table `a` is on the meta device \(built with device=\"meta\": "
            r"it holds no values for a load to write\): call model.to_empty\(device=...\) or "
            r"tte.distributed.shard\(model, device=...\) first; .*table `b` is on the meta device.*"
            r"`head.weight` is on the meta device .* call module.to_empty\(device=...\) for it first")
    with pytest.raises(tte.checkpoint.CheckpointMismatchError, match=want):
        load(tmp_path / "ck", model=model, optimizer=meta_opt)
    assert not any(meta_opt.state.values())  # (no slots made for the refused load)
    model.to_empty(device="cpu")  # drawn: the same load loads, bitwise the saved values
    opt2 = tte.optim.Adagrad(model.parameters(), lr=0.1)
    load(tmp_path / "ck", model=model, optimizer=opt2)
    for key, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    saved_state = opt.state_dict()["state"]
    for table in ("table:a", "table:b"):
        assert torch.equal(opt2.state_dict()["state"][table]["accumulators"], saved_state[table]["accumulators"])
