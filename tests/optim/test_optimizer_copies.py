"""An optimizer copied with its model (``copy.deepcopy``, ``pickle``, ``torch.save`` of both) continues as the original
would, as a copy of a torch.optim optimizer does: its call counter (the accumulation windows, the moving average's
clock) and ``skipped_steps`` come along."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from optim_registry import OPTIMIZER_INFOS, OptimizerInfo

import torch_tpu_embedding as tte

V, D = 6, 3


def _copy(obj: Any, how: str) -> Any:
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _model() -> tuple[tte.EmbeddingCollection, torch.nn.Linear]:
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", dtype=torch.float64)
    return tte.EmbeddingCollection({"a": tte.FeatureConfig(t)}), torch.nn.Linear(D, 2, bias=False).double()


def _ids(s: int) -> torch.Tensor:
    return torch.randint(0, V, (4,), generator=torch.Generator().manual_seed(s))  # duplicates and untouched rows


def _grads(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + s)
    return torch.randn(4, D, generator=g, dtype=torch.float64), torch.randn(2, D, generator=g, dtype=torch.float64)


def _call(ec: tte.EmbeddingCollection, lin: torch.nn.Linear, opt: torch.optim.Optimizer, s: int,
          nan: bool = False) -> None:
    """One call whose gradients do not depend on the weights: rows ``_grads(s)[0]`` at ``_ids(s)``, the dense
    ``_grads(s)[1]`` (NaN with ``nan``)."""
    g_rows, g_dense = _grads(s)
    (ec({"a": _ids(s)})["a"] * g_rows).sum().backward()
    (lin.weight * (g_dense * float("nan") if nan else g_dense)).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copied_sgd_keeps_its_accumulation_window_as_numpy(how: str) -> None:
    """SGD with ``gradient_accumulation_steps=2`` (Keras: the mean of each window's gradients applied at its second
    call), copied after call 3 of 6: the copy applies windows (3, 4) and (5, 6) as the float64 numpy reference,
    not (4, 5) as a counter begun again at 0 would."""
    ec, lin = _model()
    w, wd = ec.tables.t.weight.detach().numpy().copy(), lin.weight.detach().numpy().copy()
    opt = tte.optim.SGD([ec.tables.t.weight, lin.weight], lr=0.1, gradient_accumulation_steps=2)
    for s in range(3):
        _call(ec, lin, opt, s)
    ec, lin, opt = _copy((ec, lin, opt), how)
    assert opt.state_dict()["iterations"] == 3
    for s in range(3, 6):
        _call(ec, lin, opt, s)
    for window in ((0, 1), (2, 3), (4, 5)):
        g, gd = np.zeros((V, D)), np.zeros((2, D))
        for s in window:
            np.add.at(g, _ids(s).numpy(), _grads(s)[0].numpy())
            gd += _grads(s)[1].numpy()
        w, wd = w - 0.1 * g / 2, wd - 0.1 * gd / 2
    np.testing.assert_allclose(ec.tables.t.weight.detach().numpy(), w, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(lin.weight.detach().numpy(), wd, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_a_copy_continues_as_the_original(info: OptimizerInfo, how: str) -> None:
    """Every optimizer, with accumulation, a moving average and ``skip_nonfinite`` (a non-finite window dropped
    before the copy): the copy, trained on, equals the original trained on, to the bit, weights and averages."""
    ec, lin = _model()
    opt = info.cls([ec.tables.t.weight, lin.weight], **info.default, gradient_accumulation_steps=2, use_ema=True,
                   ema_overwrite_frequency=3, skip_nonfinite=True)
    for s in range(5):
        _call(ec, lin, opt, s, nan=s == 1)
    assert opt.skipped_steps == 1
    twin = _copy((ec, lin, opt), how)
    assert twin[2].skipped_steps == 1 and twin[2].state_dict()["iterations"] == 5
    for s in range(5, 10):
        for e, h, o in ((ec, lin, opt), twin):
            _call(e, h, o, s)
    assert torch.equal(twin[0].tables.t.weight, ec.tables.t.weight)
    assert torch.equal(twin[1].weight, lin.weight)
    assert torch.equal(twin[2].moving_average(twin[0].tables.t.weight), opt.moving_average(ec.tables.t.weight))
