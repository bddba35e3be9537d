"""Features prepared (``EmbeddingCollection.prepare``) before a table's weight was replaced: their batches hold the
weight they were planned for, so looking them up would read the old rows and send the gradient where no optimizer
built since looks (silently untrained). ``ec(prepared)`` raises naming the tables; the forward that
``use_prepared`` feeds (``tte.TrainPipeline``) plans its inputs again, for the tables as they are now. Features
looked up ahead (``look_up_ahead``) hold a graph of the old weight: their forward raises naming the tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte

F = 3


def _collection() -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    tables = [tte.TableConfig(10 + i, 2, name=f"t{i}", dtype=torch.float64) for i in range(F)]
    return tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t) for i, t in enumerate(tables)})


def _inputs() -> dict[str, Any]:
    return {f"f{i}": torch.tensor([1, 2, 3]) for i in range(F)}


def _assign(ec: tte.EmbeddingCollection) -> None:
    ec.load_state_dict({k: v + 100 for k, v in ec.state_dict().items()}, assign=True)


def _new_parameter(ec: tte.EmbeddingCollection) -> None:
    for t in ec.physical_tables().values():
        t.weight = torch.nn.Parameter(t.weight.detach() + 100)


def _unstack(ec: tte.EmbeddingCollection) -> None:
    ec.unstack(list(ec.groups))


CHANGES: list[Callable[[tte.EmbeddingCollection], None]] = [_assign, _new_parameter, _unstack]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__.strip("_") for c in CHANGES])
def test_prepared_features_of_a_replaced_weight_raise_naming_the_tables(change: Any) -> None:
    ec = _collection()
    ec(_inputs())  # (a kept plan too: prepare replays it)
    prepared = ec.prepare(_inputs())
    change(ec)
    with pytest.raises(ValueError, match=r"prepared before the weight of table\(s\) `t0`, `t1`, `t2` was replaced"):
        ec(prepared, concat=True)


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__.strip("_") for c in CHANGES])
def test_a_held_prepared_input_of_a_replaced_weight_is_planned_again(change: Any) -> None:
    """The forward fed by ``use_prepared`` looks the tables up as they are now and trains them (an optimizer built
    after the change steps them)."""
    ec, want = _collection(), _collection()
    x = _inputs()
    prepared = ec.prepare(x)
    change(ec)
    change(want)
    with ec.use_prepared(prepared):
        out = ec(x, concat=True)
    expected = want(_inputs(), concat=True)
    assert torch.equal(out, expected)
    for model, y in ((ec, out), (want, expected)):
        opt = tte.optim.SGD(model.parameters(), lr=1.0)
        (y * torch.arange(y.shape[1], dtype=y.dtype)).sum().backward()
        opt.step()
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in ec.state_dict().items())


def test_prepared_features_of_live_tables_are_looked_up() -> None:
    """Values written into the weights in place (load_state_dict without assign) are no replacement."""
    ec = _collection()
    prepared = ec.prepare(_inputs())
    ec.load_state_dict({k: v + 100 for k, v in ec.state_dict().items()})
    assert torch.equal(ec(prepared, concat=True), ec(_inputs(), concat=True))


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__.strip("_") for c in CHANGES])
def test_features_looked_up_ahead_of_a_replaced_weight_raise_naming_the_tables(change: Any) -> None:
    """Looked up ahead (the pipeline's one-step-stale schedule), then the weight replaced: the activations' graph
    holds the old weight, so their backward trained nothing the optimizer built since steps (silently)."""
    ec = _collection()
    x = _inputs()
    prepared = ec.prepare(x)
    ec.look_up_ahead(prepared, concat=True)
    change(ec)
    with ec.use_prepared(prepared), pytest.raises(
            ValueError, match=r"looked up ahead .* before the weight of table\(s\) `t0`, `t1`, `t2` was replaced"):
        ec(x, concat=True)
