"""``Padded`` weights where the mask holds no id are not weights of any id: the host took a NaN, an inf or a float64
value beyond float32 there as a bad weight and refused the batch, while the same bags on an XLA device were looked
up (the device's count of bad weights skips padding) and the combiner takes no weight there. Both now agree with a
float64 numpy reference of the combiners (forward and the rows after one SGD step); a bad weight under the mask is
still refused, naming the feature."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

D = 3
VOCAB = {"t": 10, "u": 7}
BAGS = {"a": [[1, 2], [], [3, 3, 5]], "b": [[6], [0, 0], [4, 5, 6]]}
WEIGHTS = {"a": [[0.5, 2.0], [], [1.0, -1.0, 0.5]], "b": [[2.0], [1.0, 3.0], [1.0, 1.0, -0.5]]}
TABLE_OF = {"a": "t", "b": "u"}
WIDTH = 4


def _rows(name: str) -> np.ndarray:
    v = VOCAB[name]
    return np.linspace(-1.0, 1.0, v * D).reshape(v, D) * (1.5 if name == "t" else 1.0)


def _reference(feature: str, combiner: str) -> tuple[np.ndarray, list[tuple[int, int, float]]]:
    """(out [B, D], [(id, bag, gain)]) by TF's combiners in float64 (empty or zero-sum bag → 0)."""
    table = _rows(TABLE_OF[feature])
    out = np.zeros((len(BAGS[feature]), D))
    gains = []
    for b, (ids, ws) in enumerate(zip(BAGS[feature], WEIGHTS[feature], strict=True)):
        total = {"sum": 1.0, "mean": sum(ws), "sqrtn": math.sqrt(sum(w * w for w in ws))}[combiner]
        scale = 0.0 if total == 0 else (1.0 if combiner == "sum" else 1.0 / total)
        for i, w in zip(ids, ws, strict=True):
            out[b] += w * scale * table[i]
            gains.append((i, b, w * scale))
    return out, gains


def _padded(feature: str, at_padding: float, dtype: torch.dtype) -> tte.Padded:
    bags = BAGS[feature]
    ids = torch.full((len(bags), WIDTH), 9999)  # not ids: never read (masked out)
    mask = torch.zeros(len(bags), WIDTH, dtype=torch.bool)
    w = torch.full((len(bags), WIDTH), at_padding, dtype=dtype)
    for b, bag in enumerate(bags):
        for p, i in enumerate(bag):
            ids[b, p], mask[b, p], w[b, p] = i, True, WEIGHTS[feature][b][p]
    return tte.Padded(ids, mask, w)


def _collection(combiner: str, stack: bool) -> tte.EmbeddingCollection:
    tables = {n: tte.TableConfig(v, D, name=n, combiner=combiner) for n, v in VOCAB.items()}
    ec = tte.EmbeddingCollection({f: tte.FeatureConfig(tables[t]) for f, t in TABLE_OF.items()}, stack_tables=stack)
    with torch.no_grad():
        for n in VOCAB:
            ec.embedding_tables[n].copy_(torch.tensor(_rows(n)))
    return ec


@pytest.mark.parametrize("at_padding,dtype", [(float("nan"), torch.float32), (float("inf"), torch.float32),
                                              (-float("inf"), torch.float64), (1e300, torch.float64)],
                         ids=["nan", "inf", "-inf-f64", "beyond-f32"])
@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weights_at_padding_are_no_weights(combiner: str, stack: bool, at_padding: float, dtype: torch.dtype) -> None:
    ec = _collection(combiner, stack)
    out = ec({f: _padded(f, at_padding, dtype) for f in BAGS})
    rng = np.random.default_rng(0)
    grads = {f: rng.standard_normal((len(BAGS[f]), D)) for f in BAGS}
    expected = {n: _rows(n) for n in VOCAB}
    for f in BAGS:
        ref, gains = _reference(f, combiner)
        np.testing.assert_allclose(out[f].detach().double().numpy(), ref, rtol=1e-6, atol=1e-6)
        for i, b, g in gains:
            expected[TABLE_OF[f]][i] -= g * grads[f][b]
    sum((out[f] * torch.tensor(grads[f], dtype=out[f].dtype)).sum() for f in BAGS).backward()
    tte.optim.SGD(ec.parameters(), lr=1.0).step()
    for n in VOCAB:
        np.testing.assert_allclose(ec.embedding_tables[n].detach().double().numpy(), expected[n], rtol=1e-6,
                                   atol=1e-6)


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_a_bad_weight_of_an_id_is_still_refused(stack: bool) -> None:
    ec = _collection("mean", stack)
    bad = _padded("b", 0.0, torch.float32)
    bad.weights[2, 1] = float("nan")  # under the mask: the weight of id 5
    with pytest.raises(ValueError, match=r"Feature `b`: weights must be finite"):
        ec({"a": _padded("a", 0.0, torch.float32), "b": bad})
    big = _padded("a", 0.0, torch.float64)
    big.weights[0, 0] = 1e300
    with pytest.raises(ValueError, match=r"Feature `a`: weights must be finite in torch.float32.*1e\+300"):
        ec({"a": big, "b": _padded("b", 0.0, torch.float32)})
    assert not ec.row_grads()
