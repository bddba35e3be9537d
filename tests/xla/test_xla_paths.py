"""On XLA (static shapes) ``choose_path`` never picks an eager-only path: tables take ROWS (one pass,
one graph) or NO_DEDUP, never ADDITIVE, KERNEL or ROW_CHUNKS."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("torch_xla")

import torch_xla  # noqa: E402
from optim_registry import KERNEL_PATH, OptimizerConfig, cases  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.optim._core import (
    base,
    update_paths,
)
from torch_tpu_embedding.optim._core.update_paths import Path, choose_path  # noqa: E402
from torch_tpu_embedding.optim._kernels import kernel_policy, row_update

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


@pytest.mark.parametrize("cfg", cases(KERNEL_PATH), ids=str)
def test_kernel_eager_update_is_never_chosen_on_xla(cfg: OptimizerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel eager row update turned on (the suite turns it off, tests/conftest.py): every
    configuration of the registry's ``kernel_path`` target still takes ROWS for an XLA table."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(20, 3, name="t"))}, device=torch_xla.device())
    assert choose_path(ec.tables.t.weight, cfg.make(ec.parameters()).param_groups[0], row_grad=True) is Path.ROWS


@pytest.mark.parametrize("cfg", [c for c in cases(KERNEL_PATH) if c.id in ("lazy_adam", "rowwise_adagrad-options")],
                         ids=str)
def test_kernel_eager_update_never_runs_on_xla(cfg: OptimizerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps on XLA with the kernel path turned on: every update runs ROWS and no update kernel is built."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    dev = torch_xla.device()
    t = tte.TableConfig(20, 3, name="t")
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=3)}, device=dev)
    opt = cfg.make(ec.parameters())
    ran: list[Path] = []
    real = update_paths.update

    def spy(item: Any) -> None:
        ran.append(item.path)
        real(item)

    monkeypatch.setattr(base, "update", spy)
    kernels = row_update.compiled_kernels()
    for s in range(2):
        ids = torch.randint(0, 20, (4, 3), generator=torch.Generator().manual_seed(s))
        ec({"f": tte.Padded(ids.to(dev), (ids % 5 != 0).to(dev))})["f"].sum().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    assert ran and set(ran) == {Path.ROWS}, ran
    assert row_update.compiled_kernels() == kernels
