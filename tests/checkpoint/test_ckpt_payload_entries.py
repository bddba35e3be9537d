"""A checkpoint file of our format whose ``model`` or ``optimizer`` entry is missing (written by other code,
or edited) is refused naming the file and what it lacks, as one that saved ``None`` there; nothing changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint import FORMAT


def build() -> tuple[tte.EmbeddingCollection, torch.optim.Optimizer]:
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10, 4, name="t"))})
    return ec, tte.optim.Adagrad(ec.parameters(), lr=0.1)


@pytest.mark.parametrize(("entries", "lacks"), [({}, "model"), ({"model": "model"}, "optimizer")],
                         ids=["no-model", "no-optimizer"])
def test_a_missing_entry_is_named_and_changes_nothing(tmp_path: Path, entries: dict[str, Any], lacks: str) -> None:
    ec, opt = build()
    ec({"f": torch.tensor([1, 2])})["f"].sum().backward()
    opt.step()
    opt.zero_grad()
    path = tmp_path / "c.pt"
    torch.save({"format": FORMAT, **{k: ec.state_dict() for k in entries}}, path)
    into, into_opt = build()
    before = into.tables["t"].weight.detach().clone(), into_opt.state_dict()
    with pytest.raises(ValueError, match=f"c.pt holds no {lacks} state"):
        tte.checkpoint.load(path, model=into, optimizer=into_opt)
    assert torch.equal(into.tables["t"].weight, before[0])
    assert into_opt.state_dict()["state"] == before[1]["state"] == {}
