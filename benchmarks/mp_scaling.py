"""Bytes each rank sends per step through a row-sharded table over a process group, at 2, 4 and 8 ranks.

``tte.distributed.shard`` with one row-sharded table (``--rows`` × ``--dim`` float32) looked up by one
feature of ``--ids`` ids per bag (uniform over the vocabulary, or Zipf(1.1) with ``--zipf``), 256
examples per rank (``--batch``), Adagrad, on gloo (CPU). Every call of torch.distributed's Python
collectives is recorded during ``--steps`` timed steps (after 2 warm-up steps): the bytes of each
collective's input (an all-to-all's input includes the block a rank keeps for itself; the column
``to others`` leaves it out). Printed per world size: bytes per rank and step, the step time (8 processes
on 2 cores time-share: the times are not a scaling measurement), and the ratios the issue asks for:
``n = 8`` against ``n = 2``, and each against ``2 · local ids · D · 4`` (the rows one rank reads and the
gradient rows it sends back, ids not counted).

Run: ``python benchmarks/mp_scaling.py`` (defaults: 200,000 × 64, 8 ids per bag, worlds 2 4 8).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_tpu_embedding as tte

NAMES = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "broadcast", "all_gather")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ids(args: argparse.Namespace, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    shape = (args.batch, args.ids)
    if not args.zipf:
        return torch.randint(0, args.rows, shape, generator=g)
    p = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(p, args.batch * args.ids, replacement=True, generator=g).reshape(shape)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    table = tte.TableConfig(args.rows, args.dim, name="t", placement="row")
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(table, max_ids_per_bag=args.ids)})
    tte.distributed.shard(ec)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    sent = {"total": 0, "others": 0}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*a: Any, **kw: Any) -> Any:
            t = a[1] if name == "all_to_all_single" else a[0]
            nbytes = t.numel() * t.element_size()
            sent["total"] += nbytes
            sent["others"] += nbytes * (world - 1) // world if name == "all_to_all_single" else nbytes
            return fn(*a, **kw)
        return counted

    def step(s: int) -> None:
        out_ = ec({"f": tte.Padded(_ids(args, s, rank))})["f"]
        opt.zero_grad()
        out_.square().mean().backward()
        opt.step()

    for s in range(2):
        step(s)
    real = {n: getattr(dist, n) for n in NAMES}
    for n, fn in real.items():
        setattr(dist, n, wrap(n, fn))
    dist.barrier()
    t0 = time.perf_counter()
    for s in range(2, 2 + args.steps):
        step(s)
    elapsed = (time.perf_counter() - t0) / args.steps
    for n, fn in real.items():
        setattr(dist, n, fn)
    torch.save({"total": sent["total"] / args.steps, "others": sent["others"] / args.steps, "time": elapsed},
               os.path.join(out, f"r{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=8, help="ids per bag")
    ap.add_argument("--batch", type=int, default=256, help="examples per rank")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--zipf", action="store_true")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    local_ids = args.batch * args.ids
    ideal = 2 * local_ids * args.dim * 4
    print(f"table {args.rows} x {args.dim} float32, {args.batch} examples x {args.ids} ids per rank "
          f"({'Zipf(1.1)' if args.zipf else 'uniform'}), {args.steps} timed steps; torch {torch.__version__}")
    print(f"2 * local ids * D * 4 = {ideal} bytes")
    print("world | bytes/rank/step (max over ranks) | to others | / (2·ids·D·4) | step ms (mean over ranks)")
    rows: dict[int, float] = {}
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_worker, args=(world, _port(), args, out), nprocs=world, start_method="spawn")
            res = [torch.load(os.path.join(out, f"r{r}.pt")) for r in range(world)]
        total = max(r["total"] for r in res)
        others = max(r["others"] for r in res)
        ms = 1000 * sum(r["time"] for r in res) / world
        rows[world] = total
        print(f"{world:5d} | {total:12.0f} | {others:12.0f} | {total / ideal:5.2f} | {ms:8.1f}", flush=True)
    if 2 in rows and 8 in rows:
        print(f"bytes n=8 / n=2: {rows[8] / rows[2]:.2f}   n=8 / (2·ids·D·4): {rows[8] / ideal:.2f}")


if __name__ == "__main__":
    sys.exit(main())
