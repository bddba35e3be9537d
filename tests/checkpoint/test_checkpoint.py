"""tte.checkpoint (weights_only, atomic, mismatch errors), interop layouts, serving and torch.export."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte

V, D = 20, 4


def model(dtype: torch.dtype = torch.float64, extra_table: bool = False, rows: int = V, combiner: str = "mean"):
    torch.manual_seed(0)
    t = tte.TableConfig(rows, D, name="t", combiner=combiner, dtype=dtype)
    feats = {"a": tte.FeatureConfig(t, max_ids_per_bag=3), "b": tte.FeatureConfig(t)}
    if extra_table:
        feats["c"] = tte.FeatureConfig(tte.TableConfig(8, D, name="u", dtype=dtype))
    ec = tte.EmbeddingCollection(feats)
    return torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(D, 1).to(dtype)})


def train(m, opt, start: int, steps: int) -> None:
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        a = torch.randint(0, 12, (6,), generator=g)
        b = torch.randint(0, 12, (3,), generator=g)
        batch = {"a": tte.Jagged(a, lengths=torch.tensor([3, 1, 2])), "b": b}
        if "c" in m["ec"].feature_names:
            batch["c"] = torch.randint(0, 8, (3,), generator=g)
        out = m["ec"](batch)
        (m["head"](out["a"]) * out["b"].sum(1, keepdim=True)).sum().backward()
        opt.step()
        opt.zero_grad()


def make_opt(m):
    return tte.optim.Adafactor(m.parameters(), lr=0.1, row_stat_dtype=torch.bfloat16, use_ema=True,
                               ema_momentum=0.9, gradient_accumulation_steps=3, clipnorm=1.0)


def test_save_load_weights_only_resumes_bitwise(tmp_path: Path) -> None:
    m, ref = model(), model()
    opt, opt_ref = make_opt(m), make_opt(ref)
    train(m, opt, 0, 4)  # mid-accumulation: the pending buffer is saved too
    train(ref, opt_ref, 0, 4)
    path = tmp_path / "ckpt.pt"
    tte.checkpoint.save(path, model=m, optimizer=opt, extra={"step": 4, "note": "mid-cycle"})
    payload = torch.load(path, weights_only=True)  # no pickled code needed
    assert payload["format"] == tte.checkpoint.FORMAT and payload["extra"] == {"step": 4, "note": "mid-cycle"}
    m2 = model(dtype=torch.float64)
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(1.0)  # not the saved values
    opt2 = make_opt(m2)
    assert tte.checkpoint.load(path, model=m2, optimizer=opt2) == {"step": 4, "note": "mid-cycle"}
    train(m2, opt2, 4, 5)
    train(ref, opt_ref, 4, 5)
    for (k, a), b in zip(ref.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert torch.equal(opt_ref.moving_average(ref["ec"].tables.t.weight), opt2.moving_average(m2["ec"].tables.t.weight))


def test_save_is_atomic(tmp_path: Path) -> None:
    m = model()
    path = tmp_path / "ckpt.pt"
    tte.checkpoint.save(path, model=m)
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises
        tte.checkpoint.save(path, model=m, extra={"bad": lambda: None})
    assert path.read_bytes() == before  # the old checkpoint is intact
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary left behind


def test_not_a_checkpoint(tmp_path: Path) -> None:
    torch.save({"weights": torch.zeros(2)}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="is not a torch_tpu_embedding checkpoint"):
        tte.checkpoint.load(tmp_path / "x.pt", model=model())


def _target(kind: str):
    """(model to load into or None, optimizer to load into or None) for each mismatch kind."""
    if kind == "missing table":
        return model(extra_table=True), None
    if kind == "unexpected table":
        return model(), None
    if kind == "wrong shape":
        return model(rows=V + 1), None
    m = model(rows=V + 1) if kind == "wrong slot shape" else model()
    if kind == "wrong optimizer":
        return None, tte.optim.FTRL(m.parameters(), lr=0.1)
    if kind == "different parameters":
        return None, make_opt(torch.nn.ModuleDict({"ec": m["ec"]}))
    return None, make_opt(m)


@pytest.mark.parametrize(
    "kind, error, match",
    [
        ("missing table", RuntimeError, r"Missing key\(s\) in state_dict: \"ec.tables.u.weight\""),
        ("unexpected table", RuntimeError, r"Unexpected key\(s\) in state_dict: \"ec.tables.u.weight\""),
        ("wrong shape", RuntimeError,
         r"size mismatch for ec.tables.t.weight: copying a param with shape torch.Size\(\[20, 4\]\)"),
        ("wrong optimizer", ValueError, r"group 0: saved by optimizer 'adafactor', loading into 'ftrl'"),
        ("different parameters", ValueError, r"group 0: missing \[\], unexpected \['param:1', 'param:2'\]"),
        ("wrong slot shape", ValueError, r"table:t: slot 'r' has shape \(20,\), expected \(21,\)"),
    ],
)
def test_mismatches_are_listed(tmp_path: Path, kind: str, error: type, match: str) -> None:
    src = model(extra_table=kind == "unexpected table")
    opt = make_opt(src)
    train(src, opt, 0, 3)
    path = tmp_path / "ckpt.pt"
    tte.checkpoint.save(path, model=src, optimizer=opt)
    dst_model, dst_opt = _target(kind)
    with pytest.raises(error, match=match):
        tte.checkpoint.load(path, model=dst_model, optimizer=dst_opt)


def test_strict_false_with_an_optimizer_of_other_tables_says_it_is_the_models_only(tmp_path: Path) -> None:
    """A table added since the save: ``strict=False`` loads the model, but the optimizer's state loads whole, and the
    refusal says so and what to do (it named the missing table alone, as if ``strict=False`` had been ignored)."""
    src = model()
    opt = make_opt(src)
    train(src, opt, 0, 2)
    path = tmp_path / "ckpt.pt"
    tte.checkpoint.save(path, model=src, optimizer=opt)
    dst = model(extra_table=True)
    with pytest.raises(ValueError, match=r"missing \['table:u'\].*strict=False applies to the model's keys only.*"
                                         r"without `optimizer`"):
        tte.checkpoint.load(path, model=dst, optimizer=make_opt(dst), strict=False)
    with pytest.raises(ValueError) as strict_error:  # (strict: the hint is not given)
        tte.checkpoint.load(path, model=dst, optimizer=make_opt(dst))
    assert "strict=False" not in str(strict_error.value)
    tte.checkpoint.load(path, model=dst, strict=False)
    assert torch.equal(dst["ec"].tables.t.weight, src["ec"].tables.t.weight)


def test_model_only_serving_needs_no_optimizer_state(tmp_path: Path) -> None:
    m = model()
    opt = make_opt(m)
    train(m, opt, 0, 3)
    tte.checkpoint.save(tmp_path / "c.pt", model=m, optimizer=opt)
    serve = model()
    tte.checkpoint.load(tmp_path / "c.pt", model=serve)  # TF's optimizer=None
    serve.eval()
    with torch.no_grad():
        out = serve["ec"]({"a": tte.Padded(torch.tensor([[1, 2, 3]])), "b": torch.tensor([4])})
    assert not serve["ec"].tables.t.row_grad  # inference records no gradient rows
    with torch.no_grad():
        want = m["ec"]({"a": tte.Padded(torch.tensor([[1, 2, 3]])), "b": torch.tensor([4])})
    torch.testing.assert_close(out, want, rtol=0, atol=0)


class Ranker(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        t = tte.TableConfig(100, 4, name="t", combiner="mean")
        u = tte.TableConfig(50, 4, name="u", combiner="sqrtn")
        self.ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t), "b": tte.FeatureConfig(u, max_ids_per_bag=3),
                                           "s": tte.FeatureConfig(t, max_sequence_length=2)})
        self.head = torch.nn.Linear(12, 1)

    def forward(self, a, b_ids, b_mask, b_w, s_ids):
        out = self.ec({"a": a, "b": tte.Padded(b_ids, b_mask, b_w), "s": tte.Padded(s_ids)})
        return self.head(torch.cat([out["a"], out["b"], out["s"].sum(1)], 1))


def test_torch_export_matches_eager() -> None:
    torch.manual_seed(0)
    m = Ranker().eval()
    g = torch.Generator().manual_seed(0)

    def inputs():
        return (torch.randint(0, 100, (5,), generator=g), torch.randint(0, 50, (5, 3), generator=g),
                torch.rand(5, 3, generator=g) > 0.3, torch.rand(5, 3, generator=g), torch.randint(0, 100, (5, 2), generator=g))

    ep = torch.export.export(m, inputs())
    for _ in range(3):  # fresh ids, masks and weights: the program is not specialised to the example
        x = inputs()
        torch.testing.assert_close(ep.module()(*x), m(*x), rtol=0, atol=0)


def test_torch_export_refuses_a_jagged_input_naming_padded() -> None:
    """A Jagged bag is padded on the host with data-dependent shapes, which export cannot trace (guide section 9):
    refused naming the feature and Padded (torch's GuardOnDataDependentSymNode error named neither)."""
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(10, 4, name="t"))})

    class Jag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = ec

        def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return self.ec({"a": tte.Jagged(values, offsets)})["a"]

    with pytest.raises(ValueError, match=r"Feature `a`.*torch\.export.*Jagged.*Padded\(ids, mask\)"):
        torch.export.export(Jag(), (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3])))


# ------------------------------------------------------------------ interop
def test_torchrec_layout_round_trip_and_embedding_bag_lookups() -> None:
    m = model(combiner="sum", extra_table=True)
    ec = m["ec"]
    sd = tte.interop.to_torchrec_state_dict(ec)
    assert sorted(sd) == ["embedding_bags.t.weight", "embedding_bags.u.weight"]
    # A module with TorchRec's EmbeddingBagCollection key layout, built from nn.EmbeddingBag.
    trec = torch.nn.Module()
    trec.embedding_bags = torch.nn.ModuleDict({n: tte.interop.to_embedding_bag(ec, n) for n in ("t", "u")})
    assert trec.state_dict().keys() == sd.keys()
    ids, offsets = torch.tensor([1, 2, 3, 7, 7]), torch.tensor([0, 3])
    ours = ec({"a": tte.Jagged(ids, offsets=torch.tensor([0, 3, 5])), "b": torch.tensor([0, 1]),
               "c": torch.tensor([0, 1])})["a"]
    torch.testing.assert_close(trec.embedding_bags["t"](ids, offsets).double(), ours, rtol=0, atol=0)
    # Into a fresh collection through the TorchRec layout.
    fresh = model(combiner="sum", extra_table=True, dtype=torch.float64)["ec"]
    with torch.no_grad():
        fresh.tables.t.weight.zero_()
    tte.interop.load_torchrec_state_dict(fresh, trec.state_dict())
    assert torch.equal(fresh.tables.t.weight, ec.tables.t.weight.detach())
    with pytest.raises(ValueError, match=re.escape("missing tables ['u']; unexpected keys ['embedding_bags.x.weight']")):
        tte.interop.load_torchrec_state_dict(fresh, {"embedding_bags.t.weight": sd["embedding_bags.t.weight"],
                                                     "embedding_bags.x.weight": torch.zeros(1, D)})
    with pytest.raises(ValueError, match=re.escape("table 't' has shape (3, 4) in the state_dict, expected (20, 4)")):
        tte.interop.load_torchrec_state_dict(fresh, {"embedding_bags.t.weight": torch.zeros(3, D),
                                                     "embedding_bags.u.weight": sd["embedding_bags.u.weight"]})
    bag = torch.nn.EmbeddingBag(V, D, mode="sum").double()
    tte.interop.load_embedding_bag(fresh, "t", bag)
    assert torch.equal(fresh.tables.t.weight, bag.weight.detach())
    with pytest.raises(ValueError, match="has no nn.EmbeddingBag mode"):
        tte.interop.to_embedding_bag(model(combiner="sqrtn")["ec"], "t")


def test_ftrl_linears_convert_between_modes() -> None:
    runs = {}
    for mult in (False, True):
        m = model()
        opt = tte.optim.FTRL(m.parameters(), lr=0.2, l1_regularization_strength=0.01,
                             multiply_linear_by_learning_rate=mult)
        train(m, opt, 0, 3)
        runs[mult] = (m, opt)
    m_plain, opt_plain = runs[False]
    converted = tte.interop.convert_ftrl_linears(opt_plain.state_dict(), multiply_linear_by_learning_rate=True)
    for key, slots in converted["state"].items():
        torch.testing.assert_close(slots["linears"], runs[True][1].state_dict()["state"][key]["linears"],
                                   rtol=1e-10, atol=1e-12)
    # Continue in the other mode: the same trajectory as never switching.
    m2 = model()
    m2.load_state_dict(m_plain.state_dict())
    opt2 = tte.optim.FTRL(m2.parameters(), lr=0.2, l1_regularization_strength=0.01, multiply_linear_by_learning_rate=True)
    opt2.load_state_dict(converted)
    train(m2, opt2, 3, 3)
    train(m_plain, opt_plain, 3, 3)
    for a, b in zip(m2.parameters(), m_plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    back = tte.interop.convert_ftrl_linears(opt2.state_dict(), multiply_linear_by_learning_rate=False)
    assert back["param_groups"][0]["multiply_linear_by_learning_rate"] is False
    for key, slots in back["state"].items():
        torch.testing.assert_close(slots["linears"], opt_plain.state_dict()["state"][key]["linears"],
                                   rtol=1e-10, atol=1e-12)


def _two_tables(rows_a: int, rows_b: int, names: tuple[str, str] = ("a_user", "b_item")) -> tuple[
        tte.EmbeddingCollection, torch.optim.Optimizer]:
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(rows_a, 8, name=names[0])),
                                  "b": tte.FeatureConfig(tte.TableConfig(rows_b, 8, name=names[1]))})
    return ec, tte.optim.Adagrad(ec.parameters(), lr=0.1)


@pytest.mark.parametrize("here, named", [((300, 1000, ("a_user", "b_item")), ("a_user", "b_item")),
                                         ((1000, 299, ("a_user", "b_item")), ("b_item",)),
                                         ((1000, 300, ("users", "items")), ("users", "items", "a_user", "b_item"))],
                         ids=["sizes-swapped", "one-row-short", "tables-renamed"])
def test_load_distributed_into_a_group_of_other_tables_is_refused_naming_them(
        tmp_path: Path, here: tuple[int, int, tuple[str, str]], named: tuple[str, ...]) -> None:
    """Both collections stack their two tables into one group of the same name. Where the group's tables differ
    (sizes 1000 + 300 saved, 300 + 1000 here: the same 1,300 rows), the load read the group in place and gave
    each table the other's rows, silently; with one row short it was refused naming the group `fused_0`, which
    the user never named. Now each table is checked as saved: refused naming the tables, nothing loaded."""
    ec, opt = _two_tables(1000, 300)
    ec({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])})["a"].sum().backward()
    opt.step()
    tte.checkpoint.save_distributed(tmp_path / "ck", model=ec, optimizer=opt)
    rows_a, rows_b, names = here
    m, o = _two_tables(rows_a, rows_b, names)
    assert list(m.groups) == list(ec.groups)  # (one stacked group of the same name)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(tte.checkpoint.CheckpointMismatchError) as e:
        tte.checkpoint.load_distributed(tmp_path / "ck", model=m, optimizer=o)
    assert "fused_0" not in str(e.value) and all(n in str(e.value) for n in named), str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert not o.state_dict()["state"] or o.state_dict()["iterations"] == 0


@pytest.mark.parametrize("kind", ["unnamed tables", "stacked member", "named parameters"])
def test_two_parameters_of_one_key_are_refused_naming_it(tmp_path: Path, kind: str) -> None:
    """Two collections' tables of one name (unnamed: ``table_0`` in each), or dense parameters given with one name,
    in one optimizer: its state was keyed by the name, so ``state_dict`` kept one table's slots and dropped the
    other's without a word, and a resumed run started that table's slots afresh. Now saving and loading refuse,
    naming the key and what to do."""
    torch.manual_seed(0)
    if kind == "named parameters":
        a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        params: list = [*a.named_parameters(), *b.named_parameters()]
        key = "param:weight"
    else:
        names = (None, None) if kind == "unnamed tables" else ("table_0", "x")
        user = tte.EmbeddingCollection({"u": tte.FeatureConfig(tte.TableConfig(20, 4, name=names[0])),
                                        "v": tte.FeatureConfig(tte.TableConfig(20, 4, name=names[1]))})
        item = tte.EmbeddingCollection({"i": tte.FeatureConfig(tte.TableConfig(30, 4))})
        params, key = [*user.parameters(), *item.parameters()], "table:table_0"
    opt = tte.optim.Adagrad(params, lr=0.1)
    message = re.escape(f"Two parameters of this optimizer would be saved under one key, '{key}'")
    with pytest.raises(ValueError, match=message):
        opt.state_dict()
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict({"state": {}, "param_groups": [], "iterations": 0})
    with pytest.raises(ValueError, match=message):
        tte.checkpoint.save(str(tmp_path / "x.pt"), optimizer=opt)
    assert not os.listdir(tmp_path)
