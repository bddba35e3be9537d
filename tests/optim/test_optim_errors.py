"""Invalid optimizer arguments: each raises at construction with a message naming the argument.

The cases are the registry's (tests/optim_registry.py): each entry's own ``error_inputs``, and every
case of ``SHARED_ERRORS`` for each entry that takes its arguments (test id ``<optimizer>-<case>``)."""

from __future__ import annotations

import re

import pytest
import torch
from optim_registry import ErrorInput, OptimizerInfo, error_cases

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741
CASES = error_cases()  # every entry's own error inputs, and each shared one it takes (tests/optim_registry.py)


@pytest.mark.parametrize("info, case", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_argument(info: OptimizerInfo, case: ErrorInput) -> None:
    p = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(case.error, match=case.regex):
        info.cls([p], **case.kwargs)


def test_case_count() -> None:
    assert len(CASES) >= 25


def test_empty_parameter_list() -> None:
    with pytest.raises(ValueError, match="empty parameter list"):
        O.SGD([], lr=0.1)


@pytest.mark.parametrize("name", tte.OPTIMIZER_NAMES)
def test_every_config_optimizer_name_builds(name: str) -> None:
    t = tte.TableConfig(4, 2, name="t", optimizer=name)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
    opt = O.SGD(ec.parameters(), lr=0.1)
    assert opt.param_groups[0]["algorithm"] == name


def test_unknown_optimizer_name() -> None:
    with pytest.raises(ValueError, match=re.escape("Argument `optimizer` must be one of")):
        O.optimizer_class("adamw")


def test_bad_table_optimizer_factory() -> None:
    t = tte.TableConfig(4, 2, name="t", optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
    with pytest.raises(TypeError, match=r"Table 't': its TableConfig optimizer factory returned SGD"):
        O.Adagrad(ec.parameters(), lr=0.1)


def test_slot_creation_fn_wrong_shape() -> None:
    p = torch.nn.Parameter(torch.zeros(3, 2))
    opt = O.Adagrad([p], lr=0.1, slot_creation_fn=lambda param, names, init: {n: torch.zeros(2) for n in names})
    p.grad = torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"slot_creation_fn must return .* shape \(3, 2\) for slot 'accumulators'"):
        opt.step()


def test_param_group_options_are_validated_like_the_constructor() -> None:
    import re

    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=re.escape("Argument `eps` must be a finite number and > 0.0. Received: -1.0")):
        tte.optim.Adam([{"params": [p], "eps": -1.0}], lr=0.1)
    with pytest.raises(ValueError, match=re.escape("Argument `initial_accumulator_value` must be a positive float")):
        tte.optim.Adagrad([{"params": [p], "initial_accumulator_value": -1.0}], lr=0.1)
    opt = tte.optim.SGD([{"params": [p], "clipvalue": 0.5}], lr=0.1)
    assert opt.param_groups[0]["clipvalue"] == (-0.5, 0.5)  # normalised, as the constructor's
    p.grad = torch.full((3,), 2.0)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), -0.05))  # clipped to 0.5, times lr 0.1
    q = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=re.escape("Argument `lr` must be a finite number and >= 0.0. Received: -1")):
        opt.add_param_group({"params": [q], "lr": -1})
    assert len(opt.param_groups) == 1  # the rejected group was not added
