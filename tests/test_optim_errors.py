"""Invalid optimizer arguments: each raises at construction with a message naming the argument."""

from __future__ import annotations

import re

import pytest
import torch

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741

CASES = [
    ("sgd-lr-negative", O.SGD, {"lr": -1}, ValueError, "Argument `lr` must be a finite number and >= 0.0. Received: -1"),
    ("sgd-lr-nan", O.SGD, {"lr": float("nan")}, ValueError, r"Argument `lr` .* Received: nan"),
    ("sgd-lr-string", O.SGD, {"lr": "0.1"}, ValueError, r"Argument `lr` .* Received: '0.1'"),
    ("sgd-lr-2d-tensor", O.SGD, {"lr": torch.ones(2)}, ValueError, r"Argument `lr` must be a float, a 0-d float tensor"),
    ("sgd-lr-int-tensor", O.SGD, {"lr": torch.tensor(1)}, ValueError, r"Argument `lr` must be a float, a 0-d float"),
    ("sgd-accum-not-bool", O.SGD, {"use_gradient_accumulation": 1}, ValueError,
     r"Argument `use_gradient_accumulation` must be a boolean. Received: 1"),
    ("sgd-clipvalue-no-accum", O.SGD, {"clipvalue": 0.0, "use_gradient_accumulation": False}, ValueError,
     r"When `use_gradient_accumulation` is False, gradient clipping cannot be used"),
    ("adam-clipvalue-tuple-no-accum", O.Adam, {"clipvalue": (None, 1.0), "use_gradient_accumulation": False},
     ValueError, r"`clipvalue` should be left as None. Received value \(None, 1.0\)"),
    ("sgd-clipvalue-negative", O.SGD, {"clipvalue": -1.0}, ValueError, r"Argument `clipvalue` .* > 0.0. Received: -1.0"),
    ("sgd-clipvalue-triple", O.SGD, {"clipvalue": (1, 2, 3)}, ValueError, r"`clipvalue` must be a number or a \(min, max\) pair"),
    ("sgd-clipvalue-min-gt-max", O.SGD, {"clipvalue": (2.0, 1.0)}, ValueError, r"`clipvalue` must have min <= max"),
    ("sgd-clip-weight-order", O.SGD, {"clip_weight_min": 1.0, "clip_weight_max": 0.0}, ValueError,
     r"Argument `clip_weight_min` must be <= clip_weight_max \(0.0\). Received: 1.0"),
    ("sgd-clip-weight-nan", O.SGD, {"clip_weight_max": float("nan")}, ValueError, r"Argument `clip_weight_max`"),
    ("sgd-weight-decay-negative", O.SGD, {"weight_decay_factor": -0.1}, ValueError,
     r"Argument `weight_decay_factor` .* >= 0.0. Received: -0.1"),
    ("sgd-multiply-wd-not-bool", O.SGD, {"multiply_weight_decay_factor_by_learning_rate": "yes"}, ValueError,
     r"Argument `multiply_weight_decay_factor_by_learning_rate` must be a boolean"),
    ("adagrad-init-zero", O.Adagrad, {"initial_accumulator_value": 0.0}, ValueError,
     r"Argument `initial_accumulator_value` must be a positive float. Received: 0.0"),
    ("adagrad-init-negative", O.Adagrad, {"initial_accumulator_value": -1}, ValueError,
     r"`initial_accumulator_value` must be a positive float. Received: -1"),
    ("adagrad-slot-fn-not-callable", O.Adagrad, {"slot_creation_fn": 3}, ValueError,
     r"Argument `slot_creation_fn` must be a callable or None. Received: 3"),
    ("adagrad_momentum-epsilon-zero", O.AdagradMomentum, {"epsilon": 0.0}, ValueError,
     r"Argument `epsilon` .* > 0.0. Received: 0.0"),
    ("adagrad_momentum-exponent-zero", O.AdagradMomentum, {"exponent": 0}, ValueError,
     r"Argument `exponent` .* > 0.0. Received: 0"),
    ("adagrad_momentum-beta2-above-1", O.AdagradMomentum, {"beta2": 1.5}, ValueError,
     r"Argument `beta2` .* <= 1.0. Received: 1.5"),
    ("adagrad_momentum-momentum-negative", O.AdagradMomentum, {"momentum": -0.1}, ValueError,
     r"Argument `momentum` .* Received: -0.1"),
    ("adagrad_momentum-nesterov-not-bool", O.AdagradMomentum, {"use_nesterov": 1}, ValueError,
     r"Argument `use_nesterov` must be a boolean. Received: 1"),
    ("adam-beta1-one", O.Adam, {"betas": (1.0, 0.999)}, ValueError, r"Argument `betas\[0\]` .* < 1.0. Received: 1.0"),
    ("adam-beta2-prints-beta2", O.Adam, {"betas": (0.9, 1.5)}, ValueError, r"Argument `betas\[1\]` .* Received: 1.5"),
    ("adam-beta-negative", O.Adam, {"betas": (-0.1, 0.9)}, ValueError, r"Argument `betas\[0\]` .* Received: -0.1"),
    ("adam-betas-not-pair", O.Adam, {"betas": 0.9}, ValueError, r"Argument `betas` must be a pair"),
    ("adam-eps-zero", O.Adam, {"eps": 0.0}, ValueError, r"Argument `eps` .* > 0.0. Received: 0.0"),
    ("adam-nonlazy-no-accum", O.Adam, {"lazy_adam": False, "use_gradient_accumulation": False}, ValueError,
     r"When disabling lazy Adam \(`lazy_adam=False`\), gradient accumulation must be used. "
     r"Set `use_gradient_accumulation` to True."),
    ("adam-bias-correction-not-bool", O.Adam, {"bias_correction": None}, ValueError,
     r"Argument `bias_correction` must be a boolean. Received: None"),
    ("lazy_adam-lazy-flag", O.LazyAdam, {"lazy_adam": False}, ValueError, r"Argument `lazy_adam` is not an argument"),
    ("ftrl-power-positive", O.FTRL, {"learning_rate_power": 0.5}, ValueError,
     r"Argument `learning_rate_power` .* <= 0.0. Received: 0.5"),
    ("ftrl-l1-negative", O.FTRL, {"l1_regularization_strength": -1.0}, ValueError,
     r"Argument `l1_regularization_strength` .* Received: -1.0"),
    ("ftrl-l2-negative", O.FTRL, {"l2_regularization_strength": -0.5}, ValueError,
     r"Argument `l2_regularization_strength` .* Received: -0.5"),
    ("ftrl-beta-negative", O.FTRL, {"beta": -0.5}, ValueError, r"Argument `beta` .* Received: -0.5"),
    ("ftrl-init-zero", O.FTRL, {"initial_accumulator_value": 0.0}, ValueError,
     r"Argument `initial_accumulator_value` must be a positive float. Received: 0.0"),
    ("ftrl-init-negative-with-zero-allowed", O.FTRL,
     {"initial_accumulator_value": -0.1, "allow_zero_accumulator": True}, ValueError,
     r"Argument `initial_accumulator_value` must be a float >= 0. Received: -0.1"),
    ("ftrl-multiply-not-bool", O.FTRL, {"multiply_linear_by_learning_rate": "no"}, ValueError,
     r"Argument `multiply_linear_by_learning_rate` must be a boolean"),
]


@pytest.mark.parametrize("cls, kwargs, exc, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_argument(cls: type, kwargs: dict, exc: type, pattern: str) -> None:
    p = torch.nn.Parameter(torch.zeros(3, 2))
    with pytest.raises(exc, match=pattern):
        cls([p], **kwargs)


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
