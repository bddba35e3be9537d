"""One rank of a run that shards several models in turn, for tests/distributed/test_shard_groups.py.

Run as ``python tests/_mp_groups_worker.py SCENARIO OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (one process per rank, as torchrun starts them); writes ``OUT_DIR/rank<r>.json``.

* ``many``: model ``first`` sharded and kept; then 4 more, each sharded, trained one step and dropped; then
  ``first`` trained. Records this process's threads and open descriptors after each ``shard`` (a gloo group is
  threads and sockets), each model's lookups and its table's rows before ``shard`` (the reference).
* ``forgot_second``: both ranks shard and train ``first``; rank 1 then skips the ``shard`` of a second model and
  trains ``first`` on. Records each rank's errors.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torch_tpu_embedding as tte

IDS = [1, 2, 3, 700]  # the same on both ranks: each row's averaged gradient is one (the loss: the lookups' sum)
WAIT = datetime.timedelta(seconds=5)


def model(seed: int) -> tuple[nn.Module, list[list[float]]]:
    """A model of one row-sharded table (1000 rows), and its rows at ``IDS`` as drawn (before ``shard``)."""
    torch.manual_seed(seed)
    m = nn.Module()
    m.ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(1000, 4, name="a", placement="row",
                                                                           dtype=torch.float64))})
    return m, m.ec.tables["a"].weight.detach()[IDS].tolist()


def step(m: nn.Module) -> list[list[float]]:
    """One SGD step (lr 0.5) on the sum of the lookups of ``IDS``; returns those lookups."""
    opt = tte.optim.SGD(m.parameters(), lr=0.5)
    out = m.ec({"a": torch.tensor(IDS)})["a"]
    out.sum().backward()
    opt.step()
    return out.detach().tolist()


def resources() -> dict[str, int]:
    gc.collect()
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd"))}


def run(scenario: str, rank: int) -> dict[str, Any]:
    first, first_rows = model(0)
    tte.distributed.shard(first, timeout=WAIT)
    if scenario == "forgot_second":
        step(first)
        errors = []
        try:
            if rank == 0:
                tte.distributed.shard(model(1)[0], timeout=WAIT)
            for _ in range(3):
                step(first)
        except RuntimeError as e:
            errors.append(str(e))
        return {"errors": errors}
    out: dict[str, Any] = {"after_shard": [resources()], "rows": [first_rows], "lookups": []}
    for seed in range(1, 5):
        m, rows = model(seed)
        tte.distributed.shard(m, timeout=WAIT)
        out["after_shard"].append(resources())
        out["rows"].append(rows)
        out["lookups"].append([step(m), step(m)])
        del m
    out["lookups"].insert(0, [step(first), step(first)])
    return out


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run(scenario, rank)
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"errors": [f"{type(e).__name__}: {e}"], "uncaught": True}
    (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    os._exit(0)  # never wait in destroy_process_group for a rank that failed


if __name__ == "__main__":
    main()
