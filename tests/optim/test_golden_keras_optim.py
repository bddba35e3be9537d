"""golden_keras.json: the Keras SGD / Adagrad / Ftrl / Adam cases on dense parameters.

Coincide with our optimizers: SGD; Adam with ``bias_correction=True, sum_inside_sqrt=False`` (Keras
Adam = SparseAdam semantics); Ftrl without l2 shrinkage (Keras folds ``beta`` into l2 exactly as TF).
Differ by design (asserted): Keras Adagrad adds ε inside the sqrt (TPU Adagrad has none), TPU Adam
(default) has no bias correction, and Ftrl's ``l2_shrinkage_regularization_strength`` has no TPU
counterpart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from optim_registry import OPTIMIZER_INFOS

CASES = {c["name"]: c for c in json.loads((Path(__file__).parents[1] / "data" / "golden_keras.json").read_text())["cases"]}


def _ours(case: dict, param: torch.nn.Parameter, tpu_defaults: bool = False):
    """The registry entry whose ``keras_golden`` claims the case (exactly one); ``tpu_defaults``: Adam
    without the two arguments that make it Keras's."""
    mine = [(info, kw) for info in OPTIMIZER_INFOS if info.keras_golden and (kw := info.keras_golden(case)) is not None]
    assert len(mine) == 1, (case["name"], [info.name for info, _ in mine])
    info, kwargs = mine[0]
    if tpu_defaults:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("bias_correction", "sum_inside_sqrt")}
    return info.cls([param], **kwargs)


def _run(case: dict, **kw) -> list[torch.Tensor]:
    w = torch.nn.Parameter(torch.tensor(case["initial_variable"], dtype=torch.float64))
    opt = _ours(case, w, **kw)
    out = []
    for g in case["gradients"]:
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        out.append(w.detach().clone())
    return out


COINCIDE = ["sgd_2d_lr0.1", "adagrad_2d_lr0.1", "adam_2d_defaults", "adam_2d_lr0.1_b1_0.8_b2_0.9_eps1e-3", "ftrl_2d_lr0.1_defaults",
            "ftrl_2d_lr0.1_lrpower-0.7_init0.5_l1_0.05"]


@pytest.mark.parametrize("name", COINCIDE)
def test_keras_cases_where_semantics_coincide(name: str) -> None:
    case = CASES[name]
    for ours, step in zip(_run(case), case["steps"], strict=True):
        torch.testing.assert_close(ours, torch.tensor(step["variable"], dtype=torch.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "name, kw, at_least",
    [("adagrad_2d_lr0.1", {}, 1e-9), ("adam_2d_lr0.1_b1_0.8_b2_0.9_eps1e-3", {"tpu_defaults": True}, 1e-3),
     ("ftrl_2d_lr0.1_l1_0.01_l2_0.02_beta0.5_shrink0.03", {}, 1e-4)],
    ids=["adagrad-eps", "adam-tpu-no-bias-correction", "ftrl-l2-shrinkage"],
)
def test_keras_cases_that_differ_by_design(name: str, kw: dict, at_least: float) -> None:
    """Adagrad's ε = 1e-7 next to a ≥ 0.1 moves weights by < 1e-6 (so it also passes above, at 1e-6)."""
    case = CASES[name]
    w0 = torch.tensor(case["initial_variable"], dtype=torch.float64)
    ours = _run(case, **kw)[-1]
    keras = torch.tensor(case["steps"][-1]["variable"], dtype=torch.float64)
    # Keras ran in float32: compare the difference against the step size, not float32 noise.
    assert (ours - keras).abs().max() > at_least or name.startswith("adagrad")
    if name.startswith("adagrad"):  # exact float64 re-derivation of Keras's formula shows the ε effect
        a = torch.full_like(w0, case["config"]["initial_accumulator_value"])
        w = w0.clone()
        for g in case["gradients"]:
            g = torch.tensor(g, dtype=torch.float64)
            a += g * g
            w -= case["config"]["learning_rate"] * g / torch.sqrt(a + case["config"]["epsilon"])
        assert at_least < (ours - w).abs().max() < 1e-6
