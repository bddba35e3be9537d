"""The kernel library's C row loops alone, on rows scattered over a large table: what an eager CPU step's memory costs.

Run (from the repository root; under a minute, 3.7 GB of memory: the table and Adam's two slots; one thread):

    OMP_WAIT_POLICY=PASSIVE python benchmarks/row_loops.py [--rows 4000000] [--dim 64] [--ids 16384] [--iters 60]

To compare two commits, run it from each checkout in turn, several times alternating: it imports its own checkout's
package, whose library is built from that checkout's source (``optim/_kernels/c_rules_source.py``) and kept by its
hash.

Workload: a float32 table of ``--rows`` × ``--dim`` on huge pages (as the library allocates tables) and a
RowWiseAdagrad accumulator and two Adam slots of its rows; ``--ids`` uniform random ids (1 id per bag of 4 tables of
4,096 in ``benchmarks/eager_cpu.py``). Before each timed call 64 MiB are written, so that the rows come from memory as a
step finds them (the user's ``torch.cat`` and the rest of a step pass between the lookup and the update). Timed, median
(p25–p75) of ``--iters`` calls, ms per ``--ids`` rows:

* ``gather``: the lookup's row gather (``tte_gather_rows``), the ids in random order;
* ``rowwise_adagrad``, ``adam``: the update loops over the distinct ids, sorted, one broadcast gradient row (as
  ``loss = out.sum()`` gives), scaled to ``--ids`` rows;
* ``gather + rowwise_adagrad``: the two on the same rows in turn, as one step does.

Prints the CPU model with the figures (record both in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package

from host_ops import cpu_model  # noqa: E402  (this folder: the script's own, first on sys.path)

from torch_tpu_embedding._util.huge_pages import empty  # noqa: E402
from torch_tpu_embedding.optim._kernels import c_library  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=16_384)
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lib = c_library.library()
    if lib is None:
        raise SystemExit("the kernel library cannot be built here (no C compiler)")
    r, d, n = args.rows, args.dim, args.ids
    p = empty((r, d), dtype=torch.float32)
    p.normal_()
    acc, mom, vel = (empty(shape, dtype=torch.float32).zero_() for shape in ((r,), (r, d), (r, d)))
    g = torch.empty(d)
    src = torch.ones(1, d).expand(n, d)  # one gradient row for every id (stride 0)
    rw_hp = torch.tensor([0.01, 1e-8, 0.0])
    adam_hp = torch.tensor([0.01, 0.9, 0.1, 0.999, 0.001, 1e-8, 0.0])
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    out = torch.empty(n, d)

    def ok(rc: int, name: str) -> None:
        if rc:  # (-1: the loop refused its arguments and wrote nothing; a time of that would mean nothing)
            raise SystemExit(f"{name} returned {rc}")

    def rowwise(u: torch.Tensor) -> None:
        ok(lib.rowwise_adagrad(p.data_ptr(), acc.data_ptr(), r, d, u.data_ptr(), u.numel(), None, None, None,
                               src.data_ptr(), 0, 0, n, rw_hp.data_ptr(), g.data_ptr()), "rowwise_adagrad")

    def adam(u: torch.Tensor) -> None:
        ok(lib.adam(p.data_ptr(), mom.data_ptr(), vel.data_ptr(), r, d, u.data_ptr(), u.numel(), None, None, None,
                    src.data_ptr(), 0, 0, n, adam_hp.data_ptr(), g.data_ptr()), "adam")

    def gather(ids: torch.Tensor) -> None:
        ok(lib.gather(out.data_ptr(), p.data_ptr(), r, d * 4, ids.data_ptr(), ids.numel()), "gather")

    # each run: (call, the ids distinct and sorted as the update takes them); the gather's ids in random order
    runs: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], None], bool]] = {
        "gather": (lambda ids, order: gather(ids), False),
        "rowwise_adagrad": (lambda ids, order: rowwise(ids), True),
        "adam": (lambda ids, order: adam(ids), True),
        "gather + rowwise_adagrad": (lambda ids, order: (gather(order), rowwise(ids))[0], True)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.iters):
        for name, (fn, distinct) in runs.items():
            ids = torch.randint(0, r, (n,))
            if distinct:
                ids = ids.unique()
            order = ids[torch.randperm(ids.numel())]
            flush.fill_(i % 251)
            t0 = time.perf_counter()
            fn(ids, order)
            times[name].append((time.perf_counter() - t0) * 1e3 * n / ids.numel())
    print(f"CPU {cpu_model()}; torch {torch.__version__}; {r:,} × {d} float32 on huge pages, {n:,} ids, 1 thread; "
          f"ms per {n:,} rows, median (p25–p75) of {args.iters}, 64 MiB written before each call")
    for name, ms in times.items():
        q = statistics.quantiles(ms, n=4)
        print(f"  {name:26s} {statistics.median(ms):7.3f} ({q[0]:.3f}–{q[2]:.3f})")


if __name__ == "__main__":
    main()
