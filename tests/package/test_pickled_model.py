"""A whole model saved with ``torch.save(model)`` before the package's modules moved into subpackages still
loads (tests/data/pickled_model, written at 7bb2a6a by its make.py): its classes and state hooks are named by
the old module paths (``torch_tpu_embedding.collection``, ``.table``, ``._fused``, ``._screening``), which stay
importable as the modules that hold them now."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from typing import Any

import torch

import torch_tpu_embedding as tte

DATA = Path(__file__).parents[1] / "data" / "pickled_model"


def _maker() -> Any:
    spec = importlib.util.spec_from_file_location("pickled_model_make", DATA / "make.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_pickled_before_the_move_loads_and_looks_up_as_it_did() -> None:
    make = _maker()
    model = torch.load(DATA / "model.pt", weights_only=False)
    assert isinstance(model["stacked"], tte.EmbeddingCollection)
    assert isinstance(model["plain"].tables["users"], tte.EmbeddingTable)
    want = torch.load(DATA / "outputs.pt")
    got = make.lookups(model)
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    # Its state equals that of the same model built by today's code, key for key and bitwise.
    fresh = make.build()
    state, fresh_state = model.state_dict(), fresh.state_dict()
    assert list(state) == list(fresh_state)
    for key in state:
        assert torch.equal(state[key], fresh_state[key]), key


def test_model_pickled_before_the_move_trains() -> None:
    make = _maker()
    model = torch.load(DATA / "model.pt", weights_only=False)
    opt = tte.optim.Adagrad(model.parameters(), lr=0.5)
    before = model["stacked"].tables["users"].weight.detach().clone()
    loss = sum(v.sum() for v in model["stacked"](make.INPUTS).values())
    loss.backward()
    opt.step()
    after = model["stacked"].tables["users"].weight.detach()
    changed = (after != before).any(dim=1)
    assert changed[[1, 2, 3, 49, 0]].all() and int(changed.sum()) == 5  # the rows the batch touched, only
    # a second save and load of the old model round-trips too
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
