"""``use_ema`` with gradient accumulation on one XLA device: the raw ``ema`` and ``ema_last`` slots equal the CPU's,
and a checkpoint moved between the CPU and XLA continues as on the layout it came from (tests/ema_window_cases.py says
what was wrong; a 4-device mesh: tests/xla_spmd/test_ema_last_spmd.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ema_window_cases import CASES, DROPPED, moved_checkpoint_continues, raw_slots_equal

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402

# The autograd engine sizes its device queues at the first backward: create the XLA device first.
DEV = torch_xla.device()
SETUP = None  # one device: the table as built


@pytest.mark.parametrize("case", list(CASES))
def test_raw_slots_equal_the_cpu_after_accumulate_only_calls(case: str) -> None:
    raw_slots_equal(DEV, case, SETUP, torch_xla.sync)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("direction", ["cpu-to-xla", "xla-to-cpu"])
def test_a_checkpoint_moved_between_the_cpu_and_xla_continues_as_on_its_own_layout(case: str, direction: str) -> None:
    moved_checkpoint_continues(DEV, case, direction, SETUP, torch_xla.sync)


@pytest.mark.parametrize("case, nan_at", DROPPED, ids=[f"{c}-{n}" for c, n in DROPPED])
def test_a_window_skip_nonfinite_drops_counts_as_on_the_cpu(case: str, nan_at: tuple[int, ...]) -> None:
    """A window dropped (a NaN in its first, last or both micro-batches): ``skipped_steps`` 1, and every slot as on
    the CPU (a non-lazy table's average back where the window began: before, it kept the moves of the window's
    accumulate-only calls here)."""
    raw_slots_equal(DEV, case, SETUP, torch_xla.sync, nan_at)


@pytest.mark.parametrize("case, nan_at", [d for d in DROPPED if len(d[1]) == 1],
                         ids=[f"{c}-{n}" for c, n in DROPPED if len(n) == 1])
@pytest.mark.parametrize("direction", ["cpu-to-xla", "xla-to-cpu"])
def test_a_checkpoint_moved_after_a_dropped_window_continues_as_on_its_own_layout(direction: str,
                                                                                 case: str, nan_at: tuple[int, ...]) -> None:
    moved_checkpoint_continues(DEV, case, direction, SETUP, torch_xla.sync, nan_at)


def _dense_run(dev: torch.device, calls: list[int], nan_at: int | None) -> tuple[Any, list[int]]:
    """A table (Adagrad, lazy) and a dense ``Linear`` head (its average moves at every call, as in Keras), ``use_ema``,
    windows of 2 calls, ``skip_nonfinite``; ``calls``: the data of each call; ``nan_at``: the call whose head
    gradient is NaN. Returns the head and the compiles of each call."""
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(20, 3, name="t", dtype=torch.float64),
                                                          max_ids_per_bag=2)}, device=dev)
    head = torch.nn.Linear(3, 1).to(torch.float64).to(dev)
    opt = tte.optim.Adagrad([*ec.parameters(), *head.parameters()], lr=0.1, use_ema=True, ema_momentum=0.7,
                            skip_nonfinite=True, gradient_accumulation_steps=2)
    compiles = []
    for s in calls:
        before = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
        ids = torch.randint(0, 20, (4, 2), generator=torch.Generator().manual_seed(s))
        scale = torch.tensor([float("nan") if s == nan_at else 1.0], dtype=torch.float64).to(dev).reshape(())
        (head(ec({"f": tte.Padded(ids.to(dev))})["f"]).square().sum() * scale).backward()  # (data: one graph)
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        compiles.append((met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0) - before)
    return (head, opt), compiles


@pytest.mark.parametrize("nan_at", [6, 7], ids=["first", "last"])
def test_a_dense_average_after_a_dropped_window_is_as_if_it_never_happened(nan_at: int) -> None:
    """The window of calls 6-7 dropped on XLA: the dense head's weights and moving average equal the run that never
    saw it (before: the average kept the move of the window's accumulate-only call, as it had nothing to go back to),
    and the steady calls compile nothing (the record is rewritten in the one graph every call traces)."""
    (head, opt), compiles = _dense_run(DEV, list(range(12)), nan_at)
    (ref, ref_opt), _ = _dense_run(DEV, [s for s in range(12) if s not in (6, 7)], None)
    assert opt.skipped_steps == 1
    for p, q in ((head.weight, ref.weight), (head.bias, ref.bias)):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(opt.moving_average(p).cpu(), ref_opt.moving_average(q).cpu(), rtol=1e-13,
                                   atol=1e-15)
    assert sum(compiles[2:]) == 0, compiles  # (the first two calls compile, as without the record)
