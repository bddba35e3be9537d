"""Hyper-parameters a user schedules by hand (``opt.param_groups[0][name] = value`` between steps) on the compiled
eager row update (``Path.KERNEL``, ``optim/_kernels/row_update.py``): a bounded number of kernels over many values,
and each step's numbers those of a float64 numpy reference of the optimizer's formula with the schedule.

Every number of a group other than 0 and 1 reaches the kernel as data; 0 and 1 (a decay that is off, AdagradMomentum's
``beta2 = 1``) choose a kernel of their own once. The weight decay, the epsilons, FTRL's strengths and the clipping
limits were constants of the kernel: a kernel per value (seconds each, kept for the process), measured 6 over 6 values
before the fix. (``momentum`` and ``betas`` under torch's schedulers: tests/optim/test_kernel_update.py.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._kernels import kernel_policy, row_update

Arrays = dict[str, np.ndarray]


@pytest.fixture(autouse=True)
def kernel_from_the_first_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel path on, from the first step of a small table (the default policy keeps those on the reference)."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    monkeypatch.setattr(row_update, "_KERNELS", {})  # (the kernels of this test's run alone are counted)
    before = kernel_policy.set_policy(0, 0)
    yield
    kernel_policy.set_policy(*before)


def _clip(w: np.ndarray, lo: float | None, hi: float | None) -> np.ndarray:
    return np.clip(w, -np.inf if lo is None else lo, np.inf if hi is None else hi)


def _around(rule: Callable[[np.ndarray, np.ndarray, Arrays, float, dict[str, Any]], np.ndarray]) -> Callable[..., Any]:
    """``rule`` inside TF's pipeline: clipvalue, decoupled weight decay, the rule, weight clipping."""
    def step(w: np.ndarray, g: np.ndarray, s: Arrays, lr: float, hp: dict[str, Any]) -> np.ndarray:
        clip = hp.get("clipvalue")
        if clip is not None:
            g = np.clip(g, *clip) if isinstance(clip, tuple) else np.clip(g, -clip, clip)
        wd = hp.get("weight_decay_factor") or 0.0
        w = w - (lr * wd if hp.get("multiply_weight_decay_factor_by_learning_rate") else wd) * w
        return _clip(rule(w, g, s, lr, hp), hp.get("clip_weight_min"), hp.get("clip_weight_max"))
    return step


def _adagrad(w: np.ndarray, g: np.ndarray, s: Arrays, lr: float, hp: dict[str, Any]) -> np.ndarray:
    s["accumulators"] = s["accumulators"] + g * g
    return w - lr * g / np.sqrt(s["accumulators"])


def _adam(w: np.ndarray, g: np.ndarray, s: Arrays, lr: float, hp: dict[str, Any]) -> np.ndarray:
    b1, b2 = hp["betas"]
    s["momenta"] = b1 * s["momenta"] + (1 - b1) * g
    s["velocities"] = b2 * s["velocities"] + (1 - b2) * g * g
    return w - lr * s["momenta"] / np.sqrt(s["velocities"] + hp["eps"] ** 2)


def _ftrl(w: np.ndarray, g: np.ndarray, s: Arrays, lr: float, hp: dict[str, Any]) -> np.ndarray:
    p, l1, l2, beta = (hp[k] for k in ("learning_rate_power", "l1_regularization_strength",
                                       "l2_regularization_strength", "beta"))
    n = s["accumulators"]
    n_new = n + g * g
    s["linears"] = z = s["linears"] + g - (n_new ** -p - n ** -p) * w / lr
    s["accumulators"] = n_new
    return (np.clip(z, -l1, l1) - z) / ((n_new ** -p + beta) / lr + 2 * l2)


def _adagrad_momentum(w: np.ndarray, g: np.ndarray, s: Arrays, lr: float, hp: dict[str, Any]) -> np.ndarray:
    b2 = hp["beta2"]
    a = s["accumulators"]
    s["accumulators"] = a = a + g * g if b2 == 1 else b2 * a + (1 - b2) * g * g
    s["momenta"] = m = hp["momentum"] * s["momenta"] + g * (a + hp["epsilon"]) ** (-1.0 / hp["exponent"])
    return w - lr * m


def _rowwise_adagrad(w: np.ndarray, g: np.ndarray, s: Arrays, lr: float, hp: dict[str, Any]) -> np.ndarray:
    g = g + hp["weight_decay"] * w
    s["accumulators"] = m = s["accumulators"] + (g * g).mean(1)
    return w - lr * g / (np.sqrt(m) + hp["eps"])[:, None]


# (optimizer, its arguments, the schedule: a value per step for each entry, the kernels it may compile, the rule)
CASES = {
    # a decay that turns off and on again (0: a kernel of its own, once), a moving lower weight bound
    "adagrad": (tte.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.2, "clip_weight_max": 0.09},
                {"weight_decay_factor": [0.02, 0.0, 0.05, 0.01, 0.0, 0.03],
                 "clip_weight_min": [-0.05, -0.04, -0.03, -0.06, -0.02, -0.07]}, 2, _adagrad),
    # (weight decay: not the fused C loop, tests/optim/test_c_rules.py)
    "adam": (tte.optim.Adam, {"lr": 0.05, "weight_decay_factor": 0.1,
                              "multiply_weight_decay_factor_by_learning_rate": True},
             {"eps": [1e-3, 2e-3, 5e-4, 3e-3, 1e-2, 4e-3], "clipvalue": [(-c, c) for c in (0.5, 0.2, 0.3, 0.1, 0.4, 0.25)]}, 1, _adam),
    # clipvalue written as a number (the constructor's form; the group stored a pair: a number failed to index)
    "adagrad_clipvalue": (tte.optim.Adagrad, {"lr": 0.1, "clipvalue": 0.5},
                          {"clipvalue": [0.2, 0.05, 0.3, 0.1, 0.4, 0.25]}, 1, _adagrad),
    "ftrl": (tte.optim.FTRL, {"lr": 0.2},
             {"l1_regularization_strength": [0.01, 0.03, 0.002, 0.02, 0.05, 0.04],
              "l2_regularization_strength": [0.1, 0.3, 0.2, 0.05, 0.4, 0.15],
              "beta": [0.5, 0.2, 0.7, 0.3, 0.9, 0.4]}, 1, _ftrl),
    "adagrad_momentum": (tte.optim.AdagradMomentum, {"lr": 0.05, "momentum": 0.5},
                         {"epsilon": [1e-2, 3e-2, 2e-2, 5e-3, 4e-2, 1e-3],
                          "beta2": [0.9, 0.95, 0.8, 0.99, 0.85, 0.7]}, 1, _adagrad_momentum),
    "rowwise_adagrad": (tte.optim.RowWiseAdagrad, {"lr": 0.1},
                        {"eps": [1e-2, 3e-2, 2e-2, 5e-3, 4e-2, 1e-3], "weight_decay": [0.1, 0.3, 0.2, 0.05, 0.4, 0.15],
                         "weight_decay_factor": [0.01, 0.03, 0.02, 0.05, 0.04, 0.015]}, 1, _rowwise_adagrad),
}


@pytest.mark.usefixtures("compiler")
@pytest.mark.parametrize("name", list(CASES))
def test_a_hand_schedule_compiles_a_bounded_number_of_kernels_and_follows_the_values(name: str) -> None:
    from torch._dynamo.utils import counters

    cls, kwargs, schedule, most, rule = CASES[name]
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(300, 6, name="t"))})
    opt = cls(ec.parameters(), **kwargs)
    w = ec.tables.t.weight.detach().double().numpy().copy()
    hp = dict(opt.param_groups[0])
    opt.init_state()
    state = {k: v.detach().double().numpy().copy() for k, v in opt.state[ec.tables.t.weight].items() if k != "step"}
    kernels, graphs = row_update.compiled_kernels(), counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(1)
    for s in range(6):
        for k, values in schedule.items():
            opt.param_groups[0][k] = hp[k] = values[s]
        ids = torch.randint(0, 50, (40,), generator=gen)  # duplicates: each row's gradient is summed
        target = torch.randn(40, 6, generator=gen, dtype=torch.float64)
        (ec({"f": ids})["f"] * target.float()).sum().backward()
        opt.step()
        opt.zero_grad()
        rows = np.unique(ids.numpy())
        g = np.zeros((300, 6))
        np.add.at(g, ids.numpy(), target.numpy())
        slots = {k: v[rows] for k, v in state.items()}
        w[rows] = _around(rule)(w[rows], g[rows], slots, kwargs["lr"], hp)
        for k, v in slots.items():
            state[k][rows] = v
        got = opt.state[ec.tables.t.weight]
        np.testing.assert_allclose(ec.tables.t.weight.detach().double().numpy(), w, rtol=1e-5, atol=1e-6,
                                   err_msg=f"step {s}: weight")
        for k, v in state.items():
            np.testing.assert_allclose(got[k].double().numpy(), v, rtol=1e-5, atol=1e-6, err_msg=f"step {s}: {k}")
    assert row_update.compiled_kernels() - kernels == most
    assert counters["stats"]["unique_graphs"] - graphs == most  # (no kernel recompiled for a value either)
    assert ec.tables.t.weight not in row_update._REFERENCE_ONLY
