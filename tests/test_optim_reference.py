"""Each optimizer × option, several steps, vs a float64 numpy reference written from tf_spec §4.

Three features share one table (a weighted mean bag with duplicate ids, dense ids, a sequence);
rows >= 12 are never looked up. The reference gets its gradient from ``nn.Embedding`` autograd at
its own weights (independent of our lookup) and applies tf_spec's per-row formulas to the touched
rows in numpy: clipvalue → decoupled decay → rule → weight clipping.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optim_registry import IDS, OPTIM_INFOS, OptimInfo

import torch_tpu_embedding as tte

V, D, STEPS = 16, 3, 4


# ---------------------------------------------------------------- numpy reference (tf_spec §4.2)
def np_rule(name: str, hp: dict, w, g, s: dict, lr: float, t: int):
    if name == "sgd":
        return w - lr * g, s
    if name == "adagrad":
        a = s["accumulators"] + g * g
        return w - lr * g / np.sqrt(a), {"accumulators": a}
    if name == "adagrad_momentum":
        b2 = hp["beta2"]
        a = s["accumulators"] + g * g if b2 == 1 else b2 * s["accumulators"] + (1 - b2) * g * g
        step = g * (a + hp["epsilon"]) ** (-1.0 / hp["exponent"])
        m = hp["momentum"] * s["momenta"] + step
        upd = hp["momentum"] * m + step if hp["use_nesterov"] else m
        return w - lr * upd, {"accumulators": a, "momenta": m}
    if name in ("adam", "lazy_adam"):
        b1, b2 = hp["betas"]
        m = b1 * s["momenta"] + (1 - b1) * g
        v = b2 * s["velocities"] + (1 - b2) * g * g
        alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t) if hp["bias_correction"] else lr
        den = np.sqrt(v + hp["eps"] ** 2) if hp["sum_inside_sqrt"] else np.sqrt(v) + hp["eps"]
        return w - alpha * m / den, {"momenta": m, "velocities": v}
    if name == "ftrl":
        p, l1, l2, beta = (hp["learning_rate_power"], hp["l1_regularization_strength"],
                           hp["l2_regularization_strength"], hp["beta"])
        n, z = s["accumulators"], s["linears"]
        n2 = n + g * g
        delta = n2 ** (-p) - n ** (-p)
        if hp["multiply_linear_by_learning_rate"]:
            z = z + lr * g - delta * w
            num = np.clip(z, -lr * l1, lr * l1) - z
            den = n2 ** (-p) + 2 * lr * l2 + beta
        else:
            z = z + g - delta * w / lr
            num = np.clip(z, -l1, l1) - z
            den = (n2 ** (-p) + beta) / lr + 2 * l2
        return num / den, {"accumulators": n2, "linears": z}
    raise AssertionError(name)


def np_init(name: str, hp: dict) -> dict[str, float]:
    return {
        "sgd": {}, "adagrad": {"accumulators": hp.get("initial_accumulator_value", 0.1)},
        "adagrad_momentum": {"accumulators": 0.0, "momenta": 0.0},
        "adam": {"momenta": 0.0, "velocities": 0.0}, "lazy_adam": {"momenta": 0.0, "velocities": 0.0},
        "ftrl": {"accumulators": hp.get("initial_accumulator_value", 0.1), "linears": 0.0},
    }[name]


def np_lazy_step(name, hp, table, slots, touched, g, lr, t):
    rows = sorted(touched)
    w, gr = table[rows], g[rows]
    if hp.get("clipvalue") is not None:
        lo, hi = hp["clipvalue"]
        gr = np.clip(gr, -np.inf if lo is None else lo, np.inf if hi is None else hi)
    if hp.get("weight_decay_factor"):
        lam = hp["weight_decay_factor"] * (lr if hp.get("multiply_weight_decay_factor_by_learning_rate") else 1)
        w = w - lam * w
    w, new = np_rule(name, hp, w, gr, {k: v[rows] for k, v in slots.items()}, lr, t)
    if hp.get("clip_weight_min") is not None or hp.get("clip_weight_max") is not None:
        lo, hi = hp.get("clip_weight_min"), hp.get("clip_weight_max")
        w = np.clip(w, -np.inf if lo is None else lo, np.inf if hi is None else hi)
    table[rows] = w
    for k in slots:
        slots[k][rows] = new[k]


# ---------------------------------------------------------------- the same model, two ways
def batch(step: int):
    g = torch.Generator().manual_seed(step)
    a = torch.randint(0, 8, (9,), generator=g)
    a[1] = a[0]  # a duplicate inside a bag
    wa = torch.rand(9, generator=g, dtype=torch.float64) + 0.2
    la = torch.tensor([3, 2, 0, 4])
    b = torch.randint(4, 12, (4,), generator=g)
    c = torch.randint(0, 12, (6,), generator=g)
    lc = torch.tensor([2, 0, 4, 0])
    return a, wa, la, b, c, lc


def loss_fn(out_a, out_b, out_c, proj):
    return ((out_a @ proj).tanh() * (out_b @ proj)).sum() + (out_c ** 2).sum() * 0.1


def reference_grad(table: np.ndarray, step: int, proj):
    """Dense dL/dtable from nn.Embedding autograd, and the rows looked up."""
    a, wa, la, b, c, lc = batch(step)
    emb = torch.nn.Embedding(V, D).double()
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(table))
    outs_a, start = [], 0
    for n in la.tolist():
        ids, w = a[start:start + n], wa[start:start + n]
        outs_a.append((emb(ids) * w[:, None]).sum(0) / w.sum() if n else torch.zeros(D, dtype=torch.float64))
        start += n
    out_a = torch.stack(outs_a)
    out_c = torch.zeros(4, 3, D, dtype=torch.float64)
    start = 0
    for i, n in enumerate(lc.tolist()):
        k = min(n, 3)
        if k:
            out_c[i, :k] = emb(c[start:start + k])
        start += n
    loss_fn(out_a, emb(b), out_c, proj).backward()
    touched = set(a.tolist()) | set(b.tolist()) | set(c[:2].tolist()) | set(c[2:5].tolist())
    return emb.weight.grad.numpy(), touched


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("info", OPTIM_INFOS, ids=IDS)
def test_matches_numpy_reference(info: OptimInfo, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner="mean", dtype=dtype)
    ec = tte.EmbeddingCollection({
        "a": tte.FeatureConfig(t), "b": tte.FeatureConfig(t), "c": tte.FeatureConfig(t, max_sequence_length=3),
    })
    proj = torch.randn(D, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    opt = info.make(ec.parameters())
    hp = opt.param_groups[0]
    name = hp["algorithm"]
    table = ec.tables.t.weight.detach().double().numpy().copy()
    slots = {k: np.full((V, D), v) for k, v in np_init(name, hp).items()}
    lr = hp["lr"]
    for step in range(STEPS):
        a, wa, la, b, c, lc = batch(step)
        out = ec({"a": tte.Jagged(a, lengths=la, weights=wa.to(dtype)), "b": b, "c": tte.Jagged(c, lengths=lc)})
        loss_fn(out["a"].double(), out["b"].double(), out["c"].double(), proj).backward()
        opt.step()
        opt.zero_grad()
        g, touched = reference_grad(table, step, proj)
        assert not touched & set(range(12, V))
        np_lazy_step(name, hp, table, slots, touched, g, lr, step + 1)
    tol = 1e-10 if dtype == torch.float64 else 1e-6
    np.testing.assert_allclose(ec.tables.t.weight.detach().double().numpy(), table, rtol=tol, atol=tol)
    state = opt.state_dict()["state"]["table:t"]
    for k, v in slots.items():
        np.testing.assert_allclose(state[k].double().numpy(), v, rtol=tol, atol=tol, err_msg=k)
