"""``use_ema`` with gradient accumulation on one XLA device: the raw ``ema`` and ``ema_last`` slots equal the CPU's,
and a checkpoint moved between the CPU and XLA continues as on the layout it came from (tests/ema_window_cases.py says
what was wrong; a 4-device mesh: tests/xla_spmd/test_ema_last_spmd.py)."""

from __future__ import annotations

import pytest
from ema_window_cases import CASES, moved_checkpoint_continues, raw_slots_equal

torch_xla = pytest.importorskip("torch_xla")

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


@pytest.mark.parametrize("nan_at", [(2,), (3,), (2, 3)], ids=["first", "last", "both"])
def test_a_window_skip_nonfinite_drops_counts_as_on_the_cpu(nan_at: tuple[int, ...]) -> None:
    """The window of calls 2-3 dropped (a NaN in its first, last or both micro-batches): ``skipped_steps`` 1, and
    every slot as on the CPU."""
    raw_slots_equal(DEV, "adagrad-skip", SETUP, torch_xla.sync, nan_at)


@pytest.mark.parametrize("nan_at", [(2,), (3,)], ids=["first", "last"])
@pytest.mark.parametrize("direction", ["cpu-to-xla", "xla-to-cpu"])
def test_a_checkpoint_moved_after_a_dropped_window_continues_as_on_its_own_layout(direction: str,
                                                                                 nan_at: tuple[int, ...]) -> None:
    moved_checkpoint_continues(DEV, "adagrad-skip", direction, SETUP, torch_xla.sync, nan_at)
