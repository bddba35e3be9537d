"""One GPU training step: every optimizer of ours against torch's sparse ones and the step's memory floor.

Run (from the repository root, where a GPU is visible; a few minutes):

    python benchmarks/cuda_step.py [--tables 4] [--rows 2000000] [--dim 128] [--batch 16384] [--ids 20]
        [--iters 20] [--optimizers sgd adagrad lazyadam ...]

Smoke test on the CPU (sizes only, no GPU figures): ``... --device cpu --rows 1000 --batch 64 --iters 2``.

Workload (issue [host]): 4 tables × 2,000,000 rows × 128 float32, one feature each, stacked (the default
construction), ``Padded`` host ids ``[16384, 20]`` uniform random, ``mean``; ``concat=True``; one step =
forward + ``out.sum().backward()`` + ``step()`` + ``zero_grad()``. Peers, in the same process and on the
same ids (moved to the GPU, as ours are by the lookup): ``nn.EmbeddingBag(mode="mean", sparse=True)`` per
table + ``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam``. The floor: the rows a step must read and write,
measured — ``index_select`` of every looked-up row of every table into a buffer and ``index_copy_`` of the
distinct ones back (weights only, no optimizer slots) at torch's own kernels' speed. Times: CUDA events
around each step, median (p10–p90) of ``--iters`` steps after 5 warm-up steps (past ``TTE_KERNEL_AFTER``,
set to 2 here). Then each steady step of ours once more under ``torch.cuda.set_sync_debug_mode("error")``:
"sync-free" or the error it raised (a host–device sync). Adafactor three times: ``adafactor`` is its compiled
update (``Path.KERNEL``, one kernel, since 2026-11-30); ``adafactor_rows`` the uncompiled one it replaced
(``Path.ROWS``, some fifteen element-wise passes over ``[N, D]``), its per-table sums spread over lanes
(``contract.spreads``); ``adafactor_index_add`` that path with the sums by plain ``index_add`` (CUDA's atomic adds
on a few addresses), as before the lanes: each change measured in one run.

Goals (printed, not asserted): SGD, Adagrad and LazyAdam ≤ 0.5× torch's sparse SGD, Adagrad and
SparseAdam; every optimizer ≤ 4× the floor; every steady step sync-free. Record the GPU, torch version and
commit with the figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

OURS = {"sgd": ("SGD", {}), "adagrad": ("Adagrad", {}), "lazyadam": ("LazyAdam", {}), "adam": ("Adam", {}),
        "ftrl": ("FTRL", {}), "rowwise_adagrad": ("RowWiseAdagrad", {}), "adagrad_momentum": ("AdagradMomentum", {}),
        "adafactor": ("Adafactor", {}), "adafactor_rows": ("Adafactor", {}), "adafactor_index_add": ("Adafactor", {})}
#: run with a stacked group's per-member sums by plain ``index_add`` (atomic adds on CUDA), as before they were
#: spread over lanes there (``optim/_core/contract.py``, ``spreads``): the two measured in the same run
INDEX_ADD = {"adafactor_index_add"}
#: run without the compiled update (``Path.ROWS``, the reference path), as Adafactor ran before it had one
UNCOMPILED = {"adafactor_rows", "adafactor_index_add"}
PEERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "lazyadam": torch.optim.SparseAdam}


#: the host's time to dispatch each timed step (ms), by label: a step whose host time nears its device time is
#: bound by the host (Python and dispatch), not by the GPU
HOST_MS: dict[str, list[float]] = {}
#: ms per step of ``--iters`` steps run back to back (no synchronisation between them), by label
BACK_TO_BACK: dict[str, float] = {}


def _timed(step: Callable[[int], Any], iters: int, device: torch.device, label: str = "") -> list[float]:
    for i in range(5):
        step(i)
    out, host = [], []
    for i in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            step(i)
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step(i)
            out.append((time.perf_counter() - t0) * 1e3)
            host.append(out[-1])
    HOST_MS[label] = sorted(host)
    if device.type == "cuda":  # back to back, as a training loop runs them: the host runs ahead of the device
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(iters):
            step(i)
        end.record()
        end.synchronize()
        BACK_TO_BACK[label] = start.elapsed_time(end) / iters
    return sorted(out)


def _profile(step: Callable[[int], Any], label: str, path: str, device: torch.device) -> None:
    """Three steady steps under torch.profiler; the kernels (or, on the CPU, the ops) by total time, appended to
    ``path``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for i in range(3):
            step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70)
    except (AttributeError, KeyError, ValueError):
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
    host = ""
    if device.type == "cuda":  # where the host's time goes (a step the host bounds: SGD's)
        host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70)
    with open(path, "a") as fh:
        fh.write(f"== {label}: 3 steps\n{table}\n" + (f"-- {label}, by the host's time\n{host}\n" if host else ""))


def _summary(ms: list[float]) -> str:
    return f"{statistics.median(ms):8.2f} ({ms[len(ms) // 10]:.2f}–{ms[-1 - len(ms) // 10]:.2f})"


def _floor(ring: list[dict[str, torch.Tensor]], names: list[str], args: argparse.Namespace,
           dev: torch.device) -> list[float]:
    """Every looked-up row read, every distinct row written back (weights only), timed."""
    w = torch.empty(args.tables * args.rows, args.dim, device=dev)
    dev_ids = [torch.cat([b[f].reshape(-1) + i * args.rows for i, f in enumerate(names)]).to(dev) for b in ring]
    distinct = [torch.unique(i) for i in dev_ids]
    buf = torch.empty(dev_ids[0].numel(), args.dim, device=dev)

    def step(i: int) -> None:
        torch.index_select(w, 0, dev_ids[i % 4], out=buf)
        w.index_copy_(0, distinct[i % 4], buf[: distinct[i % 4].numel()])

    return _timed(step, args.iters, dev, "floor")


def _never(x: torch.Tensor) -> bool:
    """``spreads`` for the ``INDEX_ADD`` runs: every per-member sum by plain ``index_add``."""
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16_384)
    ap.add_argument("--ids", type=int, default=20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--optimizers", nargs="+", default=list(OURS), choices=list(OURS))
    ap.add_argument("--profile", default="", help="a file: append each step's torch.profiler table to it")
    args = ap.parse_args()
    os.environ.setdefault("TTE_KERNEL_AFTER", "2")
    import torch_tpu_embedding as tte
    from torch_tpu_embedding.optim._core import contract
    from torch_tpu_embedding.optim._kernels import kernel_policy

    chosen, compiled = contract.spreads, kernel_policy.enabled()

    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke test: no GPU figures)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"device {name}, torch {torch.__version__}, commit {commit or '?'}")
    g = torch.Generator().manual_seed(0)
    names = [f"f{i}" for i in range(args.tables)]
    ring = [{f: torch.randint(0, args.rows, (args.batch, args.ids), generator=g) for f in names} for _ in range(4)]
    results: dict[str, list[float]] = {}

    results["floor"] = _floor(ring, names, args, dev)
    print(f"floor {_summary(results['floor'])}", flush=True)

    for opt_name in args.optimizers:
        cls_name, kw = OURS[opt_name]
        torch.manual_seed(0)
        features = {f: tte.FeatureConfig(tte.TableConfig(args.rows, args.dim, name=f"t{f}", combiner="mean"),
                                         max_ids_per_bag=args.ids) for f in names}
        ec = tte.EmbeddingCollection(features, device=dev)
        opt = getattr(tte.optim, cls_name)(ec.parameters(), lr=0.01, **kw)
        contract.spreads = _never if opt_name in INDEX_ADD else chosen  # (set for every run: none inherits it)
        kernel_policy.set_enabled(compiled and opt_name not in UNCOMPILED)
        inputs = [{f: tte.Padded(b[f]) for f in names} for b in ring]

        def ours(i: int, ec: Any = ec, opt: Any = opt, inputs: Any = inputs) -> None:
            ec(inputs[i % 4], concat=True).sum().backward()
            opt.step()
            opt.zero_grad()

        try:
            results[f"ours {opt_name}"] = _timed(ours, args.iters, dev, f"ours {opt_name}")
        except Exception as e:  # (one optimizer's failure reported, the others still measured)
            print(f"ours {opt_name} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            continue
        print(f"ours {opt_name} {_summary(results[f'ours {opt_name}'])}", flush=True)
        if args.profile:
            _profile(ours, f"ours {opt_name}", args.profile, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                ours(0)
                verdict = "sync-free"
            except RuntimeError as e:
                verdict = f"syncs: {str(e).splitlines()[0][:120]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            print(f"  ours {opt_name}: steady step {verdict}")
        del ec, opt
        if opt_name in PEERS:
            torch.manual_seed(0)
            bags = torch.nn.ModuleList(torch.nn.EmbeddingBag(args.rows, args.dim, mode="mean", sparse=True)
                                       for _ in names).to(dev)
            peer = PEERS[opt_name](bags.parameters(), lr=0.01)

            def theirs(i: int, bags: Any = bags, peer: Any = peer) -> None:
                b = ring[i % 4]
                sum(bag(b[f].to(dev, non_blocking=True)).sum() for bag, f in zip(bags, names, strict=True)).backward()
                peer.step()
                peer.zero_grad()

            results[f"torch {opt_name}"] = _timed(theirs, args.iters, dev, f"torch {opt_name}")
            print(f"torch {opt_name} {_summary(results[f'torch {opt_name}'])}", flush=True)
            if args.profile:
                _profile(theirs, f"torch {opt_name}", args.profile, dev)
            del bags, peer
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    print(f"{args.tables} tables × {args.rows:,} × {args.dim}, batch {args.batch} × {args.ids} ids, mean; "
          f"ms per step: each step timed alone, median (p10–p90) of {args.iters}; the host's dispatch time of the "
          "same steps; the mean of the same number run back to back")
    for label, ms in results.items():
        b2b = f"   back to back {BACK_TO_BACK[label]:6.2f}" if label in BACK_TO_BACK else ""
        print(f"  {label:<24s} {_summary(ms)}   host {_summary(HOST_MS[label])}{b2b}")
    for title, of in (("each step alone", lambda k: statistics.median(results[k])),
                      ("back to back", lambda k: BACK_TO_BACK[k])):
        if title == "back to back" and not BACK_TO_BACK:
            continue
        print(f"ratios, {title}:")
        floor = of("floor")
        for opt_name in [o for o in args.optimizers if f"ours {o}" in results]:
            mine = of(f"ours {opt_name}")
            line = f"  {opt_name:<18s} {mine / floor:5.2f}× the floor (goal ≤ 4)"
            if f"torch {opt_name}" in results:
                line += f", {mine / of(f'torch {opt_name}'):5.2f}× torch's sparse (goal ≤ 0.5)"
            print(line)


if __name__ == "__main__":
    main()
