"""EmbeddingCollection forward and row gradients vs a float64 numpy reference written from TF's combiners
(tensorflow/python/tpu/tpu_embedding_v2_utils.py, TableConfig.combiner)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.dedup import coalesce_rows

V, D = 9, 3
BAGS = [[1, 2], [], [3, 3, 5], [0], [8, 7, 6, 5]]  # an empty bag and a duplicate id
WEIGHTS = [[0.5, 2.0], [], [1.0, -1.0, 0.5], [0.0], [1.0, 2.0, 3.0, 4.0]]  # negative and zero-sum


def np_lookup(table: np.ndarray, bags, weights, combiner: str, grad_out: np.ndarray):
    """(out [B, D], row grads {id: [D]}) for bags, per TF's combiners (empty / zero-sum → 0)."""
    out = np.zeros((len(bags), table.shape[1]))
    grads: dict[int, np.ndarray] = {}
    for b, (ids, ws) in enumerate(zip(bags, weights, strict=True)):
        ws = [1.0] * len(ids) if ws is None else ws
        if combiner == "sum":
            scale = 1.0
        elif combiner == "mean":
            s = sum(ws)
            scale = 0.0 if s == 0 else 1.0 / s
        else:
            s = sum(w * w for w in ws)
            scale = 0.0 if s == 0 else 1.0 / np.sqrt(s)
        for i, w in zip(ids, ws, strict=True):
            out[b] += w * scale * table[i]
            grads[i] = grads.get(i, 0) + w * scale * grad_out[b]
    return out, grads


def make(combiner: str, **fc):
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner=combiner, dtype=torch.float64)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t, **fc)})


def forms(weighted: bool):
    lengths = torch.tensor([len(b) for b in BAGS])
    values = torch.tensor([i for b in BAGS for i in b])
    w = torch.tensor([x for b in WEIGHTS for x in b], dtype=torch.float64) if weighted else None
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    L = int(lengths.max())
    ids2d = torch.zeros(len(BAGS), L, dtype=torch.long)
    mask = torch.zeros(len(BAGS), L, dtype=torch.bool)
    w2d = torch.zeros(len(BAGS), L, dtype=torch.float64)
    rows, cols = [], []
    for b, bag in enumerate(BAGS):
        for p, i in enumerate(bag):
            ids2d[b, p], mask[b, p] = i, True
            w2d[b, p] = WEIGHTS[b][p]
            rows.append(b)
            cols.append(p)
    idx = torch.tensor([rows, cols])
    sp = torch.sparse_coo_tensor(idx, values, (len(BAGS), L))
    spw = torch.sparse_coo_tensor(idx, w, (len(BAGS), L)) if weighted else None
    nested = torch.nested.nested_tensor_from_jagged(values, offsets)
    nested_w = torch.nested.nested_tensor_from_jagged(w, offsets) if weighted else None
    return {
        "jagged-lengths": (tte.Jagged(values, lengths=lengths), w),
        "jagged-offsets": (tte.Jagged(values, offsets=offsets, weights=w), None),
        "nested": (nested, nested_w),
        "sparse": (sp, spw),
        "padded": (tte.Padded(ids2d, mask, w2d if weighted else None), None),
    }


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("form", ["jagged-lengths", "jagged-offsets", "nested", "sparse", "padded"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_bag_forward_and_row_grads(combiner: str, form: str, weighted: bool) -> None:
    ec = make(combiner)
    value, w = forms(weighted)[form]
    out = ec({"f": value}, None if w is None else {"f": w})["f"]
    grad_out = torch.randn(len(BAGS), D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (out * grad_out).sum().backward()
    table = ec.tables.t.weight.detach().numpy()
    ref_out, ref_grads = np_lookup(table, BAGS, WEIGHTS if weighted else [None] * len(BAGS), combiner,
                                   grad_out.numpy())
    np.testing.assert_allclose(out.detach().numpy(), ref_out, rtol=1e-12, atol=1e-12)
    assert np.all(out.detach().numpy()[1] == 0)  # the empty bag
    ids, rows = ec.row_grads()["t"]
    uniq, g = coalesce_rows(ids, rows, V)
    assert sorted(uniq.tolist()) == sorted(ref_grads)  # untouched rows receive nothing
    for i, row in zip(uniq.tolist(), g.numpy(), strict=True):
        np.testing.assert_allclose(row, ref_grads[i], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("shape", [(6,), (3, 2, 1), (6, 1)], ids=["B", "B-S-1", "B-1"])
def test_dense_ids_are_a_plain_gather(shape: tuple[int, ...], combiner: str) -> None:
    """One id a bag, every gain 1 under every combiner (taken without a pass over the ids): the rows themselves,
    and each id's row gradient its bag's."""
    ec = make(combiner)
    ids = torch.tensor([4, 0, 4, 7, 2, 8]).reshape(shape)
    out = ec({"f": ids})["f"]
    table = ec.tables.t.weight.detach()
    expect = table[ids.reshape(-1)].reshape(*(shape if len(shape) == 1 else shape[:-1]), D)
    assert torch.equal(out, expect)
    out.sum().backward()
    uniq, g = coalesce_rows(*ec.row_grads()["t"], V)
    assert uniq.tolist() == [0, 2, 4, 7, 8]
    assert g[2].tolist() == [2.0] * D  # id 4 twice


def test_row_grads_equal_dense_autograd_of_nn_embedding() -> None:
    """Several features on one table, two backward calls: == nn.Embedding's dense gradient on touched rows."""
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner="sqrtn", dtype=torch.float64)
    ec = tte.EmbeddingCollection({
        "a": tte.FeatureConfig(t), "b": tte.FeatureConfig(t), "s": tte.FeatureConfig(t, max_sequence_length=3),
    })
    ref = torch.nn.Embedding(V, D).double()
    with torch.no_grad():
        ref.weight.copy_(ec.tables.t.weight)
    lin = torch.nn.Linear(D, 1).double()
    a_vals, a_len = torch.tensor([1, 2, 2, 5]), torch.tensor([3, 1])
    b = torch.tensor([5, 3])
    s_vals, s_len = torch.tensor([0, 1, 2, 3, 6]), torch.tensor([4, 1])  # truncated to 3
    for _ in range(2):  # accumulates across backward calls
        out = ec({"a": tte.Jagged(a_vals, lengths=a_len), "b": b, "s": tte.Jagged(s_vals, lengths=s_len)})
        (lin(out["a"]).tanh() * lin(out["b"]) + out["s"].pow(2).sum((1, 2), keepdim=True)[:, 0]).sum().backward()
        ea = torch.stack([ref(a_vals[:3]).sum(0) / np.sqrt(3), ref(a_vals[3:]).sum(0)])
        eb = ref(b)
        es = torch.zeros(2, 3, D, dtype=torch.float64)
        es[0] = ref(s_vals[:3])
        es[1, 0] = ref(s_vals[4])
        (lin(ea).tanh() * lin(eb) + es.pow(2).sum((1, 2), keepdim=True)[:, 0]).sum().backward()
    assert ec.tables.t.weight.grad is None  # never a dense gradient
    uniq, g = coalesce_rows(*ec.row_grads()["t"], V)
    dense = ref.weight.grad
    touched = sorted({1, 2, 5, 3, 0, 6})
    assert uniq.tolist() == touched
    torch.testing.assert_close(g, dense[touched], rtol=1e-12, atol=1e-12)
    untouched = [i for i in range(V) if i not in touched]
    assert torch.all(dense[untouched] == 0)
    ec.zero_grad()
    assert ec.row_grads() == {}


def test_tf_fixture_golden_activations() -> None:
    """tpu_embedding_base_test: video 8×4 sum, user 16×2 mean, both initialised to arange(32)."""
    video = tte.TableConfig(8, 4, name="video", combiner="sum", dtype=torch.float64,
                            initializer=torch.arange(32, dtype=torch.float64).reshape(8, 4))
    user = tte.TableConfig(16, 2, name="user", combiner="mean", dtype=torch.float64,
                           initializer=torch.arange(32, dtype=torch.float64).reshape(16, 2))
    ec = tte.EmbeddingCollection({
        "watched": tte.FeatureConfig(video), "favorited": tte.FeatureConfig(video), "friends": tte.FeatureConfig(user),
    })

    def jag(bags):
        return tte.Jagged(torch.tensor([i for b in bags for i in b]), lengths=torch.tensor([len(b) for b in bags]))

    out = ec({
        "watched": jag([[0], [0, 1], [0, 1], [1]]),
        "favorited": jag([[0, 1], [1], [0], [0, 1]]),
        "friends": jag([[3], [0, 1, 2], [3], [0, 1, 2]]),
    })
    assert out["watched"][:2].tolist() == [[0, 1, 2, 3], [4, 6, 8, 10]]
    assert out["favorited"][:2].tolist() == [[4, 6, 8, 10], [4, 5, 6, 7]]
    assert out["friends"][:2].tolist() == [[6, 7], [2, 3]]
    # Loss Σ_features mean_b Σ_d act²: gradient 2·act/B, through sum (video) and mean (user).
    loss = sum(v.pow(2).sum(1).mean() for v in out.values())
    loss.backward()
    uniq, g = coalesce_rows(*ec.row_grads()["user"], 16)
    f = out["friends"].detach()
    expect0 = (2 * f[1] / 4 / 3 + 2 * f[3] / 4 / 3)  # id 0 in bags 1 and 3 (size 3, mean)
    torch.testing.assert_close(g[uniq.tolist().index(0)], expect0)
    expect3 = 2 * f[0] / 4 + 2 * f[2] / 4
    torch.testing.assert_close(g[uniq.tolist().index(3)], expect3)


GOLDEN_A = {c["name"]: c for c in json.loads(
    (Path(__file__).parents[1] / "data" / "golden_tf.json").read_text())["A_serving_lookup"]["cases"]}
TF_TABLE = torch.tensor([[(3 * r + 1) / 10, (3 * r + 2) / 10, (3 * r + 3) / 10] for r in range(6)], dtype=torch.float64)
TF_BAGS = [[1, 2], [], [3, 3, 5], []]
TF_W = [[0.5, 2.0], [], [1.0, -1.0, 0.5], []]


def _tf_collection(combiner: str, **fc):
    t = tte.TableConfig(6, 3, name="t", combiner=combiner, initializer=TF_TABLE, dtype=torch.float64)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t, **fc)})


def _tf_input(weighted: bool):
    vals = torch.tensor([i for b in TF_BAGS for i in b])
    w = torch.tensor([x for b in TF_W for x in b], dtype=torch.float64) if weighted else None
    return tte.Jagged(vals, lengths=torch.tensor([len(b) for b in TF_BAGS]), weights=w)


@pytest.mark.parametrize("name", sorted(n for n in GOLDEN_A if n.startswith("ragged_") and "_validate" in n))
def test_golden_tf_ragged_serving_lookup(name: str) -> None:
    """TF's ragged lookup (no pruning): our semantics exactly (incl. the negative weight)."""
    combiner = name.split("_")[1]
    out = _tf_collection(combiner)({"f": _tf_input("_weighted" in name)})["f"]
    torch.testing.assert_close(out, torch.tensor(GOLDEN_A[name]["output"], dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_golden_weighted_mean_example() -> None:
    """TF's serving lookup (tensorflow/python/tpu/tpu_embedding_for_serving.py): mean of [3,3,5] with weights [1,-1,.5] is (e3 − e3 + .5·e5)/.5 = e5 (no pruning)."""
    out = _tf_collection("mean")({"f": _tf_input(True)})["f"]
    torch.testing.assert_close(out[2], TF_TABLE[5])
    # TF's safe sparse lookup prunes the −1 weight (validate=True) and gives [1.2, 1.3, 1.4]: differs by design.
    assert not torch.allclose(out[2], torch.tensor(GOLDEN_A["sparse_mean_weighted_validateTrue"]["output"][2],
                                                   dtype=torch.float64))


@pytest.mark.parametrize("length", [2, 4])
@pytest.mark.parametrize("form", ["ragged", "sparse"])
def test_golden_tf_sequence(form: str, length: int) -> None:
    ec = _tf_collection("mean", max_sequence_length=length)
    if form == "ragged":
        value = _tf_input(False)
    else:
        idx = torch.tensor([[0, 0, 2, 2, 2], [0, 1, 0, 1, 2]])
        value = torch.sparse_coo_tensor(idx, torch.tensor([1, 2, 3, 3, 5]), (4, 3))
    out = ec({"f": value})["f"]
    expect = GOLDEN_A[f"{form}_sequence_max_len{length}"]["output"]
    torch.testing.assert_close(out, torch.tensor(expect, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_a_sequence_feature_combines_a_sparse_input_of_rank_3() -> None:
    """TF (tpu_embedding_v2 enqueue, tpu_embedding_for_serving's sparse lookup) ignores max_sequence_length for a
    sparse input of rank > 2, with a warning: its bags combine to [B, S, D] as those of any feature do."""
    idx = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 0, 1], [0, 2, 0, 1, 0]])  # bags [1, 2], [3], [4], [5]
    sp = torch.sparse_coo_tensor(idx, torch.tensor([1, 2, 3, 4, 5]), (2, 2, 3))
    ec = _tf_collection("mean", max_sequence_length=2)
    with pytest.warns(UserWarning, match=r"`f`: max_sequence_length=2 is ignored: the input is of rank 3"):
        out = ec({"f": sp})["f"]
    expect = torch.stack([(TF_TABLE[1] + TF_TABLE[2]) / 2, TF_TABLE[3], TF_TABLE[4], TF_TABLE[5]]).view(2, 2, 3)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)  # (0.5·a + 0.5·b and (a + b) / 2: one rounding each)
    with pytest.raises(ValueError, match=r"Weight specified for `f`, but this is a sequence feature"), \
            pytest.warns(UserWarning, match="is ignored"):  # (TF's CPU lookup rejects them by the config alone)
        ec({"f": sp}, {"f": torch.sparse_coo_tensor(idx, torch.ones(5, dtype=torch.float64), (2, 2, 3))})


def test_golden_tf_output_shape_cases() -> None:
    out = _tf_collection("sum", output_shape=[2, 2])({"f": _tf_input(False)})["f"]
    torch.testing.assert_close(out, torch.tensor(GOLDEN_A["ragged_output_shape_[2,2]_reduce"]["output"],
                                                 dtype=torch.float64), rtol=1e-6, atol=1e-6)
    out = _tf_collection("sum", output_shape=[4, 3])({"f": _tf_input(False)})["f"]
    torch.testing.assert_close(out, torch.tensor(GOLDEN_A["ragged_output_shape_[4,3]_sequence"]["output"],
                                                 dtype=torch.float64), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"should be the factor of the input data batch size.*\(3,\), input data "
                                         r"batch size 4"):
        _tf_collection("sum", output_shape=[3])({"f": _tf_input(False)})


def test_state_dict_names_repr_and_embedding_tables() -> None:
    u = tte.TableConfig(5, 2, name="user")
    ec = tte.EmbeddingCollection({"a": {"x": tte.FeatureConfig(u), "y": tte.FeatureConfig(tte.TableConfig(4, 2))}})
    assert list(ec.state_dict()) == ["tables.user.weight", "tables.table_1.weight"]
    assert list(ec.embedding_tables) == ["user", "table_1"]
    # Stacked (the default): a view of the group's rows; one parameter per table unstacked.
    assert torch.equal(ec.embedding_tables["user"], ec.tables.user.weight)
    assert ec.embedding_tables["user"].data_ptr() == ec.groups.fused_0.weight.data_ptr()
    plain = tte.EmbeddingCollection({"x": tte.FeatureConfig(u), "y": tte.FeatureConfig(tte.TableConfig(4, 2))},
                                    stack_tables=False)
    assert plain.embedding_tables["user"] is plain.tables.user.weight
    text = repr(ec)
    assert "user ← a/x" in text and "table_1 ← a/y" in text and "num_embeddings=5" in text
    out = ec({"a": {"x": torch.tensor([1]), "y": torch.tensor([3])}})
    assert set(out) == {"a"} and set(out["a"]) == {"x", "y"}  # the config's nested structure
