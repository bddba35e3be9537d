"""Checkpoints written before the optimizer core was split into modules (commit a4a4da5) still load
bitwise, and training on from them gives bitwise the results that code recorded (tests/data/pre_split)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte

DATA = Path(__file__).parent / "data"
sys.path.insert(0, os.fspath(DATA))
from pre_split.configs import CONFIGS, build, train  # noqa: E402

# Dense parameters beside a fused group are numbered as if the group's tables were separate
# (so their keys survive fusing and unfusing); the old files' keys load under the new numbers.
RENAMED = {"adagrad-fused-accum": {"param:1": "param:2", "param:2": "param:3"}}


def _renamed(name: str, opt_state: dict) -> dict:
    r = RENAMED.get(name, {})
    out = {**opt_state, "state": {r.get(k, k): v for k, v in opt_state["state"].items()}}
    if "param_groups" in opt_state:
        out["param_groups"] = [{**g, "params": [r.get(k, k) for k in g["params"]]} for g in opt_state["param_groups"]]
    return out


def _equal(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), (where, sorted(a), sorted(b))
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pre_split_checkpoint_loads_and_trains_on_bitwise(name: str) -> None:
    saved = torch.load(DATA / "pre_split" / f"{name}.pt", weights_only=True)
    model, opt = build(name)
    assert tte.checkpoint.load(DATA / "pre_split" / f"{name}.pt", model=model, optimizer=opt) == {"config": name}
    _equal(saved["model"], dict(model.state_dict()), "model")
    _equal(_renamed(name, saved["optimizer"])["state"], opt.state_dict()["state"], "optimizer")
    train(model, opt, 5, 3)
    after = torch.load(DATA / "pre_split" / f"{name}.after.pt", weights_only=True)
    _equal(after["model"], dict(model.state_dict()), "model after")
    _equal(_renamed(name, after["optimizer"]), opt.state_dict(), "optimizer after")


def test_pre_split_distributed_checkpoint_loads_on_cpu() -> None:
    model, opt = build("adam-dcp")
    tte.checkpoint.load_distributed(DATA / "pre_split" / "adam-dcp.dcp", model=model, optimizer=opt)
    train(model, opt, 5, 3)
    after = torch.load(DATA / "pre_split" / "adam-dcp.after.pt", weights_only=True)
    _equal(after["model"], dict(model.state_dict()), "model after")
    _equal(after["optimizer"], opt.state_dict(), "optimizer after")
