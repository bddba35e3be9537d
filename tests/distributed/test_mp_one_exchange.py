"""Every process-group-sharded table of a forward call goes through one exchange (``distributed/lookup_exchange.py``):
in a steady training step, one agreement (one ``all_reduce`` of its eight int64), two ``all_to_all_single`` in the
forward and one in the backward, and as many host reads, whether the model has one sharded table or three (dims 4, 3
and 2, row- and table-sharded, float64 and float32: their rows travel side by side as bytes). The three tables'
rows after three SGD steps equal plain torch in float64 (tests/_mp_one_exchange_worker.py), and ``largest_loads()``
gives each table's own largest load (counted from the ids in the worker), on 2 and 4 gloo ranks; so do they where
one rank's loss leaves a table out and another's uses it.

Before, each table had its own: with three tables, three agreements (three host reads) and nine all-to-alls a step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from suite_helpers import run_ranks

ROOT = Path(__file__).parents[2]


def ranks(world: int, tmp_path: Path) -> list[dict[str, Any]]:
    logs = run_ranks(ROOT / "tests" / "_mp_one_exchange_worker.py", [str(tmp_path)], world=world, hang=240,
                     what=f"{world} ranks")
    for r, log in enumerate(logs):
        assert (tmp_path / f"rank{r}.pt").exists(), log[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_one_agreement_and_three_all_to_alls_a_step_whatever_the_tables(world: int, tmp_path: Path) -> None:
    for r, got in enumerate(ranks(world, tmp_path)):
        one, three = got["one"], got["three"]
        assert "error" not in one and "error" not in three, (r, got)
        for model in (one, three):
            assert model["agreements"] == 1, (r, got)
            assert model["forward_all_to_all"] == 2 and model["all_to_all"] == 3, (r, got)
        assert three["host_reads"] == one["host_reads"], (r, got)
        assert one["distance"] <= 1e-12 and three["distance"] <= 1e-6, (r, got)  # (table c is float32)
        for model in (one, three):  # each table's own largest load, though the exchange's capacity is shared
            assert model["loads"] == model["want_loads"], (r, model["loads"], model["want_loads"])
        # Rank 1's loss uses no feature of table b, rank 0's does: every row of b is still plain torch's on the ranks'
        # mean loss (rank 1 owns some of b's rows and records rank 0's gradient rows for them: it once dropped them,
        # as they reached no lookup of its own loss).
        left_out = got["left_out"]
        assert "error" not in left_out and left_out["distance"] <= 1e-6, (r, left_out)  # (c is float32)


def test_a_frozen_table_joins_the_forward_s_exchange_not_the_backward_s(tmp_path: Path) -> None:
    """Table ``c`` frozen on every rank: one agreement and three all-to-alls (its rows travel in the forward's, no
    gradient of it in the backward's), its activations record no gradient and it gets no row; frozen on rank 1
    only: every rank raises at the step's agreement, naming the tables and what each rank runs."""
    for r, got in enumerate(ranks(2, tmp_path)):
        frozen, one_rank = got["frozen"], got["frozen_on_one_rank"]
        assert frozen["agreements"] == 1 and frozen["all_to_all"] == 3, (r, frozen)
        assert not frozen["c_records_grad"] and "c" not in frozen["rows"], (r, frozen)
        text = one_rank.get("raised", "")
        assert "The ranks of the process group are at different exchanges" in text, (r, one_rank)
        every = "table `a` with gradients (training), table `b` with gradients (training), table `c` "
        assert every + "with gradients (training)" in text, (r, text)
        assert every + "without gradients (evaluation) or frozen (requires_grad=False)" in text, (r, text)

