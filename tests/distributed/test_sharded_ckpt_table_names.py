"""A process-group checkpoint of a model whose collections hold tables of one name is refused by name.

``save_sharded`` keys each table by its name, so of two collections' ``table_0`` (the name a table given none gets in
its collection: a two-tower model's default) the second took the first's place: the first's stored rows went into
``meta.pt`` as rank 0's plain state, and ``load_sharded`` gave rank 0's rows to every rank (at 2 ranks rank 1's user
table loaded 1.49 away from what it saved, without a word). In one process: a group of one (gloo).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte


class TwoTowers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = tte.EmbeddingCollection({"u": tte.FeatureConfig(tte.TableConfig(40, 3, placement="row"))})
        self.item = tte.EmbeddingCollection({"i": tte.FeatureConfig(tte.TableConfig(50, 3, placement="row"))})


def test_tables_of_one_name_in_two_collections_are_refused(tmp_path: Path, group_of_one: None) -> None:
    model = TwoTowers()
    tte.distributed.shard(model)
    want = (r"Argument `model` holds two tables named `table_0`, in different EmbeddingCollections .* Give them "
            r"distinct names \(TableConfig\(name=\.\.\.\)\)\. Received: `user\.tables\.table_0\.weight` and "
            r"`item\.tables\.table_0\.weight`")
    with pytest.raises(ValueError, match=want):
        tte.distributed.save_sharded(tmp_path / "ck", model)
    assert not (tmp_path / "ck").exists()
    named = TwoTowers()
    named.item = tte.EmbeddingCollection({"i": tte.FeatureConfig(tte.TableConfig(50, 3, name="item", placement="row"))})
    tte.distributed.shard(named)
    tte.distributed.save_sharded(tmp_path / "ok", named)
    before = model.user.tables["table_0"].weight.detach().clone()
    with pytest.raises(ValueError, match=want):
        tte.distributed.load_sharded(tmp_path / "ok", model)
    assert torch.equal(model.user.tables["table_0"].weight, before)
