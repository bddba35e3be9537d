"""A group's ``use_ema`` or ``gradient_accumulation_steps`` changed after its parameters' state was made is refused by
the next ``step()`` with a ValueError naming the option, before anything is taken or changed. Before, the step ran into
the state made for the old value: a ``KeyError: 'ema'`` after the tables were updated and the dense parameters not
(their pending rows gone), a ``KeyError: 'accumulated_gradients'``, an ``IndexError`` (2 → 4 calls a window), or wrong
numbers without an error (4 → 2: a table's buffer kept its two stale calls, added again each window)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from optim_registry import OPTIMIZER_INFOS, OptimizerInfo

import torch_tpu_embedding as tte

V, D = 6, 3
CHANGES = [("use_ema", False, True), ("use_ema", True, False), ("gradient_accumulation_steps", None, 2),
           ("gradient_accumulation_steps", 4, 2), ("gradient_accumulation_steps", 2, 4),
           ("gradient_accumulation_steps", 2, None)]


def _model() -> tuple[tte.EmbeddingCollection, torch.nn.Linear]:
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", dtype=torch.float64)
    return tte.EmbeddingCollection({"a": tte.FeatureConfig(t)}), torch.nn.Linear(D, 2, bias=False).double()


def _ids(s: int) -> torch.Tensor:
    return torch.tensor([s % V, (s + 3) % V, s % V])


def _grads(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + s)
    return torch.randn(3, D, generator=g, dtype=torch.float64), torch.randn(2, D, generator=g, dtype=torch.float64)


def _backward(ec: tte.EmbeddingCollection, lin: torch.nn.Linear, s: int) -> None:
    g_rows, g_dense = _grads(s)
    (ec({"a": _ids(s)})["a"] * g_rows).sum().backward()
    (lin.weight * g_dense).sum().backward()


@pytest.mark.parametrize("name, old, new", CHANGES, ids=lambda v: str(v))
@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_a_changed_slot_option_is_refused_and_changes_nothing(info: OptimizerInfo, name: str, old: object,
                                                              new: object) -> None:
    ec, lin = _model()
    opt = info.cls([ec.tables.t.weight, lin.weight], **{**info.default, name: old})
    for s in range(4):  # at a window's end for k = 2 and k = 4
        _backward(ec, lin, s)
        opt.step()
        opt.zero_grad()
    _backward(ec, lin, 4)
    before = copy.deepcopy((ec.tables.t.weight, lin.weight, lin.weight.grad, opt.state_dict()))
    opt.param_groups[0][name] = new
    with pytest.raises(ValueError, match=f"Parameter group 0: `{name}` changed from {old!r} to {new!r} after"):
        opt.step()
    after = (ec.tables.t.weight, lin.weight, lin.weight.grad, opt.state_dict())
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])
    assert after[3]["iterations"] == before[3]["iterations"] == 4
    for key, slots in before[3]["state"].items():
        assert all(torch.equal(after[3]["state"][key][k], v) for k, v in slots.items()), key
    assert sorted(ec.row_grads()) == ["t"]  # the table's pending rows are still there
    opt.param_groups[0][name] = old  # back to the value the state is made for: the step goes on
    opt.step()
    assert opt.state_dict()["iterations"] == 5


def test_an_option_set_before_the_first_step_is_used_as_numpy() -> None:
    """Before any state is made the group's options may change: SGD with ``use_ema`` set on the group before the first
    step keeps Keras's moving average (float64 numpy: ``avg = w`` at call 1, then ``μ·avg + (1−μ)·w``)."""
    ec, lin = _model()
    opt = tte.optim.SGD([ec.tables.t.weight], lr=0.1)
    opt.param_groups[0]["use_ema"] = True
    w = ec.tables.t.weight.detach().numpy().copy()
    avg = None
    for s in range(4):
        _backward(ec, lin, s)
        opt.step()
        opt.zero_grad()
        g = np.zeros((V, D))
        np.add.at(g, _ids(s).numpy(), _grads(s)[0].numpy())
        w = w - 0.1 * g
        avg = w.copy() if avg is None else 0.99 * avg + 0.01 * w
    np.testing.assert_allclose(ec.tables.t.weight.detach().numpy(), w, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(opt.moving_average(ec.tables.t.weight).numpy(), avg, rtol=1e-13, atol=1e-13)


def test_a_load_that_changes_the_option_is_no_change() -> None:
    """``load_state_dict`` makes the state for the loaded options: the next step runs (use_ema saved on, built off)."""
    ec, lin = _model()
    opt = tte.optim.Adam([ec.tables.t.weight, lin.weight], lr=0.1, use_ema=True)
    _backward(ec, lin, 0)
    opt.step()
    opt.zero_grad()
    loaded = tte.optim.Adam([ec.tables.t.weight, lin.weight], lr=0.1)
    _backward(ec, lin, 1)
    loaded.step()  # state made without the averages
    loaded.zero_grad()
    loaded.load_state_dict(opt.state_dict())
    _backward(ec, lin, 2)
    loaded.step()
    assert loaded.param_groups[0]["use_ema"] is True and "ema" in loaded.state[lin.weight]


@pytest.mark.parametrize("saved, edited", [(4, 2), (2, 4)])
def test_a_loaded_table_buffer_of_another_window_length_is_refused(saved: int, edited: int) -> None:
    """A state dict whose group says ``gradient_accumulation_steps`` = ``edited`` while its table's pending buffer
    holds ``saved`` calls is refused by the load's check (it loaded, then added 2 stale calls to every window or
    wrote past the buffer's end); the dict as saved loads into an optimizer built with another ``k`` (the saved ``k``
    wins, as torch.optim's loaded hyper-parameters do) and goes on as the float64 numpy Keras accumulation."""
    ec, lin = _model()
    w = ec.tables.t.weight.detach().numpy().copy()
    opt = tte.optim.SGD([ec.tables.t.weight], lr=0.1, gradient_accumulation_steps=saved)
    for s in range(saved + 1):  # one call into the second window
        _backward(ec, lin, s)
        opt.step()
        opt.zero_grad()
    sd = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["gradient_accumulation_steps"] = edited
    loaded = tte.optim.SGD([ec.tables.t.weight], lr=0.1, gradient_accumulation_steps=edited)
    with pytest.raises(ValueError, match=f"table:t: pending accumulation buffers hold {saved} calls, but the "
                                         f"group's `gradient_accumulation_steps` is {edited}"):
        loaded.load_state_dict(bad)
    loaded.load_state_dict(sd)
    for s in range(saved + 1, 2 * saved):
        _backward(ec, lin, s)
        loaded.step()
        loaded.zero_grad()
    for window in (range(saved), range(saved, 2 * saved)):
        g = np.zeros((V, D))
        for s in window:
            np.add.at(g, _ids(s).numpy(), _grads(s)[0].numpy())
        w = w - 0.1 * g / saved
    np.testing.assert_allclose(ec.tables.t.weight.detach().numpy(), w, rtol=1e-13, atol=1e-13)
