"""Fresh random cases: every optimizer × Keras extras on dense parameters vs the float64 numpy port of
tf_spec §5 (tests/keras_reference.py: the Keras base pipeline, validated against golden_keras.json and
live Keras 3).

The numpy pipeline wraps Keras's own Adafactor/Adam/SGD/Ftrl rules where ours coincide with Keras, and
the float64 TPU rules of tests/test_optim_reference.py where the TPU formula differs (Adagrad without
ε, AdagradMomentum, TPU Adam). Several variables per case, so ``global_clipnorm`` spans them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from keras_reference import AdafactorRule, AdamRule, FtrlRule, KerasPipeline, SGDRule
from test_optim_reference import np_init, np_rule

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741
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
    """A float64 TPU rule (tf_spec §4.2) as a KerasPipeline update_step."""

    def __init__(self, name: str, hp: dict, shapes: list[tuple[int, ...]]) -> None:
        self.name, self.hp = name, hp
        self.slots = [{k: np.full(s, v) for k, v in np_init(name, hp).items()} for s in shapes]

    def __call__(self, i: int, g: np.ndarray, w: np.ndarray, lr: float, t: int) -> np.ndarray:
        w, self.slots[i] = np_rule(self.name, self.hp, w, g, self.slots[i], lr, t)
        return w


def ours_and_reference(opt: str, shapes: list[tuple[int, ...]], lr: float, extras: dict):
    """(factory for our optimizer, the numpy rule) for one optimizer name."""
    hp_tpu = {"betas": (0.8, 0.95), "eps": 1e-3, "bias_correction": False, "sum_inside_sqrt": True,
              "momentum": 0.9, "use_nesterov": True, "beta2": 1.0, "exponent": 2.0, "epsilon": 1e-10}
    wd = extras.get("weight_decay")
    tpu_wd = {} if wd is None else {"weight_decay_factor": wd, "multiply_weight_decay_factor_by_learning_rate": True}
    keras_extras = {k: v for k, v in extras.items() if k != "weight_decay"}
    if opt == "adafactor":
        return (lambda ps: O.Adafactor(ps, lr=lr, beta_2_decay=-0.6, epsilon_2=1e-2, clip_threshold=0.8,
                                       **extras),
                AdafactorRule(shapes, beta_2_decay=-0.6, epsilon_2=1e-2, clip_threshold=0.8))
    if opt == "keras_adam":  # Keras Adam == ours with bias correction and ε outside the sqrt
        return (lambda ps: O.Adam(ps, lr=lr, betas=(0.8, 0.95), eps=1e-3, bias_correction=True,
                                  sum_inside_sqrt=False, **tpu_wd, **keras_extras),
                AdamRule(shapes, beta_1=0.8, beta_2=0.95, epsilon=1e-3))
    if opt == "sgd":
        return lambda ps: O.SGD(ps, lr=lr, **tpu_wd, **keras_extras), SGDRule(shapes)
    if opt == "ftrl":  # Keras Ftrl without l2 shrinkage == TPU FTRL
        kw = {"l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02, "beta": 0.1,
              "learning_rate_power": -0.7, "initial_accumulator_value": 0.2}
        return (lambda ps: O.FTRL(ps, lr=lr, **kw, **tpu_wd, **keras_extras), FtrlRule(shapes, **kw))
    if opt == "adagrad":  # TPU Adagrad (no ε)
        return (lambda ps: O.Adagrad(ps, lr=lr, **tpu_wd, **keras_extras),
                TPURule("adagrad", {"initial_accumulator_value": 0.1}, shapes))
    if opt == "adagrad_momentum":
        return (lambda ps: O.AdagradMomentum(ps, lr=lr, momentum=0.9, use_nesterov=True, **tpu_wd, **keras_extras),
                TPURule("adagrad_momentum", hp_tpu, shapes))
    if opt == "tpu_adam":
        return (lambda ps: O.Adam(ps, lr=lr, betas=(0.8, 0.95), eps=1e-3, **tpu_wd, **keras_extras),
                TPURule("adam", hp_tpu, shapes))
    raise AssertionError(opt)


@pytest.mark.parametrize("case", range(len(EXTRAS)))
@pytest.mark.parametrize("opt", ["adafactor", "keras_adam", "sgd", "ftrl", "adagrad", "adagrad_momentum",
                                 "tpu_adam"])
def test_random_case_matches_numpy_keras_pipeline(opt: str, case: int) -> None:
    rng = np.random.default_rng(1000 * case + len(opt))
    shapes: list[tuple[int, ...]] = [(5, 4), (6,)] + ([(2, 3, 4)] if opt == "adafactor" else [])
    init = [rng.normal(size=s) for s in shapes]
    grads = [[rng.normal(size=s) for s in shapes] for _ in range(CALLS)]
    for g in grads:  # a zero row (an "untouched" row of a dense gradient) in the 2-D variable
        g[0][rng.integers(0, 5)] = 0.0
    lr = 0.1
    extras = EXTRAS[case]
    make, rule = ours_and_reference(opt, shapes, lr, extras)
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
