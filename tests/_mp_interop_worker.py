"""One rank of tests/distributed/test_mp_torchrec_interop.py: ``tte.interop`` on a collection sharded over a process
group (``tte.distributed.shard``: a row-sharded, a table-wise and two replicated tables).

Run as ``python tests/_mp_interop_worker.py DTENSOR OUT_DIR`` (``DTENSOR``: ``1`` for ``shard(...,
dtensor_state_dict=True)``) with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; saves
``OUT_DIR/rank<r>.pt``: what the rank's calls returned and raised, for the parent to compare with one process.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import torch_tpu_embedding as tte

VOCAB = {"row": 1500, "tw": 600, "rep": 50, "rep2": 40}
PLACEMENT = {"row": "row", "tw": "table", "rep": "replicated", "rep2": "replicated"}


def collection(seed: int) -> tte.EmbeddingCollection:
    """The same collection in every process: tables drawn from ``seed``, float64."""
    torch.manual_seed(seed)
    tables = {n: tte.TableConfig(v, 4 if n != "tw" else 3, name=n, placement=PLACEMENT[n], combiner="sum",
                                 dtype=torch.float64) for n, v in VOCAB.items()}
    return tte.EmbeddingCollection({f"f_{n}": tte.FeatureConfig(t) for n, t in tables.items()})


def batch() -> dict[str, torch.Tensor]:
    """Ids of every table, the same on every rank."""
    g = torch.Generator().manual_seed(3)
    return {f"f_{n}": tte.Padded(torch.randint(0, v, (6, 2), generator=g), torch.ones(6, 2, dtype=torch.bool))
            for n, v in VOCAB.items()}


def main() -> None:
    dtensor, out_dir = sys.argv[1] == "1", sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    res: dict[str, Any] = {}
    ec = collection(0)
    tte.distributed.shard(ec, dtensor_state_dict=dtensor)
    res["saved"] = {k: v.clone() for k, v in tte.interop.to_torchrec_state_dict(ec).items()}  # (views, as state_dict)
    res["bag_row"] = tte.interop.to_embedding_bag(ec, "row").weight.detach()
    res["bag_tw"] = tte.interop.to_embedding_bag(ec, "tw").weight.detach()
    # Seed 1's weights into the seed-0 collection, then looked up (a lookup routes ids to each table's owner).
    tte.interop.load_torchrec_state_dict(ec, tte.interop.to_torchrec_state_dict(collection(1)))
    res["loaded"] = {k: v.clone() for k, v in tte.interop.to_torchrec_state_dict(ec).items()}
    res["lookups"] = ec(batch())
    # A state_dict that is wrong on rank 1 only: both ranks raise, neither changes a table nor waits.
    good = tte.interop.to_torchrec_state_dict(collection(2))
    bad = dict(good, **({"embedding_bags.row.weight": torch.zeros(3, 4, dtype=torch.float64)} if rank else {}))
    try:
        tte.interop.load_torchrec_state_dict(ec, bad)
    except ValueError as e:
        res["error"] = str(e)
    # A DistributedModelParallel-style value (a DTensor) is refused, not loaded as the shard it holds.
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    sharded = DTensor.from_local(good["embedding_bags.row.weight"].chunk(2)[rank].contiguous(), mesh, [Shard(0)])
    try:
        tte.interop.load_torchrec_state_dict(ec, dict(good, **{"embedding_bags.row.weight": sharded}))
    except ValueError as e:
        res["dtensor_error"] = str(e)
    res["after_error"] = {k: v.clone() for k, v in tte.interop.to_torchrec_state_dict(ec).items()}
    # One table from an nn.EmbeddingBag.
    bag = nn.EmbeddingBag.from_pretrained(good["embedding_bags.tw.weight"], mode="sum")
    tte.interop.load_embedding_bag(ec, "tw", bag)
    res["after_bag"] = tte.interop.to_torchrec_state_dict(ec)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
