"""One rank of tests/distributed/test_dp_copies.py: copies (``copy.deepcopy``, a pickle round trip) of models whose
tables ``tte.distributed.local_tables`` or ``data_parallel(process_group=...)`` marked, trained on this rank's data.

Run as ``python tests/_dp_copy_worker.py OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
set (2 ranks); writes ``OUT_DIR/rank<r>.pt``: per case the table before and after training, or the error raised.
"""

from __future__ import annotations

import copy
import os
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist

import torch_tpu_embedding as tte

ROWS, DIM, STEPS, LR = 10, 3, 2, 0.5


def ids(rank: int, step: int) -> torch.Tensor:
    """This rank's bags of step ``step``: ranks look up different rows, some twice."""
    return torch.tensor([[rank, 2 + rank], [4 + 2 * rank, 4 + 2 * rank], [step + 5, rank]])


def weights() -> torch.Tensor:
    """Each bag's weight in the loss, so that rows get different gradients."""
    return torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)


def build() -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    table = tte.TableConfig(ROWS, DIM, name="t", combiner="sum", dtype=torch.float64)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(table)})


def train(model: tte.EmbeddingCollection, rank: int) -> dict[str, Any]:
    before = model.tables["t"].weight.detach().clone()
    opt = tte.optim.SGD(model.parameters(), lr=LR)
    try:
        for step in range(STEPS):
            opt.zero_grad()
            (model({"f": tte.Padded(ids(rank, step))})["f"].sum(1) * weights()).sum().backward()
            opt.step()
    except RuntimeError as e:
        return {"error": str(e)}
    return {"before": before, "after": model.tables["t"].weight.detach().clone()}


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    alone = [dist.new_group([0]), dist.new_group([1])]  # (every rank takes part in making each)
    local, own_group, world = build(), build(), build()
    tte.distributed.local_tables(local)
    tte.distributed.data_parallel(own_group, process_group=alone[rank])  # a group of one: nothing exchanged
    tte.distributed.data_parallel(world, process_group=dist.group.WORLD)  # the default group, named
    remarked = pickle.loads(pickle.dumps(own_group))
    tte.distributed.data_parallel(remarked, process_group=alone[rank], broadcast=False)
    out = {  # (the copies first: the originals' training would change what they copy)
        "local/deepcopy": train(copy.deepcopy(local), rank),
        "local/pickle": train(pickle.loads(pickle.dumps(local)), rank),
        "group/deepcopy": train(copy.deepcopy(own_group), rank),
        "group/pickle": train(pickle.loads(pickle.dumps(own_group)), rank),  # refused: the group cannot travel
        "group/pickle/marked again": train(remarked, rank),
        "world/deepcopy": train(copy.deepcopy(world), rank),
        "world/pickle": train(pickle.loads(pickle.dumps(world)), rank),
    }
    out["local/original"] = train(local, rank)
    out["group/original"] = train(own_group, rank)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
