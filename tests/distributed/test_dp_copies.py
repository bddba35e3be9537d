"""A copy of a model keeps its tables' data-parallel marks (2 gloo ranks, tests/_dp_copy_worker.py).

``tte.distributed.local_tables(model)`` and ``data_parallel(model, process_group=...)`` belong to the model's
tables: a ``copy.deepcopy`` of the model trains as the model does (each rank its own rows, or over the group
marked), never over the default group, which would average the ranks' row gradients. Each rank's table is compared
with a float64 reference written here: SGD on that rank's data alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _dp_copy_worker as W
import numpy as np
import pytest
import torch
from suite_helpers import run_ranks

WORKER = Path(__file__).parents[1] / "_dp_copy_worker.py"
_RUN: list[list[dict[str, Any]]] = []


@pytest.fixture
def ranks(tmp_path: Path) -> list[dict[str, Any]]:
    """Both ranks' results (one run of the worker for the file)."""
    if not _RUN:
        logs = run_ranks(WORKER, [str(tmp_path)], 2, 240, "copies of marked models")
        for r in range(2):
            assert (tmp_path / f"rank{r}.pt").exists(), f"rank {r} wrote no result\n{logs[r][-4000:]}"
        _RUN.append([torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)])
    return _RUN[0]


def reference(before: torch.Tensor, ranks: tuple[int, ...]) -> np.ndarray:
    """SGD in float64 on the data of ``ranks``, their gradients averaged (one rank: its data alone): a sum bag's
    gradient is its weight on each of its ids."""
    w = before.numpy().astype(np.float64).copy()
    for step in range(W.STEPS):
        grad = np.zeros_like(w)
        for rank in ranks:
            for bag, c in zip(W.ids(rank, step).numpy(), W.weights().numpy(), strict=True):
                np.add.at(grad, bag, c / len(ranks))
        w -= W.LR * grad
    return w


@pytest.mark.parametrize("case", ["local/original", "local/deepcopy", "local/pickle", "group/original",
                                  "group/deepcopy", "group/pickle/marked again"])
def test_copy_trains_each_rank_on_its_own_rows(ranks: list[dict[str, Any]], case: str) -> None:
    """local_tables, or a group of one rank each: a copy trains each rank on its data alone, as the original."""
    for rank, results in enumerate(ranks):
        run = results[case]
        assert "error" not in run, run.get("error")
        np.testing.assert_allclose(run["after"].numpy(), reference(run["before"], (rank,)), rtol=0, atol=1e-12,
                                   err_msg=f"{case} rank {rank}")


@pytest.mark.parametrize("case", ["world/deepcopy", "world/pickle"])
def test_copy_over_the_default_group_averages(ranks: list[dict[str, Any]], case: str) -> None:
    """data_parallel(process_group=WORLD): the default group, which a pickle need not hold."""
    for results in ranks:
        run = results[case]
        assert "error" not in run, run.get("error")
        np.testing.assert_allclose(run["after"].numpy(), reference(run["before"], (0, 1)), rtol=0, atol=1e-12)


def test_unpickled_copy_of_a_subgroup_model_is_refused(ranks: list[dict[str, Any]]) -> None:
    """A process group cannot be pickled: the unpickled model is refused at its first step (naming the table and
    the call that marks it again), never exchanged over the default group."""
    for results in ranks:
        error = results["group/pickle"].get("error", "")
        assert "Table `t`: unpickled from a model" in error and "tte.distributed.data_parallel(model, process_group=" in error
