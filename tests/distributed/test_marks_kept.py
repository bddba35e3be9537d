"""A model marked for ``tte.distributed`` (``local_tables``, ``data_parallel(model, group)``, ``shard``) keeps its
mark through ``model.to(...)``, ``.double()``, ``copy.deepcopy``, ``load_state_dict(sd, assign=True)`` and a
conversion that makes new parameters (``torch.__future__.set_overwrite_module_params_on_conversion(True)``): it
trains as it did without the call. Before, the last two dropped the mark with the old parameter: the tables' row
gradients were then averaged over the default group, silently other numbers on every rank.

One 2-rank gloo run (tests/_mp_marks_worker.py, suite_helpers.run_ranks) covers every (mark, call); the reference
is float64 numpy: two SGD steps (lr 0.1) on the sum of the lookups, each row's gradient its count of ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from suite_helpers import run_ranks

WORKER = Path(__file__).parents[1] / "_mp_marks_worker.py"
IDS = [{"a": [1, 2, 2], "b": [3]}, {"a": [4, 5], "b": [3, 6]}]  # as the worker's, by rank
CALLS = ["none", "to_float64", "double", "to_cpu", "deepcopy", "assign", "assign_float64", "overwrite_on_conversion"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("marks")
    logs = run_ranks(WORKER, [str(out)], 2, 400, "marks")
    found = []
    for r in range(2):
        f = out / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result\n{logs[r][-4000:]}"
        found.append(json.loads(f.read_text(encoding="utf-8")))
    return found


def expected(before: dict[str, dict[str, list[float]]], counts: dict[str, dict[int, float]]) -> dict[str, Any]:
    """Each row after two SGD steps (lr 0.1) whose gradient is ``counts`` (per table, id → count) times ones."""
    return {t: {i: np.asarray(row, dtype=np.float64) - 0.2 * counts[t].get(int(i), 0.0) for i, row in rows.items()}
            for t, rows in before.items()}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("mark", ["local", "alone", "shard", "unpickled_shard"])
def test_a_marked_model_trains_as_without_the_call(results: list[dict[str, Any]], mark: str, call: str) -> None:
    for rank, res in enumerate(results):
        got = res[f"{mark}/{call}"]
        assert "error" not in got, (rank, got)
        if "shard" in mark:  # both ranks' batches as one, each rank's loss its share: the counts averaged
            counts = {t: {i: sum(ids[t].count(i) for ids in IDS) / 2 for i in range(10)} for t in ("a", "b")}
        else:  # each rank alone, as one process
            counts = {t: {i: float(IDS[rank][t].count(i)) for i in range(10)} for t in ("a", "b")}
        want = expected(got["before"], counts)
        assert got["after"].keys() == want.keys() and all(got["after"][t].keys() == want[t].keys() for t in want)
        for t in want:
            for i in want[t]:
                np.testing.assert_allclose(got["after"][t][i], want[t][i], rtol=0, atol=1e-6,
                                           err_msg=f"rank {rank}, table {t}, row {i}")
