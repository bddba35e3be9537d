"""``ec.state_dict(keep_vars=True)``: torch's contract gives the parameters themselves. A table of its own gives
its parameter; a stacked table has none of its own (its group has), so it gives what ``ec.tables.<name>.weight``
gives: a view of the group's rows that requires grad, writes through, and is known as that table's rows (an
optimizer or ``tte.clip_grad_norm_`` given it refuses it by table name, ``opt.moving_average`` takes it)."""

from __future__ import annotations

import pytest
import torch

import torch_tpu_embedding as tte

_IDS = {"a": torch.tensor([1, 4, 4]), "b": torch.tensor([0, 9])}


def _make(stack: bool) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    tables = [tte.TableConfig(10, 3, name=n, combiner="sum") for n in "ab"]
    return tte.EmbeddingCollection({n: tte.FeatureConfig(t) for n, t in zip("ab", tables, strict=True)},
                                   stack_tables=stack)


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_keep_vars_entries_require_grad_and_write_through(stack: bool) -> None:
    ec = _make(stack)
    sd = ec.state_dict(keep_vars=True)
    assert sorted(sd) == ["tables.a.weight", "tables.b.weight"]
    assert all(v.requires_grad for v in sd.values())
    assert all(isinstance(v, torch.nn.Parameter) for v in sd.values()) == (not stack)
    with torch.no_grad():
        sd["tables.b.weight"][9].copy_(torch.tensor([1.0, -2.0, 0.5]))
    torch.testing.assert_close(ec(_IDS)["b"][1], torch.tensor([1.0, -2.0, 0.5]), rtol=0, atol=0)


def test_an_optimizer_built_from_keep_vars_entries_trains_unstacked_tables() -> None:
    ec = _make(False)
    start = {k: v.detach().double().clone() for k, v in ec.state_dict().items()}
    opt = tte.optim.SGD(list(ec.state_dict(keep_vars=True).values()), lr=0.5)
    out = ec(_IDS)
    (out["a"].sum() + 2 * out["b"].sum()).backward()
    opt.step()
    for name, scale in (("a", 1.0), ("b", 2.0)):  # plain torch: d/dw of scale · Σ w[ids] is scale per occurrence
        w = start[f"tables.{name}.weight"].clone().requires_grad_()
        (scale * w[_IDS[name]].sum()).backward()
        torch.testing.assert_close(ec.state_dict()[f"tables.{name}.weight"].double(), w.detach() - 0.5 * w.grad)


def test_keep_vars_entries_of_stacked_tables_are_known_by_table_name() -> None:
    ec = _make(True)
    sd = ec.state_dict(keep_vars=True)
    with pytest.raises(ValueError, match=r"Argument `params` holds the weight of table `a`, which is stacked with other "
                                         r"tables in group `fused_0`.*ec\.parameters\(\)"):
        tte.optim.SGD(list(sd.values()), lr=0.5)
    with pytest.raises(ValueError, match=r"Argument `parameters` holds the weight of table `b`, which is stacked"):
        tte.clip_grad_norm_([sd["tables.b.weight"]], 1.0)
    opt = tte.optim.Adam(ec.parameters(), lr=0.1, use_ema=True)
    out = ec(_IDS)
    (out["a"].sum() + out["b"].square().sum()).backward()
    opt.step()
    assert torch.equal(opt.moving_average(sd["tables.b.weight"]), opt.moving_average(ec.tables.b.weight))
    with pytest.raises(KeyError, match=r"Table `b` is stacked in group `fused_0`"):
        opt.state[sd["tables.b.weight"]]
