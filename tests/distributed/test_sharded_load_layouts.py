"""Checkpoints loaded into a model sharded over a process group (``tte.distributed.shard``): a one-process
``tte.checkpoint.save`` file loads, each rank keeping its rows, and a checkpoint that lacks a key of the model is
refused as a load into one process refuses it. In one process: a group of one (gloo).
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


def _train(model: Model, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        model(step).backward()
        opt.step()
        opt.zero_grad()


def _logical(model: Model, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The sharded model's stored rows of ``u`` and ``w`` and their row slots in logical order (padding dropped)."""
    out = {}
    for name, rows in (("u", 40), ("w", 9)):
        table = model.ec.tables[name]
        ids = tte.distributed.logical_ids(table)
        real = ids < rows
        order = ids[real].argsort()  # (a group of one stores every row: in logical order, they are the table)
        out[name] = table.weight.detach()[real][order]
        for slot, value in opt.state[table.weight].items():
            if value.dim() and value.shape[0] == ids.shape[0]:
                out[f"{name}/{slot}"] = value[real][order]
    return out


@pytest.mark.parametrize("name, kwargs", [("adagrad", {"lr": 0.1}), ("adam", {"lr": 0.05}),
                                          ("ftrl", {"lr": 0.2})])
def test_a_one_file_checkpoint_loads_into_a_sharded_model(name: str, kwargs: dict, tmp_path: Path,
                                                         group_of_one: None) -> None:
    """Before, ``tte.checkpoint.load`` of a ``save`` file into a sharded model was refused with torch's "size
    mismatch for ec.tables.u.weight: ... [40, 3] from checkpoint ... [512, 3] in current model" (the rank's stored
    rows), a different message on each rank, though the tables were the same. Now each rank keeps its rows: the
    rows and slots are bitwise the saved model's, and 3 more steps equal 3 more steps of the saved model."""
    cls = tte.optim.optimizer_class(name)
    source = Model(seed=0)
    source_opt = cls(source.parameters(), **kwargs)
    _train(source, source_opt, range(3))
    tte.checkpoint.save(tmp_path / "one.pt", model=source, optimizer=source_opt, extra={"step": 3})
    model = Model(seed=1)  # other values everywhere: everything must come from the file
    tte.distributed.shard(model)
    opt = cls(model.parameters(), **kwargs)
    assert tte.checkpoint.load(tmp_path / "one.pt", model=model, optimizer=opt) == {"step": 3}
    loaded = _logical(model, opt)
    saved_state = source_opt.state_dict()["state"]
    for name_ in ("u", "w"):
        assert torch.equal(loaded[name_], source.ec.state_dict()[f"tables.{name_}.weight"]), name_
        for key in [k for k in loaded if k.startswith(f"{name_}/")]:
            assert torch.equal(loaded[key], saved_state[f"table:{name_}"][key.split("/")[1]]), key
    _train(source, source_opt, range(3, 6))
    _train(model, opt, range(3, 6))
    after = _logical(model, opt)
    for name_ in ("u", "w"):
        want = source.ec.state_dict()[f"tables.{name_}.weight"]
        torch.testing.assert_close(after[name_], want, rtol=1e-12, atol=1e-12)
    for key in ("ec.tables.k.weight", "ec.tables.k2.weight", "head.weight", "head.bias"):
        torch.testing.assert_close(model.state_dict()[key], source.state_dict()[key], rtol=1e-12, atol=1e-12)


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
    # strict=False (tte.checkpoint.load): the keys the file has load, the others keep their values
    tte.checkpoint.save(tmp_path / "one.pt", model=Model(seed=0))
    model = Model(seed=1)
    model.tower = torch.nn.Linear(2, 2, dtype=DTYPE)
    tte.distributed.shard(model)
    tower = model.tower.weight.detach().clone()
    with pytest.raises(tte.checkpoint.CheckpointMismatchError, match=r'Missing key\(s\) in state_dict: "tower.weight"'):
        tte.checkpoint.load(tmp_path / "one.pt", model=model)
    tte.checkpoint.load(tmp_path / "one.pt", model=model, strict=False)
    assert torch.equal(model.tower.weight.detach(), tower)
    for key in ("ec.tables.k.weight", "head.weight"):
        assert torch.equal(model.state_dict()[key], Model(seed=0).state_dict()[key]), key
