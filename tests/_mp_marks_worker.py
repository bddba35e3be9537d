"""One rank of a run that marks models for tte.distributed, then converts or reloads them, for
tests/distributed/test_marks_kept.py.

Run as ``python tests/_mp_marks_worker.py OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set; writes ``OUT_DIR/rank<r>.json``: for each (mark, call), the tables' logical rows before the call
and after two SGD steps (lr 0.1) on this rank's ids, as ``{table: {id: row}}``.

Marks: ``local`` (``tte.distributed.local_tables``), ``alone`` (``data_parallel`` over a group of this rank alone),
``shard`` (``tte.distributed.shard``, rows split over both ranks), ``unpickled_shard`` (``alone``, pickled and
unpickled, which drops the group, then sharded). Each trains one rank's batch alone but the last,
which trains both ranks' batches as one (its row gradients averaged over the ranks).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torch_tpu_embedding as tte

IDS = [{"a": [1, 2, 2], "b": [3]}, {"a": [4, 5], "b": [3, 6]}]  # by rank


def overwrite(m: nn.Module) -> nn.Module:
    torch.__future__.set_overwrite_module_params_on_conversion(True)  # type: ignore[no-untyped-call]
    try:
        return m.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)  # type: ignore[no-untyped-call]


def assign(m: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    m.load_state_dict({k: v.detach().clone().to(dtype or v.dtype) for k, v in m.state_dict().items()}, assign=True)
    return m


CALLS = {"none": lambda m: m, "to_float64": lambda m: m.to(torch.float64), "double": lambda m: m.double(),
         "to_cpu": lambda m: m.to("cpu"), "deepcopy": copy.deepcopy, "assign": assign,
         "assign_float64": lambda m: assign(m, torch.float64), "overwrite_on_conversion": overwrite}


def rows(m: nn.Module) -> dict[str, dict[int, list[float]]]:
    out: dict[str, dict[int, list[float]]] = {}
    for name in ("a", "b"):
        t = m.ec.tables[name]
        w, ids = t.weight.detach(), tte.distributed.logical_ids(t).tolist()  # (a shard: this rank's rows)
        out[name] = {i: w[k].double().tolist() for k, i in enumerate(ids) if i < 10}
    return out


def case(mark: str, call: str, rank: int, alone: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    m = nn.Module()
    m.ec = tte.EmbeddingCollection({n: tte.FeatureConfig(tte.TableConfig(
        1000 if "shard" in mark else 10, 4, name=n, placement="row" if "shard" in mark else "auto"))
        for n in ("a", "b")}, stack_tables=mark != "unpickled_shard")  # (unstacked: shard keeps each table's module)
    if mark == "local":
        tte.distributed.local_tables(m)
    elif mark == "alone":
        tte.distributed.data_parallel(m, alone, broadcast=False)
    elif mark == "shard":
        tte.distributed.shard(m)
    else:  # a model marked with another group, pickled (which cannot hold the group) and unpickled, then sharded
        m = pickle.loads(pickle.dumps(tte.distributed.data_parallel(m, alone, broadcast=False)))
        tte.distributed.shard(m)
    before = rows(m)
    try:
        m = CALLS[call](m)
        opt = tte.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            out = m.ec({n: torch.tensor(v) for n, v in IDS[rank].items()})
            sum(v.sum() for v in out.values()).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        return {"before": before, "error": f"{type(e).__name__}: {e}"}
    return {"before": before, "after": rows(m)}


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = [dist.new_group([r]) for r in range(world)]  # (every rank makes every group, in one order)
    result = {f"{mark}/{call}": case(mark, call, rank, groups[rank])
              for mark in ("local", "alone", "shard", "unpickled_shard") for call in CALLS}
    (out / f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
