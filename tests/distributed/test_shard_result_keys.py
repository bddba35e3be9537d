"""What ``tte.distributed.shard`` returns for a model whose collections hold tables of one name. In one process: a
group of one (gloo).

``shard`` returned table name → placement, so of two towers' default ``table_0`` (the name a table given none gets in
its collection) the second's placement took the first's place: ``{'table_0': 'replicated'}`` for a ``"row"`` and a
``"replicated"`` table. Each clashing name is now keyed by its table module's path (as ``save_sharded`` names them
in its refusal), every other by its name; the ranks' layout agreement compares both tables.
"""

from __future__ import annotations

import torch

import torch_tpu_embedding as tte


class TwoTowers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = tte.EmbeddingCollection({"u": tte.FeatureConfig(tte.TableConfig(40, 3, placement="row"))})
        self.geo = tte.EmbeddingCollection({"c": tte.FeatureConfig(tte.TableConfig(7, 3, name="country"))})
        self.item = tte.EmbeddingCollection({"i": tte.FeatureConfig(tte.TableConfig(50, 3, placement="replicated"))})


def test_tables_of_one_name_in_two_collections_keep_their_own_placements(group_of_one: None) -> None:
    model = TwoTowers()
    out = tte.distributed.shard(model)
    assert out == {"user.tables.table_0": "row", "country": "replicated", "item.tables.table_0": "replicated"}, out
    # the row-sharded one was laid out (512 stored rows, interleaved), the replicated one not
    assert sorted(tte.distributed.logical_ids(model.user.tables["table_0"]).tolist()) == list(range(512))
    assert tte.distributed.logical_ids(model.item.tables["table_0"]).tolist() == list(range(50))


def test_a_root_collection_and_a_child_with_one_table_name() -> None:
    """The key is the table module's path in the model: ``tables.<name>`` for a collection that is the model."""
    from torch_tpu_embedding.distributed.sharding import _table_keys

    class Root(tte.EmbeddingCollection):
        pass

    root = Root({"a": tte.FeatureConfig(tte.TableConfig(4, 2))})
    root.child = tte.EmbeddingCollection({"b": tte.FeatureConfig(tte.TableConfig(5, 2))})
    keys = _table_keys(root, [root, root.child])
    assert keys == {id(root): ["tables.table_0"], id(root.child): ["child.tables.table_0"]}, keys
