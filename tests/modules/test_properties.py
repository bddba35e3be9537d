"""Property-based tests (hypothesis, bounded): random tables, bags and weights; forward and one optimizer step
vs a float64 numpy reference written from TF's TPU embedding
(tensorflow/python/tpu/tpu_embedding_v2_utils.py: the combiners of TableConfig, and SGD / Adagrad / FTRL)."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_tpu_embedding as tte

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    v = draw(st.integers(1, 30))
    d = draw(st.integers(1, 5))
    combiner = draw(st.sampled_from(["sum", "mean", "sqrtn"]))
    lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    n = sum(lengths)
    ids = draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n))
    weighted = draw(st.booleans())
    weights = draw(st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=n, max_size=n)) if weighted else None
    seed = draw(st.integers(0, 2**16))
    return v, d, combiner, lengths, ids, weights, seed


def np_forward(table, combiner, lengths, ids, weights):
    out, k = [], 0
    for n in lengths:
        rows = table[ids[k : k + n]]
        w = np.ones(n) if weights is None else np.asarray(weights[k : k + n], dtype=np.float64)
        total = (w[:, None] * rows).sum(0) if n else np.zeros(table.shape[1])
        if combiner == "mean":
            s = w.sum()
            total = total / s if n and s != 0 else np.zeros(table.shape[1])
        elif combiner == "sqrtn":
            s = math.sqrt((w * w).sum())
            total = total / s if n and s != 0 else np.zeros(table.shape[1])
        out.append(total)
        k += n
    return np.stack(out), _gains(combiner, lengths, weights)


def _gains(combiner, lengths, weights):
    gains, k = [], 0
    for n in lengths:
        w = np.ones(n) if weights is None else np.asarray(weights[k : k + n], dtype=np.float64)
        den = {"sum": 1.0, "mean": w.sum(), "sqrtn": math.sqrt((w * w).sum())}[combiner]
        gains.extend(list(w / den) if den != 0 else [0.0] * n)
        k += n
    return gains


def build(v, d, combiner, seed):
    torch.manual_seed(seed)
    t = tte.TableConfig(v, d, name="t", combiner=combiner, dtype=torch.float64)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})


def run_step(case, make_opt):
    v, d, combiner, lengths, ids, weights, seed = case
    ec = build(v, d, combiner, seed)
    table0 = ec.tables.t.weight.detach().numpy().copy()
    jag = tte.Jagged(torch.tensor(ids, dtype=torch.int64), lengths=torch.tensor(lengths),
                     weights=None if weights is None else torch.tensor(weights, dtype=torch.float64))
    opt = make_opt(ec.parameters())
    out = ec({"f": jag})["f"]
    g_out = np.random.default_rng(seed).normal(size=tuple(out.shape))
    (out * torch.tensor(g_out)).sum().backward()
    opt.step()
    return out.detach().numpy(), table0, ec.tables.t.weight.detach().numpy(), g_out, opt


def np_row_grads(table0, combiner, lengths, ids, weights, g_out):
    gains = _gains(combiner, lengths, weights)
    grad = np.zeros_like(table0)
    k = 0
    for b, n in enumerate(lengths):
        for j in range(n):
            grad[ids[k + j]] += gains[k + j] * g_out[b]
        k += n
    touched = sorted(set(ids))
    return grad, touched


@SETTINGS
@given(cases())
def test_forward_matches_numpy(case) -> None:
    v, d, combiner, lengths, ids, weights, seed = case
    out, table0, *_ = run_step(case, lambda ps: tte.optim.SGD(ps, lr=0.0))
    want, _ = np_forward(table0, combiner, lengths, ids, weights)
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10)


@SETTINGS
@given(cases(), st.floats(0.01, 1.0))
def test_sgd_step_matches_numpy(case, lr) -> None:
    v, d, combiner, lengths, ids, weights, seed = case
    _, table0, table1, g_out, _ = run_step(case, lambda ps: tte.optim.SGD(ps, lr=lr))
    grad, _ = np_row_grads(table0, combiner, lengths, ids, weights, g_out)
    np.testing.assert_allclose(table1, table0 - lr * grad, rtol=1e-10, atol=1e-10)


@SETTINGS
@given(cases(), st.floats(0.01, 1.0), st.floats(0.05, 1.0))
def test_adagrad_step_matches_numpy_and_leaves_untouched_rows(case, lr, init) -> None:
    v, d, combiner, lengths, ids, weights, seed = case
    _, table0, table1, g_out, opt = run_step(
        case, lambda ps: tte.optim.Adagrad(ps, lr=lr, initial_accumulator_value=init))
    grad, touched = np_row_grads(table0, combiner, lengths, ids, weights, g_out)
    acc = init + grad * grad
    want = table0.copy()
    want[touched] = table0[touched] - lr * grad[touched] / np.sqrt(acc[touched])
    np.testing.assert_allclose(table1, want, rtol=1e-10, atol=1e-10)
    untouched = [i for i in range(v) if i not in touched]
    assert np.array_equal(table1[untouched], table0[untouched])
    if ids:
        slot = opt.state[next(iter(opt.state))]["accumulators"].numpy()
        np.testing.assert_allclose(slot[touched], acc[touched], rtol=1e-12)
        assert np.all(slot[untouched] == init)
