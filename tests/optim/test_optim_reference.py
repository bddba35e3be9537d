"""Each optimizer × option, several steps, vs its float64 numpy reference (tests/optim_registry.py).

Three features share one table (a weighted mean bag with duplicate ids, dense ids, a sequence);
rows >= 12 are never looked up. The reference gets its gradient from ``nn.Embedding`` autograd at
its own weights (independent of our lookup) and applies, in numpy, the shared steps around each
entry's rule to the touched rows (every row for a non-lazy configuration): clipvalue → decoupled
decay → the entry's ``np_rule`` → weight clipping. Slots come from the entry's ``np_init`` (their
shapes are the entry's); slots of the whole table (``whole_slots``) are passed whole.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optim_registry import GENERIC, OptimizerConfig, OptimizerInfo, cases

import torch_tpu_embedding as tte

V, D, STEPS = 16, 3, 4


# ---------------------------------------------------------------- the shared steps around the rule
def np_step(info: OptimizerInfo, hp: dict, table, slots, rows, g, lr, t) -> None:
    """One step of ``info`` on ``rows`` of ``table`` (float64, in place): the pipeline of docs/optimizers.md."""
    rows = sorted(rows)
    w, gr = table[rows], g[rows]
    if hp.get("clipvalue") is not None:
        lo, hi = hp["clipvalue"]
        gr = np.clip(gr, -np.inf if lo is None else lo, np.inf if hi is None else hi)
    if hp.get("weight_decay_factor"):
        lam = hp["weight_decay_factor"] * (lr if hp.get("multiply_weight_decay_factor_by_learning_rate") else 1)
        w = w - lam * w
    s = {k: v if k in info.whole_slots else v[rows] for k, v in slots.items()}
    w, new = info.np_rule(hp, w, gr, s, lr, t, len(table))
    if hp.get("clip_weight_min") is not None or hp.get("clip_weight_max") is not None:
        lo, hi = hp.get("clip_weight_min"), hp.get("clip_weight_max")
        w = np.clip(w, -np.inf if lo is None else lo, np.inf if hi is None else hi)
    table[rows] = w
    for k in slots:
        if k in info.whole_slots:
            slots[k] = np.asarray(new[k], dtype=np.float64)
        else:
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
@pytest.mark.parametrize("cfg", cases(GENERIC), ids=str)
def test_matches_numpy_reference(cfg: OptimizerConfig, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner="mean", dtype=dtype)
    ec = tte.EmbeddingCollection({
        "a": tte.FeatureConfig(t), "b": tte.FeatureConfig(t), "c": tte.FeatureConfig(t, max_sequence_length=3),
    })
    proj = torch.randn(D, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    opt = cfg.make(ec.parameters())
    hp = opt.param_groups[0]
    table = ec.tables.t.weight.detach().double().numpy().copy()
    slots = cfg.info.table_slots(hp, (V, D))
    lr = hp["lr"]
    for step in range(STEPS):
        a, wa, la, b, c, lc = batch(step)
        out = ec({"a": tte.Jagged(a, lengths=la, weights=wa.to(dtype)), "b": b, "c": tte.Jagged(c, lengths=lc)})
        loss_fn(out["a"].double(), out["b"].double(), out["c"].double(), proj).backward()
        opt.step()
        opt.zero_grad()
        g, touched = reference_grad(table, step, proj)
        assert not touched & set(range(12, V))
        np_step(cfg.info, hp, table, slots, touched if cfg.lazy else range(V), g, lr, step + 1)
    tol = 1e-10 if dtype == torch.float64 else 1e-6
    np.testing.assert_allclose(ec.tables.t.weight.detach().double().numpy(), table, rtol=tol, atol=tol)
    state = opt.state_dict()["state"]["table:t"]
    for k, v in slots.items():
        np.testing.assert_allclose(state[k].double().numpy(), v, rtol=tol, atol=tol, err_msg=k)
