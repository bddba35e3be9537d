"""Eager CPU training step: ours vs torch's sparse optimizers, FBGEMM TBE, dense Adam and a measured floor.

Run (from the repository root; 15–30 min at full size with 2 thread counts, 6 GB of memory at most):

    OMP_WAIT_POLICY=PASSIVE python benchmarks/eager_cpu.py [--threads 1 2] [--rows 1000000] [--iters 20]
        [--bags 1 20] [--modes ours_lazyadam torch_sparseadam ...] [--no-fbgemm]

Quick check: ``... --rows 100000 --iters 3 --threads 1``.

Ranges: ``--rounds N`` runs every contender N times, round by round (all of them once, then again), and prints
each goal's ratio per round: the ratio of two contenders measured minutes apart moves with the machine (on
cloud VMs, FBGEMM's step and ours each by 30 % or more between runs), and the rounds show its range.
``--paired N`` starts every contender once (all held in memory at once, each idle while another runs) and
takes N rounds of one burst of ``--iters`` steps each, the order reversed every other round: the contenders
of a round run seconds apart, so the machine's drift moves both sides of a ratio alike. The table then gives
each contender's median over the bursts (p10–p90 of the bursts' medians).

Many tables: ``... --mixed --dim 16 --bags 1 --threads 2 --modes ours_adagrad ours_adagrad_unstacked
ours_lazyadam ours_lazyadam_unstacked``: 26 tables of mixed sizes (Criteo's 26 categorical features
capped at 1,000,000 rows, 5.6 M rows in all), ours built the default way (tables stacked) against
``stack_tables=False``; goal: stacked ≤ unstacked.

First steps: ``... --first-step`` adds, for every ``ours_*`` mode, the same run with
``TTE_UPDATE_KERNEL=0`` (``ours_*_reference``, the reference row update throughout) and prints each
one's first step: ours under the default policy of ``optim/_kernels/kernel_policy.py`` (the reference path for
the first ``TTE_KERNEL_AFTER`` calls: no compile) against the reference run's (goal ≤ 1.5×), and the
first call of the kernel path, which compiles (``TORCHINDUCTOR_CACHE_DIR`` empty: from nothing; SGD's C add
is loaded from ``TTE_KERNEL_CACHE`` once a process has compiled it). After
its first call an ``ours_*`` run starts the kernel path (``set_policy(after=0)``), so that its timed
steps measure what a long run gets after ``TTE_KERNEL_AFTER`` calls; the ratio table adds kernel /
reference path.

Workload (TorchRec's and FBGEMM's usual CPU benchmark shape): 4 tables × 1,000,000 rows × 64 fp32, one
feature per table, batch 4096, ids uniform random; (a) 1 id per bag, sum; (b) 20 ids per bag, mean. One
step = forward + ``out.sum().backward()`` + the optimizer's update (FBGEMM: fused into the backward).
Inputs are pre-built (a ring of 4 batches, the same ids for every contender); ms/step is the median
(p10–p90) of ``--iters`` timed steps after 3 warm-up steps (dense Adam: ``--dense-iters`` after 1).

Contenders, each in its own subprocess (clean thread settings and memory), per thread count:

* ours: ``tte.EmbeddingCollection`` + ``tte.optim`` SGD, Adagrad, LazyAdam, FTRL, Adafactor, RowWiseAdagrad
  (lr 0.01);
  inputs: dense ids ``[B]`` (1 id) or ``tte.Padded`` ``[B, 20]`` (20 ids).
* ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim`` SGD / SparseAdam / Adagrad.
* FBGEMM TBE ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU, EXACT_SGD / EXACT_ADAGRAD /
  EXACT_ROWWISE_ADAGRAD (``benchmarks/_fbgemm_step.py``), in a virtualenv with torch 2.13.0 and
  fbgemm-gpu-cpu 1.8.0 built on first use under ``~/.cache/torch_tpu_embedding/`` (about 1 GB, 1–2
  minutes; ``--fbgemm-venv`` to use another). If it cannot be built the FBGEMM rows are left out, with
  the reason printed.
* dense: ``nn.EmbeddingBag(sparse=False)`` + ``torch.optim.Adam`` (every row, every step; ~4 s/step).
* floor: the same ids gathered (``index_select`` into a preallocated buffer) and the same rows
  scattered back (``index_copy_``) with plain torch indexing — the memory traffic every step needs
  (weights only, no optimizer slots), at the speed of torch's own kernels. FBGEMM's update kernels can
  come in under it (pooled forward without a gathered buffer; one read-modify-write per row), so a
  second floor, gather only (the rows every step must read), is printed as well.

Prints, per thread count, ms/step of each run with the torch thread count and ``OMP_WAIT_POLICY`` it
reported (children get ``OMP_NUM_THREADS`` = the thread count, and ``OMP_WAIT_POLICY=PASSIVE`` unless
set: spinning OpenMP threads slow a busy 2-core machine ~30×), its peak RSS and its minor page faults per
step (glibc returns freed heap above its trim threshold to the OS, and steps that allocate large
temporaries fault it back in; ``GLIBC_TUNABLES``, if set, is passed on and printed). Then ratios of ours
to each peer measured in the same run, against the goals (printed, not asserted):

* LazyAdam ≥ 5× faster than SparseAdam at 20 ids/bag and ≥ 2× at 1 id/bag;
* our SGD and Adagrad no slower than FBGEMM EXACT_SGD / EXACT_ADAGRAD;
* LazyAdam within 2× of FBGEMM EXACT_ROWWISE_ADAGRAD (FBGEMM's one optimised CPU path);
* our RowWiseAdagrad no slower than FBGEMM EXACT_ROWWISE_ADAGRAD (the same algorithm).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# A sibling script: benchmarks/ is sys.path[0].
import torch
from _fbgemm_step import SERVE, add_workload_args, environment, make_batches, percentile, time_steps
from host_ops import cpu_model

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent

OURS = {"ours_sgd": "SGD", "ours_adagrad": "Adagrad", "ours_lazyadam": "LazyAdam", "ours_ftrl": "FTRL",
        "ours_adafactor": "Adafactor", "ours_rowwise_adagrad": "RowWiseAdagrad"}
# The same built with stack_tables=False: one parameter per table (ours_*: the default, stacked).
UNSTACKED = {f"{mode}_unstacked": name for mode, name in OURS.items()}
# The same with TTE_UPDATE_KERNEL=0: the reference row update throughout (its first step is the one to beat).
REFERENCE = {f"{mode}_reference": name for mode, name in OURS.items()}
# The same looked up with ec(batch, concat=True): the [B, T·D] activations FBGEMM's TBE returns (TorchRec's
# KeyedTensor.values()), where ours_* take the per-feature dict and torch.cat it, as the torch peers do.
CONCAT = {f"{mode}_concat": name for mode, name in OURS.items()}
# --mixed: 26 tables of mixed sizes, the cardinalities of Criteo's 26 categorical features (Kaggle
# display-advertising data) capped at 1,000,000 rows, as DLRM's --max-ind-range does.
MIXED_ROWS = [1460, 583, 1_000_000, 1_000_000, 305, 24, 12517, 633, 3, 93145, 5683, 1_000_000, 3194, 27, 14992,
              1_000_000, 10, 5652, 2173, 4, 1_000_000, 18, 15, 286181, 105, 142572]
FBGEMM = {"fbgemm_sgd": "sgd", "fbgemm_adagrad": "adagrad", "fbgemm_rowwise_adagrad": "rowwise_adagrad"}
LABELS = {
    "ours_sgd": "ours: tte.optim.SGD",
    "ours_adagrad": "ours: tte.optim.Adagrad",
    "ours_lazyadam": "ours: tte.optim.LazyAdam",
    "ours_ftrl": "ours: tte.optim.FTRL",
    "ours_adafactor": "ours: tte.optim.Adafactor",
    "ours_rowwise_adagrad": "ours: tte.optim.RowWiseAdagrad",
    **{mode: f"ours: tte.optim.{name}, stack_tables=False" for mode, name in UNSTACKED.items()},
    **{mode: f"ours: tte.optim.{name}, TTE_UPDATE_KERNEL=0" for mode, name in REFERENCE.items()},
    **{mode: f"ours: tte.optim.{name}, concat=True" for mode, name in CONCAT.items()},
    "torch_sgd": "EmbeddingBag(sparse) + torch SGD",
    "torch_sparseadam": "EmbeddingBag(sparse) + SparseAdam",
    "torch_adagrad": "EmbeddingBag(sparse) + torch Adagrad",
    "fbgemm_sgd": "FBGEMM TBE EXACT_SGD",
    "fbgemm_adagrad": "FBGEMM TBE EXACT_ADAGRAD",
    "fbgemm_rowwise_adagrad": "FBGEMM TBE EXACT_ROWWISE_ADAGRAD",
    "dense_adam": "EmbeddingBag(dense) + torch Adam",
    "floor": "floor: index_select + index_copy_",
    "floor_gather": "floor, gather only: index_select",
}
MODES = list(LABELS)
DEFAULT_MODES = [m for m in MODES if m not in UNSTACKED and m not in REFERENCE and m not in CONCAT]

# (label, ours, peer, {bag: largest ours/peer time ratio that meets the goal}); < 1: ours is faster.
RATIOS: list[tuple[str, str, str, dict[int, float]]] = [
    ("LazyAdam / SparseAdam", "ours_lazyadam", "torch_sparseadam", {1: 1 / 2, 20: 1 / 5}),
    ("our SGD / FBGEMM EXACT_SGD", "ours_sgd", "fbgemm_sgd", {1: 1.0, 20: 1.0}),
    ("our SGD, concat=True / FBGEMM EXACT_SGD", "ours_sgd_concat", "fbgemm_sgd", {1: 1.0, 20: 1.0}),
    ("RowWiseAdagrad, concat=True / FBGEMM rowwise Adagrad", "ours_rowwise_adagrad_concat", "fbgemm_rowwise_adagrad",
     {1: 1.0, 20: 1.0}),
    ("LazyAdam, concat=True / FBGEMM rowwise Adagrad", "ours_lazyadam_concat", "fbgemm_rowwise_adagrad",
     {1: 2.0, 20: 2.0}),
    ("our Adagrad / FBGEMM EXACT_ADAGRAD", "ours_adagrad", "fbgemm_adagrad", {1: 1.0, 20: 1.0}),
    ("LazyAdam / FBGEMM rowwise Adagrad", "ours_lazyadam", "fbgemm_rowwise_adagrad", {1: 2.0, 20: 2.0}),
    ("RowWiseAdagrad / FBGEMM rowwise Adagrad", "ours_rowwise_adagrad", "fbgemm_rowwise_adagrad", {1: 1.0, 20: 1.0}),
    ("our SGD / torch sparse SGD", "ours_sgd", "torch_sgd", {}),
    ("our Adagrad / torch sparse Adagrad", "ours_adagrad", "torch_adagrad", {}),
    ("LazyAdam / dense Adam", "ours_lazyadam", "dense_adam", {}),
    *[(f"our {name} / floor", mode, "floor", {}) for mode, name in OURS.items()],
    ("FBGEMM EXACT_SGD / floor", "fbgemm_sgd", "floor", {}),
    ("FBGEMM rowwise Adagrad / floor", "fbgemm_rowwise_adagrad", "floor", {}),
    *[(f"{name}: stacked / stack_tables=False", mode, f"{mode}_unstacked", {1: 1.0, 20: 1.0})
      for mode, name in OURS.items()],
    ("our SGD / gather-only floor", "ours_sgd", "floor_gather", {}),
    *[(f"{name}: kernel / reference path", mode, f"{mode}_reference", {}) for mode, name in OURS.items()],
]

# anchors_torchrec.md §5.2, without TorchRec (raw TBE needs only torch and fbgemm_gpu).
FBGEMM_PINS = ["torch==2.13.0", "fbgemm-gpu-cpu==1.8.0", "numpy"]


# ---------------------------------------------------------------------------------------- children
def _ours(args: argparse.Namespace, opt_name: str, raw: list[list[torch.Tensor]], stacked: bool = True,
          concat: bool = False) -> dict[str, Any]:
    import torch_tpu_embedding as tte
    from torch_tpu_embedding.optim._kernels import kernel_policy

    t, b, n = args.tables, args.batch, args.bag
    tables = [tte.TableConfig(rows, args.dim, name=f"t{i}", combiner=args.pool)
              for i, rows in enumerate(table_rows(args))]
    features = {f"f{i}": tte.FeatureConfig(tables[i], max_ids_per_bag=n if n > 1 else None) for i in range(t)}
    # stacked: the default construction, as a user's script has it
    ec = tte.EmbeddingCollection(features) if stacked else tte.EmbeddingCollection(features, stack_tables=False)
    opt = getattr(tte.optim, opt_name)(ec.parameters(), lr=args.lr)
    opt.init_state()  # slots are allocated before timing, like the peers' (torch's are lazy: warm-up)
    names = sorted(features)
    batches = [{f"f{i}": (ids[i] if n == 1 else tte.Padded(ids[i].view(b, n))) for i in range(t)} for ids in raw]

    calls: list[float] = []

    def step(batch: dict[str, Any]) -> torch.Tensor:
        t0 = time.perf_counter()
        if concat:  # [B, T·D] straight from the lookup, features in ec.feature_names order (= names)
            loss = ec(batch, concat=True).sum()
        else:
            out = ec(batch)
            loss = torch.cat([out[f] for f in names], dim=1).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        calls.append(1000 * (time.perf_counter() - t0))
        if len(calls) == 1:
            # The first call ran under the default policy (the reference path: no compile). The timed
            # steps measure the kernel path a long run takes after TTE_KERNEL_AFTER calls: it starts now,
            # and the next call compiles its kernel.
            kernel_policy.set_policy(after=0)
        return loss

    res = time_steps(step, batches, args.warmup, args.iters)
    if len(calls) > 1:
        res["second_step_ms"] = calls[1]
    res["kernel_policy"] = list(kernel_policy.policy())
    return res


def _torch(args: argparse.Namespace, mode: str, raw: list[list[torch.Tensor]]) -> dict[str, Any]:
    t, b, n = args.tables, args.batch, args.bag
    dense = mode == "dense_adam"
    embs = torch.nn.ModuleList([torch.nn.EmbeddingBag(args.rows, args.dim, mode=args.pool, sparse=not dense,
                                                      include_last_offset=True) for _ in range(t)])
    params = list(embs.parameters())
    opt: torch.optim.Optimizer = {
        "torch_sgd": lambda: torch.optim.SGD(params, lr=args.lr),
        "torch_sparseadam": lambda: torch.optim.SparseAdam(params, lr=args.lr),
        "torch_adagrad": lambda: torch.optim.Adagrad(params, lr=args.lr),
        "dense_adam": lambda: torch.optim.Adam(params, lr=args.lr),
    }[mode]()
    offsets = torch.arange(0, b * n + 1, n, dtype=torch.int64)

    def step(ids: list[torch.Tensor]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = torch.cat([embs[i](ids[i], offsets) for i in range(t)], dim=1).sum()
        loss.backward()
        opt.step()
        return loss

    warmup, iters = (1, min(args.iters, args.dense_iters)) if dense else (args.warmup, args.iters)
    return time_steps(step, raw, warmup, iters)


def _floor(args: argparse.Namespace, raw: list[list[torch.Tensor]], scatter: bool) -> dict[str, Any]:
    weights = [torch.randn(args.rows, args.dim) for _ in range(args.tables)]
    rows = [torch.empty(ids.numel(), args.dim) for ids in raw[0]]  # preallocated: no allocator cost

    def step(ids: list[torch.Tensor]) -> None:
        for w, i, r in zip(weights, ids, rows, strict=True):
            torch.index_select(w, 0, i, out=r)
            if scatter:
                w.index_copy_(0, i, r)

    return time_steps(step, raw, args.warmup, args.iters)


def table_rows(args: argparse.Namespace) -> list[int]:
    return MIXED_ROWS if args.mixed else [args.rows] * args.tables


def child(args: argparse.Namespace) -> None:
    args.threads = args.threads[0]  # the parent passes one thread count
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.mixed:
        args.tables = len(MIXED_ROWS)
        g = torch.Generator().manual_seed(0)
        raw = [[torch.randint(0, r, (args.batch * args.bag,), generator=g) for r in MIXED_ROWS]
               for _ in range(args.nbatches)]
    else:
        raw = make_batches(args.tables, args.rows, args.batch, args.bag, args.nbatches)
    if args.child in OURS:
        res = _ours(args, OURS[args.child], raw)
    elif args.child in UNSTACKED:
        res = _ours(args, UNSTACKED[args.child], raw, stacked=False)
    elif args.child in REFERENCE:
        res = _ours(args, REFERENCE[args.child], raw)
    elif args.child in CONCAT:
        res = _ours(args, CONCAT[args.child], raw, concat=True)
    elif args.child in ("floor", "floor_gather"):
        res = _floor(args, raw, scatter=args.child == "floor")
    else:
        res = _torch(args, args.child, raw)
    res.update(environment())
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------- FBGEMM venv
def fbgemm_python(args: argparse.Namespace) -> tuple[str | None, str]:
    """The FBGEMM virtualenv's python (built on first use) and a line saying what happened."""
    if args.fbgemm_venv:
        py = Path(args.fbgemm_venv) / "bin" / "python"
        return (str(py), f"FBGEMM venv {args.fbgemm_venv} (given)") if py.exists() else (
            None, f"FBGEMM rows left out: {py} does not exist")
    key = hashlib.sha256(" ".join(FBGEMM_PINS).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("TTE_ENV_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "torch_tpu_embedding")
    venv = cache / f"fbgemm-venv-py{sys.version_info.major}{sys.version_info.minor}-{key}"
    py = venv / "bin" / "python"
    if (venv / ".complete").exists():
        return str(py), f"FBGEMM venv {venv} (cached)"
    log = cache / f"{venv.name}.log"
    cmds = [[sys.executable, "-m", "venv", "--clear", str(venv)],
            [str(py), "-m", "pip", "install", "-q", *FBGEMM_PINS],
            [str(py), "-c", "import torch, fbgemm_gpu; print(torch.__version__, fbgemm_gpu.__version__)"]]
    print(f"building the FBGEMM venv {venv} ({' '.join(FBGEMM_PINS)}); log: {log}", flush=True)
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        for cmd in cmds:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
            if r.returncode:
                tail = log.read_text().strip().splitlines()[-3:]
                return None, (f"FBGEMM rows left out: `{' '.join(cmd[:4])} ...` failed (exit {r.returncode}) "
                              f"after {time.perf_counter() - t0:.0f} s: {' | '.join(tail)}")
    (venv / ".complete").touch()
    versions = log.read_text().strip().splitlines()[-1]
    return str(py), f"FBGEMM venv {venv} built in {time.perf_counter() - t0:.0f} s (torch, fbgemm_gpu: {versions})"


# ---------------------------------------------------------------------------------------- parent
def run_one(args: argparse.Namespace, mode: str, bag: int, threads: int, fbgemm_py: str | None) -> dict[str, Any]:
    cmd, env = command(args, mode, bag, threads, fbgemm_py)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res: dict[str, Any] = json.loads(line[len("RESULT "):])
            return res
    tail = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
    return {"error": f"exit {r.returncode}: {tail}"}


def run_paired(args: argparse.Namespace, bag: int, threads: int,
               fbgemm_py: str | None) -> list[dict[tuple[str, int], dict[str, Any]]]:
    """``--paired``: every contender's child started once and warmed up (all held at once, idle while another
    runs), then ``args.paired`` rounds of one burst of ``--iters`` timed steps each, the order reversed every
    other round: the contenders of a round run seconds apart, not minutes."""
    procs: dict[str, subprocess.Popen[str]] = {}
    logs: dict[str, Any] = {}

    def read(mode: str, prefix: str) -> str:
        out = procs[mode].stdout
        assert out is not None
        for line in out:
            if line.startswith(prefix):
                return line
        logs[mode].seek(0)
        tail = (logs[mode].read().strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"{mode} ended before {prefix.strip()}: {tail}")

    rounds: list[dict[tuple[str, int], dict[str, Any]]] = []
    try:
        for mode in args.modes:
            cmd, env = command(args, mode, bag, threads, fbgemm_py)
            logs[mode] = tempfile.TemporaryFile("w+")
            procs[mode] = subprocess.Popen(cmd, env={**env, SERVE: "1"}, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, stderr=logs[mode], text=True)
            read(mode, "READY")
            print(f"  threads={threads} bag={bag:<3d} {mode:24s} ready", file=sys.stderr, flush=True)
        for k in range(args.paired):
            results: dict[tuple[str, int], dict[str, Any]] = {}
            for mode in (args.modes if k % 2 == 0 else args.modes[::-1]):
                stdin = procs[mode].stdin
                assert stdin is not None
                stdin.write("run\n")
                stdin.flush()
                results[(mode, bag)] = json.loads(read(mode, "RESULT ")[len("RESULT "):])
            rounds.append(results)
            done = ", ".join(f"{m} {r['median_ms']:.2f}" for (m, _), r in results.items())
            print(f"  threads={threads} bag={bag:<3d} round {k + 1}/{args.paired}: {done}", file=sys.stderr, flush=True)
    finally:
        for mode, proc in procs.items():
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.write("exit\n")
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            logs[mode].close()
    return rounds


def command(args: argparse.Namespace, mode: str, bag: int, threads: int,
            fbgemm_py: str | None) -> tuple[list[str], dict[str, str]]:
    """A contender's child: its command line and environment."""
    pool = "sum" if bag == 1 else "mean"
    common = ["--bag", str(bag), "--pool", pool, "--rows", str(args.rows), "--dim", str(args.dim),
              "--tables", str(args.tables), "--batch", str(args.batch), "--iters", str(args.iters),
              "--warmup", str(args.warmup), "--nbatches", str(args.nbatches), "--threads", str(threads),
              "--lr", str(args.lr), *(["--mixed"] if args.mixed else [])]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if mode in REFERENCE:
        env["TTE_UPDATE_KERNEL"] = "0"
    if mode in FBGEMM:
        assert fbgemm_py is not None  # FBGEMM modes are dropped when there is no venv
        env.pop("PYTHONPATH", None)
        cmd = [fbgemm_py, str(HERE / "_fbgemm_step.py"), "--optimizer", FBGEMM[mode], *common]
    else:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--dense-iters",
               str(args.dense_iters), *common]
    return cmd, env


def fmt_ms(res: dict[str, Any] | None) -> str:
    if res is None:
        return "-"
    if "error" in res:
        return "failed"
    return f"{res['median_ms']:.2f} ({res['p10_ms']:.2f}–{res['p90_ms']:.2f})"


def print_tables(args: argparse.Namespace, threads: int, results: dict[tuple[str, int], dict[str, Any]]) -> None:
    bags = args.bags
    heads = [f"{b} id{'s' if b > 1 else ''}/bag, {'sum' if b == 1 else 'mean'}" for b in bags]
    ok = [r for r in results.values() if "error" not in r]
    reported = sorted({(r["torch_threads"], r["OMP_WAIT_POLICY"], r.get("GLIBC_TUNABLES") or "-") for r in ok})
    shape = (f"26 tables of {min(MIXED_ROWS):,} to {max(MIXED_ROWS):,} rows ({sum(MIXED_ROWS):,} in all)"
             if args.mixed else f"{args.tables} tables × {args.rows:,}")
    print(f"\n== threads={threads}: {shape} × {args.dim} fp32, batch {args.batch}; "
          f"median (p10–p90) ms/step over {args.iters} steps after {args.warmup} warm-up (dense Adam: "
          f"{min(args.iters, args.dense_iters)} after 1)")
    print(f"every run reported (torch threads, OMP_WAIT_POLICY, GLIBC_TUNABLES) = {reported}; "
          "RSS = peak resident set of the run; faults = minor page faults per timed step")
    w = 38
    print(f"{'contender':{w}s} " + " ".join(f"{h:>27s} {'RSS':>6s} {'faults':>7s}" for h in heads) + "  torch")
    for mode in args.modes:
        cells, version = [], ""
        for b in bags:
            r = results.get((mode, b))
            good = r is not None and "error" not in r
            rss = f"{r['peak_rss_mib'] / 1024:.1f}G" if good else ""
            faults = f"{r['page_faults_per_step']:.0f}" if good else ""
            cells.append(f"{fmt_ms(r):>27s} {rss:>6s} {faults:>7s}")
            if good:
                version = r["torch"] + (f" + fbgemm {r['fbgemm_gpu']}" if "fbgemm_gpu" in r else "")
        print(f"{LABELS[mode]:{w}s} " + " ".join(cells) + f"  {version}")
    for mode in args.modes:
        if mode not in OURS and mode not in UNSTACKED:
            continue
        cells = []
        for b in bags:
            r, ref = results.get((mode, b)), results.get((f"{mode}_reference", b))
            if not r or "error" in r:
                continue
            cell = f"{b} id{'s' if b > 1 else ''}: first {r['first_step_ms']:.0f} ms"
            if ref and "error" not in ref:
                ratio = r["first_step_ms"] / ref["first_step_ms"]
                cell += (f" (TTE_UPDATE_KERNEL=0: {ref['first_step_ms']:.0f} ms, {ratio:.2f}× "
                         f"≤ 1.5 {'met' if ratio <= 1.5 else 'MISSED'})")
            if "second_step_ms" in r:
                cell += f", kernel path's first (compiles) {r['second_step_ms']:.0f} ms"
            cells.append(cell)
        if cells:
            print(f"first steps, {LABELS[mode]}: " + "; ".join(cells))
    if any(m in OURS for m in args.modes):
        print("(ours: the first call takes the default policy, TTE_KERNEL_AFTER/TTE_KERNEL_MIN_ELEMENTS; the "
              "benchmark then starts the kernel path, whose first call compiles unless inductor's disk cache "
              "holds the kernel (SGD's C add: TTE_KERNEL_CACHE); the timed steps run it)")
    for mode in args.modes:
        for b in bags:
            r = results.get((mode, b))
            if r and "error" in r:
                print(f"  {LABELS[mode]} ({b} ids/bag) failed: {r['error']}")

    print(f"\nratios of medians (time of ours / time of peer; < 1: ours faster), threads={threads}; "
          "goal: ratio ≤ bound")
    print(f"{'ratio':{w}s} " + " ".join(f"{h:>27s}" for h in heads))
    for label, ours, peer, goals in RATIOS:
        if ours not in args.modes or peer not in args.modes:
            continue
        cells = []
        for b in bags:
            a, p = results.get((ours, b)), results.get((peer, b))
            if not a or not p or "error" in a or "error" in p:
                cells.append(f"{'-':>27s}")
                continue
            ratio = a["median_ms"] / p["median_ms"]
            goal = goals.get(b)
            verdict = "" if goal is None else f"≤ {goal:.2f} {'met' if ratio <= goal else 'MISSED'}"
            cells.append(f"{ratio:7.2f} {verdict:>19s}")
        print(f"{label:{w}s} " + " ".join(cells))


def _median_result(bursts: list[dict[str, Any]]) -> dict[str, Any]:
    """``--paired``: a contender's bursts as one result: the median of their medians, p10 and p90 of them."""
    ms = sorted(b["median_ms"] for b in bursts)
    return {**bursts[-1], "median_ms": statistics.median(ms), "p10_ms": percentile(ms, 0.1),
            "p90_ms": percentile(ms, 0.9),
            "page_faults_per_step": statistics.median(b["page_faults_per_step"] for b in bursts)}


def print_rounds(args: argparse.Namespace, threads: int,
                 rounds: list[dict[tuple[str, int], dict[str, Any]]]) -> None:
    """The goals' ratios of every round side by side: the contenders of a round ran one after the other, so a
    round's ratio compares steps taken minutes apart, and the rounds give its range on this machine."""
    print(f"\n== the goals over {len(rounds)} rounds, threads={threads} (each round: every contender once; "
          "ratio of medians, ours / peer)")
    for label, ours, peer, goals in RATIOS:
        if ours not in args.modes or peer not in args.modes or not goals:
            continue
        for b in args.bags:
            ratios = [r[(ours, b)]["median_ms"] / r[(peer, b)]["median_ms"] for r in rounds
                      if "error" not in r[(ours, b)] and "error" not in r[(peer, b)]]
            if not ratios or b not in goals:
                continue
            met = sum(x <= goals[b] for x in ratios)
            print(f"{label} ({b} id{'s' if b > 1 else ''}/bag): " + ", ".join(f"{x:.2f}" for x in ratios)
                  + f"; median {statistics.median(ratios):.2f}; goal ≤ {goals[b]:.2f} met in {met} of "
                    f"{len(ratios)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bags", type=int, nargs="+", default=[1, 20], help="ids per bag: 1 → sum, more → mean")
    ap.add_argument("--modes", nargs="+", default=None, choices=MODES, metavar="MODE",
                    help=f"contenders (default: all but the *_unstacked; with --mixed: ours both ways): "
                         f"{' '.join(MODES)}")
    ap.add_argument("--mixed", action="store_true",
                    help="26 tables of Criteo's sizes capped at 1M rows (--rows, --tables ignored); ours only")
    add_workload_args(ap)
    ap.add_argument("--dense-iters", type=int, default=5, help="timed steps of dense Adam (~4 s each)")
    ap.add_argument("--fbgemm-venv", default=None, help="an existing venv with torch + fbgemm-gpu-cpu")
    ap.add_argument("--no-fbgemm", action="store_true", help="leave the FBGEMM rows out")
    ap.add_argument("--first-step", action="store_true",
                    help="add ours_*_reference (TTE_UPDATE_KERNEL=0) for every ours_* mode: first steps compared")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every contender this many times, round by round, and print each goal's ratio per round")
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="start every contender once, then N rounds of one burst of --iters steps each, seconds "
                         "apart (the order reversed every other round); print each goal's ratio per round")
    ap.add_argument("--child-timeout", type=float, default=3600)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--bag", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pool", default="sum", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or args.paired < 0 or (args.paired and args.rounds > 1):
        ap.error(f"--rounds must be at least 1 and --paired at least 0, not both given; got --rounds {args.rounds} "
                 f"--paired {args.paired}")
    if args.child:
        child(args)
        return
    if args.modes is None:
        args.modes = [*OURS, *UNSTACKED] if args.mixed else DEFAULT_MODES
    if args.first_step:
        args.modes += [f"{m}_reference" for m in args.modes if m in OURS and f"{m}_reference" not in args.modes]
    if args.mixed and (others := [m for m in args.modes if m not in OURS and m not in UNSTACKED
                                  and m not in REFERENCE]):
        ap.error(f"--mixed runs ours only (the peers here take one table size); drop --modes {' '.join(others)}")

    policy = os.environ.get("OMP_WAIT_POLICY")
    print(f"CPU: {cpu_model()}")
    print(f"parent: torch {torch.__version__}, torch threads={torch.get_num_threads()}, OMP_WAIT_POLICY="
          f"{policy or 'unset (children get PASSIVE)'}; {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    fbgemm_py = None
    if any(m in FBGEMM for m in args.modes):
        if args.no_fbgemm:
            args.modes = [m for m in args.modes if m not in FBGEMM]
        else:
            fbgemm_py, note = fbgemm_python(args)
            print(note, flush=True)
            if fbgemm_py is None:
                args.modes = [m for m in args.modes if m not in FBGEMM]
    for threads in args.threads:
        if args.paired:
            paired: list[dict[tuple[str, int], dict[str, Any]]] = [{} for _ in range(args.paired)]
            for bag in args.bags:
                for k, results in enumerate(run_paired(args, bag, threads, fbgemm_py)):
                    paired[k].update(results)
            print_tables(args, threads, {key: _median_result([r[key] for r in paired]) for key in paired[0]})
            print_rounds(args, threads, paired)
            continue
        rounds: list[dict[tuple[str, int], dict[str, Any]]] = []
        for k in range(args.rounds):
            results: dict[tuple[str, int], dict[str, Any]] = {}
            for bag in args.bags:
                for mode in args.modes:
                    t0 = time.perf_counter()
                    try:
                        res = run_one(args, mode, bag, threads, fbgemm_py)
                    except subprocess.TimeoutExpired:
                        res = {"error": f"timed out after {args.child_timeout:.0f} s"}
                    results[(mode, bag)] = res
                    status = f"failed: {res['error']}" if "error" in res else f"{fmt_ms(res)} ms"
                    print(f"  threads={threads} round {k + 1}/{args.rounds} bag={bag:<3d} {mode:24s} {status}  "
                          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            if args.rounds > 1:
                print(f"\n#### round {k + 1} of {args.rounds}")
            print_tables(args, threads, results)
            rounds.append(results)
        if args.rounds > 1:
            print_rounds(args, threads, rounds)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
