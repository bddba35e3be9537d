"""A ``KeyedJaggedTensor`` input (``modules/keyed.py``) against the same bags given per feature as ``tte.Jagged``:
keys in any order, ``lengths()`` or ``offsets()`` only, int32 parts, weights, empty bags and batches, sequence
features; a malformed one raises naming what is wrong."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

_KEYS = ("fa", "fb", "fc")
_VOCAB = {"fa": 10, "fb": 17, "fc": 24}
_CAP = {"fa": 4, "fb": 6, "fc": 3}


class _KJT:
    """``keys()``, ``values()``, ``weights_or_none()`` and one of ``lengths()`` / ``offsets()`` (as given)."""

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor | None = None,
                 offsets: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> None:
        self._k, self._v, self._w = keys, values, weights
        if lengths is not None:
            self.lengths = lambda: lengths
        if offsets is not None:
            self.offsets = lambda: offsets

    def keys(self) -> list[str]:
        return self._k

    def values(self) -> torch.Tensor:
        return self._v

    def weights_or_none(self) -> torch.Tensor | None:
        return self._w


def _collection(sequence: bool = False) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    tables = {k: tte.TableConfig(_VOCAB[k], 3, name=f"t_{k}", combiner=c, dtype=torch.float64)
              for k, c in zip(_KEYS, ("mean", "sum", "sqrtn"), strict=True)}
    caps = {"fa": 4, "fb": None, "fc": 3}
    return tte.EmbeddingCollection({
        k: tte.FeatureConfig(tables[k], name=k, max_sequence_length=3) if sequence and k == "fc"
        else tte.FeatureConfig(tables[k], name=k, max_ids_per_bag=caps[k]) for k in _KEYS})


def _bags(b: int, seed: int, weighted: bool, empty: bool = False) -> dict[str, tuple[Any, ...]]:
    """Per key: (values, lengths, weights or None)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in _KEYS:
        lengths = torch.zeros(b, dtype=torch.int64) if empty else torch.randint(0, _CAP[k] + 1, (b,), generator=g)
        n = int(lengths.sum())
        out[k] = (torch.randint(0, _VOCAB[k], (n,), generator=g), lengths,
                  torch.rand(n, generator=g, dtype=torch.float64) if weighted else None)
    return out


def _keyed(bags: dict[str, tuple[Any, ...]], order: list[str], offsets: bool = False,
           dtype: torch.dtype = torch.int64) -> _KJT:
    values = torch.cat([bags[k][0] for k in order]).to(dtype)
    lengths = torch.cat([bags[k][1] for k in order]).to(dtype)
    weights = None if bags[order[0]][2] is None else torch.cat([bags[k][2] for k in order])
    if offsets:
        return _KJT(order, values, offsets=torch.cat([lengths.new_zeros(1), lengths.cumsum(0).to(dtype)]),
                    weights=weights)
    return _KJT(order, values, lengths=lengths, weights=weights)


def _flat(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([out[k].flatten(1) for k in _KEYS], 1)


@pytest.mark.parametrize("offsets", [False, True], ids=["lengths", "offsets"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("case", ["plain", "weighted", "sequence", "empty_bags", "no_bags"])
def test_a_keyed_input_equals_its_bags_per_feature(offsets: bool, dtype: torch.dtype, case: str) -> None:
    ec = _collection(sequence=case == "sequence")
    for seed in range(3):  # (later calls replay the first call's plan where their widths allow)
        bags = _bags(0 if case == "no_bags" else 5, seed, case == "weighted", empty=case == "empty_bags")
        want = _flat(ec({k: tte.Jagged(v, lengths=n, weights=w) for k, (v, n, w) in bags.items()}))
        for order in (list(_KEYS), ["fc", "fa", "fb"]):
            got = _flat(ec(_keyed(bags, order, offsets, dtype)))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_keyed_input_truncates_a_sequence_of_output_shape_as_its_bags_per_feature_do() -> None:
    """An output_shape of k·B positions makes a sequence of length k (TF's rule): longer bags are truncated there
    whatever max_ids_per_bag says (it bounds the bags a feature combines), as they are given per feature."""
    torch.manual_seed(0)
    t = tte.TableConfig(10, 3, name="t", combiner="mean", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, output_shape=[2, 3], max_ids_per_bag=1)})
    values, lengths = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([4, 1])
    want = ec({"f": tte.Jagged(values, lengths=lengths)})["f"]
    rows = ec.tables.t.weight.detach()
    torch.testing.assert_close(want, torch.stack([rows[[1, 2, 3]], torch.cat([rows[[5]], torch.zeros(2, 3)])]),
                               rtol=0, atol=0)  # (rows as they are)
    torch.testing.assert_close(ec(_KJT(["f"], values, lengths=lengths))["f"], want, rtol=0, atol=0)


def test_offsets_that_do_not_start_at_0_raise() -> None:
    """``offsets()`` only, shifted by 2: its bags are not those of its values from 0 (TorchRec's bag n is
    ``values()[offsets[n]:offsets[n + 1]]``); the lengths alone, its differences, were taken and looked up the
    wrong ids."""
    ec = _collection()
    bags = _bags(4, 0, False)
    good = _keyed(bags, list(_KEYS), offsets=True)
    ec(good)
    shifted = _KJT(list(_KEYS), good.values(), offsets=good.offsets() + 2)
    with pytest.raises(ValueError, match=r"offsets\(\) must start at 0 and end at len\(values\(\)\) = \d+. "
                                         r"Received offsets from 2 to"):
        ec(shifted)
    short = _KJT(list(_KEYS), good.values(), offsets=good.offsets()[:-1])  # (bags of unequal count: lengths)
    with pytest.raises(ValueError, match="same number of bags"):
        ec(short)
    with pytest.raises(TypeError, match=r"offsets\(\) must be a 1-D tensor .* Received Tensor\(0,\)"):
        ec(_KJT(list(_KEYS), good.values(), offsets=torch.zeros(0, dtype=torch.int64)))


def _numpy_bag(table: np.ndarray, ids: np.ndarray, w: np.ndarray, combiner: str) -> np.ndarray:
    """One bag in float64 numpy: Σ wᵢ·eᵢ, divided by Σ wᵢ (mean) or sqrt(Σ wᵢ²) (sqrtn); empty: zeros."""
    if not len(ids):
        return np.zeros(table.shape[1])
    total = (w[:, None] * table[ids]).sum(0)
    return total / {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]


@pytest.mark.parametrize("offsets", [False, True], ids=["lengths", "offsets"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_a_keyed_input_against_numpy_bags(offsets: bool, dtype: torch.dtype, weighted: bool) -> None:
    """Keys in another order than ``feature_names``, empty bags among full ones: each bag combined in numpy."""
    ec = _collection()
    combiner = {"fa": "mean", "fb": "sum", "fc": "sqrtn"}
    bags = _bags(6, 7, weighted)
    for k in _KEYS:  # bag 1 of every key empty
        v, n, w = bags[k]
        start, end = int(n[:1].sum()), int(n[:2].sum())
        bags[k] = (torch.cat([v[:start], v[end:]]), torch.cat([n[:1], n.new_zeros(1), n[2:]]),
                   None if w is None else torch.cat([w[:start], w[end:]]))
    got = ec(_keyed(bags, ["fc", "fa", "fb"], offsets, dtype))
    for k in _KEYS:
        v, n, w = bags[k]
        table = ec.embedding_tables[f"t_{k}"].detach().numpy()
        ends = np.cumsum(n.numpy())
        ws = np.ones(len(v)) if w is None else w.numpy()
        want = np.stack([_numpy_bag(table, v.numpy()[e - ln: e], ws[e - ln: e], combiner[k])
                         for e, ln in zip(ends, n.numpy(), strict=True)])
        torch.testing.assert_close(got[k], torch.from_numpy(want), rtol=1e-12, atol=1e-12)
        assert not got[k][1].any()


def test_a_keyed_input_with_a_batch_size_per_key_raises() -> None:
    """TorchRec's variable batch per feature (VBE: ``variable_stride_per_key()``): 1, 2 and 3 bags for the three keys
    are 6 lengths, which 3 keys divide; read as 2 bags each, every key's bags would be wrong."""
    ec = _collection()

    class _VBE(_KJT):
        def variable_stride_per_key(self) -> bool:
            return True

    kjt = _VBE(list(_KEYS), torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 1, 0, 0, 1]))
    with pytest.raises(ValueError, match=r"same number of bags for each of its keys .* pass \{name: tte\.Jagged"
                                         r"\(\.\.\.\)\} per feature instead\)\. Received a KeyedJaggedTensor with "
                                         r"variable_stride_per_key\(\) True"):
        ec(kjt)


def test_a_keyed_input_with_other_keys_raises_with_the_way_out() -> None:
    """A TorchRec KJT often carries other modules' keys (TorchRec's EmbeddingBagCollection skips them): the error
    names them and how to keep the collection's keys."""
    ec = _collection()
    bags = _bags(3, 0, False)
    bags["other"] = bags["fa"]
    with pytest.raises(ValueError, match=r"unknown: \['other'\]\. TorchRec's EmbeddingBagCollection ignores keys it "
                                         r"has no feature for; here keep the collection's keys first: kjt\.permute"):
        ec(_keyed(bags, ["fa", "other", "fb", "fc"]))
    with pytest.raises(ValueError, match=r"missing: \['fc'\]$"):
        ec(_keyed(bags, ["fa", "fb"]))


def test_offsets_and_weights_of_a_wrong_dtype_or_order_raise_naming_them() -> None:
    """``offsets()`` of bools crashed inside their differences (torch's "Subtraction ... with two bool tensors");
    integer weights were named as the first feature's (``Feature `fa`: weights``), and offsets that go back as
    ``lengths``, which the input does not have: each error names the KeyedJaggedTensor's own part."""
    ec = _collection()
    good = _keyed(_bags(4, 0, True), list(_KEYS), offsets=True)
    with pytest.raises(TypeError, match=r"offsets\(\) must be an integer tensor\. Received torch\.bool"):
        ec(_KJT(list(_KEYS), good.values(), offsets=good.offsets() > 0))
    with pytest.raises(TypeError, match=r"weights_or_none\(\) must be a floating point tensor\. Received torch\.int64"):
        ec(_KJT(list(_KEYS), good.values(), offsets=good.offsets(), weights=good.weights_or_none().long()))
    back = good.offsets().clone()
    back[1] = back[2] + 1  # bag 1 of length -1, bag 0 one longer: still from 0 to len(values())
    with pytest.raises(ValueError, match=r"offsets\(\) must be non-decreasing\. Received a bag of length -1$"):
        ec(_KJT(list(_KEYS), good.values(), offsets=back))
    none = _KJT(list(_KEYS), good.values())
    none.lengths = lambda: None  # type: ignore[method-assign]  # (a duck type without its bags: no AttributeError)
    with pytest.raises(TypeError, match=r"must give its bags by lengths\(\) or offsets\(\)\. Received lengths\(\) None"):
        ec(none)


@pytest.mark.parametrize("part", ["lengths", "offsets", "weights"])
def test_a_keyed_input_with_parts_on_two_devices_raises_naming_them(part: str) -> None:
    """Lengths, offsets or weights on another device than the values (on XLA: host lengths with device values, or
    the reverse) crashed in the padding with torch's "Expected XLA tensor" or a failed copy; here "meta" stands for
    the other device (nothing of it is read before the check)."""
    ec = _collection()
    good = _keyed(_bags(4, 0, True), list(_KEYS), offsets=part == "offsets")
    parts = {"lengths": None if part == "offsets" else good.lengths(), "weights": good.weights_or_none(),
             "offsets": good.offsets() if part == "offsets" else None}
    parts[part] = parts[part].to("meta")
    with pytest.raises(ValueError, match=rf"must be on one device \(kjt\.to\(device\) moves them all\)\. Received "
                                         rf"values\(\) on cpu, .*{part if part != 'weights' else 'weights_or_none'}"
                                         rf"\(\) on meta"):
        ec(_KJT(list(_KEYS), good.values(), **parts))


def test_a_weighted_keyed_input_with_a_sequence_feature_raises_with_the_way_out() -> None:
    """A weighted KeyedJaggedTensor weighs every key; a sequence feature takes no weights: the error names the
    feature and the two inputs that work (the weights dropped, or the features as a dict)."""
    ec = _collection(sequence=True)
    bags = _bags(4, 0, weighted=True)
    with pytest.raises(ValueError, match=r"\['fc'\] is a sequence feature.*without weights.*tte.Jagged"):
        ec(_keyed(bags, list(_KEYS)))
    unweighted = {k: (v, n, None) for k, (v, n, _) in bags.items()}
    given = {k: tte.Jagged(v, lengths=n, weights=w if k != "fc" else None) for k, (v, n, w) in bags.items()}
    assert _flat(ec(_keyed(unweighted, list(_KEYS)))).shape == _flat(ec(given)).shape

