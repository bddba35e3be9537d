"""Data parallel on the CPU (gloo): how the tables' row gradients are best exchanged.

Times a training step (forward, backward, exchange, optimizer step) of ``--tables`` tables of
``--rows`` × ``--dim`` on ``--world`` processes, each with ``--batch`` bags of ``--bag`` ids (uniform or
Zipf), for two forms of the exchange in ``torch_tpu_embedding/distributed/data_parallel.py``:

* ``coalesce`` (the library's): each rank sums its duplicate ids first (a factored SGD gradient is
  multiplied out piece by piece) and sends its distinct rows;
* ``raw``: each rank sends every looked-up row as the backward produced it (multiplied out whole).

Prints one line per (optimizer, form): median and p90 ms per step on rank 0, and the rows rank 0 sent per
step. ``--world 1`` times one process (no exchange), e.g. on the global batch for comparison.
Run: python benchmarks/data_parallel.py --world 2 --tables 4 --rows 100000 --batch 2048 --bag 20 --zipf
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _raw_local_rows(p: torch.Tensor, rg: Any, world: int, dedup: bool = True) -> Any:
    local = rg.local_part()
    if not local:
        return None
    ids, rows = local.collect()
    return ids, rows.to(p.dtype) / world


def run(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch_tpu_embedding as tte
    from torch_tpu_embedding import distributed as dp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    g = torch.Generator().manual_seed(rank)
    tables = [tte.TableConfig(args.rows, args.dim, name=f"t{i}", combiner="sum") for i in range(args.tables)]
    ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t) for i, t in enumerate(tables)})
    if args.zipf:
        weights = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** 1.05
    batches = []
    for _ in range(args.steps + args.warmup):
        if args.zipf:
            ids = [torch.multinomial(weights, args.batch * args.bag, replacement=True, generator=g)
                   for _ in tables]
        else:
            ids = [torch.randint(0, args.rows, (args.batch * args.bag,), generator=g) for _ in tables]
        batches.append({f"f{i}": tte.Padded(x.view(args.batch, args.bag)) for i, x in enumerate(ids)})
    real = dp._local_rows
    for name in args.optimizers.split(","):
        for form in ("coalesce", "raw") if args.world > 1 else ("single",):
            dp._local_rows = _raw_local_rows if form == "raw" else real  # type: ignore[assignment]
            opt = tte.optim.optimizer_class(name)(ec.parameters(), lr=0.01)
            sent: list[int] = []
            times = []
            for step, batch in enumerate(batches):
                dist.barrier()
                t = time.perf_counter()
                out = ec(batch)
                sum(v.sum() for v in out.values()).backward()
                sent.append(sum(int(dp._local_rows(p, p_rg, 1)[0].numel())  # type: ignore[index]
                                for p, p_rg in [(t_.weight, t_.row_grad) for t_ in ec.physical_tables().values()])
                            if step == args.warmup - 1 and args.world > 1 else 0)
                opt.step()
                opt.zero_grad()
                if step >= args.warmup:
                    times.append((time.perf_counter() - t) * 1e3)
            times.sort()
            if rank == 0:
                p90 = times[int(0.9 * (len(times) - 1))]
                print(f"{name:10s} {form:9s} median {statistics.median(times):8.1f} ms  p90 {p90:8.1f} ms  "
                      f"rows sent by rank 0 {max(sent):>9,}", flush=True)
    dp._local_rows = real  # type: ignore[assignment]
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--bag", type=int, default=20)
    ap.add_argument("--zipf", action="store_true", help="Zipf(1.05) ids instead of uniform")
    ap.add_argument("--optimizers", default="sgd,adagrad")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print(f"{args.world} processes, {args.tables} tables {args.rows:,} x {args.dim}, {args.batch} bags x "
          f"{args.bag} ids per process, {'zipf' if args.zipf else 'uniform'}, {args.threads} thread(s)", flush=True)
    mp.start_processes(run, args=(args, 29800 + os.getpid() % 100), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
