"""Checkpoints written before the optimizer core was split into modules (commit a4a4da5) still load
bitwise, and training on from them gives the results that code recorded (tests/data/pre_split).

Training on is compared twice. Bitwise, on any machine: against training on from the same values saved
and loaded by today's code (an old file is as good as a new one). And against what the old code recorded:
bitwise on the CPU that recorded it, within float64 rounding elsewhere — float64 kernels that pick their
code by CPU (vectorized reductions, MKL) round some results differently in the last bit (measured on an
Intel CPU with AVX-512: 5.6e-17 on values of order 0.1 after three steps), while any change in what a step
computes moves them by far more than 1e-12."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte

DATA = Path(__file__).parents[1] / "data"
sys.path.insert(0, os.fspath(DATA))
from pre_split.configs import CONFIGS, build, train  # noqa: E402

# Dense parameters beside a stacked group are numbered as if the group's tables were separate
# (so their keys survive fusing and unfusing); the old files' keys load under the new numbers.
RENAMED = {"adagrad-fused-accum": {"param:1": "param:2", "param:2": "param:3"}}


def _renamed(name: str, opt_state: dict) -> dict:
    r = RENAMED.get(name, {})
    out = {**opt_state, "state": {r.get(k, k): v for k, v in opt_state["state"].items()}}
    if "param_groups" in opt_state:
        out["param_groups"] = [{**g, "params": [r.get(k, k) for k in g["params"]]} for g in opt_state["param_groups"]]
    return out


def _recorded(opt_state: dict) -> dict:
    """A recorded optimizer state with the keys ``state_dict()`` gained since: ``overflowed_steps``
    (calls an id-exchange overflow dropped) is 0 in these runs, which have no exchange."""
    return {"overflowed_steps": 0, **opt_state}


def _pending(state: dict) -> dict:
    """A table's pending accumulation buffers as their entries: per micro-batch, the ids that are not
    padding (-1) and their rows, in order. Where the padding sits is the lookup's layout, not state:
    since eager lookups stopped padding bags to the longest one, a micro-batch's ids come compacted."""
    ids, rows = state["acc_ids"], state["acc_rows"]
    keep = [r >= 0 for r in ids]
    return {"ids": [r[k] for r, k in zip(ids, keep, strict=True)],
            "rows": [r[k] for r, k in zip(rows, keep, strict=True)]}


def _equal(a: object, b: object, where: str, rounding: bool = False) -> None:
    """``a`` equals ``b`` bitwise (``rounding``: floating-point tensors within float64 rounding);
    pending accumulation buffers entry by entry (:func:`_pending`)."""
    if isinstance(a, dict) and "acc_ids" in a and isinstance(b, dict) and "acc_ids" in b:
        _equal({k: v for k, v in a.items() if k not in ("acc_ids", "acc_rows")},
               {k: v for k, v in b.items() if k not in ("acc_ids", "acc_rows")}, where, rounding)
        _equal(_pending(a), _pending(b), f"{where}/pending", rounding)
        return
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        if rounding and a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), (where, sorted(a), sorted(b))
        for k in a:
            _equal(a[k], b[k], f"{where}/{k}", rounding)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]", rounding)
    else:
        assert a == b, (where, a, b)


def _trained_from_todays_save(name: str, model: torch.nn.ModuleDict, opt: object, tmp: Path) -> dict:
    """``model`` and ``opt`` saved by today's code, loaded into a new pair, trained on as the test does."""
    tte.checkpoint.save(tmp / "today.pt", model=model, optimizer=opt)
    again, again_opt = build(name)
    tte.checkpoint.load(tmp / "today.pt", model=again, optimizer=again_opt)
    train(again, again_opt, 5, 3)
    return {"model": dict(again.state_dict()), "optimizer": again_opt.state_dict()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_pre_split_checkpoint_loads_and_trains_on_bitwise(name: str, tmp_path: Path) -> None:
    saved = torch.load(DATA / "pre_split" / f"{name}.pt", weights_only=True)
    model, opt = build(name)
    assert tte.checkpoint.load(DATA / "pre_split" / f"{name}.pt", model=model, optimizer=opt) == {"config": name}
    _equal(saved["model"], dict(model.state_dict()), "model")
    _equal(_renamed(name, saved["optimizer"])["state"], opt.state_dict()["state"], "optimizer")
    today = _trained_from_todays_save(name, model, opt, tmp_path)
    train(model, opt, 5, 3)
    _equal(today["model"], dict(model.state_dict()), "model after, against today's save")
    _equal(today["optimizer"], opt.state_dict(), "optimizer after, against today's save")
    after = torch.load(DATA / "pre_split" / f"{name}.after.pt", weights_only=True)
    _equal(after["model"], dict(model.state_dict()), "model after", rounding=True)
    _equal(_recorded(_renamed(name, after["optimizer"])), opt.state_dict(), "optimizer after", rounding=True)


def test_pre_split_distributed_checkpoint_loads_on_cpu(tmp_path: Path) -> None:
    model, opt = build("adam-dcp")
    tte.checkpoint.load_distributed(DATA / "pre_split" / "adam-dcp.dcp", model=model, optimizer=opt)
    today = _trained_from_todays_save("adam-dcp", model, opt, tmp_path)
    train(model, opt, 5, 3)
    _equal(today["model"], dict(model.state_dict()), "model after, against today's save")
    _equal(today["optimizer"], opt.state_dict(), "optimizer after, against today's save")
    after = torch.load(DATA / "pre_split" / "adam-dcp.after.pt", weights_only=True)
    _equal(after["model"], dict(model.state_dict()), "model after", rounding=True)
    _equal(_recorded(after["optimizer"]), opt.state_dict(), "optimizer after", rounding=True)
