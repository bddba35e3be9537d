"""On XLA (static shapes) ``choose_path`` never picks an eager-only path: tables take ROWS (one pass,
one graph) or NO_DEDUP, never ADDITIVE or ROW_CHUNKS."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch_xla")

import torch_xla  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.optim._paths import Path, choose_path  # noqa: E402

O = tte.optim  # noqa: E741


@pytest.mark.parametrize("cls, kwargs, expected", [
    (O.SGD, {"lr": 0.1}, Path.ROWS),
    (O.Adagrad, {"lr": 0.1}, Path.ROWS),
    (O.Adagrad, {"lr": 0.1, "use_gradient_accumulation": False}, Path.NO_DEDUP),
    (O.Adafactor, {"lr": 0.1}, Path.ROWS),
    (O.Adam, {"lr": 0.1, "lazy_adam": False}, Path.DENSE),
], ids=["sgd", "adagrad", "adagrad-no-dedup", "adafactor", "adam-nonlazy"])
def test_xla_paths(cls: type, kwargs: dict, expected: Path) -> None:
    t = tte.TableConfig(10, 3, name="t")
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)}, device=torch_xla.device())
    opt = cls(ec.parameters(), **kwargs)
    assert choose_path(ec.tables.t.weight, opt.param_groups[0], row_grad=True) is expected
    head = torch.nn.Linear(3, 1).to(torch_xla.device())
    assert choose_path(head.weight, cls(head.parameters(), **kwargs).param_groups[0], row_grad=False) is Path.DENSE
