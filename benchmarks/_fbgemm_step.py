"""One FBGEMM TBE contender of ``benchmarks/eager_cpu.py``, plus the input builder and timing loop it shares.

Run by ``eager_cpu.py`` with the Python of a separate virtualenv (torch 2.13.0+cpu and
fbgemm-gpu-cpu 1.8.0, which do not install next to torch 2.9.0); it needs only torch and fbgemm_gpu,
not this package. It times raw ``SplitTableBatchedEmbeddingBagsCodegen`` on the CPU (no TorchRec), the
optimizer fused into the backward, and prints one line ``RESULT {json}``.

Run: <fbgemm venv>/bin/python benchmarks/_fbgemm_step.py --optimizer rowwise_adagrad --bag 20 --threads 1

``make_batches`` and ``time_steps`` are imported by ``eager_cpu.py`` too: every contender sees the same
ids (same seed) and the same timing loop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


def make_batches(
    tables: int, rows: int, batch: int, bag: int, nbatches: int, seed: int = 0
) -> list[list[torch.Tensor]]:
    """``nbatches`` batches of ``tables`` flat int64 id tensors ``[batch * bag]``, uniform in [0, rows)."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, rows, (batch * bag,), generator=g) for _ in range(tables)] for _ in range(nbatches)]


def percentile(sorted_ms: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    pos = q * (len(sorted_ms) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


#: set by eager_cpu.py --paired: the child serves bursts of timed steps on request (see time_steps)
SERVE = "TTE_BENCH_SERVE"


def time_steps(step: Callable[[Any], object], batches: list[Any], warmup: int, iters: int,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``warmup + iters`` steps over the ring of pre-built ``batches``; ms/step of the timed ones.

    Also counts minor page faults per timed step: memory the allocator gave back to the OS and takes
    again (glibc trims freed heap above its trim threshold), paid on every step that allocates it.

    With ``TTE_BENCH_SERVE=1`` (``eager_cpu.py --paired``) it runs the warm-up, prints ``READY``, then times
    ``iters`` more steps for every ``run`` line on stdin, printing ``RESULT {json}`` for each, until ``exit``;
    it returns the last burst's result. ``extra``: what each burst's line adds (the first step's time is the
    warm-up's).
    """
    res = _timed(step, batches, warmup, iters, 0)
    if os.environ.get(SERVE) != "1":
        return res
    print("READY", flush=True)
    done = warmup + iters
    for line in sys.stdin:
        if line.strip() != "run":
            break
        res = {**_timed(step, batches, 0, iters, done), "first_step_ms": res["first_step_ms"]}
        done += iters
        print("RESULT " + json.dumps({**res, **environment(), **(extra or {})}), flush=True)
    return res


def _timed(step: Callable[[Any], object], batches: list[Any], warmup: int, iters: int, start: int) -> dict[str, Any]:
    times = []
    faults = 0
    first_ms = 0.0
    for i in range(start, start + warmup + iters):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        step(batches[i % len(batches)])
        t1 = time.perf_counter()
        if i == 0:
            first_ms = 1000 * (t1 - t0)  # ours: the reference path (optim/_kernels/kernel_policy.py's policy)
        if i >= start + warmup:
            times.append(1000 * (t1 - t0))
            faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    times.sort()
    return {"median_ms": percentile(times, 0.5), "p10_ms": percentile(times, 0.1),
            "p90_ms": percentile(times, 0.9), "iters": iters, "warmup": warmup,
            "page_faults_per_step": faults / max(iters, 1), "first_step_ms": first_ms}


def environment() -> dict[str, Any]:
    """What every result records: torch version, torch threads, OpenMP settings, peak RSS."""
    return {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "<unset>"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "<unset>"),
            "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", ""),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload flags every contender of eager_cpu.py shares (the FBGEMM child takes the same)."""
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--nbatches", type=int, default=4, help="ring of pre-built batches")
    ap.add_argument("--lr", type=float, default=0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=OPTIMIZERS, required=True)
    ap.add_argument("--bag", type=int, default=1)
    ap.add_argument("--pool", choices=("sum", "mean"), required=True)
    add_workload_args(ap)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import fbgemm_gpu
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    optim = {"sgd": EmbOptimType.EXACT_SGD, "adagrad": EmbOptimType.EXACT_ADAGRAD,
             "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[args.optimizer]
    t, b, n = args.tables, args.batch, args.bag
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(args.rows, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for _ in range(t)],
        optimizer=optim,
        learning_rate=args.lr,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM if args.pool == "sum" else PoolingMode.MEAN,
    )
    offsets = torch.arange(0, t * b * n + 1, n, dtype=torch.int64)  # one bag per (table, example)
    batches = [torch.cat(ids) for ids in make_batches(t, args.rows, b, n, args.nbatches)]
    first = tbe(batches[0], offsets)
    if tuple(first.shape) != (b, t * args.dim):
        raise SystemExit(f"unexpected TBE output shape {tuple(first.shape)}")
    before = tbe.split_embedding_weights()[0][batches[0][0]].clone()
    first.sum().backward()  # the optimizer runs inside the backward
    if torch.equal(before, tbe.split_embedding_weights()[0][batches[0][0]]):
        raise SystemExit("FBGEMM TBE did not update a looked-up row")

    def step(ids: torch.Tensor) -> None:
        tbe(ids, offsets).sum().backward()

    extra = {"fbgemm_gpu": fbgemm_gpu.__version__, "optimizer": optim.name}
    res = time_steps(step, batches, args.warmup, args.iters, extra)
    res.update(environment(), **extra)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
