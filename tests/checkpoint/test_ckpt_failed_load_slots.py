"""A failed distributed load leaves an optimizer that had not stepped as it was: without slots.

``load_distributed`` creates the optimizer's slots (``init_state``) to check the checkpoint against them. An
EMA slot is created as a copy of the weights as they are then, so slots left behind by a refused load made a
later run's EMA start from the weights of before the refusal (here: before a model-only load that followed),
where a run that never tried the load starts it from the weights of its first step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint import CheckpointMismatchError


def build(seed: int, adam: bool = True) -> tuple[tte.EmbeddingCollection, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10, 4, name="t", dtype=torch.float64))})
    kind = tte.optim.Adam if adam else tte.optim.Adagrad
    return ec, kind(ec.parameters(), lr=0.1, use_ema=True, ema_momentum=0.5)


def step(ec: tte.EmbeddingCollection, opt: torch.optim.Optimizer) -> None:
    ec({"f": torch.tensor([1, 2, 2])})["f"].pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def test_a_refused_distributed_load_leaves_no_slots_and_training_goes_on_as_without_it(
        tmp_path: Path) -> None:
    other, other_opt = build(1, adam=False)
    step(other, other_opt)
    ck = tmp_path / "ck"
    tte.checkpoint.save_distributed(ck, model=other, optimizer=other_opt)  # an Adagrad checkpoint
    weights = tmp_path / "weights.pt"
    tte.checkpoint.save(weights, model=build(2)[0])

    tried, tried_opt = build(0)
    with pytest.raises(CheckpointMismatchError, match="saved by optimizer 'adagrad', loading into 'adam'"):
        tte.checkpoint.load_distributed(ck, model=tried, optimizer=tried_opt)
    assert tried_opt.state_dict()["state"] == {}
    plain, plain_opt = build(0)
    for ec, opt in ((tried, tried_opt), (plain, plain_opt)):
        tte.checkpoint.load(weights, model=ec)  # the weights to train from, model only
        for _ in range(3):
            step(ec, opt)
    assert torch.equal(tried.tables["t"].weight, plain.tables["t"].weight)
    a, b = tried_opt.state_dict()["state"]["table:t"], plain_opt.state_dict()["state"]["table:t"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the EMA started elsewhere"
