"""``tte.interop``'s TorchRec layout and ``nn.EmbeddingBag`` on one process: round trips for stacked and unstacked
collections, every combiner and dtype, frozen tables; a state_dict that cannot be a table's weight (not a plain
tensor, integers, the meta device, keys under another prefix) raises naming the table and the rule, and loads
nothing; ``nn.EmbeddingBag`` gives the collection's bags (per-id weights, empty bags) against float64 numpy sums.
The process-group case: tests/distributed/test_mp_torchrec_interop.py."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

COMBINERS = ("sum", "mean", "sqrtn")


def collection(stack: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0) -> tte.EmbeddingCollection:
    """Three tables of one width (one stacked group by default), one per combiner, and one of another width."""
    torch.manual_seed(seed)
    tables = [tte.TableConfig(10 + i, 4, name=f"t_{c}", combiner=c, dtype=dtype) for i, c in enumerate(COMBINERS)]
    tables.append(tte.TableConfig(7, 3, name="narrow", combiner="sum", dtype=dtype))
    return tte.EmbeddingCollection({f"f_{t.name}": tte.FeatureConfig(t) for t in tables}, stack_tables=stack)


def tables(ec: tte.EmbeddingCollection) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in ec.embedding_tables.items()}


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_round_trip_through_the_torchrec_layout(stack: bool, dtype: torch.dtype) -> None:
    src, dst = collection(stack, dtype, seed=0), collection(not stack, dtype, seed=1)
    dst.tables["t_mean"].requires_grad_(False)  # frozen: loaded all the same
    sd = tte.interop.to_torchrec_state_dict(src)
    assert list(sd) == [f"embedding_bags.{n}.weight" for n in src.tables]
    tte.interop.load_torchrec_state_dict(dst, sd)
    for n, w in tables(src).items():
        assert dst.embedding_tables[n].dtype == dtype and torch.equal(dst.embedding_tables[n], w), n
    # Any prefix, dotted ones too (a model's module path), round trips.
    again = collection(stack, dtype, seed=2)
    tte.interop.load_torchrec_state_dict(again, tte.interop.to_torchrec_state_dict(src, prefix="model.sparse.ebc"),
                                         prefix="model.sparse.ebc")
    assert all(torch.equal(again.embedding_tables[n], w) for n, w in tables(src).items())


@pytest.mark.parametrize("case, value, message", [
    ("list", [[0.0] * 4] * 11, "'embedding_bags.t_mean.weight' is a list, not a plain tensor"),
    ("integers", torch.zeros(11, 4, dtype=torch.int64),
     "table 't_mean' has dtype torch.int64 in the state_dict, not a floating point dtype"),
    ("meta", torch.empty(11, 4, device="meta"), "table 't_mean' is on the meta device in the state_dict"),
    ("shape", torch.zeros(4, 11), "table 't_mean' has shape (4, 11) in the state_dict, expected (11, 4)"),
], ids=["list", "integers", "meta", "shape"])
def test_a_value_that_is_no_weight_raises_naming_the_table_and_loads_nothing(case: str, value: object,
                                                                           message: str) -> None:
    ec = collection()
    before = tables(ec)
    sd = dict(tte.interop.to_torchrec_state_dict(collection(seed=1)), **{"embedding_bags.t_mean.weight": value})
    with pytest.raises(ValueError, match="^TorchRec state_dict does not match the collection: .*" + message.replace(
            "(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        tte.interop.load_torchrec_state_dict(ec, sd)  # type: ignore[arg-type]
    assert all(torch.equal(ec.embedding_tables[n], w) for n, w in before.items())


def test_keys_under_another_prefix_raise_with_the_way_out() -> None:
    """TorchRec's EmbeddingCollection saves ``embeddings.<table>.weight``: taken with ``prefix="embeddings"``."""
    ec, src = collection(), collection(seed=1)
    sd = tte.interop.to_torchrec_state_dict(src, prefix="embeddings")
    with pytest.raises(ValueError, match=r"missing tables .*; unexpected keys .*'embeddings\.t_sum\.weight'.*; keys "
                                         r"are read as 'embedding_bags\.<table>\.weight': pass the prefix of your keys "
                                         r"\(prefix='embeddings'"):
        tte.interop.load_torchrec_state_dict(ec, sd)
    tte.interop.load_torchrec_state_dict(ec, sd, prefix="embeddings")
    assert all(torch.equal(ec.embedding_tables[n], w) for n, w in tables(src).items())


def test_a_whole_models_state_dict_raises_with_the_way_out() -> None:
    # A TorchRec model's state_dict holds its dense layers too: the error listed them and said nothing more.
    ec, src = collection(), collection(seed=1)
    sd = {**tte.interop.to_torchrec_state_dict(src, prefix="sparse.ebc"), "over.weight": torch.zeros(1, 4)}
    with pytest.raises(ValueError, match=r"unexpected keys \['over\.weight'\]; pass the tables' keys only: "
                                         r"\{k: v for k, v in sd\.items\(\) if k\.startswith\('sparse\.ebc\.'\)\}"):
        tte.interop.load_torchrec_state_dict(ec, sd, prefix="sparse.ebc")
    tte.interop.load_torchrec_state_dict(ec, {k: v for k, v in sd.items() if k.startswith("sparse.ebc.")},
                                         prefix="sparse.ebc")
    assert all(torch.equal(ec.embedding_tables[n], w) for n, w in tables(src).items())


def _numpy_bags(weight: torch.Tensor, ids: list[list[int]], w: list[list[float]] | None, combiner: str) -> np.ndarray:
    """Each bag combined in float64 numpy: Σ wᵢ·eᵢ, divided by Σ wᵢ (mean); an empty bag is zeros."""
    table = weight.detach().double().numpy()
    out = np.zeros((len(ids), table.shape[1]))
    for b, bag in enumerate(ids):
        ws = np.ones(len(bag)) if w is None else np.array(w[b])
        if bag:
            out[b] = (ws[:, None] * table[bag]).sum(0) / (ws.sum() if combiner == "mean" else 1.0)
    return out


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_embedding_bags_give_the_collections_bags(stack: bool, dtype: torch.dtype) -> None:
    ec = collection(stack, dtype)
    bags = [[1, 2, 3], [], [7, 7], [9]]
    weights = [[0.5, 2.0, 1.0], [], [0.25, 3.0], [1.5]]
    ids = torch.tensor([i for b in bags for i in b])
    offsets = torch.tensor([0, 3, 3, 5])
    per_id = torch.tensor([x for b in weights for x in b], dtype=dtype)
    tol = {"rtol": 0, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
    for name in ("t_sum", "t_mean"):
        combiner = name[2:]
        bag = tte.interop.to_embedding_bag(ec, name)
        assert bag.mode == combiner and bag.weight.dtype == dtype
        want = _numpy_bags(ec.embedding_tables[name], bags, None, combiner)
        jagged = tte.Jagged(ids, offsets=torch.cat([offsets, torch.tensor([ids.numel()])]))
        ours = ec({f"f_{n}": jagged if n != "narrow" else torch.zeros(4, dtype=torch.int64)
                   for n in ec.tables})[f"f_{name}"]
        torch.testing.assert_close(bag(ids, offsets).double(), torch.from_numpy(want), **tol)
        torch.testing.assert_close(ours.double(), torch.from_numpy(want), **tol)
    # nn.EmbeddingBag takes per_sample_weights in mode "sum" only
    want = _numpy_bags(ec.embedding_tables["t_sum"], bags, weights, "sum")
    got = tte.interop.to_embedding_bag(ec, "t_sum")(ids, offsets, per_sample_weights=per_id)
    torch.testing.assert_close(got.double(), torch.from_numpy(want), **tol)
    with pytest.raises(ValueError, match="Table `t_sqrtn`: combiner 'sqrtn' has no nn.EmbeddingBag mode"):
        tte.interop.to_embedding_bag(ec, "t_sqrtn")
    # The recipe of to_embedding_bag's docstring: sqrtn (and weighted mean) as mode="sum" with normalised weights.
    ends = offsets.tolist()[1:] + [ids.numel()]
    for name, norm in (("t_sqrtn", lambda w: w.square().sum().sqrt()), ("t_mean", lambda w: w.sum())):
        combiner = name[2:]
        bag = torch.nn.EmbeddingBag.from_pretrained(ec.embedding_tables[name].detach(), mode="sum")
        scaled = torch.cat([per_id[a:b] / norm(per_id[a:b]) for a, b in zip(offsets.tolist(), ends, strict=True)])
        want = _numpy_bags(ec.embedding_tables[name], bags, weights, combiner) if combiner == "mean" else np.stack(
            [_numpy_bags(ec.embedding_tables[name], [b], [w], "sum")[0] / (np.sqrt(np.square(w).sum()) if b else 1)
             for b, w in zip(bags, weights, strict=True)])
        torch.testing.assert_close(bag(ids, offsets, per_sample_weights=scaled).double(), torch.from_numpy(want), **tol)


def test_a_collection_on_the_meta_device_is_refused_not_silently_left_empty() -> None:
    """Built on the meta device, a collection holds no values: ``load_state_dict`` into it is a no-op (torch only
    warns), so a TorchRec load there was lost without an error, and ``to_embedding_bag`` raised torch's
    "Cannot copy out of meta tensor"."""
    ec = tte.EmbeddingCollection({f"f_{t.name}": tte.FeatureConfig(t)
                                  for t in collection().table_configs.values()}, device="meta")
    sd = tte.interop.to_torchrec_state_dict(collection())
    rule = r"table 't_sum' is on the meta device in the collection \(it holds no values yet: call model\.to_empty"
    with pytest.raises(ValueError, match=rule):
        tte.interop.load_torchrec_state_dict(ec, sd)
    with pytest.raises(ValueError, match="Cannot build an nn.EmbeddingBag: " + rule):
        tte.interop.to_embedding_bag(ec, "t_sum")
    with pytest.raises(ValueError, match="Cannot load the module's weight: " + rule):
        tte.interop.load_embedding_bag(ec, "t_sum", torch.nn.EmbeddingBag(10, 4))


def test_a_module_whose_weight_cannot_be_a_table_is_refused_and_loads_nothing() -> None:
    """``load_embedding_bag``: a module on the meta device raised torch's copy error naming the stacked group's
    internal parameter (``groups.fused_0.weight``), not the table."""
    ec = collection()
    before = tables(ec)
    for module, why in ((torch.nn.EmbeddingBag(11, 4, device="meta"), "is on the meta device in the module"),
                        (torch.nn.EmbeddingBag(12, 4), r"has shape \(12, 4\) in the module, expected \(11, 4\)")):
        with pytest.raises(ValueError, match=r"^Cannot load the module's weight: table 't_mean' " + why):
            tte.interop.load_embedding_bag(ec, "t_mean", module)
    assert all(torch.equal(ec.embedding_tables[n], w) for n, w in before.items())


# ------------------------------------------------------------------ load_embedding_bag: which modules, which options
class _HasWeight(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(11, 4))


@pytest.mark.parametrize("module, kind", [(torch.nn.Linear(4, 11, bias=False), "Linear"), (_HasWeight(), "_HasWeight")],
                         ids=["linear", "module-with-a-weight"])
def test_a_module_that_is_no_embedding_is_refused_with_the_way_out(module: torch.nn.Module, kind: str) -> None:
    """Any module with a [V, D] ``weight`` loaded, an ``nn.Linear(D, V)`` (a tied output layer) among them."""
    ec = collection()
    before = tables(ec)
    with pytest.raises(TypeError, match=r"^Argument `module` must be an nn\.EmbeddingBag or an nn\.Embedding \(another "
                       r"module's \[V, D\] weight loads with collection\.load_state_dict\(\{'tables\.t_mean\.weight': "
                       rf"weight\}}, strict=False\)\)\. Received: {kind}$"):
        tte.interop.load_embedding_bag(ec, "t_mean", module)  # type: ignore[arg-type]
    assert all(torch.equal(ec.embedding_tables[n], w) for n, w in before.items())
    ec.load_state_dict({"tables.t_mean.weight": module.weight}, strict=False)  # the way out the message gives
    assert torch.equal(ec.embedding_tables["t_mean"], module.weight.detach())


class _MyEmbedding(torch.nn.Embedding):
    pass


@pytest.mark.parametrize("module, table", [
    (lambda: torch.nn.EmbeddingBag(11, 4), "t_mean"),
    (lambda: torch.nn.EmbeddingBag.from_pretrained(torch.randn(10, 4), mode="sum"), "t_sum"),  # frozen: only the weight
    (lambda: torch.nn.Embedding(12, 4, sparse=True), "t_sqrtn"),
    (lambda: _MyEmbedding(11, 4), "t_mean"),
], ids=["bag-mean", "bag-from-pretrained-sum", "embedding", "subclass"])
def test_a_module_the_table_follows_loads_without_a_warning(module, table: str) -> None:
    ec, m = collection(), module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tte.interop.load_embedding_bag(ec, table, m)
    assert torch.equal(ec.embedding_tables[table], m.weight.detach())


LOST = [
    ("bag-max", lambda: torch.nn.EmbeddingBag(11, 4, mode="max"), "EmbeddingBag",
     r"mode='max' \(the table combines its bags with combiner='mean'; no combiner takes a max\)\.$"),
    ("bag-sum-into-mean", lambda: torch.nn.EmbeddingBag(11, 4, mode="sum"), "EmbeddingBag",
     r"mode='sum' \(the table combines its bags with combiner='mean'\)\.$"),
    ("bag-padding-idx", lambda: torch.nn.EmbeddingBag(11, 4, padding_idx=0), "EmbeddingBag",
     r"padding_idx=0 \(the table looks up and trains row 0 as any other: leave id 0 out of the inputs\)\.$"),
    ("embedding-padding-idx", lambda: torch.nn.Embedding(11, 4, padding_idx=-1), "Embedding", r"padding_idx=10 "),
    ("max-norm", lambda: torch.nn.Embedding(11, 4, max_norm=1.0), "Embedding",
     r"max_norm=1\.0 \(the table never renormalises the rows it looks up\)\.$"),
    ("scale-grad-by-freq", lambda: torch.nn.EmbeddingBag(11, 4, scale_grad_by_freq=True), "EmbeddingBag",
     r"scale_grad_by_freq=True \(row gradients are not scaled"),
    ("several", lambda: torch.nn.EmbeddingBag(11, 4, mode="sum", padding_idx=3, max_norm=2.0), "EmbeddingBag",
     r"mode='sum' .*; padding_idx=3 .*; max_norm=2\.0 "),
]


@pytest.mark.parametrize("module, kind, pattern", [c[1:] for c in LOST], ids=[c[0] for c in LOST])
def test_an_option_the_table_cannot_follow_is_named_in_a_warning(module, kind: str, pattern: str) -> None:
    ec, m = collection(), module()
    with pytest.warns(UserWarning, match=rf"^load_embedding_bag: table `t_mean` took the {kind}'s weight, but not "
                      rf"its .*{pattern}"):
        tte.interop.load_embedding_bag(ec, "t_mean", m)
    assert torch.equal(ec.embedding_tables["t_mean"], m.weight.detach())  # the weight itself is loaded


@pytest.mark.parametrize("module", [lambda: torch.nn.EmbeddingBag(11, 4, mode="max"),
                                    lambda: torch.nn.EmbeddingBag(11, 4, padding_idx=0)], ids=["max", "padding-idx"])
def test_the_lookups_those_options_change_differ_from_the_tables(module) -> None:
    """Why they are named: after the load the module and the table give other bags ([0, 3], [5, 6])."""
    ec, m = collection(), module()
    with pytest.warns(UserWarning):
        tte.interop.load_embedding_bag(ec, "t_mean", m)
    ids, offsets = torch.tensor([0, 3, 5, 6]), torch.tensor([0, 2])
    w = m.weight.detach().double()
    mean = torch.stack([w[[0, 3]].mean(0), w[[5, 6]].mean(0)])  # the table's rule, float64 by hand
    ours = ec({f"f_{n}": tte.Jagged(ids, offsets=torch.tensor([0, 2, 4])) if n == "t_mean"
               else torch.zeros(2, dtype=torch.int64) for n in ec.tables})["f_t_mean"]
    torch.testing.assert_close(ours.double(), mean, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(m(ids, offsets).double(), mean, atol=1e-3)
