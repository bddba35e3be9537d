"""XLA:CPU (one device): a lazy step vs a dense one, and compile / step time vs the number of tables.

Run (from the repository root; a few minutes):

    PJRT_DEVICE=CPU OMP_WAIT_POLICY=PASSIVE python benchmarks/xla_tables.py [--tables 1 10 100] [--steps 20]
        [--parts lazy-dense tables graphs first-compile]

Quick check (under a minute): ``... --steps 3 --vocab 20000 --table-rows 100000``.

Every configuration runs in its own subprocess: a fresh process has an empty compile cache (no
persistent cache is configured), so its first step compiles from nothing. Per configuration: the wall
time of the first step (trace + compile + run), XLA's ``CompileTime`` metric summed over that step, the
number of compiles (counter ``UncachedCompile``) in the first step, in the other warm-up steps and in
the timed steps (must be 0), and the ops that fell back to the host (``executed_fallback_ops()``, must be
empty for ours). Steady step time: median (p10–p90) of ``--steps`` synchronous steps
(``torch_xla.sync()`` + ``wait_device_ops()`` each) after 3 warm-up steps, and how much of it is
host-side tracing (the Python step up to ``sync()``). Inputs are a ring of 4 pre-built host batches.
Every run records torch's thread count, ``OMP_WAIT_POLICY`` (children get ``PASSIVE`` unless set) and the
XLA device count; the table prints them.

(a) lazy vs dense, at a moderate vocabulary (``--vocab``, default 100,000 × 64, batch 1024 × 8 ids,
    mean): ours (``EmbeddingCollection`` + ``tte.optim.Adam``, lazy rows) vs ``nn.EmbeddingBag`` + dense
    autograd + ``torch.optim.Adam`` on the XLA device, once through the module's own forward (whose
    training lowering falls back to the host on XLA) and once as a gather + mean of its weight (no
    fallback). The step time vs vocabulary (100,000 and 2,000,000 rows, row-sharded on 4 devices) is
    ``benchmarks/spmd_vocab.py``; not repeated here.
(b) 1, 10 and 100 tables with the same total work: the same batch (256), 100 ids per example split
    evenly over the tables (100/T ids per bag, one feature per table, mean) and 1,000,000 rows × 16
    split evenly (1,000,000/T rows per table); ours with ``tte.optim.Adam``. Only the number of tables
    in the graph changes. Each T > 1 runs three times: ``stack_tables=False``, ``stack_tables=True`` (all T tables
    in one group: one dedup, gather and scatter per step), and once with the default construction
    (``EmbeddingCollection(features)``, no flag: stacked). Goals (printed, not asserted): 100 tables
    compile in ≤ 2× the time of one table and step in ≤ 3× its time; ratios 10/1 and 100/1 are printed.
    Whole process: the graphs compiled and their ``CompileTime`` from the start of the process until the
    first step returns (construction and ``init_state``'s sync included), per T and as a ratio to T=1.
    ``--layouts`` picks the constructions run for T > 1.
(c) every graph compiled until the first step returns, default construction, for each T: a run of its
    own with torch_xla's ``PT_XLA_DEBUG_LEVEL=1`` reports, each graph named by the phase it came in
    (construction, ``init_state`` and its sync, first step), torch_xla's cause and the innermost frame in
    this package that triggered it. ``tests/xla/test_compiles_vs_tables.py`` asserts the count does not
    grow with the number of tables.
(d) a user's script (``--parts first-compile``): (b)'s tables, default construction, a ``Linear`` head on
    the concatenated activations (with its own ``torch.optim.SGD`` in the step) and no ``init_state()``, so
    the first step also makes the optimizer state: the first step's wall time and ``CompileTime`` per T
    and as a ratio to T = 1 (goal of issue [host]: ≤ 2× at 100 tables); the activations once as the dict
    concatenated by the user's ``torch.cat``, once as ``concat=True``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent


def _percentile(sorted_ms: list[float], q: float) -> float:
    pos = q * (len(sorted_ms) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_ms) - 1)
    return sorted_ms[lo] + (sorted_ms[hi] - sorted_ms[lo]) * (pos - lo)


# ---------------------------------------------------------------------------------------- children
def phase(name: str) -> None:
    """Marks where the process is in its stderr, between torch_xla's ``PT_XLA_DEBUG_LEVEL`` reports
    (the ``--graphs`` child names each compiled graph by the phase it came in, :func:`graphs_of`)."""
    print(f"PHASE {name}", file=sys.stderr, flush=True)


def measure(build: Callable[[Any], None], batches: list[Any], warmup: int, steps: int) -> dict[str, Any]:
    """Compile and step metrics of ``build`` (traces one step; the caller's graph ends at our sync)."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    def compiles() -> int:
        return int(met.counter_value("UncachedCompile") or 0)

    def run(i: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        build(batches[i % len(batches)])
        t1 = time.perf_counter()
        torch_xla.sync()
        xm.wait_device_ops()
        return 1000 * (t1 - t0), 1000 * (time.perf_counter() - t0)

    def compile_ms() -> float:
        data = met.metric_data("CompileTime")
        return (data[1] / 1e6) if data else 0.0  # the accumulator is in ns

    # Everything compiled since the process started (construction, init_state's sync): then cleared,
    # so that the first step's own numbers follow.
    before_compiles, before_compile_ms = compiles(), compile_ms()
    met.clear_all()
    phase("first step")
    _, first_ms = run(0)
    first_compile_ms = compile_ms()
    first_compiles = compiles()
    phase("later steps")
    for i in range(1, warmup):
        run(i)
    warm_compiles = compiles() - first_compiles
    trace, total = [], []
    for i in range(warmup, warmup + steps):
        tr, tt = run(i)
        trace.append(tr)
        total.append(tt)
    total.sort()
    return {"first_step_ms": first_ms, "compile_ms": first_compile_ms, "compiles_first": first_compiles,
            "compiles_before_first": before_compiles, "compile_ms_before_first": before_compile_ms,
            "compiles_warmup": warm_compiles, "compiles_timed": compiles() - first_compiles - warm_compiles,
            "fallbacks": sorted(met.executed_fallback_ops()), "median_ms": _percentile(total, 0.5),
            "p10_ms": _percentile(total, 0.1), "p90_ms": _percentile(total, 0.9),
            "trace_ms": statistics.median(trace), "steps": steps, "warmup": warmup}


def _ours(tables: int, rows: int, dim: int, batch: int, bag: int, lr: float,
          layout: str = "unstacked", user: bool = False, concat: bool = False
          ) -> tuple[Callable[[Any], None], list[Any]]:
    import torch_xla

    import torch_tpu_embedding as tte

    phase("construction")
    dev = torch_xla.device()
    configs = [tte.TableConfig(rows, dim, name=f"t{i}", combiner="mean") for i in range(tables)]
    features = {f"f{i:03d}": tte.FeatureConfig(configs[i], max_ids_per_bag=bag) for i in range(tables)}
    if layout == "default":  # what a user's script gets: no flag
        ec = tte.EmbeddingCollection(features, device=dev)
    else:
        ec = tte.EmbeddingCollection(features, device=dev, stack_tables=layout == "stacked")
    opt = tte.optim.Adam(ec.parameters(), lr=lr)
    head = torch.nn.Linear(dim * tables, 1).to(dev)
    head_opt = torch.optim.SGD(head.parameters(), lr=lr)
    if not user:  # (a user's script: no init_state(); the first step makes the state)
        phase("init_state and its sync")
        opt.init_state()  # then one sync: the steady step is the only graph (docs/optimizers.md)
    torch_xla.sync()
    names = sorted(features)
    g = torch.Generator().manual_seed(0)
    batches = [{f: tte.Padded(torch.randint(0, rows, (batch, bag), generator=g)) for f in names} for _ in range(4)]

    def build(b: dict[str, Any]) -> None:
        if concat:  # the activations side by side from the collection (TorchRec's KeyedTensor.values())
            act = ec(b, concat=True)
        else:  # the dict, concatenated by the user
            out = ec(b)
            act = torch.cat([out[f] for f in names], dim=1)
        (head(act).square().mean() if user else act.sum()).backward()
        opt.step()
        opt.zero_grad()
        if user:
            head_opt.step()
            head_opt.zero_grad()

    return build, batches


def _dense(kind: str, rows: int, dim: int, batch: int, bag: int, lr: float) -> tuple[Callable[[Any], None], list[Any]]:
    import torch_xla

    dev = torch_xla.device()
    emb = torch.nn.EmbeddingBag(rows, dim, mode="mean").to(dev)
    opt = torch.optim.Adam(emb.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, rows, (batch, bag), generator=g) for _ in range(4)]

    def build(ids: torch.Tensor) -> None:
        ids = ids.to(dev)
        out = emb(ids) if kind == "dense_module" else emb.weight[ids].mean(1)
        out.sum().backward()
        opt.step()
        opt.zero_grad()

    return build, batches


def child(args: argparse.Namespace) -> None:
    import torch_xla
    import torch_xla.runtime as xr

    torch.manual_seed(0)
    if args.child == "tables":
        t = args.ntables
        build, batches = _ours(t, args.table_rows // t, args.table_dim, args.table_batch,
                               args.ids_per_example // t, args.lr, layout=args.layout)
    elif args.child == "user":
        t = args.ntables
        build, batches = _ours(t, args.table_rows // t, args.table_dim, args.table_batch,
                               args.ids_per_example // t, args.lr, layout="default", user=True, concat=args.concat)
    elif args.child == "lazy":
        build, batches = _ours(1, args.vocab, args.dim, args.batch, args.bag, args.lr)
    else:
        build, batches = _dense(args.child, args.vocab, args.dim, args.batch, args.bag, args.lr)
    res = measure(build, batches, args.warmup, args.steps)
    res.update(torch=torch.__version__, torch_xla=torch_xla.__version__, devices=xr.global_runtime_device_count(),
               torch_threads=torch.get_num_threads(), OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "<unset>"))
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------- parent
def graphs_of(stderr: str) -> list[dict[str, Any]]:
    """The graphs torch_xla compiled, from its ``PT_XLA_DEBUG_LEVEL=1`` reports on stderr: per graph the
    phase it came in (:func:`phase`), the cause torch_xla gives and where: the innermost frame in this
    package, else the innermost outside torch_xla."""
    graphs: list[dict[str, Any]] = []
    where_phase = "before construction"
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("PHASE "):
            where_phase = line[len("PHASE "):]
        if not line.startswith("Compilation Analysis: Compilation Cause"):
            continue
        block = []
        for x in lines[i + 1:]:
            if not x.startswith("Compilation Analysis:") or x.startswith("Compilation Analysis: ---"):
                break
            block.append(x[len("Compilation Analysis:"):].strip())
        frames = block[block.index("Python Frame Triggered Execution:") + 1:] if (
            "Python Frame Triggered Execution:" in block) else []
        package = f"({REPO / 'torch_tpu_embedding'}/"
        ours = [f for f in frames if package in f] or [f for f in frames if "site-packages" not in f]
        where = ours[0].replace(str(REPO) + "/", "") if ours else "?"
        io = [x for x in block if x.startswith("Number of Graph")]
        graphs.append({"phase": where_phase, "cause": block[0] if block else "?", "where": where,
                       "io": ", ".join(x.removeprefix("Number of Graph ").lower() for x in io)})
    return graphs


def run_child(args: argparse.Namespace, *extra: str, graphs: bool = False) -> dict[str, Any]:
    """One child; ``graphs``: with torch_xla's compile reports on (one timed step, only the graphs count)."""
    env = dict(os.environ)
    env.setdefault("PJRT_DEVICE", "CPU")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.pop("CPU_NUM_DEVICES", None)  # one device
    env.pop("XLA_PERSISTENT_CACHE_PATH", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    if graphs:
        env["PT_XLA_DEBUG_LEVEL"] = "1"
    flags = ["--steps", "1" if graphs else str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr),
             "--vocab", str(args.vocab), "--dim", str(args.dim), "--batch", str(args.batch), "--bag", str(args.bag),
             "--table-rows", str(args.table_rows), "--table-dim", str(args.table_dim), "--table-batch",
             str(args.table_batch), "--ids-per-example", str(args.ids_per_example)]
    cmd = [sys.executable, str(Path(__file__).resolve()), *extra, *flags]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.child_timeout:.0f} s"}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res: dict[str, Any] = json.loads(line[len("RESULT "):])
            res["process_s"] = time.perf_counter() - t0
            if graphs:
                res["graphs"] = graphs_of(r.stderr)
            print(f"  {' '.join(extra):24s} first step {res['first_step_ms']:9.0f} ms, step {res['median_ms']:8.2f} ms"
                  f"  ({res['process_s']:.0f} s)", file=sys.stderr, flush=True)
            return res
    tail = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
    print(f"  {' '.join(extra):24s} failed: {tail}", file=sys.stderr, flush=True)
    return {"error": f"exit {r.returncode}: {tail}"}


def row(label: str, r: dict[str, Any], w: int) -> str:
    if "error" in r:
        return f"{label:{w}s} failed: {r['error']}"
    fb = ", ".join(r["fallbacks"]) if r["fallbacks"] else "0"
    return (f"{label:{w}s} {r['first_step_ms']:10.0f} {r['compile_ms']:10.0f} "
            f"{r['compiles_first']:>3d}/{r['compiles_warmup']}/{r['compiles_timed']:<3d}"
            f" {r['median_ms']:9.2f} ({r['p10_ms']:.2f}–{r['p90_ms']:.2f}) {r['trace_ms']:8.2f}  {fb}")


def header(w: int) -> str:
    return (f"{'':{w}s} {'1st step':>10s} {'compile':>10s} {'compiles':>9s} {'step ms (p10–p90)':>24s} "
            f"{'trace ms':>8s}  fallbacks\n{'':{w}s} {'ms':>10s} {'ms':>10s} {'1st/wu/t':>9s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["lazy-dense", "tables", "graphs", "first-compile"],
                    choices=["lazy-dense", "tables", "graphs", "first-compile"])
    ap.add_argument("--layouts", nargs="+", default=["unstacked", "stacked", "default"],
                    choices=["unstacked", "stacked", "default"], help="(b): the constructions run for T > 1")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps (the first compiles)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--vocab", type=int, default=100_000, help="(a): rows of the table")
    ap.add_argument("--dim", type=int, default=64, help="(a)")
    ap.add_argument("--batch", type=int, default=1024, help="(a)")
    ap.add_argument("--bag", type=int, default=8, help="(a): ids per bag")
    ap.add_argument("--tables", type=int, nargs="+", default=[1, 10, 100], help="(b): table counts")
    ap.add_argument("--table-rows", type=int, default=1_000_000, help="(b): rows of all tables together")
    ap.add_argument("--table-dim", type=int, default=16, help="(b)")
    ap.add_argument("--table-batch", type=int, default=256, help="(b)")
    ap.add_argument("--ids-per-example", type=int, default=100, help="(b): ids per example over all tables")
    ap.add_argument("--child-timeout", type=float, default=1800)
    ap.add_argument("--child", choices=["lazy", "dense_module", "dense_gather", "tables", "user"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--ntables", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--concat", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", choices=["unstacked", "stacked", "default"], default="unstacked",
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    for t in args.tables:
        if args.ids_per_example % t or args.table_rows % t:
            ap.error(f"--tables {t} must divide --ids-per-example ({args.ids_per_example}) and --table-rows "
                     f"({args.table_rows})")
    print(f"parent: torch {torch.__version__}, PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'unset (children: CPU)')}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset (children: PASSIVE)')}; {os.cpu_count()} CPUs, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results: list[dict[str, Any]] = []
    w = 44
    if "lazy-dense" in args.parts:
        runs = [("ours: EmbeddingCollection + tte Adam (lazy)", run_child(args, "--child", "lazy")),
                ("nn.EmbeddingBag forward + torch Adam", run_child(args, "--child", "dense_module")),
                ("EmbeddingBag weight gather+mean + torch Adam", run_child(args, "--child", "dense_gather"))]
        results += [r for _, r in runs]
        print(f"\n(a) lazy vs dense on XLA:CPU: 1 table {args.vocab:,} × {args.dim}, batch {args.batch} × "
              f"{args.bag} ids, mean, Adam; {args.steps} timed steps after {args.warmup} warm-up "
              "(vocabulary sweep: benchmarks/spmd_vocab.py)")
        print(header(w))
        for label, r in runs:
            print(row(label, r, w))
        ours = runs[0][1]
        for label, r in runs[1:]:
            if "error" not in ours and "error" not in r:
                print(f"  {label} / ours: {r['median_ms'] / ours['median_ms']:.1f}× the step time")
    if "tables" in args.parts:
        by_t = {t: run_child(args, "--child", "tables", "--ntables", str(t)) for t in args.tables
                if t == 1 or "unstacked" in args.layouts}
        stacked = {t: run_child(args, "--child", "tables", "--ntables", str(t), "--layout", "stacked")
                   for t in args.tables if t > 1 and "stacked" in args.layouts}
        default = {t: run_child(args, "--child", "tables", "--ntables", str(t), "--layout", "default")
                   for t in args.tables if t > 1 and "default" in args.layouts}
        results += list(by_t.values()) + list(stacked.values()) + list(default.values())
        print(f"\n(b) tables on XLA:CPU, same total work: batch {args.table_batch}, {args.ids_per_example} ids per "
              f"example and {args.table_rows:,} rows × {args.table_dim} split evenly over T tables (one feature "
              f"each, mean), tte Adam; {args.steps} timed steps after {args.warmup} warm-up")
        print(header(w))
        for t in args.tables:
            label = f"T={t}: {args.table_rows // t:,} rows, {args.ids_per_example // t} ids/bag"
            if t in by_t:
                print(row(label, by_t[t], w))
            else:
                print(label)
            if t in stacked:
                print(row(f"T={t} stack_tables=True (one group)", stacked[t], w))
            if t in default:
                print(row(f"T={t} default construction (no flag)", default[t], w))
        base = by_t.get(1)
        if base and "error" not in base:
            print(f"\n{'ratio to T=1':{w}s} {'compile':>10s} {'1st step':>10s} {'step':>8s}")
            runs_t = [(f"T={t} / T=1", t, r) for t, r in by_t.items()]
            runs_t += [(f"T={t} stacked / T=1", t, r) for t, r in stacked.items()]
            runs_t += [(f"T={t} default / T=1", t, r) for t, r in default.items()]
            for label_t, t, r in runs_t:
                if t == 1 or "error" in r:
                    continue
                c = r["compile_ms"] / base["compile_ms"] if base["compile_ms"] else float("nan")
                f = r["first_step_ms"] / base["first_step_ms"]
                s = r["median_ms"] / base["median_ms"]
                goal = ""
                if t == 100:
                    goal = (f"   goals: compile ≤ 2 {'met' if c <= 2 else 'MISSED'}, "
                            f"step ≤ 3 {'met' if s <= 3 else 'MISSED'}")
                print(f"{label_t:{w}s} {c:10.2f} {f:10.2f} {s:8.2f}{goal}")
            print(f"\n{'whole process until the 1st step returns':{w}s} {'graphs':>7s} {'compile ms':>11s} "
                  f"{'ratio to T=1':>12s}")
            for label_t, t, r in [("T=1", 1, base), *[x for x in runs_t if x[1] != 1]]:
                if "error" in r:
                    continue
                ms = r["compile_ms_before_first"] + r["compile_ms"]
                base_ms = base["compile_ms_before_first"] + base["compile_ms"]
                goal = f"   goal ≤ 2 {'met' if ms <= 2 * base_ms else 'MISSED'}" if t == 100 else ""
                print(f"{label_t:{w}s} {r['compiles_before_first'] + r['compiles_first']:7d} {ms:11.0f} "
                      f"{ms / base_ms if base_ms else float('nan'):12.2f}{goal}")
    if "first-compile" in args.parts:
        user = {t: run_child(args, "--child", "user", "--ntables", str(t)) for t in args.tables}
        side = {t: run_child(args, "--child", "user", "--ntables", str(t), "--concat") for t in args.tables}
        results += list(user.values()) + list(side.values())
        print("\n(d) a user's script on XLA:CPU: (b)'s tables, default construction, a Linear head on the "
              "concatenated activations (its SGD in the step), no init_state(): the first step makes the "
              "optimizer state and compiles the step")
        print(header(w))
        for label, runs in (("dict + torch.cat", user), ("concat=True", side)):
            for t, r in runs.items():
                print(row(f"{label}, T = {t}", r, w))
            one = runs.get(min(runs))
            for t, r in runs.items():
                if t != min(runs) and one and "error" not in one and "error" not in r:
                    print(f"  {label}: T = {t} / T = {min(runs)}: first step "
                          f"{r['first_step_ms'] / one['first_step_ms']:.2f}×, its compile "
                          f"{r['compile_ms'] / one['compile_ms']:.2f}× (goal ≤ 2×), trace "
                          f"{r['trace_ms'] / one['trace_ms']:.2f}×")
    if "graphs" in args.parts:
        print("\n(c) every graph compiled until the first step returns (default construction; a run of its own with "
              "PT_XLA_DEBUG_LEVEL=1): phase, torch_xla's cause, where (innermost frame in the package, else outside "
              "torch_xla), graph inputs / outputs")
        for t in args.tables:
            r = run_child(args, "--child", "tables", "--ntables", str(t), "--layout", "default", graphs=True)
            if "error" in r:
                print(f"T={t}: failed: {r['error']}")
                continue
            before = [g for g in r["graphs"] if g["phase"] != "later steps"]
            print(f"T={t}: {len(before)} graphs")
            for g in before:
                print(f"  [{g['phase']}] {g['cause']} at {g['where']} ({g['io']})")
    ok = [r for r in results if "error" not in r]
    if ok:
        seen = sorted({(r["torch_threads"], r["OMP_WAIT_POLICY"], r["devices"], r["torch"], r["torch_xla"])
                       for r in ok})
        print(f"\nevery run reported (torch threads, OMP_WAIT_POLICY, XLA devices, torch, torch_xla) = {seen}; "
              f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
