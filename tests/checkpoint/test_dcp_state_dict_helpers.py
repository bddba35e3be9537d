"""torch's distributed-checkpoint helpers on this package's optimizers (issue [conformance] item 3).

``torch.distributed.checkpoint.state_dict``'s ``get_/set_optimizer_state_dict`` and
``get_/set_model_state_dict`` (what TorchTitan-style loops checkpoint with), in one process with no
process group, on a model with stacked tables, a table of its own and dense layers, for every
optimizer of tests/optim_registry.py. On main they raised ``KeyError: 'param:<i>'``, and on a fresh
optimizer the helpers' zero-gradient step allocated a ``[V, D]`` gradient per table and moved FTRL's
dense weights.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from optim_registry import OPTIMIZER_INFOS, OptimizerInfo
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._state import state_save

DATA = Path(__file__).parents[1] / "data"
sys.path.insert(0, os.fspath(DATA))
from pre_exchange.configs import build as pre_exchange_build, step as pre_exchange_step  # noqa: E402, I001
from pre_split.configs import CONFIGS as PRE_SPLIT, build as pre_split_build, train as pre_split_train  # noqa: E402, I001
from _stacked_model import Model, batches  # noqa: E402, I001



def train(model: Model, opt: torch.optim.Optimizer, data: Iterator[dict[str, tte.Jagged]], steps: int) -> None:
    for _ in range(steps):
        model(next(data)).backward()
        opt.step()
        opt.zero_grad()


def make(info: OptimizerInfo, model: Model) -> Any:
    return info.cls(model.parameters(), **info.default)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            assert_bitwise(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def assert_same_pending(a: dict[str, Any], b: dict[str, Any]) -> None:
    """``a`` equals ``b`` bitwise, except that a pending accumulation buffer (``acc_ids`` /
    ``acc_rows``, whose width follows the stacking) is compared as its rows summed per call and id."""
    def split(sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[dict[int, torch.Tensor]]]]:
        rest = {**sd, "state": {}}
        pending = {}
        for key, entry in sd["state"].items():
            rest["state"][key] = {k: v for k, v in entry.items() if k not in ("acc_ids", "acc_rows")}
            if "acc_ids" in entry:
                calls = []
                for ids, rows in zip(entry["acc_ids"], entry["acc_rows"], strict=True):
                    sums: dict[int, torch.Tensor] = {}
                    for i, r in zip(ids.tolist(), rows, strict=True):
                        if i >= 0:
                            sums[i] = sums[i] + r if i in sums else r.clone()
                    calls.append(dict(sorted(sums.items())))
                pending[key] = calls
        return rest, pending

    (ra, pa), (rb, pb) = split(a), split(b)
    assert_bitwise(ra, rb)
    assert_bitwise(pa, pb)


class NoTableSizedAllocations:
    """Records every ``torch.zeros_like`` of a tensor as large as a table or stacked group (the
    helpers' ``_init_optim_state`` makes one per parameter) and every ``.grad`` set on the model."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.sizes = {p.numel() for n, p in model.named_parameters() if n.startswith("ec.")}
        self.calls: list[tuple[int, ...]] = []

    def __enter__(self) -> NoTableSizedAllocations:
        self.patch = pytest.MonkeyPatch()
        real = torch.zeros_like

        def zeros_like(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if t.numel() in self.sizes:
                self.calls.append(tuple(t.shape))
            return real(t, *args, **kwargs)

        self.patch.setattr(torch, "zeros_like", zeros_like)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.patch.undo()
        assert self.calls == [], f"table-sized zeros_like: {self.calls}"
        assert [n for n, p in self.model.named_parameters() if p.grad is not None] == []


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_round_trip_into_a_fresh_optimizer_and_training_continues_bitwise(info: OptimizerInfo) -> None:
    data = batches()
    model = Model()
    opt = make(info, model)  # no opt-in: the helpers get torch's layout
    train(model, opt, data, 3)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    # torch's layout under the parameters' module paths: the stacked group's entry, the own table's, the dense
    assert list(msd) == ["ec.tables.a.weight", "ec.tables.b.weight", "ec.tables.c.weight",
                         "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"]
    assert set(osd["state"]) == {"ec.groups.fused_0.weight", "ec.tables.c.weight",
                                 "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"}
    assert [g["params"] for g in osd["param_groups"]] == [[n for n, _ in model.named_parameters()]]
    assert osd["param_groups"][0]["iterations"] == 3

    fresh = Model(seed=7)  # other weights: everything must come from the checkpoint
    opt2 = make(info, fresh)  # a fresh optimizer, not even turned to torch's layout: set needs nothing
    before = weights(fresh)
    with NoTableSizedAllocations(fresh):
        set_optimizer_state_dict(fresh, opt2, osd)
    assert_bitwise(weights(fresh), before)  # the optimizer's load changes no weight (FTRL included)
    set_model_state_dict(fresh, msd)
    assert_bitwise(weights(fresh), weights(model))

    assert_bitwise(_ours(opt2), _ours(opt))

    train(model, opt, batches(5), 4)
    train(fresh, opt2, batches(5), 4)
    assert_bitwise(weights(fresh), weights(model))
    assert_bitwise(_ours(opt2), _ours(opt))


def _ours(opt: Any) -> dict[str, Any]:
    """``opt``'s state in our own layout (``table:<name>`` keys), whatever hooks it has."""
    return state_save.state_dict(opt)


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_a_fresh_optimizer_gives_its_initial_state_without_stepping(info: OptimizerInfo) -> None:
    """The restore flow's first call (the template ``dcp.load`` fills): no ``[V, D]`` gradient, no
    step, no weight changed; the state is each slot's initial value, as ``init_state()`` makes it."""
    model = Model()
    opt = make(info, model)  # no opt-in: the helpers get torch's layout
    before = weights(model)
    with NoTableSizedAllocations(model):
        osd = get_optimizer_state_dict(model, opt)
    assert_bitwise(weights(model), before)
    assert opt._run.iterations == 0 and osd["param_groups"][0]["iterations"] == 0
    ref = make(info, Model())
    ref.init_state()
    assert_bitwise(_ours(opt), _ours(ref))
    assert set(osd["state"]) == {"ec.groups.fused_0.weight", "ec.tables.c.weight", "mlp.0.weight", "mlp.0.bias",
                                 "mlp.2.weight", "mlp.2.bias"}


@pytest.mark.parametrize("name", ["ftrl", "adafactor", "lazy_adam"])
def test_dcp_save_and_load_through_files(name: str, tmp_path: Any) -> None:
    """TorchTitan's flow: ``get_state_dict`` → ``dcp.save``; a new model and optimizer's
    ``get_state_dict`` as the template → ``dcp.load`` → ``set_state_dict``."""
    info = next(i for i in OPTIMIZER_INFOS if i.name == name)
    data = batches()
    model = Model()
    opt = make(info, model)  # no opt-in: the helpers get torch's layout
    train(model, opt, data, 3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path)
    fresh = Model(seed=9)
    opt2 = make(info, fresh)
    with NoTableSizedAllocations(fresh):
        tm, to = get_state_dict(fresh, opt2)
    sd = {"model": tm, "optim": to}
    dcp.load(sd, checkpoint_id=tmp_path)
    set_state_dict(fresh, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert_bitwise(weights(fresh), weights(model))
    assert_bitwise(_ours(opt2), _ours(opt))
    train(model, opt, batches(5), 3)
    train(fresh, opt2, batches(5), 3)
    assert_bitwise(weights(fresh), weights(model))


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_into_a_model_built_with_stacking_off(info: OptimizerInfo) -> None:
    """The model's state (per table) moves through ``set_model_state_dict``; the optimizer's, keyed
    by parameter path (``ec.groups.fused_0.weight`` here, ``ec.tables.a.weight`` there), cannot pass
    ``set_optimizer_state_dict``: torch's ``_split_optim_state_dict`` reads ``osd["state"][path]`` for
    each parameter path of the loading model, before this package sees the dict, and
    ``get_optimizer_state_dict`` writes only the saving model's parameter paths. It loads with
    ``load_state_dict`` (the documented route), which splits the group's entry per table
    (``tte_params``), and the other way joins per-table entries into the group."""
    data = batches()
    stacked = Model()
    opt = make(info, stacked)
    train(stacked, opt, data, 3)
    msd, osd = get_model_state_dict(stacked), get_optimizer_state_dict(stacked, opt)
    plain = Model(stack=False, seed=11)
    opt2 = make(info, plain)
    set_model_state_dict(plain, msd)
    assert_bitwise(weights(plain), weights(stacked))
    # torch 2.9: KeyError; 2.13: RuntimeError "Missing optimizer state for parameter ..." (its
    # strict=False then loads the group's tables' state as missing: nothing gained)
    with pytest.raises((KeyError, RuntimeError), match="ec.tables.a.weight"):
        set_optimizer_state_dict(plain, opt2, osd)
    before = weights(plain)
    opt2.load_state_dict(osd)
    assert_bitwise(weights(plain), before)
    assert_bitwise(_ours(opt2), _ours(opt))  # per table, as the stacked optimizer's own layout has it
    # and back: the unstacked optimizer's torch layout into a stacked model
    back = Model(seed=12)
    opt3 = make(info, back)
    set_model_state_dict(back, get_model_state_dict(plain))
    plain_osd = get_optimizer_state_dict(plain, opt2)
    with pytest.raises((KeyError, RuntimeError), match="ec.groups.fused_0.weight"):
        set_optimizer_state_dict(back, opt3, plain_osd)
    assert not any(opt3.state.values()) and opt3._run.iterations == 0
    opt3.load_state_dict(plain_osd)
    assert_bitwise(_ours(opt3), _ours(opt))
    train(stacked, opt, batches(5), 3)
    train(back, opt3, batches(5), 3)
    assert_bitwise(weights(back), weights(stacked))


@pytest.mark.parametrize("name", sorted(PRE_SPLIT))
def test_pre_split_checkpoints_load_and_pass_through_the_helpers(name: str) -> None:
    """A checkpoint written before the core was split (tests/data/pre_split: pending accumulation
    buffers, EMA, a stacked group) loads into an optimizer turned to torch's layout, and its state
    goes through ``get_/set_optimizer_state_dict`` unchanged, and (``load_state_dict``) into a
    collection built as today's default, stacked."""
    model, opt = pre_split_build(name)
    tte.checkpoint.load(DATA / "pre_split" / f"{name}.pt", model=model, optimizer=opt)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    again, opt2 = pre_split_build(name)
    set_model_state_dict(again, msd)
    set_optimizer_state_dict(again, opt2, osd)
    assert_bitwise(_ours(opt2), _ours(opt))
    stacked, opt3 = pre_split_build(name, default_construction=True)
    set_model_state_dict(stacked, msd)
    opt3.load_state_dict(osd)
    assert_same_pending(_ours(opt3), _ours(opt))
    pre_split_train(model, opt, 5, 3)
    pre_split_train(again, opt2, 5, 3)
    assert_bitwise(dict(again.state_dict()), dict(model.state_dict()))


def test_pre_exchange_checkpoint_loads_and_passes_through_the_helpers() -> None:
    """tests/data/pre_exchange (a distributed checkpoint of row-sharded tables, a per-table optimizer
    override: two parameter groups) loads on the CPU and goes through the helpers unchanged."""
    model, opt = pre_exchange_build(torch.device("cpu"), spmd=False)
    tte.checkpoint.load_distributed(DATA / "pre_exchange" / "model.dcp", model=model, optimizer=opt)
    osd = get_optimizer_state_dict(model, opt)
    assert len(osd["param_groups"]) == 2
    again, opt2 = pre_exchange_build(torch.device("cpu"), spmd=False)
    set_model_state_dict(again, get_model_state_dict(model))
    set_optimizer_state_dict(again, opt2, osd)
    assert_bitwise(_ours(opt2), _ours(opt))
    for s in range(3):
        pre_exchange_step(model, opt, 50 + s)
        pre_exchange_step(again, opt2, 50 + s)
    assert_bitwise(dict(again.state_dict()), dict(model.state_dict()))
    assert_bitwise(_ours(opt2), _ours(opt))


def test_flattened_state_is_refused_not_loaded_with_its_counters_lost() -> None:
    """``flatten_optimizer_state_dict=True``: torch's unflattening keeps only the keys the live groups
    and slots have, which drops the call counter (and, for an optimizer with no slots yet, every slot)."""
    info = next(i for i in OPTIMIZER_INFOS if i.name == "adam")
    model = Model()
    opt = make(info, model)  # no opt-in: the helpers get torch's layout
    train(model, opt, batches(), 2)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    osd = get_optimizer_state_dict(model, opt, options=flat)
    assert osd["param_groups.ec.groups.fused_0.weight.iterations"] == 2
    fresh = Model(seed=3)
    opt2 = make(info, fresh)
    with pytest.raises(ValueError, match="has no 'iterations'"):
        set_optimizer_state_dict(fresh, opt2, osd, options=flat)
    assert not any(opt2.state.values()) and opt2._run.iterations == 0  # (torch's lookups leave empty entries)


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_the_helpers_get_torchs_layout_with_no_opt_in_and_every_other_caller_ours(info: OptimizerInfo) -> None:
    """No ``use_torch_layout``: ``get_optimizer_state_dict`` reads torch's layout from ``state_dict()``
    (on the branch before: ``KeyError: 'table:a'``), and ``opt.state_dict()`` called by anyone else
    (a user, ``tte.checkpoint``) is still ours; ``use_torch_layout`` still turns it for every caller and
    the helpers give the same dict through it. A fresh optimizer is never stepped (on main: a
    table-sized ``zeros_like`` per table at lr 0, and FTRL's dense weights moved)."""
    model = Model()
    opt = make(info, model)
    before = weights(model)
    with NoTableSizedAllocations(model):
        fresh_osd = get_optimizer_state_dict(model, opt)
    assert_bitwise(weights(model), before)
    assert opt._run.iterations == 0 and fresh_osd["param_groups"][0]["iterations"] == 0
    train(model, opt, batches(), 2)
    ours = opt.state_dict()
    assert {"table:a", "table:b", "table:c"} <= set(ours["state"]) and len(ours["state"]) == 7
    assert all(k.startswith(("table:", "param:")) for k in ours["state"])
    assert all(k.startswith(("table:", "param:")) for g in ours["param_groups"] for k in g["params"])
    osd = get_optimizer_state_dict(model, opt)
    assert "ec.groups.fused_0.weight" in osd["state"]
    turned = tte.optim.use_torch_layout(opt)
    assert turned is opt and set(opt.state_dict()["state"]) == set(range(6))
    assert_bitwise(get_optimizer_state_dict(model, opt), osd)


class _Subclassed(tte.optim.Adagrad):
    def state_dict(self) -> dict[str, Any]:  # an override calling super(), as users write them
        return super().state_dict()


def test_a_subclass_overriding_state_dict_still_gives_the_helpers_torchs_layout() -> None:
    model = Model()
    opt = _Subclassed(model.parameters(), lr=0.1)
    train(model, opt, batches(), 1)
    assert "table:a" in opt.state_dict()["state"]
    assert set(get_optimizer_state_dict(model, opt)["state"]) == {
        "ec.groups.fused_0.weight", "ec.tables.c.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"}


@pytest.mark.parametrize("bad", [
    lambda sd: sd["param_groups"][0].__setitem__("tte_params", sd["param_groups"][0]["tte_params"][:-1]),
    lambda sd: sd["param_groups"][0]["tte_params"][0].__setitem__("rows", [40]),
    lambda sd: sd["state"].__setitem__(0, torch.zeros(3)),
], ids=["tte_params short", "rows short", "entry not a mapping"])
def test_a_malformed_torch_layout_is_refused_before_anything_changes(bad: Any) -> None:
    info = next(i for i in OPTIMIZER_INFOS if i.name == "adagrad")
    model = Model()
    opt = tte.optim.use_torch_layout(make(info, model))  # torch's layout from state_dict() itself
    train(model, opt, batches(), 2)
    sd = opt.state_dict()
    bad(sd)
    fresh = Model(seed=3)
    opt2 = make(info, fresh)
    train(fresh, opt2, batches(7), 1)
    before = _ours(opt2)
    with pytest.raises(ValueError, match="Optimizer state does not match"):
        opt2.load_state_dict(sd)
    assert_bitwise(_ours(opt2), before)
