"""suite_helpers.run_ranks, which every process-group scenario of tests/distributed runs through: each rank a fresh
process running its worker script as ``__main__`` (its arguments, its environment, one thread), forked from a server
that imported torch once; its output back to the test, also when it ends in ``os._exit``; a hang killed and named,
with what the ranks printed. And suite_helpers.start_ranks, the ranks of a function, forked from the same server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import _launcher_worker
import pytest
import torch.multiprocessing as mp
from suite_helpers import ROOT, free_port, run_ranks, start_ranks

WORKER = ROOT / "tests" / "_launcher_worker.py"


def test_each_case_runs_in_fresh_ranks_that_start_with_torch_and_the_package_imported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cases in turn (the second with an environment variable set by the test): each rank finds no process
    group and a pid of its own, its argv and environment as ``python worker`` would, one thread; and torch and the
    package already imported when its script starts (before, a rank was its own interpreter: about 3 s of imports a
    rank)."""
    pids = set()
    for case in ("first", "second"):
        out = tmp_path / case
        out.mkdir()
        if case == "second":
            monkeypatch.setenv("TTE_LAUNCHER_PROBE", "seen")
        run_ranks(WORKER, ["record", str(out)], world=3, what=case)
        for r in range(3):
            got = json.loads((out / f"rank{r}.json").read_text(encoding="utf-8"))
            assert got["sum"] == 0 + 1 + 2 and not got["group_before"], (case, r, got)
            assert got["argv"] == [str(WORKER), "record", str(out)] and got["main"] == "__main__", (case, r, got)
            want = {"RANK": str(r), "WORLD_SIZE": "3", "OMP_NUM_THREADS": "1",
                    "TTE_LAUNCHER_PROBE": "seen" if case == "second" else None}
            assert got["env"] == want and got["threads"] == 1, (case, r, got)
            assert got["torch_before"] and got["package_before"], (case, r, got)
            pids.add(got["pid"])
    assert len(pids) == 6 and os.getpid() not in pids


def test_a_failing_rank_s_output_comes_back(tmp_path: Path) -> None:
    """Rank 1 raises, rank 0 leaves by ``os._exit`` after a print that nothing flushed: both outputs come back, the
    traceback and the printed lines."""
    logs = run_ranks(WORKER, ["fail", str(tmp_path)], what="failing")
    assert "rank 0 before its end" in logs[0], logs
    assert "rank 1 before its end" in logs[1] and "ValueError: rank 1 fails on purpose" in logs[1], logs


def test_a_hang_is_killed_and_named_with_the_ranks_output(tmp_path: Path) -> None:
    """Rank 1 sleeps past the timeout: the test fails naming the case and showing what rank 1 printed, and rank 1
    is no longer running."""
    with pytest.raises(pytest.fail.Exception, match=r"(?s)sleepy case: a rank hung \(still running after 5 s\)"
                                                    r".*rank 1's output.*rank 1 sleeps"):
        run_ranks(WORKER, ["hang", str(tmp_path)], hang=5, what="sleepy case")
    pid = int((tmp_path / "pid1").read_text(encoding="utf-8"))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_start_ranks_forks_fresh_ranks_with_the_package_imported_and_raises_a_rank_s_error(tmp_path: Path) -> None:
    """``start_ranks``: each rank its own process, no process group at its start, the package imported before the
    worker module was (under the ``spawn`` start method the ranks used before, only torch, by
    torch.multiprocessing); a rank that raises fails the call with its traceback."""
    start_ranks(_launcher_worker.rank, (2, free_port(), str(tmp_path), False), 2)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in range(2)]
    assert [g["sum"] for g in got] == [1, 1] and not any(g["group_before"] for g in got), got
    assert len({g["pid"] for g in got} | {os.getpid()}) == 3 and all(g["package_before"] for g in got), got
    with pytest.raises(mp.ProcessRaisedException, match="ValueError: rank 1 of start_ranks fails on purpose"):
        start_ranks(_launcher_worker.rank, (2, free_port(), str(tmp_path), True), 2)
