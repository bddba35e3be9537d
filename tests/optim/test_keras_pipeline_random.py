"""Fresh random cases: every optimizer × Keras extras on dense parameters vs the float64 numpy port of
Keras 3.15.1's optimizers (tests/keras_reference.py: the Keras base pipeline, validated against
golden_keras.json and live Keras 3).

The numpy pipeline wraps Keras's own Adafactor/Adam/SGD/Ftrl rules where ours coincide with Keras (a
configuration's ``keras_rule`` in tests/optim_registry.py), and otherwise the entry's float64 TPU rule
(``np_rule``: Adagrad without ε, AdagradMomentum, TPU Adam, ...). Several variables per case, so
``global_clipnorm`` spans them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from keras_reference import KerasPipeline
from optim_registry import KERAS, OptimizerConfig, OptimizerInfo, cases

EXTRAS = [
    {"clipnorm": 0.7, "use_ema": True, "ema_momentum": 0.75, "ema_overwrite_frequency": 2,
     "gradient_accumulation_steps": 2},
    {"global_clipnorm": 0.5, "weight_decay": 0.05, "loss_scale_factor": 64.0},
    {"clipvalue": 0.3, "use_ema": True, "ema_momentum": 0.5, "ema_overwrite_frequency": 3,
     "gradient_accumulation_steps": 3, "weight_decay": 0.02},
    {"global_clipnorm": 0.2, "gradient_accumulation_steps": 2, "use_ema": True, "ema_momentum": 0.9},
]
CALLS = 9


class TPURule:
    """An entry's float64 rule (tests/optim_registry.py) as a KerasPipeline update_step."""

    def __init__(self, info: OptimizerInfo, hp: dict, shapes: list[tuple[int, ...]]) -> None:
        self.info, self.hp = info, hp
        self.slots = [info.np_init(hp, s) for s in shapes]

    def __call__(self, i: int, g: np.ndarray, w: np.ndarray, lr: float, t: int) -> np.ndarray:
        w, self.slots[i] = self.info.np_rule(self.hp, w, g, self.slots[i], lr, t, w.shape[0])
        return w


def ours_and_reference(cfg: OptimizerConfig, shapes: list[tuple[int, ...]], extras: dict):
    """(our optimizer factory, the numpy rule): Keras's decoupled ``weight_decay`` is TF's
    ``weight_decay_factor`` times the lr for the optimizers that take TF's arguments."""
    wd = extras.get("weight_decay")
    keras_extras = {k: v for k, v in extras.items() if k != "weight_decay"}
    if wd is not None:
        keras_extras.update({"weight_decay_factor": wd, "multiply_weight_decay_factor_by_learning_rate": True}
                            if cfg.info.tpu_args else {"weight_decay": wd})

    def make(ps: list[torch.nn.Parameter]):
        return cfg.make(ps, **keras_extras)

    keras_rule = cfg.meta.get("keras_rule")
    if keras_rule is not None:
        return make, keras_rule(shapes, cfg.kwargs)
    hp = make([torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]).param_groups[0]
    return make, TPURule(cfg.info, hp, shapes)


@pytest.mark.parametrize("case", range(len(EXTRAS)))
@pytest.mark.parametrize("cfg", cases(KERAS), ids=str)
def test_random_case_matches_numpy_keras_pipeline(cfg: OptimizerConfig, case: int) -> None:
    rng = np.random.default_rng(1000 * case + len(cfg.id))
    shapes: list[tuple[int, ...]] = [(5, 4), (6,), *cfg.meta.get("extra_shapes", [])]
    init = [rng.normal(size=s) for s in shapes]
    grads = [[rng.normal(size=s) for s in shapes] for _ in range(CALLS)]
    for g in grads:  # a zero row (an "untouched" row of a dense gradient) in the 2-D variable
        g[0][rng.integers(0, 5)] = 0.0
    lr = cfg.kwargs["lr"]
    extras = EXTRAS[case]
    make, rule = ours_and_reference(cfg, shapes, extras)
    params = [torch.nn.Parameter(torch.tensor(w)) for w in init]
    ours = make(params)
    ref = KerasPipeline(init, rule, learning_rate=lr, **extras)
    for call, g in enumerate(grads):
        for p, gi in zip(params, g, strict=True):
            p.grad = torch.tensor(gi) * extras.get("loss_scale_factor", 1.0)  # a scaled loss
        ours.step()
        ref.apply([gi * extras.get("loss_scale_factor", 1.0) for gi in g])
        for p, want in zip(params, ref.variables, strict=True):
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-10, atol=1e-12, err_msg=f"call {call}")
        if extras.get("use_ema"):
            assert ref.averages is not None
            for p, want in zip(params, ref.averages, strict=True):
                np.testing.assert_allclose(ours.moving_average(p).numpy(), want, rtol=1e-10, atol=1e-12)
    if extras.get("use_ema"):
        final = ref.finalize_variable_values()
        ours.finalize_variable_values()
        for p, want in zip(params, final, strict=True):
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-10, atol=1e-12)
