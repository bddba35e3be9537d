"""``tte.distributed.logical_ids`` takes the library's tables only: ``logical_ids(nn.Linear(3, 5))`` returned
``arange(5)`` (the rows of any module's weight); it now refuses what is not one of the library's tables, naming
what it got and what it takes.
"""

from __future__ import annotations

import pytest
import torch

import torch_tpu_embedding as tte


@pytest.mark.parametrize("what, received", [
    (torch.nn.Linear(3, 5), "'Linear'"),
    (torch.zeros(5, 3), "'Tensor of shape [5, 3]'"),
    ("table_0", "'str'"),
], ids=["Linear", "plain tensor", "a name"])
def test_logical_ids_refuses_what_is_not_a_table(what: object, received: str) -> None:
    want = (r"Argument `table` must be one of the library's tables: an EmbeddingTable or TableView "
            r"\(collection.tables\[name\]\) or its weight\. Received: " + received.replace("[", r"\[").replace("]", r"\]"))
    with pytest.raises(ValueError, match=want):
        tte.distributed.logical_ids(what)


def test_logical_ids_of_tables_not_sharded_are_their_rows() -> None:
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(4, 2, name="a")),
                                  "b": tte.FeatureConfig(tte.TableConfig(6, 2, name="b"))})  # stacked: TableViews
    alone = tte.EmbeddingCollection({"c": tte.FeatureConfig(tte.TableConfig(3, 2, name="c"))}, stack_tables=False)
    for table, rows in ((ec.tables["a"], 4), (ec.tables["b"], 6), (alone.tables["c"], 3),
                        (alone.tables["c"].weight, 3)):
        assert tte.distributed.logical_ids(table).tolist() == list(range(rows))
