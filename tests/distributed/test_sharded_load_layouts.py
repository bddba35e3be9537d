"""Checkpoints loaded into a model sharded over a process group (``tte.distributed.shard``): a checkpoint that lacks
a key of the model is refused as a load into one process refuses it. In one process: a group of one (gloo).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte

DTYPE = torch.float64


class Model(torch.nn.Module):
    """A row-sharded, a table-wise and two replicated tables (stacked unsharded) and a dense head."""

    def __init__(self, seed: int, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        tables = {"u": tte.TableConfig(40, 3, name="u", placement="row", dtype=DTYPE),
                  "w": tte.TableConfig(9, 3, name="w", placement="table", dtype=DTYPE),
                  "k": tte.TableConfig(7, 2, name="k", placement="replicated", dtype=DTYPE),
                  "k2": tte.TableConfig(5, 2, name="k2", placement="replicated", dtype=DTYPE)}
        if extra:  # a table added since the save
            tables["new"] = tte.TableConfig(6, 2, name="new", placement="replicated", dtype=DTYPE)
        self.features = ["f_u", "f_w", "f_k", "f_k2"]  # (looked up: a table added since holds no feature here)
        self.ec = tte.EmbeddingCollection({f"f_{n}": tte.FeatureConfig(t) for n, t in tables.items()})
        self.head = torch.nn.Linear(3 + 3 + 2 + 2, 1, dtype=DTYPE)

    def forward(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        rows = {"u": 40, "w": 9, "k": 7, "k2": 5}
        out = self.ec({f: torch.randint(0, rows[f[2:]], (6,), generator=g) for f in self.features})
        return self.head(torch.cat([out[f] for f in self.features], dim=1)).pow(2).mean()


def test_a_checkpoint_without_a_key_of_the_sharded_model_is_refused(tmp_path: Path, group_of_one: None) -> None:
    """Before, a load into a sharded model filled the keys the checkpoint lacks (a replicated table, a dense layer
    added since the save) with the model's own values, without a word, where a load into one process raises
    "Missing key(s)". Now it raises the same, naming them, and nothing changes."""
    saved = Model(seed=0)
    tte.distributed.shard(saved)
    tte.checkpoint.save_distributed(tmp_path / "ck", model=saved)
    model = Model(seed=1, extra=True)
    model.tower = torch.nn.Linear(2, 2, dtype=DTYPE)
    tte.distributed.shard(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = r'Missing key\(s\) in state_dict: "ec.tables.new.weight", "tower.weight", "tower.bias"'
    with pytest.raises(tte.checkpoint.CheckpointMismatchError, match=want):
        tte.checkpoint.load_distributed(tmp_path / "ck", model=model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
