"""A jagged nested tensor with holes (built with ``lengths=``, or by ``torch.nested.narrow``) holds bag ``b`` at
``values()[offsets[b] : offsets[b] + lengths[b]]``; the entries between bags are not its own (``unbind()`` leaves
them out). The lookup read ``values()`` and ``offsets()`` alone, so the holes' ids were looked up in the bags and
trained (or, where ``offsets()`` did not end at ``len(values())``, an error about offsets the user never gave). Each
case against a float64 numpy reference of TF's combiners and sequences, forward and the rows after one SGD step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

V, D = 10, 3
TABLE = np.linspace(-1.0, 1.0, V * D).reshape(V, D)
HOLE = 9  # a valid id: looked up and trained if a hole were read as an id
BAGS = [[1, 2], [3, 3, 5], [0], []]
WEIGHTS = [[0.5, 2.0], [1.0, -1.0, 0.5], [3.0], []]


def _with_holes(rows: list[list[float]], dtype: torch.dtype, how: str) -> torch.Tensor:
    """``rows`` as a jagged nested tensor whose bags are separated by one or two hole entries (``HOLE``)."""
    if how == "narrow":  # a [B, 5] buffer, row b from column b % 2 (the rest of each row: holes)
        buf = torch.full((len(rows), 5), float(HOLE), dtype=dtype)
        starts = torch.tensor([b % 2 for b in range(len(rows))])
        for b, r in enumerate(rows):
            buf[b, b % 2 : b % 2 + len(r)] = torch.tensor(r, dtype=dtype)
        return torch.nested.narrow(buf, 1, starts, torch.tensor([len(r) for r in rows]), layout=torch.jagged)
    values: list[float] = []
    offsets = []
    for b, r in enumerate(rows):
        offsets.append(len(values))
        values += list(r) + [float(HOLE)] * (1 + b % 2)
    offsets.append(len(values))
    return torch.nested.nested_tensor_from_jagged(torch.tensor(values, dtype=dtype), torch.tensor(offsets),
                                                  lengths=torch.tensor([len(r) for r in rows]))


def _reference(combiner: str, weighted: bool, seq: int) -> tuple[np.ndarray, list[tuple[int, tuple[int, ...], float]]]:
    if seq:
        out = np.zeros((len(BAGS), seq, D))
        gains = []
        for b, ids in enumerate(BAGS):
            for p, i in enumerate(ids[:seq]):
                out[b, p] = TABLE[i]
                gains.append((i, (b, p), 1.0))
        return out, gains
    out = np.zeros((len(BAGS), D))
    gains = []
    for b, ids in enumerate(BAGS):
        ws = WEIGHTS[b] if weighted else [1.0] * len(ids)
        total = {"sum": 1.0, "mean": sum(ws), "sqrtn": math.sqrt(sum(w * w for w in ws))}[combiner]
        scale = 0.0 if total == 0 else (1.0 if combiner == "sum" else 1.0 / total)
        for i, w in zip(ids, ws, strict=True):
            out[b] += w * scale * TABLE[i]
            gains.append((i, (b,), w * scale))
    return out, gains


def _check(ec: tte.EmbeddingCollection, feats: dict, weights: dict | None, combiner: str, weighted: bool,
           seq: int = 0) -> None:
    out = ec(feats, weights)["f"]
    ref, gains = _reference(combiner, weighted, seq)
    np.testing.assert_allclose(out.detach().double().numpy(), ref, rtol=1e-6, atol=1e-6)
    grad = np.random.default_rng(0).standard_normal(ref.shape)
    (out * torch.tensor(grad, dtype=out.dtype)).sum().backward()
    tte.optim.SGD(ec.parameters(), lr=1.0).step()
    expected = TABLE.copy()
    for i, pos, g in gains:
        expected[i] -= g * grad[pos]
    np.testing.assert_allclose(ec.embedding_tables["t"].detach().double().numpy(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(ec.embedding_tables["t"][HOLE], torch.tensor(TABLE[HOLE], dtype=torch.float32))  # untrained


def _collection(combiner: str, **fc) -> tte.EmbeddingCollection:
    t = tte.TableConfig(V, D, name="t", combiner=combiner, initializer=torch.tensor(TABLE, dtype=torch.float32))
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t, **fc)})


@pytest.mark.parametrize("how", ["lengths", "narrow"])
@pytest.mark.parametrize("weights", ["none", "nested", "flat", "inside-jagged"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_bags_with_holes(combiner: str, weights: str, how: str) -> None:
    ids = _with_holes(BAGS, torch.int64, how)
    nested_w = _with_holes(WEIGHTS, torch.float32, how)
    feats: dict = {"f": ids}
    given = None
    if weights == "nested":
        given = {"f": nested_w}
    elif weights == "flat":  # one weight per entry of the ids' values(), holes too (their weight: HOLE)
        given = {"f": nested_w.values()}
    elif weights == "inside-jagged":  # nested weights with holes beside packed Jagged ids
        feats = {"f": tte.Jagged(torch.tensor([i for b in BAGS for i in b]), lengths=torch.tensor([len(b) for b in BAGS]),
                                 weights=nested_w)}
    _check(_collection(combiner), feats, given, combiner, weights != "none")


@pytest.mark.parametrize("how", ["lengths", "narrow"])
@pytest.mark.parametrize("length", [2, 4])
def test_sequence_with_holes(how: str, length: int) -> None:
    _check(_collection("sum", max_sequence_length=length), {"f": _with_holes(BAGS, torch.int64, how)}, None, "sum",
           False, seq=length)


def test_weights_with_other_holes_are_refused() -> None:
    ids = _with_holes(BAGS, torch.int64, "lengths")
    other = _with_holes([[1.0, 1.0], [1.0, 1.0, 1.0], [1.0], []], torch.float32, "narrow")
    with pytest.raises(ValueError, match=r"Feature `f`: nested weights must have the same offsets \(and lengths\)"):
        _collection("mean")({"f": ids}, {"f": other})
    with pytest.raises(ValueError, match=r"Feature `f`: weights must have the shape of the nested ids' values\(\)"):
        _collection("mean")({"f": ids}, {"f": torch.ones(6)})


@pytest.mark.parametrize("where", ["inside-jagged", "weights-argument"])
def test_nested_weights_of_other_bags_beside_jagged_ids_are_refused(where: str) -> None:
    # Bags [1, 2], [3, 3, 5], [0], [] with weights nested as [0.5], [2, 1, -1], [0.5, 3], []: as many weights,
    # so they were taken entry by entry, bag 0's second id weighed by what the user put in bag 1.
    ids = torch.tensor([i for b in BAGS for i in b])
    lengths = torch.tensor([len(b) for b in BAGS])
    other = torch.nested.nested_tensor_from_jagged(torch.tensor([w for b in WEIGHTS for w in b]),
                                                   torch.tensor([0, 1, 4, 6, 6]))
    feats = {"f": tte.Jagged(ids, lengths=lengths, weights=other if where == "inside-jagged" else None)}
    name = "Jagged weights" if where == "inside-jagged" else "the weights"
    with pytest.raises(ValueError, match=rf"Feature `f`: {name}, a nested tensor, must hold the bags of the ids: "
                       r"bag lengths \[2, 3, 1, 0\]\. Received bag lengths \[1, 3, 2, 0\]$"):
        _collection("mean")(feats, None if where == "inside-jagged" else {"f": other})
    ec = _collection("mean")  # the same weights in the ids' bags: taken
    right = torch.nested.nested_tensor_from_jagged(torch.tensor([w for b in WEIGHTS for w in b]),
                                                   torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
    _check(ec, {"f": tte.Jagged(ids, lengths=lengths, weights=right if where == "inside-jagged" else None)},
           None if where == "inside-jagged" else {"f": right}, "mean", True)
