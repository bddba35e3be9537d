"""Stacked table groups (``stack_tables=True``) against the unstacked collection, which is the reference.

Same seeds give the same weights; a training run gives bitwise the same weights and slots; state_dicts
have the same keys and move between the two layouts; a step does one dedup, one gather and one scatter
per group (counted at the aten level); every optimizer and option keeps its per-table meaning (whole-table
statistics, clipnorm, slot_creation_fn).
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from optim_registry import STACKED, OptimizerConfig, case, cases
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._kernels import kernel_policy

O = tte.optim  # noqa: E741
# Every optimizer that trains stacked groups, alone, with EMA + accumulation + global_clipnorm, with
# accumulation + loss scale + skip_nonfinite, and without dedup (tests/optim_registry.py, ``stacked``).
CASES = cases(STACKED)


def features(dtype: torch.dtype = torch.float64, override: Any = None) -> dict[str, tte.FeatureConfig]:
    """Seven tables: four of dim 4 (one with its own optimizer), two of dim 8, one of dim 4 in float32."""
    t = [
        tte.TableConfig(40, 4, name="a", combiner="sqrtn", dtype=dtype),
        tte.TableConfig(17, 4, name="b", combiner="sum", dtype=dtype),
        tte.TableConfig(9, 8, name="c", dtype=dtype),
        tte.TableConfig(23, 4, name="d", dtype=dtype),
        tte.TableConfig(11, 8, name="e", combiner="sum", dtype=dtype),
        tte.TableConfig(5, 4, name="f", dtype=torch.float32),
        tte.TableConfig(13, 4, name="g", dtype=dtype, optimizer=override),
    ]
    return {
        "a": tte.FeatureConfig(t[0], max_ids_per_bag=4), "a2": tte.FeatureConfig(t[0]),  # a shared table
        "b": tte.FeatureConfig(t[1]), "c": tte.FeatureConfig(t[2], max_sequence_length=3),
        "d": tte.FeatureConfig(t[3]), "e": tte.FeatureConfig(t[4]), "f": tte.FeatureConfig(t[5]),
        "g": tte.FeatureConfig(t[6]),
    }


VOCAB = {"a": 40, "a2": 40, "b": 17, "c": 9, "d": 23, "e": 11, "f": 5, "g": 13}


def batch(g: torch.Generator) -> dict[str, tte.Jagged]:
    out = {}
    for name, vocab in VOCAB.items():
        lengths = torch.randint(0, 4, (6,), generator=g)
        ids = torch.randint(0, vocab, (int(lengths.sum()),), generator=g)
        weights = None if name == "c" else torch.rand(ids.numel(), generator=g, dtype=torch.float64) + 0.5
        out[name] = tte.Jagged(ids, lengths=lengths, weights=weights)  # c: a sequence feature, no weights
    return out


def train(ec: tte.EmbeddingCollection, opt: torch.optim.Optimizer, steps: int = 6, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        out = ec(batch(g))
        loss = sum((i + 1) * o.double().square().sum() for i, o in enumerate(out.values()))
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()


def build(stack: bool, cfg: OptimizerConfig, override: Any = None) -> tuple[tte.EmbeddingCollection, Any]:
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection(features(override=override), stack_tables=stack)
    return ec, cfg.make(ec.parameters())


def assert_same_state(sd1: dict[str, Any], sd2: dict[str, Any], exact: bool = True) -> None:
    assert list(sd1) == list(sd2)
    for k in sd1:
        if exact:
            assert torch.equal(sd1[k], sd2[k]), k
        else:
            torch.testing.assert_close(sd1[k], sd2[k], rtol=1e-12, atol=1e-14, msg=k)


def test_groups_by_dim_dtype_placement_and_optimizer() -> None:
    ec = tte.EmbeddingCollection(features(override="ftrl"), stack_tables=True)
    assert ec.stacked_members() == {
        "fused_0": (("a", 0, 40), ("b", 40, 17), ("d", 57, 23)),
        "fused_1": (("c", 0, 9), ("e", 9, 11)),
    }
    assert set(ec.physical_tables()) == {"f", "g", "fused_0", "fused_1"}  # alone in their key: not stacked
    assert ec.groups["fused_0"].weight.shape == (80, 4)
    assert [p.shape for p in ec.parameters()] == [(80, 4), (20, 8), (5, 4), (13, 4)]
    tables, dense = tte.split_parameters(ec)
    assert len(tables) == 4 and dense == []
    assert "stacked in 'fused_0' at row 40" in repr(ec)
    text = repr(ec)  # one line per group, in group order (docs/guide.md section 13)
    assert "group fused_0 = a + b + d: 80 rows × 4, torch.float64, placement 'auto'" in text
    assert text.index("group fused_0 = a + b + d") < text.index("group fused_1 = c + e: 20 rows × 8")
    # formation depends on the configuration only: dict keys are sorted, so insertion order does not matter
    shuffled = dict(reversed(list(features(override="ftrl").items())))
    assert tte.EmbeddingCollection(shuffled, stack_tables=True).stacked_members() == ec.stacked_members()


def test_same_seed_same_initial_weights() -> None:
    torch.manual_seed(0)
    plain = tte.EmbeddingCollection(features())
    torch.manual_seed(0)
    stacked = tte.EmbeddingCollection(features(), stack_tables=True)
    assert_same_state(plain.state_dict(), stacked.state_dict())
    for name, w in stacked.embedding_tables.items():
        assert torch.equal(w, plain.embedding_tables[name])
    torch.manual_seed(3)
    stacked.groups["fused_0"].reset_parameters()
    torch.manual_seed(3)
    for t in ("a", "b", "d"):
        expected = tte.EmbeddingTable(plain.table_configs[t], t).weight
        assert torch.equal(stacked.embedding_tables[t], expected)


def test_forward_matches_unstacked() -> None:
    torch.manual_seed(0)
    plain = tte.EmbeddingCollection(features())
    torch.manual_seed(0)
    stacked = tte.EmbeddingCollection(features(), stack_tables=True)
    inputs = batch(torch.Generator().manual_seed(5))
    a, b = plain(inputs), stacked(inputs)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("cfg", CASES, ids=str)
def test_training_is_bitwise_the_same(cfg: OptimizerConfig) -> None:
    """Bitwise, except where a sum's order changes (≤ 1e-12 in float64): global_clipnorm (squares summed
    per group), clipnorm and statistics over a table's rows (Adafactor: summed per member table)."""
    exact = "global_clipnorm" not in cfg.kwargs and "clipnorm" not in cfg.kwargs and cfg.info.per_row_rule
    plain, opt_p = build(False, cfg)
    stacked, opt_f = build(True, cfg)
    train(plain, opt_p)
    train(stacked, opt_f)
    assert_same_state(plain.state_dict(), stacked.state_dict(), exact)
    sp, sf = opt_p.state_dict(), opt_f.state_dict()
    assert sorted(sp["state"]) == sorted(sf["state"]) == [f"table:{t}" for t in "abcdefg"]
    assert [g["params"] for g in sp["param_groups"]] != [] and sorted(sp["param_groups"][0]["params"]) == sorted(
        sf["param_groups"][0]["params"])
    for key, slots in sp["state"].items():
        assert sorted(slots) == sorted(sf["state"][key]), key
        for slot, v in slots.items():
            if slot.startswith("acc_"):  # buffer capacity differs (per table vs per group)
                continue
            assert_same_state({slot: v}, {slot: sf["state"][key][slot]}, exact)
    if cfg.kwargs.get("use_ema"):
        for t, w in stacked.embedding_tables.items():
            pw = plain.embedding_tables[t]
            n = pw.shape[0]
            group = stacked.groups[next(g for g, m in stacked.stacked_members().items() if t in [x[0] for x in m])] \
                if t not in stacked.physical_tables() else None
            avg_f = opt_f.moving_average(group.weight if group is not None else w)
            off = dict((m[0], m[1]) for ms in stacked.stacked_members().values() for m in ms).get(t, 0)
            assert_same_state({t: avg_f[off: off + n]}, {t: opt_p.moving_average(pw)}, exact)


@pytest.mark.parametrize("cfg", CASES, ids=str)
@pytest.mark.parametrize("direction", ["plain->stacked", "stacked->plain"])
def test_state_dicts_move_between_layouts_and_training_goes_on(cfg: OptimizerConfig, direction: str) -> None:
    src_stacked = direction == "stacked->plain"
    ref, opt_ref = build(False, cfg)
    train(ref, opt_ref, steps=4)  # 4 calls: mid-accumulation for k=3, pending buffers are saved
    src, opt_src = build(src_stacked, cfg)
    train(src, opt_src, steps=4)
    dst, opt_dst = build(not src_stacked, cfg)
    dst.load_state_dict(src.state_dict())
    opt_dst.load_state_dict(opt_src.state_dict())
    train(ref, opt_ref, steps=3, seed=9)
    train(dst, opt_dst, steps=3, seed=9)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v, rtol=1e-12, atol=1e-12, msg=k)


def test_checkpoint_files_move_between_layouts(tmp_path: Path) -> None:
    plain, opt_p = build(False, case(STACKED, "lazy_adam"))
    stacked, opt_f = build(True, case(STACKED, "lazy_adam"))
    train(stacked, opt_f)
    tte.checkpoint.save(tmp_path / "f.pt", model=stacked, optimizer=opt_f)
    payload = torch.load(tmp_path / "f.pt", weights_only=True)
    assert sorted(payload["optimizer"]["state"]) == [f"table:{t}" for t in "abcdefg"]
    assert list(payload["model"]) == list(plain.state_dict())
    tte.checkpoint.load(tmp_path / "f.pt", model=plain, optimizer=opt_p)
    assert_same_state(plain.state_dict(), stacked.state_dict())
    tte.checkpoint.save(tmp_path / "p.pt", model=plain, optimizer=opt_p)
    stacked2, opt_f2 = build(True, case(STACKED, "lazy_adam"))
    tte.checkpoint.load(tmp_path / "p.pt", model=stacked2, optimizer=opt_f2)
    train(stacked, opt_f, seed=4)
    train(stacked2, opt_f2, seed=4)
    assert_same_state(stacked.state_dict(), stacked2.state_dict())


def test_partial_and_mismatched_loads() -> None:
    torch.manual_seed(0)
    stacked = tte.EmbeddingCollection(features(), stack_tables=True)
    before = stacked.state_dict()
    new_b = torch.full((17, 4), 0.5, dtype=torch.float64)
    result = stacked.load_state_dict({"tables.b.weight": new_b}, strict=False)
    after = stacked.state_dict()
    assert torch.equal(after["tables.b.weight"], new_b)
    assert torch.equal(after["tables.a.weight"], before["tables.a.weight"])
    assert torch.equal(after["tables.d.weight"], before["tables.d.weight"])
    assert "tables.b.weight" not in result.missing_keys
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: .*tables\.a\.weight"):
        stacked.load_state_dict({"tables.b.weight": new_b})
    with pytest.raises(RuntimeError, match=r"size mismatch for tables\.b\.weight.*\(16, 4\).*\(17, 4\)"):
        stacked.load_state_dict({**before, "tables.b.weight": new_b[:16]})
    # interop writes one table at a time through load_state_dict
    bag = torch.nn.EmbeddingBag(17, 4, mode="sum").double()
    tte.interop.load_embedding_bag(stacked, "b", bag)
    assert torch.equal(stacked.embedding_tables["b"], bag.weight.detach())
    assert torch.equal(tte.interop.to_embedding_bag(stacked, "b").weight, bag.weight)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stack", [False, True])
def test_one_dedup_gather_and_scatter_per_group(stack: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_policy, "_ENABLED", False)  # the reference path's ops (also under TTE_UPDATE_KERNEL=1)
    torch.manual_seed(0)
    tables = [tte.TableConfig(50, 4, name=f"t{i}") for i in range(6)]
    ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t) for i, t in enumerate(tables)}, stack_tables=stack)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    sum(o.sum() for o in ec({f"f{i}": torch.randint(0, 50, (8,), generator=g) for i in range(6)}).values()).backward()
    with _CountOps() as ops:
        opt.step()
    physical = 1 if stack else 6
    assert ops.counts["_unique2"] == physical  # dedup
    assert ops.counts["index_select"] == 2 * physical  # rows of the weight and of `accumulators`
    assert ops.counts["index_copy_"] == 2 * physical  # scatter of both


def _slot_fn(calls: list[tuple[int, ...]], rowwise: bool) -> Any:
    """A slot_creation_fn whose slots depend on the table's values (and record the shape it was given)."""
    def fn(p: torch.Tensor, names: list[str], init: dict[str, float]) -> dict[str, torch.Tensor]:
        calls.append(tuple(p.shape))
        acc = 0.1 + p.detach().abs()
        return {"accumulators": acc.sum(-1) if rowwise else acc}
    return fn


@pytest.mark.parametrize("opt_cls", [O.Adagrad, O.RowWiseAdagrad], ids=lambda c: c.__name__)
def test_slot_creation_fn_is_called_per_table(opt_cls: Any) -> None:
    """In a group slot_creation_fn is called once per table with that table's rows, as unstacked; the
    slots and the training that reads them are bitwise the same."""
    runs = {}
    for stack in (False, True):
        calls: list[tuple[int, ...]] = []
        torch.manual_seed(0)
        ec = tte.EmbeddingCollection(features(), stack_tables=stack)
        opt = opt_cls(ec.parameters(), lr=0.1, slot_creation_fn=_slot_fn(calls, opt_cls is O.RowWiseAdagrad))
        opt.init_state()
        assert sorted(calls) == sorted((t.num_embeddings, t.embedding_dim) for t in ec.table_configs.values())
        train(ec, opt)
        runs[stack] = (ec.state_dict(), opt.state_dict()["state"])
    assert_same_state(runs[False][0], runs[True][0])
    assert sorted(runs[False][1]) == sorted(runs[True][1])
    for key, slots in runs[False][1].items():
        assert_same_state(slots, runs[True][1][key])


def test_slot_creation_fn_shape_error_names_the_table() -> None:
    ec = tte.EmbeddingCollection(features(), stack_tables=True)
    opt = O.Adagrad(ec.parameters(), lr=0.1, slot_creation_fn=lambda p, names, init: {"accumulators": p[:1]})
    with pytest.raises(ValueError, match=r"shape \(40, 4\) for slot 'accumulators' of table 'a'. Received: Tensor"):
        opt.init_state()


def test_whole_table_state_is_per_table_in_a_group() -> None:
    """Adafactor in a group keeps c [members, D] and r_sum [members]; state_dict has each table's own
    shapes (c [D], r_sum []), and a table override naming Adafactor is stacked with its like."""
    ec = tte.EmbeddingCollection(features(), stack_tables=True)
    opt = O.Adafactor(ec.parameters(), lr=0.1)
    train(ec, opt, steps=2)
    group = ec.groups["fused_0"].weight
    assert opt.state[group]["c"].shape == (4, 4) and opt.state[group]["r_sum"].shape == (4,)
    sd = opt.state_dict()["state"]
    for t in "abdg":
        assert sd[f"table:{t}"]["c"].shape == (4,) and sd[f"table:{t}"]["r_sum"].shape == ()
        assert sd[f"table:{t}"]["r"].shape == (ec.table_configs[t].num_embeddings,)
    assert len({float(sd[f"table:{t}"]["r_sum"]) for t in "abdg"}) == 4  # four tables, four statistics
    both = {
        "x": tte.FeatureConfig(tte.TableConfig(10, 4, name="x", optimizer="adafactor")),
        "y": tte.FeatureConfig(tte.TableConfig(12, 4, name="y", optimizer="adafactor")),
    }
    ec2 = tte.EmbeddingCollection(both, stack_tables=True)
    assert list(ec2.groups) == ["fused_0"]
    opt2 = O.SGD(ec2.parameters(), lr=0.1)
    assert opt2.param_groups[0]["algorithm"] == "adafactor"
    # a table with its own optimizer is grouped only with tables naming the same one
    factory = functools.partial(tte.optim.FTRL, lr=0.1)
    ec3 = tte.EmbeddingCollection(features(override=factory), stack_tables=True)
    assert [m[0] for m in ec3.stacked_members()["fused_0"]] == ["a", "b", "d"]


class _NonLazyFactored(O.Adafactor):
    """Whole-table state on a non-lazy optimizer: the one combination a group refuses (test-only;
    registered under its own name, not exported by tte.optim)."""

    algorithm = "_test_non_lazy_factored"

    @classmethod
    def is_lazy(cls, hp: Any) -> bool:
        return False


def test_non_lazy_whole_table_state_is_rejected_by_name() -> None:
    ec = tte.EmbeddingCollection(features(), stack_tables=True)
    with pytest.raises(ValueError, match=r"Stacked table group 'fused_0' \(tables \['a', 'b', 'd', 'g'\]\).*"
                                         r"non-lazy optimizer '_test_non_lazy_factored'.*stack_tables=False"):
        _NonLazyFactored(ec.parameters(), lr=0.1)
    _NonLazyFactored(tte.EmbeddingCollection(features(), stack_tables=False).parameters(), lr=0.1)  # fine unstacked


def test_row_grads_and_zero_grad_per_group() -> None:
    ec = tte.EmbeddingCollection(features(), stack_tables=True)
    ec(batch(torch.Generator().manual_seed(0)))["b"].sum().backward()
    grads = ec.row_grads()
    assert set(grads) == {"b"}  # only b (stacked in fused_0) was reached: reported per table
    ids, _ = grads["b"]
    assert ids.numel() > 0 and bool(((ids >= 0) & (ids < 17)).all())  # b's own ids
    ec.zero_grad()
    assert ec.row_grads() == {}


def test_fuse_tables_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="Argument `stack_tables` must be a boolean. Received: 'yes'"):
        tte.EmbeddingCollection(features(), stack_tables="yes")  # type: ignore[arg-type]


def test_group_name_avoids_table_names() -> None:
    t = [tte.TableConfig(3, 2, name="fused_0"), tte.TableConfig(4, 2, name="x")]
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t[0]), "b": tte.FeatureConfig(t[1])}, stack_tables=True)
    assert list(ec.groups) == ["_fused_0"]
    assert list(ec.state_dict()) == ["tables.fused_0.weight", "tables.x.weight"]
