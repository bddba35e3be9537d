"""The optimizer's own collectives in a steady step of two tables row-sharded over 2 gloo processes
(``tte.distributed.shard``; tests/_mp_optim_collectives_worker.py wraps ``torch.distributed.all_reduce``).

Each ``all_reduce`` is a launch and a latency on an accelerator, and a step makes only those its math needs:

* a per-row rule sums nothing over the ranks: 0;
* Adafactor's sums over every row of a table: the touched rows, ``Σ w²``, the column sums of ``g²`` and ``r``'s
  change in one, then ``Σ u²`` (which needs them) in a second: 2 per table. Before: 5 (each alone);
* ``clipnorm`` of every table of the step, ``global_clipnorm`` and ``skip_nonfinite``: one ``all_reduce`` for all
  of them (the check taken on the gradients before their clip, which is the same check). Before: one per table for
  ``clipnorm`` plus one for each of the other two (with clipnorm and skip_nonfinite on two tables: 3).

The numbers stay one process's (tests/distributed/test_mp_shard.py compares every optimizer and option at 2 to 4
ranks with one process); here SGD with ``clipnorm`` and ``skip_nonfinite`` over three steps, the second with a NaN
gradient row on rank 1 only, against plain torch in float64: every rank skips that step, and the others are each
table clipped by its own norm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from suite_helpers import run_ranks

ROOT = Path(__file__).parents[2]
TABLES = 2  # row-sharded tables in the step
OPTIONS = {"": 0, "clipnorm": 1, "global_clipnorm": 1, "skip_nonfinite": 1, "global_clipnorm+skip_nonfinite": 1,
           "clipnorm+skip_nonfinite": 1}
PER_TABLE = {"sgd": 0, "adagrad": 0, "adagrad_momentum": 0, "adam": 0, "adam-nonlazy": 0, "lazy_adam": 0, "ftrl": 0,
             "adafactor": 2, "rowwise_adagrad": 0}


def ranks(case: str, tmp_path: Path) -> list[dict[str, Any]]:
    logs = run_ranks(ROOT / "tests" / "_mp_optim_collectives_worker.py", [case, str(tmp_path)], world=2, hang=240,
                     what=case)
    for r, log in enumerate(logs):
        assert (tmp_path / f"rank{r}.pt").exists(), log[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_all_reduces_of_a_steady_step(tmp_path: Path) -> None:
    want = {f"{name}+{option}" if option else name: TABLES * per_table + extra
            for name, per_table in PER_TABLE.items() for option, extra in OPTIONS.items()}
    for r, got in enumerate(ranks("counts", tmp_path)):
        assert "error" not in got, (r, got)
        assert got == want, (r, {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v})


def test_clipnorm_and_skip_nonfinite_equal_plain_torch(tmp_path: Path) -> None:
    for r, got in enumerate(ranks("clip_skip", tmp_path)):
        assert "error" not in got, (r, got)
        assert got["clip_moves"] > 1e-3, got  # the clip changes the first step
        assert got["skipped"] == 1, (r, got)
        for step, far in enumerate(got["distance"]):
            assert max(far.values()) <= 1e-12, (r, step, far)
