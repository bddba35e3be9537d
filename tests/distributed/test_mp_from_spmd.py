"""A torch_xla SPMD checkpoint (4 devices, written on torch 2.9: tests/data/mp_spmd4, made by its make.py)
loads into 3 gloo processes (tte.distributed.shard: row- and table-wise tables, replicated ones, a DDP head)
(RowWiseAdagrad) and 5 more steps equal the uninterrupted SPMD run stored beside it (float64 <= 1e-10). Runs on torch 2.9 and
on torch 2.13 (scripts/test.sh's 2.13 subset), where no torch_xla is installed: the checkpoint is read with
torch.distributed.checkpoint alone.
"""

from __future__ import annotations

from pathlib import Path

import _mp_ckpt_worker as C
import _mp_worker as W
import torch
from suite_helpers import free_port, start_ranks
from test_mp_shard import _close, bound, compare

FIXTURE = Path(__file__).parents[1] / "data" / "mp_spmd4"
OPTIMIZER = "rowwise_adagrad"  # tests/data/mp_spmd4/make.py's


def expected() -> dict[str, object]:
    return torch.load(FIXTURE / "expected.pt", weights_only=True)


def test_spmd4_checkpoint_loads_at_world_3(tmp_path: Path) -> None:
    start_ranks(C.resume_worker, (3, free_port(), str(FIXTURE / "ckpt"), str(tmp_path), OPTIMIZER), 3)
    want = expected()
    for r in range(3):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        try:
            compare(got, want, torch.float64, bound("", torch.float64, 3))
        except AssertionError as e:
            raise AssertionError(f"rank {r} of 3: {e}") from e


def test_the_fixture_is_one_process_on_the_global_batch() -> None:
    """The stored SPMD run equals one process trained on the global batch here (float64 <= 1e-10)."""
    want, ref = expected(), W.reference(OPTIMIZER, torch.float64)
    for k, v in ref["model"].items():
        _close(want["model"][k], v, 1e-10, k, torch.float64)
    for key, slots in ref["optimizer"]["state"].items():
        for slot, v in slots.items():
            _close(want["optimizer"]["state"][key][slot], v, 1e-10, f"{key}/{slot}", torch.float64)
