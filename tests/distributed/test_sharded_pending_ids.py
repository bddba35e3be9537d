"""A process-group checkpoint's pending accumulation ids are checked before each rank keeps its own.

Into a sharded model each rank keeps the pending entries of the rows it stores (``select_accumulation``);
an id outside the table is stored by no rank, so before this check it was dropped on every rank, unseen,
where ``tte.checkpoint.load`` and a ``save_distributed`` directory refuse it by name. In one process: a group
of one (gloo), a table row-sharded over it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint import CheckpointMismatchError
from torch_tpu_embedding.checkpoint.publish import MANIFEST, write_manifest


def build() -> tuple[tte.EmbeddingCollection, torch.optim.Optimizer]:
    cfg = tte.TableConfig(20, 4, name="t", placement="row", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(cfg)})
    tte.distributed.shard(ec)
    return ec, tte.optim.Adagrad(ec.parameters(), lr=0.1, gradient_accumulation_steps=2)


def step(ec: tte.EmbeddingCollection, opt: torch.optim.Optimizer, ids: list[int]) -> None:
    ec({"f": torch.tensor(ids)})["f"].sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("bad", [25, -2], ids=["past-the-table", "below-padding"])
def test_a_pending_id_outside_the_table_is_refused_and_changes_nothing(tmp_path: Path, group_of_one: None,
                                                                       bad: int) -> None:
    ec, opt = build()
    step(ec, opt, [1, 3])  # one call of two: pending
    ck = tmp_path / "ck"
    tte.checkpoint.save_distributed(ck, model=ec, optimizer=opt)
    part = torch.load(ck / "rows-0.pt", weights_only=True)
    ids = part["t"]["acc"]["acc_ids"]
    assert 3 in ids.tolist()[0]
    ids[ids == 3] = bad
    torch.save(part, ck / "rows-0.pt")
    os.remove(ck / MANIFEST)
    write_manifest(str(ck))  # sealed again: the file is as the manifest says

    into, into_opt = build()
    step(into, into_opt, [2, 5])
    w = into.tables["t"].weight
    before = [w.detach().clone(), *(v.clone() for v in into_opt.state[w].values())]
    with pytest.raises(CheckpointMismatchError, match=rf"ck does not match \(nothing was loaded\): optimizer: "
                                                      rf"table:t: slot 'acc_ids' must hold -1 \(padding\) or rows "
                                                      rf"of this table, in \[0, 20\)\. Received \[{bad}\]"):
        tte.checkpoint.load_distributed(ck, model=into, optimizer=into_opt)
    after = [w.detach(), *into_opt.state[w].values()]
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
