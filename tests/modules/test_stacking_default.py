"""Stacking is the default (issue [stack]): what a user sees per table stays per table.

The unstacked collection (``stack_tables=False``) is the reference: row gradients, moving averages,
state_dict keys and checkpoints written before stacking became the default (tests/data/pre_split,
written by the code of commit a4a4da5 with one parameter per table).
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from test_stacked_groups import batch, features, train

import torch_tpu_embedding as tte

DATA = Path(__file__).parents[1] / "data"
sys.path.insert(0, os.fspath(DATA))
from pre_split.configs import CONFIGS, build, train as pre_split_train  # noqa: E402, I001


def _coalesced(ids: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """The dense ``[vocab, D]`` sum of a raw row gradient (padding ids ``>= vocab`` dropped)."""
    keep = ids < vocab
    return torch.zeros(vocab, rows.shape[1], dtype=rows.dtype).index_add_(0, ids[keep], rows[keep])


def test_the_default_stacks_and_false_opts_out() -> None:
    stacked = tte.EmbeddingCollection(features())
    assert stacked.stacked_members() == tte.EmbeddingCollection(features(), stack_tables=True).stacked_members()
    assert list(stacked.groups) == ["fused_0", "fused_1"]  # a+b+d+g (dim 4), c+e (dim 8); f (float32) apart
    assert "group fused_0 = a + b + d + g:" in repr(stacked)
    plain = tte.EmbeddingCollection(features(), stack_tables=False)
    assert list(plain.groups) == [] and len(tte.split_parameters(plain)[0]) == 7
    assert list(stacked.state_dict()) == list(plain.state_dict())


def test_the_deprecated_names_still_work_and_warn() -> None:
    """``fuse_tables=`` (now ``stack_tables=``), ``fused_members()``, ``FusedTables`` and the state hooks'
    old names (models pickled whole name them) still work; ``fuse_tables`` with ``stack_tables`` is refused."""
    from torch_tpu_embedding.modules import stacking

    with pytest.warns(DeprecationWarning, match="fuse_tables"):
        old = tte.EmbeddingCollection(features(), fuse_tables=False)
    assert list(old.groups) == [] and not old._fuse
    with pytest.warns(DeprecationWarning, match="fuse_tables"):
        old = tte.EmbeddingCollection(features(), fuse_tables=True)
    with pytest.warns(DeprecationWarning, match="fused_members"):
        assert old.fused_members() == old.stacked_members() == tte.EmbeddingCollection(features()).stacked_members()
    with pytest.raises(TypeError, match="`stack_tables` and `fuse_tables`"):
        tte.EmbeddingCollection(features(), stack_tables=True, fuse_tables=True)
    with pytest.raises(ValueError, match="fuse_tables"):
        tte.EmbeddingCollection(features(), fuse_tables=1)  # type: ignore[arg-type]
    assert stacking.FusedTables is stacking.StackedTables and isinstance(old.groups["fused_0"], stacking.FusedTables)
    assert stacking.split_fused_weights is stacking.split_stacked_weights
    assert stacking.join_fused_weights is stacking.join_stacked_weights
    assert stacking.GROUP_KEY_PREFIX == "fused_"  # the saved name: every existing checkpoint loads


def test_row_grads_stay_per_table() -> None:
    got = {}
    for stack in (True, False):
        torch.manual_seed(0)
        ec = tte.EmbeddingCollection(features(), stack_tables=stack)
        out = ec(batch(torch.Generator().manual_seed(3)))
        sum((i + 1) * o.square().sum() for i, o in enumerate(out.values())).backward()  # type: ignore[union-attr]
        got[stack] = ec.row_grads()
    assert list(got[True]) == list(got[False]) == ["a", "b", "c", "d", "e", "f", "g"]
    for name, (ids, rows) in got[False].items():
        vocab = tte.EmbeddingCollection(features()).table_configs[name].num_embeddings
        want = _coalesced(ids, rows, vocab)
        torch.testing.assert_close(_coalesced(*got[True][name], vocab), want, rtol=1e-12, atol=0)


def test_moving_average_of_a_stacked_table_is_its_rows_of_the_group() -> None:
    avgs = {}
    for stack in (True, False):
        torch.manual_seed(0)
        ec = tte.EmbeddingCollection(features(), stack_tables=stack)
        opt = tte.optim.LazyAdam(ec.parameters(), lr=0.05, use_ema=True, ema_momentum=0.7)
        train(ec, opt, steps=4)
        avgs[stack] = {n: opt.moving_average(ec.tables[n].weight) for n in ("a", "b", "d", "g")}
    for name, want in avgs[False].items():
        assert torch.equal(avgs[True][name], want), name


def test_a_stacked_tables_weight_is_refused_as_a_parameter_by_name() -> None:
    ec = tte.EmbeddingCollection(features())
    with pytest.raises(ValueError, match=r"table `b`, which is stacked with other tables in group `fused_0`.*"
                                         r"ec\.groups\.fused_0\.weight.*TableConfig\(optimizer=\.\.\.\).*"
                                         r"stack_tables=False"):
        tte.optim.Adagrad([{"params": [ec.tables.b.weight], "lr": 0.1}, {"params": [ec.tables.a.weight]}], lr=0.2)
    plain = tte.EmbeddingCollection(features(), stack_tables=False)  # per-table groups work unstacked
    opt = tte.optim.Adagrad([{"params": [plain.tables.a.weight], "lr": 0.1}, {"params": [plain.tables.b.weight]}],
                            lr=0.2)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]


def _pending(entry: dict[str, torch.Tensor]) -> torch.Tensor:
    """A pending accumulation buffer (``acc_ids [k, cap]``, ``acc_rows [k, cap, D]``, ``-1`` = empty) as
    dense ``[k, 64, D]`` sums: stacked and unstacked buffers lay the same rows out differently."""
    ids, rows = entry["acc_ids"], entry["acc_rows"]
    out = torch.zeros(ids.shape[0], 64, rows.shape[-1], dtype=rows.dtype)
    for k in range(ids.shape[0]):
        keep = ids[k] >= 0
        out[k].index_add_(0, ids[k][keep], rows[k][keep])
    return out


def _close(a: object, b: object, where: str) -> None:
    if isinstance(a, dict) and "acc_ids" in a:
        assert isinstance(b, dict) and "acc_ids" in b, where
        torch.testing.assert_close(_pending(b), _pending(a), rtol=1e-12, atol=1e-15, msg=where)
        a = {k: v for k, v in a.items() if k not in ("acc_ids", "acc_rows")}
        b = {k: v for k, v in b.items() if k not in ("acc_ids", "acc_rows")}
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15, msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), (where, sorted(a), sorted(b))
        for k in a:
            _close(a[k], b[k], f"{where}/{k}")
    else:
        assert a == b, (where, a, b)


UNSTACKED = sorted(n for n, (_, _, stack) in CONFIGS.items() if not stack)


@pytest.mark.parametrize("name", UNSTACKED)
def test_a_checkpoint_saved_before_stacking_became_the_default_loads_and_trains_on(name: str) -> None:
    """Files written with one parameter per table load into today's default (stacked) collection, and
    training on matches what that code recorded (a sum may run in another order: 1e-12)."""
    model, opt = build(name, default_construction=True)
    assert list(model["ec"].groups) == ["fused_0"]  # a and b stacked
    source = DATA / "pre_split" / (f"{name}.dcp" if name.endswith("-dcp") else f"{name}.pt")
    if name.endswith("-dcp"):
        tte.checkpoint.load_distributed(source, model=model, optimizer=opt)
    else:
        assert tte.checkpoint.load(source, model=model, optimizer=opt) == {"config": name}
        saved = torch.load(source, weights_only=True)
        _close(saved["model"], dict(model.state_dict()), "model")
        _close(saved["optimizer"]["state"], opt.state_dict()["state"], "optimizer")
    pre_split_train(model, opt, 5, 3)
    after = torch.load(DATA / "pre_split" / f"{name}.after.pt", weights_only=True)
    _close(after["model"], dict(model.state_dict()), "model after")
    _close(after["optimizer"]["state"], opt.state_dict()["state"], "optimizer after")


def test_restack_regroups_by_placement_and_checks_its_argument() -> None:
    ec = tte.EmbeddingCollection(features())
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    where = {n: "replicated" for n in ec.tables}
    where["b"] = "row"  # b leaves a + b + d
    ec.restack(where)
    assert [m[0] for m in ec.stacked_members()["fused_0"]] == ["a", "d", "g"] and "b" in ec.physical_tables()
    assert ec.groups["fused_0"].config.placement == "replicated"
    for k, v in ec.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match=r"Argument `placements` must map every table name.*Received: \{'a': 'auto'\}"):
        ec.restack({"a": "auto"})


def test_clipping_a_stacked_tables_weight_is_refused_by_name() -> None:
    """Its gradient lives in its group's: clipping the view alone would silently see no gradient."""
    ec = tte.EmbeddingCollection(features())
    out = ec(batch(torch.Generator().manual_seed(3)))
    out["a"].sum().backward()
    with pytest.raises(ValueError, match=r"Argument `parameters` holds the weight of table `a`.*group `fused_0`.*"
                                         r"cannot be clipped on its own"):
        tte.clip_grad_norm_([ec.tables.a.weight], 1.0)
    assert float(tte.clip_grad_norm_(ec.parameters(), 1.0)) > 0  # the group's gradient, a's included


def test_an_optimizer_built_before_the_tables_were_restacked_refuses_to_step() -> None:
    """``restack`` (what ``xla.shard`` does first) replaces group parameters: an optimizer built on the
    old ones would train tensors nothing looks up. It raises at ``step``/``init_state``, naming the
    group; one built afterwards trains."""
    ec = tte.EmbeddingCollection(features())
    stale = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    placements = {n: "replicated" for n in ec.tables}
    placements["a"] = "row"  # a leaves group fused_0
    ec.restack(placements)
    ec(batch(torch.Generator().manual_seed(3)))["a"].sum().backward()  # type: ignore[index]
    with pytest.raises(RuntimeError, match=r"tables `a`, `b`, `d`, `g` \(stacked together\) that is no longer theirs: the tables were "
                                           r"stacked anew.*Build the optimizer after"):
        stale.step()
    with pytest.raises(RuntimeError, match="no longer theirs") as refused:
        stale.init_state()
    assert "fused_0" not in str(refused.value)  # the user's tables are named, not the internal group
    fresh = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    before = ec.tables.a.weight.detach().clone()
    fresh.step()
    assert not torch.equal(ec.tables.a.weight, before)
    same = tte.EmbeddingCollection(features())
    kept = tte.optim.Adagrad(same.parameters(), lr=0.1)
    same.restack({n: "row" for n in same.tables})  # the same groups: parameters kept, the optimizer stays valid
    kept.init_state()


def test_optimizer_state_of_a_stacked_tables_weight_says_where_the_slots_are() -> None:
    ec = tte.EmbeddingCollection(features())
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    train(ec, opt, steps=1)
    with pytest.raises(KeyError, match=r"Table `b` is stacked in group `fused_0`: its optimizer state is in "
                                       r"opt\.state\[ec\.groups\.fused_0\.weight\] \(its rows \[\d+, \d+\)"):
        opt.state[ec.tables.b.weight]
    assert opt.state.get(ec.tables.b.weight) is None and ec.tables.b.weight not in opt.state
    assert "accumulators" in opt.state[ec.groups.fused_0.weight]
    for copy_ in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        with pytest.raises(KeyError, match="is stacked in group"):
            copy_.state[ec.tables.b.weight]


def test_a_stacked_table_whose_bags_were_all_empty_is_still_reported_by_row_grads() -> None:
    """Unstacked, a table looked up with empty bags only reports its padding entries; stacked, it is
    reported too (with no entries of its own), not dropped. Found by tests/modules/test_stacking_properties.py."""
    got = {}
    for stack in (True, False):
        t = [tte.TableConfig(3, 2, name=n, combiner="sum") for n in ("t0", "t1")]
        ec = tte.EmbeddingCollection({"x": tte.FeatureConfig(t[0]), "y": tte.FeatureConfig(t[1], max_ids_per_bag=2)},
                                     stack_tables=stack)
        out = ec({"x": torch.tensor([0, 2]), "y": tte.Padded(torch.zeros(2, 2, dtype=torch.int64),
                                                            torch.zeros(2, 2, dtype=torch.bool))})
        (out["x"].sum() + out["y"].sum()).backward()
        got[stack] = ec.row_grads()
    assert list(got[True]) == list(got[False]) == ["t0", "t1"]
    for name in ("t0", "t1"):
        torch.testing.assert_close(_coalesced(*got[True][name], 3), _coalesced(*got[False][name], 3), rtol=0, atol=0)


def test_a_tables_own_exchange_capacity_is_never_dropped_by_stacking() -> None:
    """A group's exchange capacity is the sum of its tables'; a table with one set stacks only with
    tables that set one too (with a derived one it would have been dropped for the default)."""
    caps = {"a": 16, "b": None, "c": 24, "d": None}
    tables = {n: tte.TableConfig(50, 4, name=n, placement="row", max_unique_ids_per_shard=c) for n, c in caps.items()}
    ec = tte.EmbeddingCollection({f"f_{n}": tte.FeatureConfig(t) for n, t in tables.items()})
    groups = {tuple(m[0] for m in members): g for g, members in ec.stacked_members().items()}
    assert set(groups) == {("a", "c"), ("b", "d")}
    assert ec.groups[groups["a", "c"]].config.max_unique_ids_per_shard == 40
    assert ec.groups[groups["b", "d"]].config.max_unique_ids_per_shard is None


def test_the_overflow_error_of_a_stacked_group_names_its_tables_and_how_to_fix_it() -> None:
    from torch_tpu_embedding.modules.screening import overflow_problem

    assert overflow_problem(["fa"], "t", None, [0, 0], [3, 4], 8) is None
    msg = overflow_problem(["fa", "fb"], "fused_0", ["ta", "tb"], [9, 0, 7], [11, 6, 12], 8)
    assert msg is not None
    assert msg.startswith("Feature(s) `fa`, `fb` (tables `ta`, `tb`, stacked as `fused_0`): ids over the exchange "
                          "capacity 8 were dropped since the last check_ids(): 9 for shard 0, 7 for shard 2 "
                          "(the most distinct ids one device had for each in one step: 11, 12)."), msg
    assert "A capacity of 12 would have sufficed" in msg
    assert "on each of those tables (the group's capacity is their sum)" in msg
    assert "The tables were not updated" in msg
