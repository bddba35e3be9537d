"""``tte.checkpoint.save`` (one file, one process's state) of tables sharded over a process group is refused by name.

Each rank stores only its rows of a row- or table-sharded table, so a file written by one rank held that rank's rows
alone (a 20-row table saved as its 512 stored rows in a group of one; at 2 ranks each rank's 256, the table-wise
table's ``[0, D]`` off its owner), without a word, and was found out only when a load failed. In one process: a
group of one (gloo).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte


def test_a_one_file_save_of_sharded_tables_is_refused(tmp_path: Path, group_of_one: None) -> None:
    row = tte.TableConfig(20, 4, name="row", placement="row", dtype=torch.float64)
    whole = tte.TableConfig(9, 4, name="whole", placement="table", dtype=torch.float64)
    rep = tte.TableConfig(5, 4, name="rep", placement="replicated", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(row), "b": tte.FeatureConfig(whole),
                                  "c": tte.FeatureConfig(rep)})
    tte.distributed.shard(ec)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    sum(o.sum() for o in ec({"a": torch.tensor([1, 3]), "b": torch.tensor([2, 2]), "c": torch.tensor([0, 4])}).values()
        ).backward()
    opt.step()
    path = tmp_path / "one.pt"
    for kw, arg in (({"model": ec, "optimizer": opt}, "model"), ({"optimizer": opt}, "optimizer")):
        with pytest.raises(ValueError, match=rf"Argument `{arg}` holds tables sharded over a process group .*"
                                             r"tte\.checkpoint\.save_distributed\(directory.*"
                                             r"Received: tables `row`, `whole`$"):
            tte.checkpoint.save(path, **kw)
        assert not path.exists()
    # what it points to: every logical row, loadable into one process
    tte.checkpoint.save_distributed(tmp_path / "ck", model=ec, optimizer=opt)
    tte.checkpoint.convert_distributed(tmp_path / "ck", path)
    assert torch.load(path, weights_only=True)["model"]["tables.row.weight"].shape == (20, 4)


def test_a_data_parallel_collection_still_saves_one_file(tmp_path: Path, group_of_one: None) -> None:
    """Replicated tables (data parallel) are whole on every process: one file holds them, as guide §14 saves."""
    ec = tte.EmbeddingCollection({"c": tte.FeatureConfig(tte.TableConfig(5, 4, name="rep", placement="replicated"))})
    tte.distributed.shard(ec)
    tte.checkpoint.save(tmp_path / "one.pt", model=ec, optimizer=tte.optim.Adagrad(ec.parameters(), lr=0.1))
    assert torch.load(tmp_path / "one.pt", weights_only=True)["model"]["tables.rep.weight"].shape == (5, 4)
