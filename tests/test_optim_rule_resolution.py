"""Each parameter group's rule class is resolved once, when the group is added or loaded
(``_util/registry.resolve_rule``), and read by the core (``rule_of``); never saved in a state dict."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding._util.registry import RULE_KEY, rule_of


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))]


def test_groups_hold_their_rule_and_state_dicts_do_not() -> None:
    a, b = _params()
    opt = tte.optim.Adam([{"params": [a]}], lr=0.1)
    opt.add_param_group({"params": [b], "lr": 0.2})
    assert [rule_of(g) for g in opt.param_groups] == [tte.optim.Adam, tte.optim.Adam]
    sd = opt.state_dict()
    assert all(RULE_KEY not in g for g in sd["param_groups"])
    assert not any(isinstance(v, type) for g in sd["param_groups"] for v in g.values())
    assert all(RULE_KEY not in g for g in opt.physical_state().rest()["param_groups"])


def test_load_and_unpickle_resolve_again() -> None:
    a, b = _params()
    opt = tte.optim.FTRL([a, b], lr=0.1)
    (a.sum() + b.sum()).backward()
    opt.step()
    sd = opt.state_dict()
    other = tte.optim.FTRL(_params(), lr=0.5)
    del other.param_groups[0][RULE_KEY]
    other.load_state_dict(sd)
    assert other.param_groups[0][RULE_KEY] is tte.optim.FTRL
    clone = pickle.loads(pickle.dumps(copy.deepcopy(opt)))
    assert rule_of(clone.param_groups[0]) is tte.optim.FTRL


def test_a_copied_group_gets_the_rule_of_its_own_algorithm() -> None:
    a, b = _params()
    sgd = tte.optim.SGD([a], lr=0.1)
    adagrad = tte.optim.Adagrad([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    stale = {**adagrad.param_groups[0], "params": [b]}  # carries Adagrad's resolution
    stale.pop("initial_accumulator_value")
    stale["algorithm"] = "sgd"
    stale[RULE_KEY] = tte.optim.Adagrad
    sgd.add_param_group(stale)
    assert sgd.param_groups[-1][RULE_KEY] is tte.optim.SGD


def test_a_group_naming_another_algorithm_without_its_hyper_parameters_is_refused_by_name() -> None:
    """``{"algorithm": "adam"}`` in a group of a ``tte.optim.Adagrad`` raised a bare ``KeyError: 'betas'`` from Adam's
    checks (the group took Adagrad's defaults); now a TypeError naming the group, the key and the ways out, and the
    optimizer is left as it was."""
    a, b = _params()
    with pytest.raises(TypeError, match=r"Parameter group 1: its algorithm 'adam' is not Adagrad's.*'betas'.*"
                                        r"TableConfig optimizer='adam'.*tte\.optim\.Adam"):
        tte.optim.Adagrad([{"params": [a]}, {"params": [b], "algorithm": "adam"}], lr=0.1)
    opt = tte.optim.Adagrad([a], lr=0.1)
    with pytest.raises(TypeError, match=r"Parameter group 1: .*'betas'"):
        opt.add_param_group({"params": [b], "algorithm": "adam"})
    assert len(opt.param_groups) == 1
    full = {**tte.optim.Adam([torch.nn.Parameter(torch.ones(2))], lr=0.1).param_groups[0], "params": [b]}
    opt.add_param_group(full)  # a whole group of another algorithm is still taken (as a copied group is)
    assert rule_of(opt.param_groups[1]) is tte.optim.Adam
