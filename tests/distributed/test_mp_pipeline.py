"""``tte.TrainPipeline`` over a process group: 2 gloo processes on the CPU, tables sharded over the group and data
parallel, with input prefetch and with pipelined execution.

One spawn runs every case (tests/_mp_pipe_worker.py): each rank trains its share of each global batch through the
pipeline, and every rank equals one process running the global batches through the same schedule written out by
hand (the plain loop for prefetch; TF's one-step-stale schedule for pipelined execution), float64, compared as the
suites of each setup compare (tests/distributed/test_mp_shard.py: every rank's stored rows by logical id, their
slots, the replicated tables and the DDP head; tests/distributed/test_data_parallel.py: replicas bitwise equal, and
equal to one process); every collective is the main thread's, in one order on both ranks. A bad id on one rank raises on both at that step, in each schedule (one process per rank
under a timeout, as tests/distributed/test_mp_guards.py runs them: a rank that hangs fails the test).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _mp_pipe_worker as W
import pytest
import torch
from suite_helpers import free_port, start_ranks
from test_data_parallel import assert_close, assert_replicas_equal
from test_mp_guards import run as run_ranks
from test_mp_shard import compare

WORLD = 2
TOL = 1e-10  # float64 against one process: as tests/_mp_worker.py's and tests/_dp_worker.py's TOL
_RUNS: list[list[dict[str, Any]]] = []


def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of one spawn (run once per session)."""
    if not _RUNS:
        out = tmp_path_factory.mktemp("pipe")
        start_ranks(W.worker, (WORLD, free_port(), str(out)), WORLD)
        _RUNS.append([torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)])
    return _RUNS[0]


_REFS: dict[tuple[str, str, str], dict[str, Any]] = {}


def reference(setup: str, name: str, schedule: str) -> dict[str, Any]:
    if (setup, name, schedule) not in _REFS:
        make = W.pg_reference if setup == "pg" else W.dp_reference
        _REFS[(setup, name, schedule)] = make(name, schedule)
    return _REFS[(setup, name, schedule)]


@pytest.mark.parametrize("schedule", W.SCHEDULES)
@pytest.mark.parametrize("name", W.OPTS)
def test_sharded_tables_every_rank_equals_one_process(name: str, schedule: str,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Row-, table-wise and replicated tables sharded over the group (tte.distributed.shard), a DDP head: every
    rank's rows, slots and head equal one process on the global batches with the same schedule."""
    ref = reference("pg", name, schedule)
    for r, res in enumerate(ranks(tmp_path_factory)):
        try:
            compare(res[f"pg/{name}/{schedule}"], ref, torch.float64, lambda leaf: TOL)
        except AssertionError as e:
            raise AssertionError(f"rank {r}: {e}") from e


@pytest.mark.parametrize("schedule", W.SCHEDULES)
@pytest.mark.parametrize("name", W.OPTS)
def test_data_parallel_replicas_equal_one_process(name: str, schedule: str,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """tte.distributed.DistributedDataParallel (ranks start from other tables; rank 0's are broadcast): the
    replicas bitwise equal, and equal to one process on the global batches with the same schedule."""
    runs = [res[f"dp/{name}/{schedule}"] for res in ranks(tmp_path_factory)]
    assert_replicas_equal(runs)
    assert_close(runs[0], reference("dp", name, schedule), TOL)


@pytest.mark.parametrize("schedule", W.SCHEDULES)
@pytest.mark.parametrize("setup", ["pg", "dp"])
def test_every_collective_is_the_main_threads_in_one_order(setup: str, schedule: str,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every collective of every run (recorded by tests/_mp_worker.py's wrapping backend: the exchange's, DDP's and
    the optimizers') was issued by the main thread, never by the prefetch thread, and both ranks issued the same
    ones in the same order."""
    results = ranks(tmp_path_factory)
    for name in W.OPTS:
        logs = [res[f"collectives/{setup}/{name}/{schedule}"] for res in results]
        assert logs[0] and {thread for _, thread in logs[0] + logs[1]} == {"MainThread"}, (name, logs)
        assert [c for c, _ in logs[0]] == [c for c, _ in logs[1]], name
    if setup == "pg":  # the id exchange ran (its all-to-alls) in every schedule
        assert any(c == "all_to_all_single" for c, _ in results[0][f"collectives/pg/sgd/{schedule}"])


@pytest.mark.parametrize("setup", ["pg", "dp"])
def test_the_schedules_differ(setup: str) -> None:
    """The comparisons can fail: the one-step-stale schedule does not end where the plain loop does (ids repeat
    across consecutive batches), so a pipeline that looked up fresh tables, or the wrong batch, would not pass."""
    for name in W.OPTS:
        plain, stale = reference(setup, name, "prefetch")["model"], reference(setup, name, "pipelined")["model"]
        for key in [k for k in plain if k.startswith("ec.tables.")] + ["head.weight"]:  # every table, the head
            assert float((plain[key] - stale[key]).abs().max()) > 1e3 * TOL, (setup, name, key)


@pytest.mark.parametrize("pipelined", [False, True], ids=["prefetch", "pipelined"])
@pytest.mark.parametrize("fault", ["bad_id", "features", "source"])
def test_a_failure_on_one_rank_raises_at_its_step_on_every_rank(fault: str, pipelined: bool, tmp_path: Path) -> None:
    """Rank 1 fails at batch 2 (an out-of-range id; ``features(batch)`` raising; the source raising instead of
    giving it); both ranks run TrainPipeline with prefetch (and pipelined execution): rank 1 raises its error and
    rank 0 the failure of rank 1, both at step 2, after steps 0 and 1 (with pipelined execution, batch 2 is taken
    and looked up during step 1: its error waits for step 2 on both ranks); no rank hangs, no prefetch thread is
    left, and the failed batch is the first unfinished one."""
    _failed_at_step_2(f"pipeline_{fault}" + ("_stale" if pipelined else ""), fault, tmp_path)


def _failed_at_step_2(scenario: str, fault: str, tmp_path: Path) -> None:
    """What :func:`test_a_failure_on_one_rank_raises_at_its_step_on_every_rank` checks, for ``scenario`` of
    tests/_mp_guard_worker.py."""
    r0, r1 = run_ranks(scenario, tmp_path)
    for res in (r0, r1):
        assert res["done"] == [0, 1] and [e["step"] for e in res["errors"]] == [2], res
        assert res["threads"] == 0, res
    assert "Rank 1 of the process group failed this step" in r0["errors"][0]["message"], r0
    assert r0["unfinished_first"] == 2, r0
    want = {"bad_id": ("ValueError", "Feature `item`"), "features": ("KeyError", "ids"),
            "source": ("OSError", "the reader failed")}[fault]
    assert (r1["errors"][0]["type"], want[1] in r1["errors"][0]["message"]) == (want[0], True), r1
    assert r1["unfinished_first"] == (None if fault == "source" else 2), r1


@pytest.mark.parametrize("pipelined", [False, True], ids=["prefetch", "pipelined"])
@pytest.mark.parametrize("fault", ["bad_id", "features", "source"])
def test_data_parallel_a_failure_on_one_rank_raises_at_its_step_on_every_rank(fault: str, pipelined: bool,
                                                                              tmp_path: Path) -> None:
    """As :func:`test_a_failure_on_one_rank_raises_at_its_step_on_every_rank`, under data parallel (no table
    sharded, the model in tte.distributed.DistributedDataParallel): the failed rank takes part in data parallel's
    agreement on the lookup (distributed/step_agreement.py), so rank 0 raises at step 2 too, before its backward."""
    _failed_at_step_2(f"dp_ddp_pipeline_{fault}" + ("_stale" if pipelined else ""), fault, tmp_path)
