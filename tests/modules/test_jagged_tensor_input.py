"""TorchRec's ``JaggedTensor`` as one feature's input (what ``KeyedJaggedTensor.to_dict()`` gives per key), taken
as it is: any object with its ``values()``, ``lengths()`` or ``offsets()`` and ``weights_or_none()`` (stand-ins
here: torchrec need not be installed). It was refused ("unsupported input type"). Checked against a float64
numpy reference of TF's combiners: the forward and the rows after one SGD step, stacked and not."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

V, D = 12, 4
TABLES = {n: np.linspace(-1.0, 1.0, V * D).reshape(V, D) * s for n, s in (("u", 1.0), ("m", -0.5))}
BAGS = {"a": [[1, 2, 2], [], [7]], "b": [[3], [4, 5, 11], [0, 0]]}
WEIGHTS = {"a": [[0.5, 2.0, -1.0], [], [3.0]], "b": None}
COMBINERS = {"a": "sqrtn", "b": "mean"}


class JaggedTensorLike:
    """torchrec.JaggedTensor's methods (it keeps both offsets and lengths)."""

    def __init__(self, bags: list[list[int]], weights: list[list[float]] | None, by: str) -> None:
        self._values = torch.tensor([i for bag in bags for i in bag], dtype=torch.int64)
        self._lengths = torch.tensor([len(bag) for bag in bags], dtype=torch.int32)
        self._weights = None if weights is None else torch.tensor([w for ws in weights for w in ws])
        self._by = by

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor | None:
        return self._lengths if self._by != "offsets" else None

    def offsets(self) -> torch.Tensor:
        return torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights


def _reference(feature: str) -> tuple[np.ndarray, list[tuple[int, int, float]]]:
    table = TABLES["u" if feature == "a" else "m"]
    out = np.zeros((3, D))
    gains = []
    for b, ids in enumerate(BAGS[feature]):
        ws = WEIGHTS[feature][b] if WEIGHTS[feature] is not None else [1.0] * len(ids)
        total = {"sum": 1.0, "mean": sum(ws), "sqrtn": math.sqrt(sum(w * w for w in ws))}[COMBINERS[feature]]
        scale = 0.0 if total == 0 else 1.0 / total
        for i, w in zip(ids, ws, strict=True):
            out[b] += w * scale * table[i]
            gains.append((i, b, w * scale))
    return out, gains


def _collection(stack: bool) -> tte.EmbeddingCollection:
    def table(name: str, combiner: str) -> tte.TableConfig:
        return tte.TableConfig(V, D, name=name, combiner=combiner, dtype=torch.float64,
                               initializer=torch.tensor(TABLES[name]))

    return tte.EmbeddingCollection({"a": tte.FeatureConfig(table("u", "sqrtn")),
                                    "b": tte.FeatureConfig(table("m", "mean"))}, stack_tables=stack)


@pytest.mark.parametrize("stack", [True, False])
@pytest.mark.parametrize("by", ["lengths", "offsets"])
def test_a_jagged_tensor_per_feature_equals_the_reference(stack: bool, by: str) -> None:
    ec = _collection(stack)
    inputs = {f: JaggedTensorLike(BAGS[f], WEIGHTS[f], by) for f in BAGS}
    out = ec(inputs)
    rng = np.random.default_rng(0)
    loss = torch.zeros((), dtype=torch.float64)
    expected = {n: t.copy() for n, t in TABLES.items()}
    for f, table in (("a", "u"), ("b", "m")):
        ref, gains = _reference(f)
        np.testing.assert_allclose(out[f].detach().numpy(), ref, rtol=1e-13, atol=1e-15)
        grad = rng.standard_normal(ref.shape)
        loss = loss + (out[f] * torch.tensor(grad)).sum()
        for i, b, g in gains:
            expected[table][i] -= g * grad[b]
    loss.backward()
    tte.optim.SGD(ec.parameters(), lr=1.0).step()
    for name in TABLES:
        np.testing.assert_allclose(ec.embedding_tables[name].detach().numpy(), expected[name], rtol=1e-13,
                                   atol=1e-15)


def test_weights_given_twice_and_objects_without_bags_are_refused_by_feature() -> None:
    ec = _collection(True)
    inputs = {f: JaggedTensorLike(BAGS[f], WEIGHTS[f], "lengths") for f in BAGS}
    with pytest.raises(ValueError, match=r"Feature `a`: weights given twice \(JaggedTensorLike weights_or_none\(\) and "
                                         r"`weights`\)"):
        ec(inputs, {"a": torch.ones(4, dtype=torch.float64), "b": None})

    class ValuesOnly:
        def values(self) -> torch.Tensor:
            return torch.tensor([1])

    with pytest.raises(TypeError, match=r"Feature `b`: unsupported input type ValuesOnly.*JaggedTensor"):
        ec({"a": inputs["a"], "b": ValuesOnly()})


def _jt(by: str = "lengths", **parts: object) -> JaggedTensorLike:
    jt = JaggedTensorLike(BAGS["a"], WEIGHTS["a"], by)
    for name, value in parts.items():
        setattr(jt, f"_{name}", value)
    return jt


I32 = torch.int32
BAD_PARTS = {  # (the input of feature `b`, the error's type, its message after "Feature `b`: ")
    "values-list": (_jt(values=[1, 2, 2, 7]), TypeError,
                    r"JaggedTensorLike values\(\) must be a torch.Tensor. Received list"),
    "values-sparse": (_jt(values=torch.tensor([1, 2, 2, 7]).to_sparse()), ValueError,
                      r"JaggedTensorLike values\(\) must be a dense \(strided\) tensor. Received a sparse_coo tensor.*"
                      r"not inside JaggedTensorLike$"),
    "values-2d": (_jt(values=torch.tensor([[1, 2], [2, 7]])), ValueError,
                  r"JaggedTensorLike values\(\) must be 1-D. Received shape \(2, 2\)"),
    "lengths-float": (_jt(lengths=torch.tensor([3.0, 0.0, 1.0])), TypeError,
                      r"JaggedTensorLike lengths\(\) must be an integer tensor. Received dtype torch.float32"),
    "lengths-negative": (_jt(lengths=torch.tensor([3, -1, 2], dtype=I32)), ValueError,
                         r"JaggedTensorLike lengths\(\) must be 1-D and >= 0"),
    "lengths-sum": (_jt(lengths=torch.tensor([3, 0, 2], dtype=I32)), ValueError,
                    r"JaggedTensorLike lengths\(\) must add up to len\(JaggedTensorLike values\(\)\)=4. "
                    r"Received: \[3, 0, 2\]"),
    "offsets-end": (_jt("offsets", lengths=torch.tensor([3, 0, 2], dtype=I32)), ValueError,
                    r"JaggedTensorLike offsets\(\) must start at 0, be non-decreasing and end at "
                    r"len\(JaggedTensorLike values\(\)\)=4. Received: \[0, 3, 3, 5\]"),
    "weights-list": (_jt(weights=[1.0] * 4), TypeError,
                     r"JaggedTensorLike weights_or_none\(\) must be a torch.Tensor. Received list"),
    "weights-shape": (_jt(weights=torch.ones(3, dtype=torch.float64)), ValueError,
                      r"weights must have the shape of JaggedTensorLike values\(\) \(4,\). Received: \(3,\)"),
}


@pytest.mark.parametrize("case", list(BAD_PARTS))
def test_errors_name_the_feature_and_the_jagged_tensor_s_own_parts(case: str) -> None:
    """A JaggedTensor's errors name what the user passed (its type, its methods), not the tte.Jagged it is read as
    (they said "Jagged values", "Jagged lengths", or "offsets" for bags given by lengths())."""
    value, kind, message = BAD_PARTS[case]
    ec = _collection(False)
    with pytest.raises(kind, match=r"^Feature `b`: " + message) as info:
        ec({"a": _jt(), "b": value})
    assert not re.search(r"Jagged (values|offsets|lengths|weights)|inside Jagged\b|a Jagged input", str(info.value))
