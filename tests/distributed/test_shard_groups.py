"""``tte.distributed.shard`` called for model after model in one job (a sweep, models built in a loop): the process
groups it makes over the default group are made once, not one more gloo group (threads, sockets) per call, and a
rank that skips one of those calls is still named, not waited for.

Each case starts 2 fresh gloo processes running tests/_mp_groups_worker.py (suite_helpers.run_ranks), under a
timeout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from suite_helpers import run_ranks

WORKER = Path(__file__).parents[1] / "_mp_groups_worker.py"


def run(scenario: str, tmp_path: Path) -> list[dict[str, Any]]:
    logs = run_ranks(WORKER, [scenario, str(tmp_path)], 2, 240, scenario)
    out = []
    for r in range(2):
        f = tmp_path / f"rank{r}.json"
        assert f.exists(), f"{scenario}: rank {r} wrote no result\n{logs[r][-4000:]}"
        out.append(json.loads(f.read_text(encoding="utf-8")))
    return out


def test_sharding_model_after_model_holds_no_more_threads_or_sockets(tmp_path: Path) -> None:
    """After the first ``shard``, four more models sharded (and dropped) leave the threads and open descriptors as
    they were (before: 3 threads and 5 descriptors more per call on each rank, a gloo group never destroyed), and
    every model, the first one trained last, looks up and trains as one process would (a shared exchange group
    pairs no model's all-to-alls with another's)."""
    for r, res in enumerate(run("many", tmp_path)):
        assert "errors" not in res, (r, res)
        seen = res["after_shard"]
        assert all(s == seen[0] for s in seen[1:]), (r, seen)
        for rows, (before, after) in zip(res["rows"], res["lookups"], strict=True):
            want = np.asarray(rows, dtype=np.float64)  # float64 reference: each row's averaged gradient is 1
            np.testing.assert_array_equal(before, want)
            np.testing.assert_allclose(after, want - 0.5, rtol=0, atol=1e-12)


def test_a_rank_that_skips_a_later_shard_is_named_not_waited_for(tmp_path: Path) -> None:
    """Both ranks shard and train one model; rank 1 skips ``shard`` of a second one and trains the first on. The
    groups ``shard`` made are reused, but its meeting still pairs with nothing else: rank 0 raises after its
    ``timeout``, naming the cause, and rank 1 gets an error, neither hangs."""
    r0, r1 = run("forgot_second", tmp_path)
    assert len(r0["errors"]) == 1 and "uncaught" not in r0, r0
    msg = r0["errors"][0]
    assert "every rank must call tte.distributed.shard(model)" in msg and "timeout=" in msg, msg
    assert r1["errors"], r1
