"""Invalid configs and inputs: each raises an error whose message names what is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

T = tte.TableConfig(10, 4, name="t")

CONFIG_CASES = [
    ("vocab-zero", lambda: tte.TableConfig(0, 4), ValueError,
     r"Argument `num_embeddings` must be an int and must be >= 1. Received: 0"),
    ("vocab-bool", lambda: tte.TableConfig(True, 4), ValueError, r"`num_embeddings` must be an int.*Received: True"),
    ("vocab-np-int", lambda: tte.TableConfig(np.int64(5), 4), ValueError, r"`num_embeddings` must be an int"),
    ("dim-negative", lambda: tte.TableConfig(5, -1), ValueError, r"Argument `embedding_dim` .* Received: -1"),
    ("combiner-max", lambda: tte.TableConfig(5, 4, combiner="max"), ValueError,
     r"Argument `combiner` must be in \('mean', 'sum', 'sqrtn'\). Received: 'max'"),
    ("combiner-not-str", lambda: tte.TableConfig(5, 4, combiner=1), ValueError, r"Argument `combiner` must be a str"),
    ("initializer-shape", lambda: tte.TableConfig(5, 4, initializer=torch.zeros(4, 5)), ValueError,
     r"Argument `initializer` must have shape \(5, 4\).*Received: \(4, 5\)"),
    ("initializer-meta", lambda: tte.TableConfig(5, 4, initializer=torch.zeros(5, 4, device="meta")), ValueError,
     r"Argument `initializer` must hold real values .*not on the meta device.*Received: 'torch.float32 torch.strided "
     r"tensor on meta'"),
    ("initializer-sparse", lambda: tte.TableConfig(5, 4, initializer=torch.ones(5, 4).to_sparse()), ValueError,
     r"Argument `initializer` must hold real values when it is a tensor: a dense \(strided\) tensor.*sparse_coo"),
    ("initializer-complex", lambda: tte.TableConfig(5, 4, initializer=torch.ones(5, 4, dtype=torch.complex64)),
     ValueError, r"Argument `initializer` must hold real values.*not complex.*complex64"),
    ("initializer-not-callable", lambda: tte.TableConfig(5, 4, initializer=3), ValueError,
     r"Argument `initializer` must be a callable, a tensor or None. Received: 3"),
    ("name-with-dot", lambda: tte.TableConfig(5, 4, name="a.b"), ValueError, r"Argument `name` .* Received: 'a.b'"),
    ("optimizer-unknown", lambda: tte.TableConfig(5, 4, optimizer="rmsprop"), ValueError,
     r"Argument `optimizer` must be one of .*Received: 'rmsprop'"),
    ("dtype-int", lambda: tte.TableConfig(5, 4, dtype=torch.int32), ValueError, r"Argument `dtype`"),
    ("feature-table-type", lambda: tte.FeatureConfig("t"), TypeError,
     r"Argument `table` has invalid type str. Expected `torch_tpu_embedding.TableConfig`."),
    ("seq-len-negative", lambda: tte.FeatureConfig(T, max_sequence_length=-1), ValueError,
     r"Argument `max_sequence_length` must be an int and must be >= 0. Received: -1"),
    ("output-shape-zero", lambda: tte.FeatureConfig(T, output_shape=[0, 2]), ValueError,
     r"Argument `output_shape` must be a sequence of ints >= 1"),
    ("output-shape-floats", lambda: tte.FeatureConfig(T, output_shape=(2.0, 2)), ValueError,
     r"Argument `output_shape` must be a sequence of ints >= 1 \(or None\). Received: \(2.0, 2\)"),
    ("output-shape-bool", lambda: tte.FeatureConfig(T, output_shape=[True]), ValueError,
     r"Argument `output_shape` must be a sequence of ints >= 1"),
    ("capacity-zero", lambda: tte.FeatureConfig(T, max_ids_per_bag=0), ValueError,
     r"Argument `max_ids_per_bag` must be an int and must be >= 1. Received: 0"),
    ("duplicate-table-names", lambda: tte.EmbeddingCollection({
        "a": tte.FeatureConfig(tte.TableConfig(5, 2, name="x")), "b": tte.FeatureConfig(tte.TableConfig(5, 2, name="x"))}),
     ValueError, r"Tables must have a unique name. Multiple tables with name 'x' found \(distinct TableConfig objects, "
     r"looked up by the features at \['a', 'b'\];.*To share one table, pass the same TableConfig object"),
    # An unnamed table is table_<i>: the message said only "Multiple tables with name 'table_0' found".
    ("default-name-taken", lambda: tte.EmbeddingCollection({
        "a": tte.FeatureConfig(tte.TableConfig(5, 2)), "b": tte.FeatureConfig(tte.TableConfig(5, 2, name="table_0"))}),
     ValueError, r"name 'table_0' found .*\['a', 'b'\]; a TableConfig without a name is called table_<i>"),
    ("duplicate-feature-names", lambda: tte.EmbeddingCollection({
        "a": tte.FeatureConfig(T, name="b"), "b": tte.FeatureConfig(T)}),
     ValueError, r"Features must have unique names. Duplicated: \['b'\] \(the features at \['a', 'b'\];.*Give them "
     r"distinct names"),
    ("non-feature-leaf", lambda: tte.EmbeddingCollection({"a": T}), TypeError,
     r"must hold only FeatureConfig leaves; found TableConfig at `a`"),
    ("empty-config", lambda: tte.EmbeddingCollection({}), ValueError, r"must hold at least one FeatureConfig"),
    # TF's initializer(shape, dtype) form failed inside the user's function, naming neither table nor contract.
    ("tf-style-initializer", lambda: tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(
        5, 2, name="x", initializer=lambda shape, dtype: torch.ones(shape, dtype=dtype)))}), TypeError,
     r"Table `x`: its initializer '<lambda>' failed when called as initializer\(weight\) with the \[5, 2\] weight "
     r"tensor.*missing 1 required positional argument: 'dtype'.*TF's initializer\(shape, dtype\) form is not taken"),
]


@pytest.mark.parametrize("build, exc, pattern", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_invalid_config(build, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        build()


@pytest.mark.parametrize("build, pattern", [
    (lambda: tte.TableConfig(0, 4, name="user"), r"Received: 0 \(in the TableConfig 'user'\)$"),
    (lambda: tte.TableConfig(5, 4, combiner="SUM"), r"Received: 'SUM' \(in the TableConfig without a name\)$"),
    (lambda: tte.FeatureConfig(T, name="clicks", max_ids_per_bag=0),
     r"Received: 0 \(in the FeatureConfig 'clicks' of table 't'\)$"),
], ids=["table", "unnamed-table", "feature"])
def test_a_config_error_names_the_users_table_and_feature(build, pattern) -> None:
    # Tables built in a loop from a TF or TorchRec config: the argument alone did not say which table was wrong.
    with pytest.raises(ValueError, match=pattern):
        build()


def _ec(**fc):
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(T, **fc), "g": tte.FeatureConfig(T)})


OK_G = torch.tensor([1, 2])
INPUT_CASES = [
    ("missing-feature", {}, {"f": torch.tensor([1, 2])}, None, ValueError, r"missing \['g'\], unknown \[\]"),
    ("unknown-feature", {}, {"f": torch.tensor([1, 2]), "g": OK_G, "h": OK_G}, None, ValueError, r"unknown \['h'\]"),
    ("weights-for-dense", {}, {"f": torch.tensor([1, 2]), "g": OK_G}, {"f": torch.ones(2), "g": None}, ValueError,
     r"Weight specified for `f`, but input is dense"),
    ("weights-for-sequence", {"max_sequence_length": 2},
     {"f": tte.Jagged(torch.tensor([1, 2]), lengths=torch.tensor([1, 1]), weights=torch.ones(2)), "g": OK_G}, None,
     ValueError, r"Weight specified for `f`, but this is a sequence feature."),
    # the rule that makes it a sequence, named: max_sequence_length, or an output_shape of k·B positions (k = 2)
    ("weights-for-sequence-named", {"max_sequence_length": 2},
     {"f": tte.Padded(torch.tensor([[1, 2]]), None, torch.ones(1, 2)), "g": OK_G[:1]}, None, ValueError,
     r"Weight specified for `f`, but this is a sequence feature \(max_sequence_length=2\)\. A sequence takes no "
     r"weights"),
    ("weights-for-output-shape-sequence", {"output_shape": [2, 2]},
     {"f": tte.Jagged(torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]), weights=torch.ones(3)), "g": OK_G},
     None, ValueError, r"Weight specified for `f`, but this is a sequence feature \(output_shape \(2, 2\) holds 2 "
     r"positions per bag: prod\(output_shape\) is 2 × the batch"),
    ("padded-weights-for-output-shape-sequence", {"output_shape": [2, 2]},
     {"f": tte.Padded(torch.tensor([[1, 2], [3, 0]]), None, torch.ones(2, 2)), "g": OK_G}, None, ValueError,
     r"sequence feature \(output_shape \(2, 2\) holds 2 positions per bag"),
    ("dense-for-sequence", {"max_sequence_length": 2}, {"f": torch.tensor([1, 2]), "g": OK_G}, None, ValueError,
     r"is a sequence feature but a dense tensor was passed"),
    ("dense-rank2-last-not-1", {}, {"f": torch.ones(2, 3, dtype=torch.long), "g": OK_G}, None, ValueError,
     r"Rank 2 or above dense tensor should have last dimension as 1"),
    ("id-out-of-range", {}, {"f": torch.tensor([1, 10]), "g": OK_G}, None, ValueError,
     r"Feature `f`: ids must be in \[0, 10\) \(num_embeddings of table `t`\)\. Received: 10"),
    ("id-negative", {}, {"f": tte.Jagged(torch.tensor([-1, 2]), lengths=torch.tensor([2])), "g": OK_G[:1]}, None,
     ValueError, r"ids must be in \[0, 10\).*Received: -1"),
    ("float-ids", {}, {"f": torch.tensor([1.0, 2.0]), "g": OK_G}, None, TypeError,
     r"Feature `f`: ids must be an integer tensor. Received dtype torch.float32"),
    ("offsets-inconsistent", {}, {"f": tte.Jagged(torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2])),
                                  "g": OK_G[:1]}, None, ValueError, r"offsets must start at 0.*end at len\(values\)=3"),
    # given lengths, the error names them, not the offsets made from them (it said "offsets must start at 0")
    ("lengths-inconsistent", {}, {"f": tte.Jagged(torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 2])),
                                  "g": OK_G}, None, ValueError,
     r"Feature `f`: Jagged lengths must add up to len\(Jagged values\)=3\. Received: \[2, 2\]$"),
    ("jagged-both-offsets-lengths", {}, {"f": tte.Jagged(torch.tensor([1]), offsets=torch.tensor([0, 1]),
                                                         lengths=torch.tensor([1])), "g": OK_G[:1]}, None,
     ValueError, r"exactly one of `offsets` and `lengths`"),
    ("capacity-overflow", {"max_ids_per_bag": 2}, {"f": tte.Jagged(torch.tensor([1, 2, 3]), lengths=torch.tensor([3])),
                                                   "g": OK_G[:1]}, None, ValueError,
     r"a bag holds 3 ids, more than max_ids_per_bag=2.*never dropped silently"),
    ("output-shape-not-factor", {"output_shape": [3]}, {"f": tte.Jagged(torch.tensor([1, 2]),
                                                                        lengths=torch.tensor([1, 1])), "g": OK_G},
     None, ValueError, r"should be the factor of the input data batch size"),
    ("weights-shape", {}, {"f": tte.Jagged(torch.tensor([1, 2]), lengths=torch.tensor([2]), weights=torch.ones(3)),
                           "g": OK_G[:1]}, None, ValueError, r"weights must have the shape of the jagged values \(2,\)"),
    ("weights-nan", {}, {"f": tte.Jagged(torch.tensor([1, 2]), lengths=torch.tensor([2]),
                                         weights=torch.tensor([1.0, float("nan")])), "g": OK_G[:1]}, None,
     ValueError, r"weights must be finite"),
    ("sparse-weights-not-sparse", {}, {"f": torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1]), (1, 2)),
                                       "g": OK_G[:1]}, {"f": torch.ones(1), "g": None}, TypeError,
     r"Weight for `f` is type Tensor .* which does not match type input which is a sparse COO tensor"),
    ("unsupported-type", {}, {"f": [1, 2], "g": OK_G}, None, TypeError, r"Feature `f`: unsupported input type list"),
    ("padded-mask-dtype", {}, {"f": tte.Padded(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2)), "g": OK_G},
     None, ValueError, r"Padded mask must be a bool tensor"),
    ("inputs-not-mapping", {}, [torch.tensor([1])], None, TypeError, r"Inputs `features` must be a mapping"),
]


@pytest.mark.parametrize("fc, features, weights, exc, pattern", [c[1:] for c in INPUT_CASES],
                         ids=[c[0] for c in INPUT_CASES])
def test_invalid_input(fc, features, weights, exc, pattern) -> None:
    ec = _ec(**fc)
    w0 = ec.tables.t.weight.detach().clone()
    with pytest.raises(exc, match=pattern):
        ec(features, weights)
    assert torch.equal(ec.tables.t.weight, w0)
    assert ec.row_grads() == {}


def test_configs_are_never_mutated() -> None:
    t = tte.TableConfig(5, 2)  # unnamed: the collection calls it table_0, the config stays None
    f = tte.FeatureConfig(t, output_shape=[2])
    before = (repr(t), repr(f))
    ec = tte.EmbeddingCollection({"x": f})
    assert list(ec.embedding_tables) == ["table_0"]
    assert (repr(t), repr(f)) == before and t.name is None
    with pytest.raises(AttributeError):
        t.name = "y"  # type: ignore[misc]


@pytest.mark.parametrize("shape", [(np.int64(2), 2), np.array([2, 2]), [np.int32(2), np.int64(2)]],
                         ids=["numpy-ints", "numpy-array", "numpy-int32"])
def test_output_shape_takes_numpy_integers_as_tf_does(shape) -> None:
    # TF's TensorShape takes numpy's ints (what np.prod and array.shape give); only Python ints passed here.
    t = tte.TableConfig(10, 3, name="t", combiner="sum")
    fc = tte.FeatureConfig(t, output_shape=shape)
    assert fc.output_shape == (2, 2) and all(type(d) is int for d in fc.output_shape)
    bags = tte.Jagged(torch.tensor([1, 2, 3, 3, 5]), lengths=torch.tensor([2, 0, 3, 0]))
    assert tte.EmbeddingCollection({"f": fc})({"f": bags})["f"].shape == (2, 2, 3)


@pytest.mark.parametrize("stack", [True, False])
def test_table_names_that_are_module_dict_attributes_are_tables_like_any_other(stack: bool) -> None:
    # TF takes any str as a table name; nn.ModuleDict refused "keys", "items", "update"... with a KeyError
    # naming none of the user's arguments, so such a collection could not be built.
    k, tr = tte.TableConfig(10, 2, name="keys"), tte.TableConfig(12, 2, name="items")
    up = tte.TableConfig(5, 2, name="update")
    config = {"f": tte.FeatureConfig(k), "g": tte.FeatureConfig(tr), "h": tte.FeatureConfig(up)}
    ec = tte.EmbeddingCollection(config, stack_tables=stack)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.5)
    ids = torch.tensor([1, 2])
    before = ec.embedding_tables["keys"].detach().clone()
    sum(o.sum() for o in ec({"f": ids, "g": ids, "h": ids}).values()).backward()
    opt.step()
    assert list(ec.embedding_tables) == ["keys", "items", "update"] and ec.training is True
    ec.eval()
    ec.train()
    assert ec.training and all(m.training for m in ec.modules())
    assert not torch.equal(ec.embedding_tables["keys"], before)
    again = tte.EmbeddingCollection(config, stack_tables=stack)
    again.load_state_dict(ec.state_dict())
    assert all(torch.equal(again.embedding_tables[n], w) for n, w in ec.embedding_tables.items())


@pytest.mark.parametrize("name", ["training", "_parameters"])
def test_a_table_named_as_a_value_every_module_keeps_is_refused_by_name(name: str) -> None:
    # (a table "training" was built, and ec.eval() then failed in torch: "cannot assign 'bool' as child module")
    with pytest.raises(ValueError, match=rf"A table may not be named `{name}`: every torch.nn.Module keeps"):
        tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10, 2, name=name))})


def test_import_without_torch_xla() -> None:
    code = (
        "import sys; sys.modules['torch_xla'] = None\n"
        "import torch_tpu_embedding as tte, torch_tpu_embedding.optim, torch_tpu_embedding.xla\n"
        "assert all(hasattr(tte, n) for n in tte.__all__)\n"
        "assert all(hasattr(tte.optim, n) for n in tte.optim.__all__)\n"
        "assert sys.modules['torch_xla'] is None\n"
        "try:\n"
        "    torch_tpu_embedding.xla.shard\n"
        "except ImportError as e:\n"
        "    assert 'needs torch_xla' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).parents[2], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_torchscript_is_refused_naming_what_to_use_instead() -> None:
    """TorchScript cannot compile the collection (inputs of any structure, Python-side planning): refused by
    name, pointing to torch.export and torch.compile (torch's own error named a keyword argument of forward)."""
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(10, 4, name="t"))})
    with pytest.raises(RuntimeError, match=r"TorchScript.*torch\.export.*Padded.*torch\.compile"):
        torch.jit.script(ec)
    with pytest.raises(RuntimeError, match="TorchScript"):
        torch.jit.script(torch.nn.Sequential(ec))


def test_torch_jit_trace_is_refused_naming_what_to_use_instead() -> None:
    """A trace would keep the host's id checks and the sizes of the one batch it saw (torch's own trace check failed
    on it; with ``check_trace=False`` a traced module skipped the id checks): refused by name, as scripting is."""
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(10, 4, name="t"))})
    with pytest.raises(RuntimeError, match=r"TorchScript \(torch\.jit\.trace\).*torch\.export.*Padded.*torch\.compile"):
        torch.jit.trace(ec, ({"a": torch.tensor([1, 2])},), strict=False)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace"):
        torch.jit.trace(ec, ({"a": torch.tensor([1, 2])},), strict=False, check_trace=False)
    assert ec({"a": torch.tensor([1, 2])})["a"].shape == (2, 4)  # the collection is unharmed
