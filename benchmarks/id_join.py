"""The host's share of moving a stacked group's host ids to an accelerator: the C join against torch's ops.

Run (from the repository root; under a minute, no accelerator needed):

    OMP_WAIT_POLICY=PASSIVE python benchmarks/id_join.py [--iters 40] [--threads 1]

For host ids bound for an accelerator's table (XLA, CUDA), ``EmbeddingCollection.forward`` joins a stacked group's
features' ids on the host before one transfer. Two ways, in one process, alternating call by call:

* **torch**: the torch ops' join (``torch.stack`` of the ids and of the masks, feature-major; ``aminmax`` and its two
  host reads; for CUDA the copy into pinned memory that a non-blocking transfer needs, here ``pin_memory`` where a
  GPU is visible, else a ``clone`` of the same bytes standing in for it); the mask, shift and padding are then the
  device's ops;
* **c**: ``optim/_kernels/c_gather.join_ids`` (one pass: shifted, padding written as the padding id, checked per
  table, int32; for CUDA written into pinned memory where a GPU is visible).

Workloads: **cuda** is issue [host]'s GPU step (4 features × 16,384 bags × 20 ids, no mask, 2,000,000 rows per
table); **xla** is ``benchmarks/host_ops.py``'s T = 100 (100 features × 256 bags × 4 ids, a quarter masked out, 1,000
rows per table). Each call's host time (``time.perf_counter``), median over ``--iters`` calls after 5, on data that
a 64 MiB buffer written between calls has pushed out of the caches (``--warm``: not). Prints ms per call and
c / torch. The bytes to move: torch's int64 ids (and bool masks), c's int32 ids.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host_ops import cpu_model  # noqa: E402  (this folder: the script's own, first on sys.path)

from torch_tpu_embedding.optim._kernels import c_library  # noqa: E402
from torch_tpu_embedding.optim._kernels.c_gather import join_ids  # noqa: E402

WORKLOADS = {"cuda": (4, 16_384, 20, False, 2_000_000), "xla": (100, 256, 4, True, 1_000)}


def _data(f: int, b: int, width: int, masked: bool, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, rows, (b, width), generator=g) for _ in range(f)]
    masks = [torch.rand(b, width, generator=g) > 0.25 for _ in range(f)] if masked else None
    return ids, masks


def torch_join(ids: list[torch.Tensor], masks: list[torch.Tensor] | None, rows: int, pinned: bool) -> int:
    joined = torch.stack(ids)  # (feature-major, as modules/assembly.py joins for another device)
    mask = torch.stack(masks) if masks is not None else None
    lo, hi = torch.aminmax(joined)
    assert int(lo) >= 0 and int(hi) < rows
    if pinned:  # the copy a non-blocking transfer from pageable memory needs
        joined = joined.pin_memory() if torch.cuda.is_available() else joined.clone()
    return joined.numel() * 8 + (0 if mask is None else mask.numel())


def c_join(ids: list[torch.Tensor], masks: list[torch.Tensor] | None, rows: int, pinned: bool) -> int:
    f, shape = len(ids), tuple(ids[0].shape)
    out = join_ids(ids, shape, [rows * i for i in range(f)], [rows] * f, masks, rows * f, True,
                   pinned and torch.cuda.is_available())
    assert out is not None
    return out.numel() * out.element_size()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warm", action="store_true", help="no cache flush between calls")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if c_library.library() is None:
        sys.exit("no C compiler builds the kernel library here")
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, threads {args.threads}, "
          f"{'warm' if args.warm else 'cold'} caches")
    junk = None if args.warm else torch.zeros(64 << 18)
    for name, (f, b, width, masked, rows) in WORKLOADS.items():
        ids, masks = _data(f, b, width, masked, rows)
        ways: dict[str, Any] = {"torch": torch_join, "c": c_join}
        times: dict[str, list[float]] = {k: [] for k in ways}
        moved: dict[str, int] = {}
        for i in range(5 + args.iters):
            for way, fn in ways.items():
                if junk is not None:
                    junk.add_(1)
                start = time.perf_counter()
                moved[way] = fn(ids, masks, rows, name == "cuda")
                if i >= 5:
                    times[way].append((time.perf_counter() - start) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{name}: {f} features × {b} bags × {width} ids{' (masked)' if masked else ''}: "
              + ", ".join(f"{k} {med[k]:.3f} ms ({min(v):.3f}–{max(v):.3f}), {moved[k] / 2**20:.2f} MiB to move"
                          for k, v in times.items())
              + f"; c / torch {med['c'] / med['torch']:.2f}")


if __name__ == "__main__":
    main()
