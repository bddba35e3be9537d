"""The host's share of a training step against the number of features: ops dispatched, host reads, trace time.

Run (from the repository root; about a minute):

    OMP_WAIT_POLICY=PASSIVE python benchmarks/host_ops.py [--features 1 26 100] [--steps 5] [--rounds 1]
        [--no-level | --idle-ms MS | --synthetic-level] [--same-ids] [--no-xla]

A DLRM-like step: ``T`` features, one table each (1,000 rows × 16, ``mean``), default construction (all
``T`` tables stacked in one group), bags of 4 host ids (``Padded [256, 4]``, a quarter of them masked
out), a ``Linear`` head on the activations, ``tte.optim.Adam``; steady state (past the kernel switch,
``TTE_KERNEL_AFTER``). Every ``T`` runs in a process of its own. Per ``T`` and output form (the dict,
concatenated by the user's ``torch.cat``; ``concat=True``; and a duck-typed ``KeyedJaggedTensor`` input):

* **ops**: aten ops dispatched by one steady step (forward, loss, backward, ``step``, ``zero_grad``),
  counted with a ``TorchDispatchMode``; and among them the host reads (``_local_scalar_dense``) and
  data-dependent shapes (``nonzero``, ``unique*``, ``masked_select``);
* **XLA trace** (``PJRT_DEVICE=CPU``, one device, ``concat=True``): the median host time of the Python
  step up to ``torch_xla.sync()`` over ``--steps`` steps (the device's work not included: each step starts
  after ``torch_xla.sync()`` and ``xm.wait_device_ops()`` of the one before). Two kinds of step alternate in
  one process, so that both see the same minutes of a shared machine:

  * **warm**: right after the previous step's device work, as a training loop runs;
  * **levelled**: the same, right after the largest ``T``'s own training step (a second model of that many
    features in the process, its batch, forward, backward and update: :class:`Leveller`), run and waited for outside
    the clock. XLA:CPU runs the device's work on the host's cores: T = 100's step (Adam on 102,400 looked-up rows)
    takes tens of ms there, T = 1's under one, and a trace right after such work runs slower than one right after the
    previous trace, whatever it traces: the device work leaves the core's caches and predictors holding its own data
    (no page faults, no system time, no other thread: the Python thread's CPU time grows with its wall time). The
    warm ratio compares a trace after T = 100's device work with one after T = 1's; the levelled one starts every
    ``T`` after the same device work. On a TPU the device's work runs on the chip, not on the host's cores.
    ``--synthetic-level``: after a fixed computation of the same size instead (sorting 1,024 · T ids, an Adam-like
    update of 1,000 · T rows: :class:`SyntheticLeveller`, this benchmark's leveller until 2026-12-01); on an AMD EPYC
    it slowed T = 1's trace as T = 100's step does, on an Intel Xeon much less (docs/benchmarks.md). (Until
    2026-11-30 this kind was **cold**: a 64 MiB host buffer written before the step, which evicts data but not the
    code the trace runs; it left T = 1 as fast as warm.)

  Each kind is given as wall time and as the Python thread's CPU time (``time.thread_time``: what the host
  computed, without time spent preempted or waiting on other threads), and its wall time by phase: the forward
  and the loss, ``backward()``, the optimizers' ``step()`` and ``zero_grad()`` (whose trace reads no host data:
  where it grows with T, the host's state did, not the work). ``--rounds`` repeats every ``T``'s
  process, the ``T`` alternating, and prints each round's ratios and their median.

  At a fixed batch, each feature brings its own bags: T = 100's step carries 100 times T = 1's ids (102,400)
  and rows, which the host joins, checks and moves, and which XLA:CPU's device work walks through on the
  same cores. ``--same-ids`` adds a run of T = 1 with the largest T's ids and table rows (its bags and rows
  that many times: one feature, one table, the same data): the largest T against it is the cost of the
  number of features alone.

Goals of issue [host] (printed): with ``concat=True`` ops at T = 100 ≤ 1.3× T = 1 and host reads
independent of T; with the dict output ≤ 3 ops per feature beyond T = 1; XLA trace at T = 100 ≤ 1.5×
T = 1, read levelled (both from the same host state; warm printed beside it).
``tests/modules/test_host_ops.py`` asserts the op counts' bounds (counts do not depend on the machine's speed; they
do on torch's thread count where the eager reference update runs in chunks of rows: at one thread T = 26's, whose
table is below the kernel path's size, takes 7 chunks of 2,048 rows and 279 ops, at two 1 chunk and 115).
The first-step compile against the number of tables is ``benchmarks/xla_tables.py --parts first-compile``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
READS = ("_local_scalar_dense",)
#: the extra XLA run of ``--same-ids``: T = 1 with the largest T's ids and table rows
SAME = "same-ids"
DATA_DEPENDENT = ("nonzero", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "masked_select")


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, by name (the overload packet)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class KJT:
    """A duck-typed ``torchrec.KeyedJaggedTensor``: ``keys()``, ``values()``, ``lengths()``, ``offsets()``,
    ``weights_or_none()`` (torchrec need not be installed)."""

    def __init__(self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor,
                 weights: torch.Tensor | None = None) -> None:
        self._keys, self._values, self._lengths, self._weights = keys, values, lengths, weights

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights


def build(t: int, device: Any = None, rows: int = 1000) -> tuple[Any, Any, Any, list[str]]:
    import torch_tpu_embedding as tte

    torch.manual_seed(0)
    features = {f"f{i:03d}": tte.FeatureConfig(tte.TableConfig(rows, 16, name=f"t{i:03d}", combiner="mean"),
                                               max_ids_per_bag=4) for i in range(t)}
    ec = tte.EmbeddingCollection(features, device=device)
    head = torch.nn.Linear(16 * t, 1).to(device)
    opt = tte.optim.Adam(ec.parameters(), lr=0.01)
    dense = torch.optim.SGD(head.parameters(), lr=0.01)
    return ec, head, (opt, dense), list(features)


def batches(names: list[str], n: int, form: str, batch: int = 256) -> list[Any]:
    import torch_tpu_embedding as tte

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = {f: torch.randint(0, 1000, (batch, 4), generator=g) for f in names}
        mask = {f: torch.rand(batch, 4, generator=g) > 0.25 for f in names}
        if form == "kjt":
            lengths = torch.cat([mask[f].sum(1) for f in names])
            values = torch.cat([ids[f][mask[f]] for f in names])
            out.append(KJT(names, values, lengths))
        else:
            out.append({f: tte.Padded(ids[f], mask[f]) for f in names})
    return out


def step(ec: Any, head: Any, opts: Any, x: Any, form: str, y: torch.Tensor) -> torch.Tensor:
    if form == "concat":
        act = ec(x, concat=True)
    else:
        out = ec(x)
        act = torch.cat([out[k] for k in sorted(out)], dim=1)
    loss = torch.nn.functional.mse_loss(head(act).squeeze(1), y)
    loss.backward()
    for o in opts:  # (tte's zero_grad clears the tables' pending row gradients too)
        o.step()
        o.zero_grad()
    return loss


def count_ops(t: int, form: str) -> dict[str, Any]:
    ec, head, opts, names = build(t)
    data = batches(names, 4, form)
    y = torch.zeros(256)
    for i in range(6):  # past the kernel switch (TTE_KERNEL_AFTER=2 below)
        step(ec, head, opts, data[i % 4], form, y)
    with OpCounter() as c:
        step(ec, head, opts, data[1], form, y)
    reads = sum(c.counts[n] for n in READS)
    dd = sum(c.counts[n] for n in DATA_DEPENDENT)
    return {"ops": sum(c.counts.values()), "reads": reads, "data_dependent": dd,
            "top": c.counts.most_common(8)}


class Leveller:
    """The largest ``T``'s own training step, run and waited for before a levelled step: a second model of ``t``
    features (:func:`build`), its batches and :func:`step`; whatever ``T`` traces next, the host's cores have just
    run that step's device work (XLA:CPU runs it on them)."""

    def __init__(self, t: int, dev: Any) -> None:
        self.ec, self.head, self.opts, names = build(t, dev)
        self.data = batches(names, 4, "concat")
        self.y = torch.zeros(256, device=dev)
        self.i = 0

    def run(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        step(self.ec, self.head, self.opts, self.data[self.i % 4], "concat", self.y)
        self.i += 1
        torch_xla.sync()
        xm.wait_device_ops()


class SyntheticLeveller:
    """A fixed XLA computation the size of the largest ``T``'s device step (sorting its 1,024 · T ids, an Adam-like
    update of its 1,000 · T rows of 16), run and waited for before a levelled step (``--synthetic-level``)."""

    def __init__(self, t: int, dev: Any) -> None:
        g = torch.Generator().manual_seed(2)
        self.rows, n = 1000 * t, 1024 * t
        self.keys = torch.randint(0, 2**31, (n,), generator=g).to(dev)
        self.dev, self.n = dev, n
        self.w, self.m, self.v = (torch.zeros(self.rows, 16, device=dev) for _ in range(3))

    def run(self) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        self.keys = (self.keys * 1103515245 + 12345) % 2**31
        rows = torch.sort(self.keys)[0] % self.rows
        g = torch.zeros(self.rows, 16, device=self.dev).index_add(0, rows, torch.ones(self.n, 16, device=self.dev))
        self.m = 0.9 * self.m + 0.1 * g
        self.v = 0.999 * self.v + 0.001 * g * g
        self.w = self.w - 0.001 * self.m / (self.v.sqrt() + 1e-8)
        torch_xla.sync()
        xm.wait_device_ops()


def trace_time(t: int, steps: int, level: int, scale: int = 1, idle_ms: float = 0.0,
               synthetic: bool = False) -> dict[str, Any]:
    """The XLA trace per step (see the module's text); ``level``: the largest T (levelled steps after its device
    work, or after :class:`SyntheticLeveller`'s where ``synthetic``; 0: none); ``scale``: the table's rows and the
    batch's bags that many times the usual (1,000 rows, 256 bags), so that one feature brings the ids and rows of
    ``scale`` features; ``idle_ms``: levelled steps after that long a sleep instead (the control: no work at all)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    dev = torch_xla.device()
    ec, head, opts, names = build(t, dev, rows=1000 * scale)
    data = batches(names, 4, "concat", batch=256 * scale)
    y = torch.zeros(256 * scale, device=dev)
    leveller = (SyntheticLeveller if synthetic else Leveller)(level, dev) if level and not idle_ms else None
    kinds: dict[str, list[tuple[float, float]]] = {"warm": [], "levelled": []}
    phases: dict[str, list[list[float]]] = {"warm": [], "levelled": []}  # forward and loss, backward, step
    for i in range(3 + (2 * steps if level else steps)):
        levelled = bool(level) and i % 2 == 1
        if leveller is not None and (levelled or i < 3):  # (its graph compiled in the first steps)
            leveller.run()
        elif levelled:
            time.sleep(idle_ms / 1e3)
        start, cpu = time.perf_counter(), time.thread_time()
        act = ec(data[i % 4], concat=True)  # (step()'s concat form, its three parts timed)
        loss = torch.nn.functional.mse_loss(head(act).squeeze(1), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        for o in opts:
            o.step()
            o.zero_grad()
        traced, cpu = time.perf_counter() - start, time.thread_time() - cpu
        torch_xla.sync()
        xm.wait_device_ops()
        if i >= 3:
            kinds["levelled" if levelled else "warm"].append((traced * 1e3, cpu * 1e3))
            phases["levelled" if levelled else "warm"].append(
                [(forward - start) * 1e3, (backward - forward) * 1e3, (traced - (backward - start)) * 1e3])
    out: dict[str, Any] = {}
    for kind, times in kinds.items():
        if times:
            wall = [w for w, _ in times]
            prefix = "trace" if kind == "warm" else "level_trace"
            out.update({f"{prefix}_ms": statistics.median(wall), f"{prefix}_ms_range": [min(wall), max(wall)],
                        f"{prefix}_cpu_ms": statistics.median(c for _, c in times),
                        f"{prefix}_phases_ms": [statistics.median(p[j] for p in phases[kind]) for j in range(3)]})
    return out


def child(args: argparse.Namespace) -> None:
    t = args.child
    out: dict[str, Any] = {"T": t}
    if args.xla:
        out.update(trace_time(t, args.steps, args.level, args.scale, args.idle_ms, args.synthetic_level))
    else:
        for form in ("dict", "concat", "kjt"):
            out[form] = count_ops(t, form)
    print(json.dumps(out))


def cpu_model() -> str:
    """The CPU's model name with its family, model and stepping (cloud machines name several CPUs "AMD EPYC")."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        if "model name" in fields:
            ids = ", ".join(f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields)
            return fields["model name"] + (f" ({ids})" if ids else "")
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=int, nargs="+", default=[1, 26, 100])
    p.add_argument("--steps", type=int, default=5, help="measured steps of each kind (warm, levelled) per process")
    p.add_argument("--rounds", type=int, default=1, help="XLA processes per T, the T alternating")
    level = p.add_mutually_exclusive_group()
    level.add_argument("--no-level", action="store_true", help="no levelled steps (warm ones only)")
    level.add_argument("--idle-ms", type=float, default=0.0,
                       help="levelled steps after this long a sleep instead of the device work (a control)")
    level.add_argument("--synthetic-level", action="store_true",
                       help="levelled steps after a fixed computation the size of the largest T's step instead")
    p.add_argument("--same-ids", action="store_true",
                   help="also trace T=1 with the ids and rows of the largest T (its bags and rows that many times)")
    p.add_argument("--no-xla", action="store_true")
    p.add_argument("--scale", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--level", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--xla", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args)
        return
    env = dict(os.environ, TTE_KERNEL_AFTER="2", OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               PYTHONPATH=str(REPO))
    rows: dict[int, dict[str, Any]] = {}
    for t in args.features:  # (op counts do not depend on the machine: one process per T)
        cmd = [sys.executable, __file__, "--child", str(t)]
        rows[t] = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
    rounds: list[dict[int, dict[str, Any]]] = []
    if not args.no_xla:
        xenv = dict(env, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
        for _ in range(args.rounds):
            got = {}
            runs: list[tuple[Any, int, int]] = [(t, t, 1) for t in args.features]
            if args.same_ids and max(args.features) > 1:
                runs.append((SAME, 1, max(args.features)))
            for key, t, scale in runs:
                cmd = [sys.executable, __file__, "--child", str(t), "--xla", "--steps", str(args.steps),
                       "--level", str(0 if args.no_level else max(args.features)), "--scale", str(scale),
                       *(["--idle-ms", str(args.idle_ms)] if args.idle_ms else []),
                       *(["--synthetic-level"] if args.synthetic_level else [])]
                res = subprocess.run(cmd, env=xenv, check=True, capture_output=True, text=True)
                got[key] = json.loads(res.stdout.strip().splitlines()[-1])
            rounds.append(got)
    print(f"CPU: {cpu_model()}, torch {torch.__version__}, {os.cpu_count()} cores")
    print(f"{'T':>4} | {'dict ops':>8} {'reads':>5} {'dd':>3} | {'concat ops':>10} {'reads':>5} {'dd':>3} | "
          f"{'kjt ops':>7} {'reads':>5} {'dd':>3}")
    for t, r in rows.items():
        cells = " | ".join(f"{r[f]['ops']:>{w}} {r[f]['reads']:>5} {r[f]['data_dependent']:>3}"
                           for f, w in (("dict", 8), ("concat", 10), ("kjt", 7)))
        print(f"{t:>4} | {cells}")
    lo, hi = min(rows), max(rows)
    if hi > lo:
        first, last = rows[lo], rows[hi]
        print(f"goals: concat ops T={hi}/T={lo} = {last['concat']['ops'] / first['concat']['ops']:.2f} "
              f"(≤ 1.3); dict ops per feature beyond T={lo}: "
              f"{(last['dict']['ops'] - first['dict']['ops']) / (hi - lo):.2f} (≤ 3); host reads "
              f"{[r['concat']['reads'] for r in rows.values()]} (independent of T)")
    for t, r in rows.items():
        print(f"T={t} most frequent ops (concat): {r['concat']['top']}")
    if not rounds:
        return
    kinds = [k for k in ("trace", "level_trace") if f"{k}_ms" in rounds[0][lo]]
    print(f"XLA trace per step, ms, median of {args.steps} steps per kind (wall; the Python thread's CPU in brackets)"
          + (f"; {SAME}: T=1 with T={hi}'s ids and rows" if SAME in rounds[0] else ""))
    name = {"trace": "warm", "level_trace": f"after {args.idle_ms:g} ms idle" if args.idle_ms
            else "levelled (synthetic)" if args.synthetic_level else "levelled"}

    def label(t: Any) -> str:  # a T, or the same-ids run
        return str(t) if t == SAME else f"T={t}"

    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for n, got in enumerate(rounds, 1):
        cells = []
        for k in kinds:
            shown = [*args.features, *([SAME] if SAME in got else [])]
            cells.append(f"{name[k]} " + " / ".join(f"{label(t)} {got[t][f'{k}_ms']:.2f} ({got[t][f'{k}_cpu_ms']:.2f})"
                                                    for t in shown))
            for base in (lo, SAME):
                if hi > lo and base in got:
                    ratio = (got[hi][f"{k}_ms"] / got[base][f"{k}_ms"],
                             got[hi][f"{k}_cpu_ms"] / got[base][f"{k}_cpu_ms"])
                    ratios.setdefault((k, str(base)), []).append(ratio)
                    cells[-1] += f", {label(hi)}/{label(base)} {ratio[0]:.2f} ({ratio[1]:.2f})"
        print(f"round {n}: " + "; ".join(cells))
        print("  phases, ms (forward and loss / backward / step() and zero_grad()): " + "; ".join(
            f"{name[k]} " + ", ".join(f"{label(t)} " + " / ".join(f"{x:.2f}" for x in got[t][f"{k}_phases_ms"])
                                      for t in [*args.features, *([SAME] if SAME in got else [])])
            for k in kinds))
    if hi > lo:
        read = ", ".join(f"{name[k]}{'' if base == str(lo) else ' against ' + base} "
                         f"{statistics.median(w for w, _ in v):.2f} ({statistics.median(c for _, c in v):.2f})"
                         for (k, base), v in ratios.items())
        print(f"goal: XLA trace T={hi}/T={lo} ≤ 1.5, read levelled; median over rounds, wall (CPU): {read}")

if __name__ == "__main__":
    main()
