"""Should a table sharded over a process group be a DTensor ``Shard(0)``? What it costs and what it serves,
measured on 2 gloo processes (docs/sharding.md, "DTensor or plain shards").

Run: ``PYTHONPATH=. python benchmarks/mp_dtensor.py`` (2 processes on the CPU, about a minute).

1. The owner's two row operations of a step (``index_select`` of the rows asked for, ``index_add_`` of
   their gradients) on the rank's shard as a plain tensor, and on the same shard as a DTensor ``Shard(0)``
   given local row numbers (``to_local()`` first, as the library would have to) and given global row
   numbers (DTensor's own semantics): time per call, and the collectives DTensor issues
   (``CommDebugMode``).
2. ``torch.distributed.checkpoint``: a state_dict of plain local shards (the default ``state_dict()`` of a
   sharded table) saved by both ranks and loaded back, against a DTensor ``Shard(0)`` of the same rows:
   what each rank reads back.
3. ``state_dict()`` and ``dcp.save`` of a row-sharded table with its entry as the stored rows and as a
   DTensor ``Shard(0)`` of its logical rows (``tte.distributed.shard(..., dtensor_state_dict=True)``).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

ROWS, DIM, IDS, REPEAT = 200_000, 64, 4096, 200


def _timed(fn: Any) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(REPEAT):
        fn()
    return (time.perf_counter() - start) / REPEAT * 1e6


def _ops(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    local = torch.randn(ROWS // world, DIM, generator=torch.Generator().manual_seed(rank))
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, ROWS // world, (IDS,), generator=g)
    rows = torch.randn(IDS, DIM, generator=g)
    out: dict[str, Any] = {
        "plain index_select us": _timed(lambda: local.index_select(0, ids)),
        "plain index_add_ us": _timed(lambda: local.index_add_(0, ids, rows)),
        "DTensor to_local()+index_select us": _timed(lambda: dt.to_local().index_select(0, ids)),
        "DTensor to_local()+index_add_ us": _timed(lambda: dt.to_local().index_add_(0, ids, rows)),
    }
    wanted = torch.randint(0, ROWS, (IDS,), generator=torch.Generator().manual_seed(99))  # global row numbers
    every = DTensor.from_local(wanted, mesh, [Replicate()], run_check=False)
    for name, op in (("index_select", lambda: dt.index_select(0, every)),
                     ("embedding", lambda: torch.nn.functional.embedding(every, dt))):
        with CommDebugMode() as comm:
            start = time.perf_counter()
            got = op().full_tensor()  # the rows asked for, on every rank
            out[f"DTensor {name} (global ids) us"] = (time.perf_counter() - start) * 1e6
        out[f"DTensor {name} collectives"] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
        out[f"DTensor {name} rows right"] = bool(torch.equal(got, dt.full_tensor()[wanted]))
    return out


def _dcp(rank: int, world: int, path: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    mine = torch.full((4, 2), float(rank + 1))  # rank r's shard holds r + 1 everywhere
    dcp.save({"plain": mine.clone(), "dtensor": DTensor.from_local(mine.clone(), mesh, [Shard(0)])},
             checkpoint_id=path)
    back = {"plain": torch.zeros(4, 2),
            "dtensor": DTensor.from_local(torch.zeros(4, 2), mesh, [Shard(0)])}
    dcp.load(back, checkpoint_id=path)
    return {"plain shard read back (own value: %d)" % (rank + 1): back["plain"][0, 0].item(),
            "DTensor shard read back": back["dtensor"].to_local()[0, 0].item()}


def _state_dict(rank: int, world: int, path: str) -> dict[str, Any]:
    """A row-sharded table of ROWS x DIM built on the meta device: ``state_dict()`` and ``dcp.save`` with its
    entry as the stored rows (plain) and as a DTensor Shard(0) of its logical rows."""
    import torch_tpu_embedding as tte

    out: dict[str, Any] = {}
    for as_dtensor in (False, True):
        config = tte.TableConfig(ROWS, DIM, name="t", placement="row")
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(config)}, device="meta")
        tte.distributed.shard(ec, dtensor_state_dict=as_dtensor)
        kind = "DTensor" if as_dtensor else "plain"
        out[f"state_dict() {kind} ms"] = _timed_ms(ec.state_dict)
        sd = ec.state_dict()
        start = time.perf_counter()
        dcp.save(sd, checkpoint_id=os.path.join(path, kind))
        out[f"dcp.save {kind} ms"] = (time.perf_counter() - start) * 1e3
    return out


def _timed_ms(fn: Any, repeat: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def _worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {"ops": _ops(rank, world), "dcp": _dcp(rank, world, os.path.join(path, "ckpt")),
              "state_dict": _state_dict(rank, world, path)}
    torch.save(result, os.path.join(path, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as path:
        mp.start_processes(_worker, args=(2, port, path), nprocs=2, start_method="spawn")
        print(f"torch {torch.__version__}, {ROWS} x {DIM} float32 table over 2 gloo ranks, {IDS} ids per call")
        for r in range(2):
            res = torch.load(os.path.join(path, f"rank{r}.pt"), weights_only=False)
            for part in ("ops", "dcp", "state_dict"):
                for k, v in res[part].items():
                    print(f"rank {r} {k}: {v:.1f}" if isinstance(v, float) and part != "dcp" else f"rank {r} {k}: {v}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
