"""[hardening4] 10: ``save_sharded`` streams each rank's rows (checkpoint/row_writer.py) instead of copying its
shard and slots into logical order first (+1.2 GB at a 1 GiB table per rank); the rows are written in
ascending logical id whatever the ownership, as before.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import _mp_ckpt_worker as C
import pytest
import torch
from suite_helpers import free_port, start_ranks

from torch_tpu_embedding.checkpoint import row_writer
from torch_tpu_embedding.checkpoint.publish import CHUNK
from torch_tpu_embedding.checkpoint.row_writer import Rows, write_rows
from torch_tpu_embedding.distributed import sharded_save as sc
from torch_tpu_embedding.distributed.exchange import GroupSharding
from torch_tpu_embedding.distributed.sharding import ROW_ALIGNMENT
from torch_tpu_embedding.routing import RowOwnership


@pytest.mark.parametrize("scheme", ["interleaved", "mod", "range"])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("v", [1, 100, 4097])
def test_rows_are_placed_in_ascending_logical_id_window_by_window(v: int, world: int, scheme: str) -> None:
    """The save's per-window order (``_in_order``) is the sort of the shard's logical ids that the save used
    to make whole, its real rows (``_real_rows``) the ids below ``v``, in windows of 7 rows too."""
    block = math.lcm(ROW_ALIGNMENT, world)
    own = RowOwnership(scheme, -(-v // block) * block, world, block)
    for rank in range(world):
        s = GroupSharding("row", None, world, rank, v, own)
        want_ids, want_pos = torch.sort(s.local_logical_ids())
        at = sc._in_order(s)
        assert torch.equal(at(0, s.local_rows), want_pos), rank
        assert torch.equal(torch.cat([at(a, min(a + 7, s.local_rows)) for a in range(0, s.local_rows, 7)]), want_pos)
        assert torch.equal(sc._logical(s, want_pos), want_ids)
        assert sc._real_rows(s, at) == int((want_ids < v).sum()), rank


@pytest.mark.parametrize("found", [True, False], ids=["offsets-found", "offsets-not-found"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_streamed_file_loads_as_torch_save_wrote_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    dtype: torch.dtype, found: bool) -> None:
    """:func:`write_rows`: the file ``torch.load`` reads (plain and mmap) equals ``torch.save`` of the same
    values: streamed rows (several windows, an empty one), small tensors and plain values beside them; where
    the records' offsets are not found, the whole is written by ``torch.save``."""
    if not found:
        monkeypatch.setattr(row_writer, "storage_offsets", lambda file, part: None)
    big = (torch.arange(20000 * 3) % 251).to(dtype).reshape(20000, 3)

    def fill(a: int, b: int, out: torch.Tensor) -> None:
        out.copy_(big[a:b])

    obj = {"t": {"ids": Rows((20000, 3), dtype, fill), "none": Rows((0, 3), dtype, fill),
                 "whole": {"step": torch.tensor(7.0)}, "n": 3, "name": "x"}}
    write_rows(str(tmp_path / "f.pt"), obj)
    for mmap in (False, True):
        got = torch.load(tmp_path / "f.pt", weights_only=True, mmap=mmap)
        assert torch.equal(got["t"]["ids"], big) and got["t"]["none"].shape == (0, 3)
        assert torch.equal(got["t"]["whole"]["step"], torch.tensor(7.0)) and got["t"]["n"] == 3


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_saving_memory_is_within_two_chunks(tmp_path: Path) -> None:
    """A table of 2**20 rows of 64 float32 row-sharded over 2 ranks with Adagrad (shards of 128 MiB, as many
    accumulators): save_sharded grows a rank's peak resident memory (VmHWM) over its memory before the save
    by at most 2 chunks (8 MiB); before, it copied the shard and the accumulators into logical order first
    (+256 MiB). A 4096-row save first warms the code paths (not measured). The rows come back bitwise."""
    start_ranks(C.save_memory_worker, (2, free_port(), str(tmp_path)), 2)
    for r in range(2):
        got = torch.load(tmp_path / f"save{r}.pt", weights_only=True)
        for rows in (C.MEMORY_ROWS[0], C.MEMORY_ROWS[2]):
            g = got[rows]
            assert g["weight"] and g["accumulators"], (r, rows, g)
            print(f"rank {r}, {rows} rows: the save grew peak memory by {g['delta'] // 1024} KiB")  # (pytest -s)
        g = got[C.MEMORY_ROWS[2]]
        assert g["shard"] == C.MEMORY_ROWS[2] * C.BIG_DIM * 4 // 2
        assert g["delta"] <= 2 * CHUNK, (f"rank {r}: the save grew memory by {g['delta'] / 2**20:.1f} MiB > two "
                                        f"chunks (shard: {g['shard'] / 2**20:.0f} MiB)")


def test_ranks_that_opened_different_saves_all_refuse(tmp_path: Path) -> None:
    """Each rank pins the directory it opened (checkpoint/snapshot.py); a save published while the ranks of a
    group opened the path would give them different saves. Made deterministic: rank r loads save r. Every
    rank raises CheckpointCorruptError before writing anything (none hangs), its model and optimizer
    unchanged. A save that rank 0 refuses (a user's file in the directory) raises on every rank, none left
    waiting in a barrier."""
    start_ranks(C.two_saves_worker, (2, free_port(), str(tmp_path)), 2)
    for r in range(2):
        got = torch.load(tmp_path / f"two{r}.pt", weights_only=True)
        assert got["error"] is not None and "The ranks opened different saves of" in got["error"], (r, got)
        assert got["unchanged"], r
        assert got["refused"] is not None and "['notes.txt']" in got["refused"], (r, got["refused"])
    assert sorted(os.listdir(tmp_path / "mine")) == ["notes.txt"]
