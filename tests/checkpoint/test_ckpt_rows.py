"""The windowed reader of process-group checkpoints' rank files (torch_tpu_embedding/checkpoint/logical_rows.py), in one
process: rank files as ``save_sharded`` writes them (a table's stored rows in ascending logical id, with
their ids and a row slot), read into each rank's shard of another world size by the ownership
(``_pg_ckpt._locator``), in windows of a few rows so that windows are partly ours, wholly ours and not
ours at all. The reads with ``os.preadv`` (the default) and through per-window mappings (used when the
storages' file offsets are not found) write the same rows, and only the rows stored here.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
from pathlib import Path

import pytest
import torch

from torch_tpu_embedding.checkpoint import logical_rows
from torch_tpu_embedding.checkpoint.logical_rows import Source, everything, select_accumulation
from torch_tpu_embedding.checkpoint.publish import CHUNK, RESERVE, CheckpointCorruptError
from torch_tpu_embedding.distributed.exchange import GroupSharding
from torch_tpu_embedding.distributed.sharded_checkpoint import _locator
from torch_tpu_embedding.routing import RowOwnership

V, D = 3001, 3  # not a multiple of the row block: padding rows at every world size


def sharding(world: int, rank: int, placement: str = "row", owner: int = 0) -> GroupSharding:
    """The layout ``tte.distributed.shard`` gives a ``V``-row table (torch_tpu_embedding/distributed/sharding.py)."""
    if placement == "row":
        block = math.lcm(512, world)
        ownership = RowOwnership("interleaved", -(-V // block) * block, world, block)
    else:
        ownership = RowOwnership("range", world * V, world)
    return GroupSharding(placement, None, world, rank, V, ownership, owner)


def value(ids: torch.Tensor, slot: float = 0.0) -> torch.Tensor:
    return ids.to(torch.float64)[:, None] * 10 + torch.arange(D, dtype=torch.float64) + slot


def write_rank_files(path: Path, world: int) -> None:
    """``rows-<r>.pt`` of a row-sharded table "t" saved at ``world`` ranks (save_sharded's entries)."""
    path.mkdir()
    for r in range(world):
        s = sharding(world, r)
        ids = torch.sort(s.local_logical_ids()).values
        ids = ids[ids < V]
        entry = {"ids": ids, "weight": value(ids), "rows": {"acc": value(ids, 0.5)}, "whole": {}}
        torch.save({"t": entry}, path / f"rows-{r}.pt")


def source(path: Path, world: int) -> Source:
    return Source({}, None, {"t": {"placement": "row", "rows": V, "owner": 0, "key": "t.weight"}},
                  (str(path), world))


@pytest.mark.parametrize("mapped", [False, True], ids=["preadv", "mapped"])
@pytest.mark.parametrize(("saved", "loaded"), [(2, 3), (3, 2), (2, 2), (2, 1)])
def test_each_rank_gets_exactly_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: int,
                                         loaded: int, mapped: bool) -> None:
    write_rank_files(tmp_path / "ck", saved)
    monkeypatch.setattr(logical_rows, "window_rows", lambda src, dest: 40)  # windows of 40 rows
    src = source(tmp_path / "ck", saved)
    assert src.files is not None
    assert all(o is not None for o in src.files.offsets)  # torch.save's storages found in the files
    if mapped:
        src.files.offsets = [None] * saved
    for r in range(loaded):
        s = sharding(loaded, r)
        ids = s.local_logical_ids()
        real = ids < V
        weight = torch.full((s.local_rows, D), -7.0, dtype=torch.float64)
        acc = torch.full((s.local_rows, D), -7.0, dtype=torch.float32)  # another dtype: converted per window
        assert src.copy_rows("t", "t.weight", None, _locator(s), weight)
        assert src.copy_rows("t", "t.weight", "acc", _locator(s), acc)
        assert torch.equal(weight[real], value(ids[real])), (r, "weight")
        assert torch.equal(acc[real], value(ids[real], 0.5).to(torch.float32)), (r, "acc")
        assert bool((weight[~real] == -7).all()) and bool((acc[~real] == -7).all()), r  # padding untouched
        assert not src.copy_rows("t", "t.weight", "absent", _locator(s), acc)


def test_table_placement_and_the_whole_table(tmp_path: Path) -> None:
    """A table placed whole on rank 1 of 3 takes every row there, none elsewhere; ``everything`` (one
    process) takes every row."""
    write_rank_files(tmp_path / "ck", 2)
    src = source(tmp_path / "ck", 2)
    for r in range(3):
        s = sharding(3, r, "table", owner=1)
        dest = torch.full((V, D), -7.0, dtype=torch.float64)
        src.copy_rows("t", "t.weight", None, _locator(s), dest)
        assert torch.equal(dest, value(torch.arange(V)) if r == 1 else torch.full_like(dest, -7.0)), r
    whole = torch.zeros(V, D, dtype=torch.float64)
    src.copy_rows("t", "t.weight", None, everything, whole)
    assert torch.equal(whole, value(torch.arange(V)))


def test_pending_accumulation_goes_to_its_owner() -> None:
    """Logical ids of a pending buffer (``-1``: padding) become each rank's local rows; other ranks' and
    padding entries are dropped, each call's kept entries packed to the front."""
    ids = torch.tensor([[5, -1, 2999, 7], [3000, 12, -1, -1]])
    rows = torch.arange(8 * D, dtype=torch.float64).reshape(2, 4, D)
    kept = []
    for r in range(2):
        s = sharding(2, r)
        local, got = select_accumulation((ids, rows), _locator(s))
        logical = s.local_logical_ids()
        for j in range(2):
            n = int((local[j] >= 0).sum())
            assert bool((local[j, n:] == -1).all())
            back = logical[local[j, :n]].tolist()
            kept += back
            for i, lid in enumerate(back):
                assert torch.equal(got[j, i], rows[j, ids[j].tolist().index(lid)])
    assert sorted(kept) == [5, 7, 12, 2999, 3000]


def test_a_file_cut_short_after_verifying_is_named(tmp_path: Path) -> None:
    """A rank file truncated between the checks and the reads: CheckpointCorruptError naming the file."""
    write_rank_files(tmp_path / "ck", 2)
    src = source(tmp_path / "ck", 2)
    file = tmp_path / "ck" / "rows-0.pt"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)
    s = sharding(2, 0)
    with pytest.raises(CheckpointCorruptError, match="rows-0.pt ended .* bytes early"):
        src.copy_rows("t", "t.weight", "acc", _locator(s), torch.zeros(s.local_rows, D, dtype=torch.float64))


@pytest.mark.parametrize(("shape", "src", "dest"), [
    ((1 << 20, 64), torch.float32, torch.float32), ((1 << 20, 64), torch.float32, torch.float64),
    ((1 << 20, 3), torch.float64, torch.float32), ((1 << 20, 1), torch.bfloat16, torch.float32),
    ((1 << 20, 4096), torch.float32, torch.float64), ((1 << 20, 8, 16), torch.float16, torch.float16),
], ids=["f32", "f32-to-f64", "narrow-f64-to-f32", "one-column-bf16", "wide-cast", "3d-f16"])
def test_a_window_fits_the_read_buffer(shape: tuple[int, ...], src: torch.dtype, dest: torch.dtype) -> None:
    """The window's term of the bound, by construction (the module docstring): the mapping of a window of
    ``window_rows`` rows, every buffer in it and its rounding to pages included, is at most WINDOW_BYTES,
    and within a page and a row of it (windows are not needlessly short); with the Locate's charge it
    makes BUFFER = CHUNK - RESERVE; the buffers are where they say."""
    assert logical_rows.WINDOW_BYTES + logical_rows._PIECE * logical_rows._LOCATE_BYTES == logical_rows.BUFFER
    assert logical_rows.BUFFER == CHUNK - RESERVE
    a, b = torch.zeros((), dtype=src).expand(shape), torch.zeros((), dtype=dest).expand(shape)
    n = logical_rows.window_rows(a, b)
    assert logical_rows.window_bytes(n, a, b) <= logical_rows.WINDOW_BYTES
    row = math.prod(shape[1:]) * (2 * a.element_size() + (b.element_size() if src != dest else 0)) + 33
    assert logical_rows.window_bytes(n + 1, a, b) > logical_rows.WINDOW_BYTES - 8 * 64 - 2 * 4096 - row
    w = logical_rows.window_buffers(n, a, b)
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in w if t.numel())
    assert all(e <= s for (_, e), (s, _) in zip(ends, ends[1:], strict=False))  # no overlap
    assert ends[-1][1] - ends[0][0] <= logical_rows.window_bytes(n, a, b)
    assert w.rows.shape == w.gathered.shape == (n, *shape[1:]) and w.cast.shape[0] == (n if src != dest else 0)


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs") or not hasattr(ctypes.CDLL(None), "malloc_trim"),
                    reason="needs Linux's /proc/self/clear_refs and glibc's malloc_trim")
@pytest.mark.parametrize(("placement", "world"), [("row", 2), ("row", 3), ("row", 5), ("row", 1024), ("table", 3)])
def test_placing_ids_stays_within_its_charge(placement: str, world: int) -> None:
    """The Locate's term of the bound: placing a piece of ids (_PIECE, logical ids of a 2^24-row table)
    grows the peak resident memory by at most _LOCATE_BYTES per id, freed memory given back first
    (malloc_trim) so that the heap grows anew. Interleaved ownership with power-of-two chunks (2, 1024
    ranks) and not (3, 5: an odd factor, more temporaries), and a whole table on one rank."""
    rows, block = 1 << 24, math.lcm(512, world)
    ownership = (RowOwnership("interleaved", -(-rows // block) * block, world, block) if placement == "row"
                 else RowOwnership("range", world * rows, world))
    locate = _locator(GroupSharding(placement, None, world, world - 1, rows, ownership, 1))
    ids = torch.randint(0, rows, (logical_rows._PIECE,))
    for _ in range(3):  # the last measured: the first calls build lazily what is not a load's
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _kib("VmRSS")
        mine, local = locate(ids)
        del mine, local
        grown = (_kib("VmHWM") - before) * 1024
    assert grown <= logical_rows._PIECE * logical_rows._LOCATE_BYTES, (
        f"{placement}, {world} ranks: {grown / logical_rows._PIECE:.0f} bytes per id")
