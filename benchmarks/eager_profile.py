"""Where an eager CPU training step of eager_cpu.py's workload spends its time: forward, backward and
``opt.step()`` timed separately, the same ids' gather + scatter floor (eager_cpu.py's), and the
step's top operators from ``torch.profiler``.

Run (from the repository root):

    OMP_WAIT_POLICY=PASSIVE python benchmarks/eager_profile.py --optimizer Adagrad --bag 20 [--threads 1]
        [--rows 1000000] [--iters 10] [--kernel 0|1]

``--concat`` looks the features up with ``concat=True`` (one ``[B, T·D]``, FBGEMM's output layout) instead of the
per-feature dict and the caller's ``torch.cat`` of it, which the forward's time then includes; ``--concat --copy``
copies that output (``.clone()``) before the loss: a copy as large as the dict mode's ``torch.cat``, without the dict.

``--kernel 0`` runs the uncompiled reference update (``TTE_UPDATE_KERNEL=0``) for comparison; with
``--kernel 1`` the kernel path runs from the first call (``set_policy(after=0)``; the first warm-up step
compiles).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from _fbgemm_step import add_workload_args, make_batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", default="Adagrad", help="a tte.optim class name")
    ap.add_argument("--bag", type=int, default=20, help="ids per bag: 1 → sum, more → mean")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernel", type=int, default=1, choices=(0, 1))
    ap.add_argument("--top", type=int, default=12, help="operators listed from the profile")
    ap.add_argument("--concat", action="store_true", help="ec(batch, concat=True), not the dict and a torch.cat")
    ap.add_argument("--copy", action="store_true",
                    help="with --concat: the [B, T·D] output copied (.clone()) before the loss, a copy of the size the "
                         "dict mode's torch.cat makes (what that copy costs, apart from the dict)")
    add_workload_args(ap)
    args = ap.parse_args()
    os.environ["TTE_UPDATE_KERNEL"] = str(args.kernel)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    import torch_tpu_embedding as tte
    from torch_tpu_embedding.optim._kernels import kernel_policy

    # The kernel path from the first call (its default policy keeps the first TTE_KERNEL_AFTER calls on the
    # reference path): the steps profiled are those of a long run. The first warm-up step compiles.
    kernel_policy.set_policy(after=0)
    t, b, n = args.tables, args.batch, args.bag
    pool = "sum" if n == 1 else "mean"
    tables = [tte.TableConfig(args.rows, args.dim, name=f"t{i}", combiner=pool) for i in range(t)]
    features = {f"f{i}": tte.FeatureConfig(tables[i], max_ids_per_bag=n if n > 1 else None) for i in range(t)}
    ec = tte.EmbeddingCollection(features)
    opt = getattr(tte.optim, args.optimizer)(ec.parameters(), lr=args.lr)
    opt.init_state()
    raw = make_batches(t, args.rows, b, n, args.nbatches)
    batches = [{f"f{i}": (ids[i] if n == 1 else tte.Padded(ids[i].view(b, n))) for i in range(t)} for ids in raw]
    names = sorted(features)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "floor": []}

    def step(batch: dict[str, Any], record: bool) -> None:
        t0 = time.perf_counter()
        if args.concat:  # [B, T·D] straight from the lookup, features in ec.feature_names order (= names)
            out = ec(batch, concat=True)
            loss = (out.clone() if args.copy else out).sum()
        else:
            out = ec(batch)
            loss = torch.cat([out[f] for f in names], dim=1).sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if record:
            for k, v in zip(("forward", "backward", "step"), (t1 - t0, t2 - t1, t3 - t2), strict=True):
                phases[k].append(1000 * v)

    for i in range(args.warmup + args.iters):
        step(batches[i % len(batches)], i >= args.warmup)
    weights = [torch.randn(args.rows, args.dim) for _ in range(t)]
    rows = [torch.empty(ids.numel(), args.dim) for ids in raw[0]]
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        for w, ids, r in zip(weights, raw[i % len(raw)], rows, strict=True):
            torch.index_select(w, 0, ids, out=r)
            w.index_copy_(0, ids, r)
        if i >= args.warmup:
            phases["floor"].append(1000 * (time.perf_counter() - t0))
    print(f"{args.optimizer}, {n} id{'s' if n > 1 else ''}/bag, {args.threads} thread(s), kernel={args.kernel}, "
          f"{('concat=True + a copy' if args.copy else 'concat=True') if args.concat else 'dict + torch.cat'}, "
          f"{t} × {args.rows:,} × {args.dim}, batch {b}; load average {os.getloadavg()[0]:.1f}")
    for k, v in phases.items():
        print(f"  {k:9s} median {statistics.median(v):8.1f} ms  (min {min(v):.1f}, max {max(v):.1f})")
    total = sum(statistics.median(phases[k]) for k in ("forward", "backward", "step"))
    print(f"  step total / floor (gather + scatter): {total / statistics.median(phases['floor']):.2f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(3):
            step(batches[i % len(batches)], False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
