"""A table sharded over 2 gloo processes (``tte.distributed.shard``, ``distributed/routed.py``) against plain torch
in float64 (one process on the global batch, written in tests/_mp_routed_grads_worker.py), one spawn per case:

* a feature whose activations a rank's loss does not use touches no row (docs/optimizers.md, "Touched rows"), also
  when only one rank's loss uses it, and that rank's peer still takes part in the backward's exchange (a rank that
  hangs fails the test). Before, the exchange's backward got zeros for such a feature and its ids reached their
  owners: lazy Adam's moments decayed and moved those rows (0.28 on rank 1's shard after three steps);
* ``torch.autograd.grad`` of the table's weight is refused by table name on every rank, before any exchange, and
  records no row; ``torch.autograd.grad`` of the per-id weights adds none either, so the next backward and SGD step
  are one step. Before, asking for the weight ran the exchange, recorded the rows and raised torch's own error; the
  next step applied them on top of the backward's (0.24 from one step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from suite_helpers import run_ranks

ROOT = Path(__file__).parents[2]


def ranks(case: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Each rank's results of ``case`` (tests/_mp_routed_grads_worker.py), 2 ranks; a rank that hangs fails the test."""
    logs = run_ranks(ROOT / "tests" / "_mp_routed_grads_worker.py", [case, str(tmp_path)], world=2, hang=240,
                     what=case)
    for r, log in enumerate(logs):
        assert (tmp_path / f"rank{r}.pt").exists(), log[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_a_feature_a_loss_does_not_use_touches_no_row(tmp_path: Path) -> None:
    for r, got in enumerate(ranks("unused", tmp_path)):
        assert "error" not in got, (r, got)
        for leaf in ("weight", "momenta", "velocities"):
            assert got[leaf] <= 1e-12, (r, leaf, got[leaf])


def test_autograd_grad_adds_no_rows_and_refuses_the_table_weight(tmp_path: Path) -> None:
    for r, got in enumerate(ranks("autograd_grad", tmp_path)):
        assert "error" not in got, (r, got)
        assert got["weight_refused"].startswith(
            "Argument `inputs` of torch.autograd.grad holds the weight of embedding table(s) `t`: "), (r, got)
        assert "EmbeddingCollection.row_grads()" in got["weight_refused"]
        assert got["rows_after_refusal"] == [] and got["rows_after_grad"] == [], (r, got)
        assert got["gw"] <= 1e-12 and got["table"] <= 1e-12, (r, got)
