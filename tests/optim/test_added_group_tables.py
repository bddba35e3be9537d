"""``add_param_group`` treats tables as the constructor does: a table whose ``TableConfig.optimizer`` is set gets a group
of its own with that optimizer (before, the table joined the added group and was trained by the outer optimizer's rule
without a word: SGD where its config said Adagrad), and a stacked table's own weight (a view of its group's) is refused
naming the table and its group (before: torch's "can't optimize a non-leaf Tensor")."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

V, D = 8, 2
BAGS = [[[0, 1], [1, 1]], [[2, 1], [5, 3]], [[1, 4], [4, 4]]]  # per step: two bags of two ids


def _model(optimizer: object = None) -> tuple[tte.EmbeddingCollection, torch.nn.Linear]:
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner="sum", dtype=torch.float64, optimizer=optimizer)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t, name="f")}), torch.nn.Linear(D, 1).double()


def _coef(s: int) -> torch.Tensor:  # the loss's weight of each bag's activations in step s
    return torch.rand(2, D, generator=torch.Generator().manual_seed(10 + s), dtype=torch.float64)


def _step(ec: tte.EmbeddingCollection, lin: torch.nn.Linear, opt: torch.optim.Optimizer, s: int) -> None:
    ids = torch.tensor(BAGS[s])
    out = ec({"f": tte.Padded(ids, torch.ones_like(ids, dtype=torch.bool))})["f"]
    ((out * _coef(s)).sum() + lin(out.detach()).sum()).backward()
    opt.step()
    opt.zero_grad()


_ADAGRAD = functools.partial(tte.optim.Adagrad, lr=0.5, initial_accumulator_value=0.2)


def _train_and_check(ec: tte.EmbeddingCollection, lin: torch.nn.Linear, opt: torch.optim.Optimizer) -> None:
    """Trains BAGS and compares the table with the float64 TF Adagrad formula (_ADAGRAD's lr and accumulator)."""
    w = ec.tables["t"].weight.detach().numpy().copy()
    acc = np.full((V, D), 0.2)
    for s in range(len(BAGS)):
        _step(ec, lin, opt, s)
        g = np.zeros((V, D))  # sum combiner: each id of bag b gets coef[b]; duplicates summed (TF's Adagrad)
        for b, bag in enumerate(BAGS[s]):
            for i in bag:
                g[i] += _coef(s).numpy()[b]
        rows = sorted({i for bag in BAGS[s] for i in bag})
        acc[rows] += g[rows] ** 2
        w[rows] -= 0.5 * g[rows] / np.sqrt(acc[rows])
    np.testing.assert_allclose(ec.tables["t"].weight.detach().numpy(), w, rtol=1e-13, atol=1e-14)


def test_a_table_with_its_own_optimizer_added_later_is_trained_by_that_optimizer() -> None:
    ec, lin = _model(_ADAGRAD)
    opt = tte.optim.SGD(lin.parameters(), lr=0.1)
    opt.add_param_group({"params": list(ec.parameters())})
    assert [g["algorithm"] for g in opt.param_groups] == ["sgd", "adagrad"]
    built = tte.optim.SGD([*lin.parameters(), *ec.parameters()], lr=0.1)  # as the constructor groups it
    assert [g["algorithm"] for g in built.param_groups] == ["adagrad", "sgd"]
    _train_and_check(ec, lin, opt)


@pytest.mark.parametrize("later", [False, True], ids=["constructor", "add_param_group"])
def test_named_parameters_with_a_table_of_its_own_optimizer(later: bool) -> None:
    # (before: torch's "all optimizer param groups should be with/without names": the table's own group was built
    # from the bare tensor, without its name)
    ec, lin = _model(_ADAGRAD)
    if later:
        opt = tte.optim.SGD(list(lin.named_parameters()), lr=0.1)
        opt.add_param_group({"params": list(ec.named_parameters())})
    else:
        opt = tte.optim.SGD([*lin.named_parameters(), *ec.named_parameters()], lr=0.1)
    table_group = next(g for g in opt.param_groups if g["algorithm"] == "adagrad")
    assert table_group["param_names"] == [n for n, _ in ec.named_parameters()]
    _train_and_check(ec, lin, opt)


def test_a_refused_group_adds_no_table_group_either() -> None:
    ec, lin = _model("adagrad")
    opt = tte.optim.SGD(lin.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"`lr`.*Received: -1"):
        opt.add_param_group({"params": [*ec.parameters(), *torch.nn.Linear(2, 1).parameters()], "lr": -1})
    assert len(opt.param_groups) == 1


def test_a_stacked_tables_own_weight_added_is_refused_naming_it() -> None:
    torch.manual_seed(0)
    ta, tb = tte.TableConfig(10, 3, name="ta"), tte.TableConfig(7, 3, name="tb")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(ta, name="a"), "b": tte.FeatureConfig(tb, name="b")})
    opt = tte.optim.SGD(torch.nn.Linear(3, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"table `ta`, which is stacked with other tables in group `fused_0`"):
        opt.add_param_group({"params": [ec.tables["ta"].weight]})
    assert len(opt.param_groups) == 1
