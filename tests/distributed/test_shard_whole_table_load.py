"""``model.load_state_dict`` of whole (unsharded) tables into a model sharded by ``tte.distributed.shard`` is refused
before anything loads, naming the tables and what loads whole tables (before: torch's raw "size mismatch for
ec.tables.u.weight: ... [40, 3] ... [512, 3]" after the other entries, here the replicated table and the head, had
loaded). In one process: a group of one (gloo).
"""

from __future__ import annotations

import pytest
import torch

import torch_tpu_embedding as tte


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3, 1)  # loaded before the collection: its entries come first
        self.ec = tte.EmbeddingCollection({
            "u": tte.FeatureConfig(tte.TableConfig(40, 3, name="u", placement="row")),
            "k": tte.FeatureConfig(tte.TableConfig(7, 3, name="k", placement="replicated"))})


def test_whole_tables_into_a_sharded_model_are_refused_before_anything_loads(group_of_one: None) -> None:
    torch.manual_seed(0)
    whole = Model().state_dict()
    torch.manual_seed(1)
    model = Model()
    tte.distributed.shard(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = (r"Argument `state_dict` gives tables sharded over a process group \(tte.distributed.shard\) other rows "
            r"than each rank stores.* Nothing was loaded.* tte.interop.load_torchrec_state_dict.* "
            r"tte.distributed.save_sharded / load_sharded.* Received: `ec.tables.u.weight` \(table `u`: 512 rows "
            r"stored on rank 0 of 1, 40 rows in all\) of shape \(40, 3\)$")
    with pytest.raises(ValueError, match=want):
        model.load_state_dict(whole)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # nothing loaded, the head and the replicated table included
    # the documented way in: each rank takes its rows of the whole table; its own stored rows load as they are
    tte.interop.load_torchrec_state_dict(model.ec, {f"embedding_bags.{n}.weight": whole[f"ec.tables.{n}.weight"]
                                                    for n in ("u", "k")})
    ids = tte.distributed.logical_ids(model.ec.tables["u"])
    real = ids < 40
    assert torch.equal(model.ec.tables["u"].weight.detach()[real], whole["ec.tables.u.weight"][ids[real]])
    model.load_state_dict(model.state_dict())
