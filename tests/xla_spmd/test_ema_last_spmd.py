"""``use_ema`` with gradient accumulation on a 4-device mesh (the table row-sharded, trained through the id exchange):
the raw ``ema`` and ``ema_last`` slots equal the CPU's, and a checkpoint moved between the CPU and the mesh continues
as on the layout it came from (tests/ema_window_cases.py says what was wrong). Run in its own process:
PJRT_DEVICE=CPU CPU_NUM_DEVICES=4.
"""

from __future__ import annotations

import pytest

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()  # before any XLA tensor exists
from ema_window_cases import CASES, DROPPED, moved_checkpoint_continues, raw_slots_equal  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, shard  # noqa: E402

DEV = torch_xla.device()


def on_mesh(ec: tte.EmbeddingCollection) -> None:
    assert shard(ec, device_mesh()) == {"t": "row"}


SETUP = on_mesh


@pytest.mark.parametrize("case", list(CASES))
def test_raw_slots_equal_the_cpu_after_accumulate_only_calls(case: str) -> None:
    raw_slots_equal(DEV, case, SETUP, torch_xla.sync)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("direction", ["cpu-to-xla", "xla-to-cpu"])
def test_a_checkpoint_moved_between_the_cpu_and_the_mesh_continues_as_on_its_own_layout(case: str,
                                                                                       direction: str) -> None:
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
