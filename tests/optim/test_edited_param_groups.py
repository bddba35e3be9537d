"""A hyper-parameter set in ``optimizer.param_groups[i]`` after construction (as torch users and LR schedulers edit
them) is checked by the next ``step()`` as the constructor checks it: a value the constructor refuses raises, naming
the group and the argument, before anything is taken or changed. Before, only ``lr`` was checked there: an Adagrad
``initial_accumulator_value`` or an Adam / RowWiseAdagrad ``eps`` set to 0 turned the rows of a zero gradient NaN,
and an Adam ``betas[0]`` of 1.5 trained on without a word. Valid edits (a scheduler's ``betas``) go on as torch.optim's."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

V, D = 6, 2
CASES = [  # (optimizer, its arguments, the key edited, a value its constructor refuses)
    (tte.optim.Adagrad, {"lr": 0.1}, "initial_accumulator_value", 0.0),
    (tte.optim.Adam, {"lr": 0.1, "sum_inside_sqrt": False}, "eps", 0.0),
    (tte.optim.Adam, {"lr": 0.1}, "betas", (1.5, 0.999)),
    (tte.optim.RowWiseAdagrad, {"lr": 0.1}, "eps", 0.0),
    (tte.optim.FTRL, {"lr": 0.1}, "learning_rate_power", 0.5),
    (tte.optim.AdagradMomentum, {"lr": 0.1}, "epsilon", 1e-46),
]


def _model() -> tuple[tte.EmbeddingCollection, torch.nn.Linear]:
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner="sum", dtype=torch.float64)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t, name="f")}), torch.nn.Linear(D, 1).double()


def _backward(ec: tte.EmbeddingCollection, lin: torch.nn.Linear) -> None:
    ids = torch.tensor([[1, 3]])
    out = ec({"f": tte.Padded(ids, torch.ones_like(ids, dtype=torch.bool))})["f"]
    # column 1 of the table's rows gets a zero gradient (the 0/0 of a zero accumulator or eps)
    (out[:, 0].sum() + lin(out).sum()).backward()


@pytest.mark.parametrize("opt_cls, kwargs, key, bad", CASES, ids=[f"{c[0].__name__}-{c[2]}" for c in CASES])
def test_a_refused_value_set_in_a_group_raises_at_the_step_and_changes_nothing(
        opt_cls: Any, kwargs: dict[str, Any], key: str, bad: Any) -> None:
    ec, lin = _model()
    opt = opt_cls([*ec.parameters(), *lin.parameters()], **kwargs)
    good = opt.param_groups[0][key]
    before = [p.detach().clone() for p in (*ec.parameters(), *lin.parameters())]
    _backward(ec, lin)
    opt.param_groups[0][key] = bad
    name = "betas[0]" if key == "betas" else key
    with pytest.raises(ValueError, match=rf"param_groups\[0\].*`{re.escape(name)}`.*Received: {bad[0] if key == 'betas' else bad}"):
        opt.step()
    for p, p0 in zip((*ec.parameters(), *lin.parameters()), before, strict=True):
        assert torch.equal(p.detach(), p0)
    assert not any(opt.state.get(p) for p in ec.parameters())
    opt.param_groups[0][key] = good  # the pending gradients are still there: the step takes them
    opt.step()
    assert all(torch.isfinite(p).all() for p in ec.parameters())
    assert not torch.equal(ec.tables["t"].weight.detach(), before[0])


def test_adagrad_after_a_refused_edit_is_the_float64_formula() -> None:
    ec, lin = _model()
    w0 = ec.tables["t"].weight.detach().numpy().copy()
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1, initial_accumulator_value=0.1)
    _backward(ec, lin)
    g = np.zeros((V, D))
    g[[1, 3], 0] = 1.0
    g[[1, 3]] += lin.weight.detach().numpy()[0]
    opt.param_groups[0]["initial_accumulator_value"] = 0.0
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        opt.step()
    opt.param_groups[0]["initial_accumulator_value"] = 0.5
    opt.step()
    acc = 0.5 + g * g  # TF's Adagrad: a ← a + g², w ← w − η g / √a (rows 1 and 3 only)
    want = w0.copy()
    want[[1, 3]] -= 0.1 * g[[1, 3]] / np.sqrt(acc[[1, 3]])
    np.testing.assert_allclose(ec.tables["t"].weight.detach().numpy(), want, rtol=1e-14, atol=1e-15)


def test_betas_a_scheduler_sets_each_step_are_taken_as_torch_adams() -> None:
    ec, lin = _model()
    ref = torch.nn.EmbeddingBag(V, D, mode="sum", dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(ec.tables["t"].weight)
    # (eps negligible: ours adds it to √v, torch's to √v̂)
    ours = tte.optim.Adam(ec.parameters(), lr=0.1, eps=1e-18, lazy_adam=False, sum_inside_sqrt=False,
                          bias_correction=True)
    theirs = torch.optim.Adam(ref.parameters(), lr=0.1, eps=1e-18)
    sched = [torch.optim.lr_scheduler.OneCycleLR(o, 0.5, total_steps=8) for o in (ours, theirs)]
    for s in range(6):
        ids = torch.tensor([[s % V, (s + 2) % V]])
        out = ec({"f": tte.Padded(ids, torch.ones_like(ids, dtype=torch.bool))})["f"]
        (out ** 2).sum().backward()
        (ref(ids) ** 2).sum().backward()
        for o, sc in zip((ours, theirs), sched, strict=True):
            o.step()
            o.zero_grad()
            sc.step()
        if s == 2:  # set by hand too (beta_2), as the scheduler keeps it
            for o in (ours, theirs):
                o.param_groups[0]["betas"] = (o.param_groups[0]["betas"][0], 0.99)
    assert ours.param_groups[0]["betas"] == theirs.param_groups[0]["betas"]
    torch.testing.assert_close(ec.tables["t"].weight.detach(), ref.weight.detach(), rtol=1e-12, atol=1e-12)


def test_an_lr_tensor_of_several_numbers_set_in_a_group_is_named() -> None:
    ec, lin = _model()
    opt = tte.optim.SGD([*ec.parameters(), *lin.parameters()], lr=0.1)
    before, lin_w = ec.tables["t"].weight.detach().clone(), lin.weight.detach().numpy().copy()
    _backward(ec, lin)
    opt.param_groups[0]["lr"] = torch.tensor([0.1, 0.2])  # before: "shape '[]' is invalid for input of size 2"
    with pytest.raises(ValueError, match=r"`lr`.*Received: a tensor of shape \(2,\)"):
        opt.step()
    assert torch.equal(ec.tables["t"].weight.detach(), before)
    opt.param_groups[0]["lr"] = torch.tensor(0.1, dtype=torch.float64)
    opt.step()
    g = np.zeros((V, D))
    g[[1, 3], 0] = 1.0
    g[[1, 3]] += lin_w[0]
    np.testing.assert_allclose(ec.tables["t"].weight.detach().numpy(), before.numpy() - 0.1 * g, rtol=1e-14, atol=1e-15)


def test_a_users_own_key_holding_a_new_array_each_step_is_no_error() -> None:
    ec, lin = _model()
    opt = tte.optim.SGD(ec.parameters(), lr=0.1)
    for s in range(2):  # (torch.optim keeps keys of the user's own in a group; == of two arrays has no truth value)
        opt.param_groups[0]["my_stats"] = np.array([s, s + 1.0])
        _backward(ec, lin)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("shape", [(1,), (1, 1)], ids=["[1]", "[1,1]"])
def test_a_one_element_lr_set_in_a_group_trains_a_0d_parameter_as_torch_sgd(shape: tuple[int, ...]) -> None:
    # (before: the table was updated, then the 0-d parameter's update raised "output with shape [] doesn't match
    # the broadcast shape [1]", the step applied in part)
    ec, _ = _model()
    ref = torch.nn.EmbeddingBag(V, D, mode="sum", dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(ec.tables["t"].weight)
    s, s_ref = (torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64)) for _ in range(2))
    ours = tte.optim.SGD([*ec.parameters(), s], lr=0.1)
    theirs = torch.optim.SGD([*ref.parameters(), s_ref], lr=0.1)
    for o in (ours, theirs):
        o.param_groups[0]["lr"] = torch.full(shape, 0.05, dtype=torch.float64)
    ids = torch.tensor([[1, 3], [3, 4]])
    for _ in range(2):
        (ec({"f": tte.Padded(ids, torch.ones_like(ids, dtype=torch.bool))})["f"].pow(2).sum() * s).backward()
        (ref(ids).pow(2).sum() * s_ref).backward()
        for o in (ours, theirs):
            o.step()
            o.zero_grad()
    assert s.shape == ()
    torch.testing.assert_close(s.detach(), s_ref.detach(), rtol=1e-14, atol=0)
    torch.testing.assert_close(ec.tables["t"].weight.detach(), ref.weight.detach(), rtol=1e-14, atol=1e-15)


def test_adafactors_weight_decay_set_in_a_group_is_its_decoupled_decay_as_built() -> None:
    # (before: the group kept `weight_decay` beside the weight_decay_factor it was built with, which the rule reads:
    # the new value was ignored without a word, the rows decayed by 1 - 0.1 · 0.01)
    ec, _ = _model()
    w0 = ec.tables["t"].weight.detach().clone()
    opt = tte.optim.Adafactor(ec.parameters(), lr=0.1, weight_decay=0.01)
    opt.param_groups[0]["weight_decay"] = 0.5
    ids = torch.tensor([[1]])
    (ec({"f": tte.Padded(ids, torch.ones_like(ids, dtype=torch.bool))})["f"].sum() * 0).backward()
    opt.step()
    assert "weight_decay" not in opt.param_groups[0] and opt.param_groups[0]["weight_decay_factor"] == 0.5
    want = w0.numpy().copy()  # Keras: w ← w − w · wd · lr, then the update (0 for a zero gradient), looked-up rows only
    want[1] -= want[1] * 0.5 * 0.1
    np.testing.assert_allclose(ec.tables["t"].weight.detach().numpy(), want, rtol=1e-15, atol=0)
    opt.param_groups[0]["weight_decay"] = -1.0
    with pytest.raises(ValueError, match=r"param_groups\[0\].*`weight_decay`.*Received: -1.0"):
        opt.step()
