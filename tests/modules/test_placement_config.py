"""Placement config and padding rows on CPU: validated, and invisible to state_dict and optimizer state."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import torch_tpu_embedding as tte


def test_placement_values() -> None:
    assert tte.PLACEMENTS == ("auto", "row", "column", "replicated", "table")
    assert tte.TableConfig(4, 2).placement == "auto"
    for p in tte.PLACEMENTS:
        assert tte.TableConfig(4, 2, placement=p).placement == p
    with pytest.raises(ValueError, match=re.escape(
            "Argument `placement` must be one of ('auto', 'row', 'column', 'replicated', 'table'). Received: 'rows'")):
        tte.TableConfig(4, 2, placement="rows")
    assert "placement='row'" in repr(tte.TableConfig(4, 2, placement="row"))


def model():
    torch.manual_seed(0)
    t = tte.TableConfig(10, 3, name="t", combiner="sum")
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})


def train(ec, opt, steps: int, start: int = 0) -> None:
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        out = ec({"f": torch.randint(0, 10, (6,), generator=g)})["f"]
        out.square().sum().backward()
        opt.step()
        opt.zero_grad()


def test_padding_rows_are_invisible() -> None:
    ec, ref = model(), model()
    table = ec.tables.t
    table.pad_rows(4)
    assert table.weight.shape == (12, 3) and table.padding_rows == 2
    assert "padding_rows=2" in repr(table)
    assert torch.equal(table.weight[:10], ref.tables.t.weight) and torch.all(table.weight[10:] == 0)
    opt = tte.optim.Adam(ec.parameters(), lr=0.1, use_ema=True)
    opt_ref = tte.optim.Adam(ref.parameters(), lr=0.1, use_ema=True)
    train(ec, opt, 3)
    train(ref, opt_ref, 3)
    torch.testing.assert_close(table.weight[:10], ref.tables.t.weight, rtol=0, atol=0)
    assert torch.all(table.weight[10:] == 0)  # never looked up, never updated
    sd = ec.state_dict()
    assert sd["tables.t.weight"].shape == (10, 3)
    osd = opt.state_dict()["state"]["table:t"]
    assert {k: tuple(v.shape) for k, v in osd.items() if k != "step"} == {
        "momenta": (10, 3), "velocities": (10, 3), "ema": (10, 3), "ema_last": (10,)}
    # Round trip: a padded model loads an unpadded checkpoint and vice versa.
    plain = model()
    plain.load_state_dict(copy.deepcopy(sd))
    torch.testing.assert_close(plain.tables.t.weight, table.weight[:10])
    padded = model()
    padded.tables.t.pad_rows(8)
    padded.load_state_dict(ref.state_dict())
    assert padded.tables.t.weight.shape == (16, 3)
    torch.testing.assert_close(padded.tables.t.weight[:10], ref.tables.t.weight)
    opt2 = tte.optim.Adam(padded.parameters(), lr=0.1, use_ema=True)
    opt2.load_state_dict(opt_ref.state_dict())
    train(padded, opt2, 2, start=3)
    train(ref, opt_ref, 2, start=3)
    torch.testing.assert_close(padded.tables.t.weight[:10], ref.tables.t.weight, rtol=0, atol=0)


def test_ids_in_padding_rows_are_rejected() -> None:
    ec = model()
    ec.tables.t.pad_rows(4)
    with pytest.raises(ValueError, match=re.escape("ids must be in [0, 10)")):
        ec({"f": torch.tensor([10])})
