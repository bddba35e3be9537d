"""Bad inputs fail loudly, before any state changes: 40+ cases over every input form.

Each case: a model that has trained one step (so optimizer slots exist), then a bad batch. The error names
the feature and the rule; the weights, every optimizer slot and the pending row gradients are unchanged.
TorchRec remaps out-of-range ids to row 0 and trains it; here an out-of-range id is an error.
"""

from __future__ import annotations

import pytest
import torch

import torch_tpu_embedding as tte

V, D = 10, 3
T = tte.TableConfig(V, D, name="t", combiner="mean")


def model():
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(T, max_ids_per_bag=4), "g": tte.FeatureConfig(T),
                                  "s": tte.FeatureConfig(T, max_sequence_length=3)})
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    out = ec(ok())
    sum(v.sum() for v in out.values()).backward()
    opt.step()
    opt.zero_grad()
    return ec, opt


def ok(**over):
    batch = {"f": tte.Jagged(torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])), "g": torch.tensor([4, 5]),
             "s": tte.Jagged(torch.tensor([6, 7]), lengths=torch.tensor([1, 1]))}
    batch.update(over)
    return batch


def jag(ids, lengths=None, **kw):
    return tte.Jagged(torch.tensor(ids), lengths=torch.tensor(lengths or [len(ids) - 1, 1]), **kw)


def nested(rows):
    return torch.nested.nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)


def sparse(ids, shape=(2, 3)):
    idx = torch.tensor([[0, 0, 1][: len(ids)], [0, 1, 0][: len(ids)]])
    return torch.sparse_coo_tensor(idx, torch.tensor(ids), shape)


RANGE = r"Feature `{f}`: ids must be in \[0, 10\)"
CASES = [
    # out-of-range / negative ids, every input form
    ("dense-neg", ok(g=torch.tensor([-1, 2])), None, ValueError, RANGE.format(f="g") + r".*Received: -1"),
    ("dense-eq-V", ok(g=torch.tensor([1, 10])), None, ValueError, RANGE.format(f="g") + r".*Received: 10"),
    ("dense-huge", ok(g=torch.tensor([1, 2**40])), None, ValueError, RANGE.format(f="g")),
    ("dense-2d-neg", ok(g=torch.tensor([[-3], [1]])), None, ValueError, RANGE.format(f="g")),
    ("dense-2d-eq-V", ok(g=torch.tensor([[1], [10]])), None, ValueError, RANGE.format(f="g")),
    ("jagged-lengths-neg", ok(f=jag([1, -2, 3])), None, ValueError, RANGE.format(f="f")),
    ("jagged-lengths-eq-V", ok(f=jag([1, 10, 3])), None, ValueError, RANGE.format(f="f")),
    ("jagged-offsets-neg", ok(f=tte.Jagged(torch.tensor([1, -2]), offsets=torch.tensor([0, 1, 2]))), None,
     ValueError, RANGE.format(f="f")),
    ("jagged-offsets-big", ok(f=tte.Jagged(torch.tensor([1, 12]), offsets=torch.tensor([0, 1, 2]))), None,
     ValueError, RANGE.format(f="f")),
    ("nested-neg", ok(f=nested([[1, 2], [-1]])), None, ValueError, RANGE.format(f="f")),
    ("nested-eq-V", ok(f=nested([[1, 10], [3]])), None, ValueError, RANGE.format(f="f")),
    ("sparse-neg", ok(f=sparse([1, -1, 2])), None, ValueError, RANGE.format(f="f")),
    ("sparse-eq-V", ok(f=sparse([1, 10, 2])), None, ValueError, RANGE.format(f="f")),
    ("padded-neg", ok(f=tte.Padded(torch.tensor([[1, -1], [2, 3]]))), None, ValueError, RANGE.format(f="f")),
    ("padded-eq-V", ok(f=tte.Padded(torch.tensor([[1, 10], [2, 3]]))), None, ValueError, RANGE.format(f="f")),
    ("padded-masked-in-range-only", ok(f=tte.Padded(torch.tensor([[1, 99], [2, 3]]),
                                                      torch.tensor([[True, True], [True, False]]))), None,
     ValueError, RANGE.format(f="f") + r".*Received: 99"),
    ("sequence-neg", ok(s=jag([6, -7])), None, ValueError, RANGE.format(f="s")),
    ("sequence-eq-V", ok(s=jag([6, 10])), None, ValueError, RANGE.format(f="s")),
    # wrong dtypes
    ("dense-float-ids", ok(g=torch.tensor([1.0, 2.0])), None, TypeError, r"Feature `g`: ids must be an integer tensor"),
    ("jagged-float-ids", ok(f=tte.Jagged(torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1]))), None, TypeError,
     r"Feature `f`: ids must be an integer tensor"),
    ("padded-float-ids", ok(f=tte.Padded(torch.ones(2, 2))), None, TypeError, r"Feature `f`: ids must be an integer"),
    ("sparse-float-ids", ok(f=sparse([1.0, 2.0, 3.0])), None, TypeError, r"Feature `f`: ids must be an integer"),
    # a hybrid sparse COO tensor (values [nnz, 2]: two ids at an index) is no tf.SparseTensor of ids
    ("sparse-hybrid", ok(f=torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 2]]), torch.tensor([[1, 2], [3, 4]]),
                                                   (2, 3, 2))), None, ValueError,
     r"Feature `f`: a sparse input must hold one id at each index.*hybrid sparse COO tensor of shape \(2, 3, 2\) "
     r"with 1 dense dim"),
    ("sparse-hybrid-empty", ok(s=torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long),
                                                         torch.zeros(0, 2, dtype=torch.long), (2, 3, 2))), None,
     ValueError, r"Feature `s`: a sparse input must hold one id at each index"),
    ("bool-ids", ok(g=torch.tensor([True, False])), None, TypeError, r"Feature `g`: ids must be an integer tensor"),
    ("weights-int", ok(f=jag([1, 2, 3], weights=torch.tensor([1, 2, 3]))), None, TypeError,
     r"Feature `f`: weights must be a floating point tensor"),
    ("padded-mask-not-bool", ok(f=tte.Padded(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2))), None,
     ValueError, r"Feature `f`: Padded mask must be a bool tensor"),
    # non-finite and misshapen weights
    ("jagged-weights-nan", ok(f=jag([1, 2, 3], weights=torch.tensor([1.0, float("nan"), 1.0]))), None, ValueError,
     r"Feature `f`: weights must be finite"),
    ("jagged-weights-inf", ok(f=jag([1, 2, 3], weights=torch.tensor([1.0, float("inf"), 1.0]))), None, ValueError,
     r"Feature `f`: weights must be finite"),
    ("padded-weights-nan", ok(f=tte.Padded(torch.ones(2, 2, dtype=torch.long), None,
                                           torch.tensor([[1.0, float("nan")], [1.0, 1.0]]))), None, ValueError,
     r"Feature `f`: weights must be finite"),
    # weights of another layout than their ids' (they crashed inside torch: aten::ne.Scalar on SparseCPU, ...)
    ("padded-weights-arg-sparse", ok(f=tte.Padded(torch.ones(2, 2, dtype=torch.long),
                                                  torch.tensor([[True, True], [True, False]]))),
     {"f": torch.ones(2, 2).to_sparse(), "g": None, "s": None}, ValueError,
     r"Feature `f`: weights must be a dense \(strided\) tensor of the shape of the padded ids \(2, 2\).*Received a "
     r"sparse_coo tensor"),
    ("padded-weights-arg-csr", ok(f=tte.Padded(torch.ones(2, 2, dtype=torch.long))),
     {"f": torch.ones(2, 2).to_sparse_csr(), "g": None, "s": None}, ValueError,
     r"Feature `f`: weights must be a dense \(strided\).*Received a sparse_csr tensor"),
    ("jagged-weights-sparse", ok(f=jag([1, 2, 3], weights=torch.ones(3).to_sparse())), None, ValueError,
     r"Feature `f`: weights must be a dense \(strided\) tensor of the shape of the jagged values \(3,\)"),
    ("nested-weights-arg-sparse", ok(f=nested([[1, 2], [3]])), {"f": torch.ones(3).to_sparse(), "g": None, "s": None},
     ValueError, r"Feature `f`: weights must be a dense \(strided\).*Received a sparse_coo tensor"),
    ("jagged-weights-short", ok(f=jag([1, 2, 3], weights=torch.ones(2))), None, ValueError, r"Feature `f`: weights"),
    ("padded-weights-shape", ok(f=tte.Padded(torch.ones(2, 2, dtype=torch.long), None, torch.ones(2, 3))), None,
     ValueError, r"Feature `f`: weights"),
    ("weights-arg-nan", ok(), {"f": torch.tensor([1.0, float("nan"), 1.0]), "g": None, "s": None}, ValueError,
     r"Feature `f`: weights must be finite"),
    ("weights-for-dense", ok(), {"f": None, "g": torch.ones(2), "s": None}, ValueError,
     r"Weight specified for `g`, but input is dense"),
    ("weights-for-sequence", ok(), {"f": None, "g": None, "s": torch.ones(2)}, ValueError,
     r"Weight specified for `s`, but this is a sequence feature"),
    # structure and capacity
    ("missing-feature", {"f": ok()["f"], "g": ok()["g"]}, None, ValueError, r"missing \['s'\]"),
    ("unknown-feature", ok(h=torch.tensor([1])), None, ValueError, r"unknown \['h'\]"),
    ("capacity-overflow-jagged", ok(f=jag([1, 2, 3, 4, 5, 6], [5, 1])), None, ValueError,
     r"Feature `f`: a bag holds 5 ids, more than max_ids_per_bag=4"),
    ("capacity-overflow-nested", ok(f=nested([[1, 2, 3, 4, 5], [1]])), None, ValueError,
     r"more than max_ids_per_bag=4"),
    ("capacity-overflow-padded", ok(f=tte.Padded(torch.ones(2, 5, dtype=torch.long))), None, ValueError,
     r"max_ids_per_bag=4"),
    ("lengths-negative", ok(f=tte.Jagged(torch.tensor([1, 2]), lengths=torch.tensor([3, -1]))), None, ValueError,
     r"Feature `f`"),
    ("offsets-decreasing", ok(f=tte.Jagged(torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 1, 2]))), None,
     ValueError, r"Feature `f`"),
    ("offsets-not-ending-at-n", ok(f=tte.Jagged(torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2]))), None,
     ValueError, r"Feature `f`"),
    ("dense-for-sequence", ok(s=torch.tensor([1, 2])), None, ValueError, r"Feature `s`: is a sequence feature"),
    ("dense-rank2-wide", ok(g=torch.ones(2, 3, dtype=torch.long)), None, ValueError, r"Feature `g`: Rank 2"),
    ("list-input", ok(g=[1, 2]), None, TypeError, r"Feature `g`: unsupported input type list"),
    ("weights-structure", ok(), {"f": None}, ValueError, r"Argument `weights` do not match the feature config"),
]


@pytest.mark.parametrize("features, weights, exc, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_before_any_state_changes(features, weights, exc, pattern) -> None:
    ec, opt = model()
    w0 = ec.tables.t.weight.detach().clone()
    slots0 = {k: v.clone() for k, v in opt.state[ec.tables.t.weight].items()}
    with pytest.raises(exc, match=pattern):
        out = ec(features, weights)
        sum(v.sum() for v in out.values()).backward()  # only reached if the forward wrongly accepted it
        opt.step()
    assert torch.equal(ec.tables.t.weight, w0)
    assert ec.row_grads() == {}
    for k, v in opt.state[ec.tables.t.weight].items():
        assert torch.equal(v, slots0[k]), k


def test_case_count() -> None:
    assert len(CASES) >= 40
