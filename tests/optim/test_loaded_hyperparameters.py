"""``load_state_dict`` takes the saved hyper-parameters as its own copies, as torch.optim does: a tensor ``lr`` of a
state dict is the saving optimizer's live tensor (``state_dict`` returns it, as torch.optim's does), which that
optimizer's scheduler goes on changing in place. A torch.optim optimizer's state dict is refused as not this
package's."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from optim_registry import OPTIMIZER_INFOS, OptimizerInfo

import torch_tpu_embedding as tte

V, D = 6, 3


def _model() -> tuple[tte.EmbeddingCollection, torch.nn.Linear]:
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", dtype=torch.float64)
    return tte.EmbeddingCollection({"a": tte.FeatureConfig(t)}), torch.nn.Linear(D, 2, bias=False).double()


def _grads(s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + s)
    return torch.randn(V, D, generator=g, dtype=torch.float64), torch.randn(2, D, generator=g, dtype=torch.float64)


def _call(ec: tte.EmbeddingCollection, lin: torch.nn.Linear, opt: torch.optim.Optimizer, s: int) -> None:
    g_rows, g_dense = _grads(s)
    (ec({"a": torch.arange(V)})["a"] * g_rows).sum().backward()  # every row, each once: the dense gradient g_rows
    (lin.weight * g_dense).sum().backward()
    opt.step()
    opt.zero_grad()


def test_loaded_tensor_lr_is_not_the_saving_optimizers_as_torch_sgd() -> None:
    """The saving optimizer's ExponentialLR halves its tensor lr in place after the load: the loaded SGD keeps 0.1,
    and its weights are torch.optim.SGD's in the same sequence (torch's own load, on dense copies)."""
    ec, lin = _model()
    opt = tte.optim.SGD([ec.tables.t.weight, lin.weight], lr=torch.tensor(0.1, dtype=torch.float64))
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in (ec.tables.t.weight, lin.weight)]
    ref = torch.optim.SGD(ref_params, lr=torch.tensor(0.1, dtype=torch.float64))
    _call(ec, lin, opt, 0)
    for p, g in zip(ref_params, _grads(0), strict=True):
        p.grad = g.clone()
    ref.step()
    ec2, lin2 = copy.deepcopy((ec, lin))
    loaded = tte.optim.SGD([ec2.tables.t.weight, lin2.weight], lr=0.5)
    loaded.load_state_dict(opt.state_dict())
    ref_params2 = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
    ref2 = torch.optim.SGD(ref_params2, lr=0.5)
    ref2.load_state_dict(ref.state_dict())
    sched, ref_sched = (torch.optim.lr_scheduler.ExponentialLR(o, 0.5) for o in (opt, ref))
    for s in range(1, 4):
        _call(ec, lin, opt, s)
        sched.step()
        for p, g in zip(ref_params, _grads(s), strict=True):
            p.grad = g.clone()
        ref.step()
        ref_sched.step()
        _call(ec2, lin2, loaded, s)
        for p, g in zip(ref_params2, _grads(s), strict=True):
            p.grad = g.clone()
        ref2.step()
    assert float(opt.param_groups[0]["lr"]) == float(ref.param_groups[0]["lr"]) == 0.0125
    assert float(loaded.param_groups[0]["lr"]) == float(ref2.param_groups[0]["lr"]) == 0.1
    torch.testing.assert_close(ec2.tables.t.weight, ref_params2[0], rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(lin2.weight, ref_params2[1], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_no_loaded_hyperparameter_is_the_saved_dicts_object(info: OptimizerInfo) -> None:
    """Every optimizer: after a load no value of a group is the state dict's object (a list or tensor changed in the
    dict later would change the loaded group)."""
    ec, lin = _model()
    opt = info.cls([ec.tables.t.weight, lin.weight], **{**info.default, "lr": torch.tensor(0.01)})
    _call(ec, lin, opt, 0)
    sd = opt.state_dict()
    ec2, lin2 = copy.deepcopy((ec, lin))
    loaded = info.cls([ec2.tables.t.weight, lin2.weight], **info.default)
    loaded.load_state_dict(sd)
    shared = [k for k, v in loaded.param_groups[0].items()
              if k != "params" and isinstance(v, (torch.Tensor, list, dict)) and v is sd["param_groups"][0].get(k)]
    assert shared == []


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
@pytest.mark.parametrize("torch_cls", [torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad],
                         ids=lambda c: c.__name__)
def test_a_torch_optim_state_dict_is_named_as_not_ours(info: OptimizerInfo, torch_cls: type) -> None:
    """A torch.optim optimizer's state_dict (a user moving a model to this package) is refused as not this package's
    optimizer's, naming its slots and what to do, not as a state dict that torch's ``flatten_optimizer_state_dict``
    stripped of a counter; nothing is loaded."""
    lin = torch.nn.Linear(3, 2).double()
    ref = torch_cls(lin.parameters(), lr=0.1)
    lin(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    ref.step()
    opt = info.cls(lin.parameters(), **info.default)
    slots = sorted({n for entry in ref.state_dict()["state"].values() for n in entry})
    with pytest.raises(ValueError, match=r"param_groups\[0\] has no 'algorithm': this is the state_dict of another "
                                         rf"kind of optimizer .* with slots {re.escape(str(slots))}, not of a "
                                         r"torch_tpu_embedding.optim optimizer"):
        opt.load_state_dict(ref.state_dict())
    assert len(opt.state_dict()["state"]) == 0 and opt.param_groups[0]["algorithm"] == info.name
