"""Distributed checkpoints of tables sharded over a process group, through tte.checkpoint's entry points
(save_distributed / load_distributed; tests/_mp_ckpt_worker.py): pending gradient-accumulation buffers are
saved (a run resumed mid-window at 2 and 3 ranks and in one process equals the uninterrupted one), a load
that does not fit changes nothing, and loading a table at 2 ranks grows no rank's memory by more than one
read chunk (not with its shard).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import _mp_ckpt_worker as C
import _mp_worker as W
import pytest
import torch
from suite_helpers import free_port, start_ranks
from test_mp_shard import assert_equals_reference, bound, compare, reference

import torch_tpu_embedding as tte
from torch_tpu_embedding.checkpoint.publish import CHUNK

_RUN: dict[str, Any] = {}


def accum_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    if "ranks" not in _RUN:
        out = tmp_path_factory.mktemp("mpckpt")
        start_ranks(C.worker, (4, free_port(), str(out)), 4)
        _RUN["dir"], _RUN["ranks"] = out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]
    return _RUN["dir"], _RUN["ranks"]


def test_pending_accumulation_is_saved_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Saved after 5 calls of 2-call windows (every sharded table holds a pending buffer), loaded at 2 and 3
    ranks: 5 more steps equal one uninterrupted process (float64 <= 1e-10)."""
    out, results = accum_run(tmp_path_factory)
    for r, res in enumerate(results):
        for name, ids in res["pending"].items():
            assert ids.shape[0] == 2, (r, name)  # k = 2 calls
    assert any(bool((res["pending"]["big"] < res["pending"]["big"].max()).any()) for res in results)
    for r in range(4):  # each rank's file holds its pending buffers, with logical ids
        part = torch.load(out / "accum" / f"rows-{r}.pt", weights_only=True)
        acc = part["big"]["acc"]["acc_ids"]
        real = acc[acc >= 0]
        assert real.numel() and bool(torch.isin(real, part["big"]["ids"]).all())
    ref = reference(C.ACCUM, torch.float64)
    for w in (2, 3):
        for r in range(w):
            assert results[r][w]["extra"] == {"step": 5, "rank": 0}, (r, w)  # save_sharded's extra: rank 0's
            try:
                compare(results[r][w], ref, torch.float64, bound("", torch.float64, w))
            except AssertionError as e:
                raise AssertionError(f"rank {r} of {w}: {e}") from e


def test_pending_accumulation_into_one_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    out, _ = accum_run(tmp_path_factory)
    model = W.Model(torch.float64, seed=7)
    opt = W.make_opt(C.ACCUM, model.parameters())
    assert tte.checkpoint.load_distributed(out / "accum", model=model, optimizer=opt) == {"step": 5, "rank": 0}
    assert opt.state_dict()["state"]["table:big"]["acc_ids"].shape[0] == 2
    W.train(model, model, opt, torch.float64, steps=range(5, W.STEPS))
    # after 10 calls no window is pending: the buffers are stale
    assert_equals_reference(model, opt, C.ACCUM, skip=("acc_ids", "acc_rows"))


def test_convert_a_sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """tte.checkpoint.convert_distributed turns a process-group checkpoint into one save file (logical rows)
    that tte.checkpoint.load reads into one process: the same state as loading the directory."""
    out, _ = accum_run(tmp_path_factory)
    tte.checkpoint.convert_distributed(out / "accum", tmp_path / "one.pt")
    a, b = W.Model(torch.float64, seed=3), W.Model(torch.float64, seed=4)
    oa, ob = W.make_opt(C.ACCUM, a.parameters()), W.make_opt(C.ACCUM, b.parameters())
    assert tte.checkpoint.load(tmp_path / "one.pt", model=a, optimizer=oa) == {"step": 5, "rank": 0}
    tte.checkpoint.load_distributed(out / "accum", model=b, optimizer=ob)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key, slots in sa.items():
        for slot, v in slots.items():
            assert torch.equal(v, sb[key][slot]), (key, slot)


def test_a_load_that_does_not_fit_changes_nothing(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Into sharded models: another optimizer (Adam for a checkpoint of Adagrad), or table `big` 8 wide
    instead of 4. Refused with CheckpointMismatchError naming what differs; every rank's model and optimizer
    bitwise unchanged (the checks run before anything is written)."""
    _, results = accum_run(tmp_path_factory)
    for r, res in enumerate(results):
        got = res["refusal"]
        assert "adagrad" in got["optimizer"] and "'adam'" in got["optimizer"], (r, got["optimizer"])
        assert "ec.tables.big.weight" in got["width"] and "nothing was loaded" in got["width"], (r, got["width"])
        assert got["optimizer_unchanged"] and got["width_unchanged"], r


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
def test_loading_memory_is_one_chunk(tmp_path: Path) -> None:
    """The issue's bound: loading a checkpoint grows a rank's peak resident memory (VmHWM) over its memory
    before the load (shard and accumulators in place) by at most one read chunk (CHUNK, 4 MiB), nothing
    added: by construction one buffer of at most BUFFER = CHUNK - RESERVE bytes, pages included, is alive
    at a time (the checksums', then each window of rows with all its bookkeeping and the ownership's
    temporaries: _ckpt_rows's module docstring, tests/checkpoint/test_ckpt_rows.py), and RESERVE (512 KiB) holds
    the rest (interpreter objects, the pickles' pages). For a table row-sharded over 2 ranks with Adagrad of 2**19 and of 2**20
    rows (shards of 64 and 128 MiB): the growth does not follow the shard (the loader before windowed
    reads took 824 MiB at 2**20; with a per-row table of logical ids, 35 and 57-71 MiB measured so). Also
    2**19 rows saved by one rank, so that each rank gathers half of every window. A 4096-row load first
    warms the code paths (not measured: a process's first load faults in the code it runs). The rows and
    accumulators come back bitwise."""
    start_ranks(C.memory_worker, (2, free_port(), str(tmp_path)), 2)
    for r in range(2):
        got = torch.load(tmp_path / f"mem{r}.pt", weights_only=True)
        for case, rows in [(n, n) for n in C.MEMORY_ROWS] + [("resharded", C.MEMORY_ROWS[1])]:
            g = got[case]
            assert g["weight"] and g["accumulators"], (r, case, g)
            assert g["shard"] == rows * C.BIG_DIM * 4 // 2
            print(f"rank {r}, {case} rows: the load grew peak memory by {g['delta'] // 1024} KiB")  # (pytest -s)
            if case == C.MEMORY_ROWS[0]:
                continue  # the warm-up
            assert g["delta"] <= CHUNK, (
                f"rank {r}, {case} rows: the load grew memory by {g['delta'] / 2**10:.0f} KiB > one chunk "
                f"({CHUNK / 2**10:.0f} KiB; shard: {g['shard'] / 2**20:.0f} MiB)")
