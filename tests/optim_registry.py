"""Registry of optimizer configurations driving the generic optimizer tests (like torch's OptimizerInfo)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch_tpu_embedding as tte


@dataclasses.dataclass(frozen=True)
class OptimInfo:
    id: str
    cls: type
    kwargs: dict[str, Any]

    def make(self, params: Any, **overrides: Any) -> Any:
        return self.cls(params, **{**self.kwargs, **overrides})


O = tte.optim  # noqa: E741
OPTIM_INFOS = [
    OptimInfo("sgd", O.SGD, {"lr": 0.1}),
    OptimInfo("sgd-clip-decay", O.SGD, {"lr": 0.1, "clipvalue": 0.05, "weight_decay_factor": 0.01,
                                        "clip_weight_min": -0.3, "clip_weight_max": 0.3}),
    OptimInfo("adagrad", O.Adagrad, {"lr": 0.1}),
    OptimInfo("adagrad-init0.5-decaylr", O.Adagrad, {
        "lr": 0.2, "initial_accumulator_value": 0.5, "weight_decay_factor": 0.1,
        "multiply_weight_decay_factor_by_learning_rate": True}),
    OptimInfo("adagrad_momentum", O.AdagradMomentum, {"lr": 0.05, "momentum": 0.9}),
    OptimInfo("adagrad_momentum-nesterov-beta2", O.AdagradMomentum, {
        "lr": 0.05, "momentum": 0.5, "use_nesterov": True, "beta2": 0.9, "exponent": 3.0}),
    OptimInfo("adam", O.Adam, {"lr": 0.01}),
    OptimInfo("adam-eps-outside", O.Adam, {"lr": 0.01, "sum_inside_sqrt": False, "eps": 1e-3}),
    OptimInfo("adam-bias-correction", O.Adam, {"lr": 0.01, "bias_correction": True}),
    OptimInfo("lazy_adam-sparseadam", O.LazyAdam, {
        "lr": 0.01, "bias_correction": True, "sum_inside_sqrt": False, "eps": 1e-8}),
    OptimInfo("ftrl", O.FTRL, {"lr": 0.1}),
    OptimInfo("ftrl-l1l2beta-power", O.FTRL, {
        "lr": 0.1, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02,
        "beta": 0.1, "learning_rate_power": -0.7}),
    OptimInfo("ftrl-multiply-linear", O.FTRL, {
        "lr": 0.1, "l1_regularization_strength": 0.01, "multiply_linear_by_learning_rate": True}),
]
LAZY_INFOS = OPTIM_INFOS  # every registered configuration updates only touched rows
NON_LAZY_INFOS = [OptimInfo("adam-nonlazy", O.Adam, {"lr": 0.01, "lazy_adam": False})]
IDS = [i.id for i in OPTIM_INFOS]
