"""Communication per device vs the number of devices, for a row-sharded table at a fixed per-device batch.

Per device and step: 64 examples (``--batch``), one 8-id bag feature (sum) and one single-id feature on the same
65,536 × 64 float32 table, row-sharded; loss ``Σ out_a · out_b``; Adam. Inputs batch-sharded
(``shard_batch``). Ids uniform or Zipf(1.1) over the table (id 0 the most frequent, as in a vocabulary
sorted by frequency). For n = 2, 4, 8 virtual XLA:CPU devices (one subprocess per n):

* ``library``: today's path, ``EmbeddingCollection`` + ``tte.optim.Adam``, placement ``"row"``.
* ``exchange/<scheme>/<capacity>``: the id exchange prototype (``torch_tpu_embedding.xla.exchange``):
  ids routed to their owner shard, rows back, gradient rows to the owner, owner-local lazy Adam with
  chunk-aligned slots, gated on overflow. ``default`` capacity: ``default_capacity(576, n)``;
  ``sized`` (Zipf ids): ``capacity_for_load`` (1.25 × the largest per-shard load seen with the default
  capacity), TF's ``max_unique_ids_per_partition`` workflow.

Reported per path: the collective bytes per device of the training step, read from the optimized
(partitioned) HLO — the results of every ``all-reduce``/``all-gather``/``reduce-scatter``/``all-to-all``/
``collective-permute`` in the largest ``SyncTensorsGraph`` dump of the phase — the ideal
``2 · local ids · D · 4`` (each id's row in and its gradient out once), ms/step (median of the timed steps
after 2 warm-up steps, including the host's tracing; and ``ms exec``, the median of XLA's
``ExecuteReplicatedTime``: the compiled step alone. 2 shared cores run all n virtual devices, so times are
indicative only),
compiles in the timed steps, host fallbacks, ids dropped by overflow and the largest per-shard load.
Goals for the exchange (printed, not asserted): bytes at n = 8 ≤ 1.3 × bytes at n = 2 and ≤ 3 × ideal.

Run (from the repository root; about 10 minutes on 2 cores):

    PJRT_DEVICE=CPU OMP_WAIT_POLICY=PASSIVE python benchmarks/spmd_scaling.py [--devices 2 4 8] [--steps 8]
        [--batch 64] [--schemes interleaved range]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

ROWS, D, L = 65_536, 64, 8
B = 64  # examples per device (--batch)
IDS = B * (L + 1)  # ids per device per step
IDEAL = 2 * IDS * D * 4
LR = 1e-3


def batches(n: int, dist: str, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, ROWS + 1) ** 1.1
    p /= p.sum()

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        x = g.choice(ROWS, size=shape, p=p) if dist == "zipf" else g.integers(0, ROWS, size=shape)
        return torch.from_numpy(x)

    return [(draw((n * B, L)), draw((n * B,))) for _ in range(steps)]


def child(args: argparse.Namespace) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    xr.use_spmd()
    import torch_tpu_embedding as tte
    from torch_tpu_embedding.xla import device_mesh, shard, shard_batch
    from torch_tpu_embedding.xla.exchange import exchange_grad, exchange_lookup, largest_load, total_overflow
    from torch_tpu_embedding.xla.hlo import collective_bytes, step_hlo_path
    from torch_tpu_embedding.xla.manual import all_reduce, local_row_update, shard_local
    from torch_tpu_embedding.xla.ownership import (
        RowOwnership,
        capacity_for_load,
        default_capacity,
        slot_from_table_order,
    )

    n = xr.global_runtime_device_count()
    dev = torch_xla.device()
    mesh = device_mesh()
    dump = args.dump
    total = 2 + args.steps

    def library() -> Any:
        t = tte.TableConfig(ROWS, D, name="t", combiner="sum", placement="row", initializer=torch.nn.init.zeros_)
        ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=L), "b": tte.FeatureConfig(t)},
                                     device=dev)
        shard(ec, mesh)
        opt = tte.optim.Adam(ec.parameters(), lr=LR)
        opt.init_state()
        torch_xla.sync()

        def step(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
            a_x, b_x = shard_batch(a.to(dev), mesh), shard_batch(b.to(dev), mesh)
            out = ec({"a": tte.Padded(a_x), "b": b_x})
            (out["a"] * out["b"]).sum().backward()
            opt.step()
            opt.zero_grad()
            return {}

        return step

    def exchange(scheme: str, cap: int) -> Any:
        own = RowOwnership(scheme, ROWS, n, 512)
        table = torch.zeros(ROWS, D).to(dev)
        m = slot_from_table_order(torch.zeros(ROWS, D), 1, 512).to(dev)
        v = slot_from_table_order(torch.zeros(ROWS, D), 2, 512).to(dev)
        for x in (table, m, v):
            shard_batch(x, mesh)  # row-sharded, like placement "row"
        t_count = torch.zeros(1).to(dev).reshape(())
        lr = torch.tensor([LR]).to(dev).reshape(())
        torch_xla.sync()

        def adam(shards: list, inputs: list, rep: list) -> tuple[list, list]:
            w, ms, vs = shards
            ids, rows, overflow = inputs
            lr_l, t = rep
            gate = all_reduce(overflow.sum(), mesh) == 0
            bc = torch.sqrt(1 - 0.999**t) / (1 - 0.9**t)

            def rule(w0: torch.Tensor, g: torch.Tensor, s: dict) -> tuple[torch.Tensor, dict]:
                m1 = 0.9 * s["m"] + 0.1 * g
                v1 = 0.999 * s["v"] + 0.001 * g * g
                return w0 - lr_l * bc * m1 / (v1.sqrt() + 1e-7), {"m": m1, "v": v1}

            w1, s1 = local_row_update(rule, w, {"m": (ms, 1), "v": (vs, 2)}, ids, rows, ROWS // 512, gate)
            return [w1, s1["m"], s1["v"]], []

        def step(a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
            a_x, b_x = shard_batch(a.to(dev), mesh), shard_batch(b.to(dev), mesh)
            ids = torch.cat([a_x.reshape(n, B * L), b_x.reshape(n, B)], 1)
            rows, routing = exchange_lookup(table, ids, own, cap, mesh)
            rows = rows.detach().requires_grad_()
            out_a = rows[:, : B * L].reshape(n * B, L, D).sum(1)
            out_b = rows[:, B * L :].reshape(n * B, D)
            (out_a * out_b).sum().backward()
            local_ids, local_rows = exchange_grad(rows.grad, routing)
            with torch.no_grad():
                t_count.copy_(t_count + 1)
                shard_local(adam, [table, m, v], [local_ids, local_rows, routing.overflow], [lr, t_count], mesh=mesh)
            return {"overflow": total_overflow(routing), "load": largest_load(routing)}

        return step

    def phase(name: str, make: Any, dist: str) -> dict[str, Any]:
        before = set(glob.glob(os.path.join(dump, "*")))
        step = make()
        met.clear_all()
        times, overflow, load, compiles_warm = [], 0, 0, 0
        for i, (a, b) in enumerate(batches(n, dist, total)):
            t0 = time.perf_counter()
            extra = step(a, b)
            torch_xla.sync()
            xm.wait_device_ops()
            times.append(time.perf_counter() - t0)
            if extra:
                overflow += int(extra["overflow"].cpu())
                load = max(load, int(extra["load"].cpu()))
            if i == 1:
                compiles_warm = met.counter_value("UncachedCompile") or 0
        compiles_timed = (met.counter_value("UncachedCompile") or 0) - compiles_warm
        data = met.metric_data("ExecuteReplicatedTime")
        execs = [v / 1e6 for _, v in data[2]][-args.steps:] if data else [0.0]
        try:
            hlo = open(step_hlo_path(dump, before)).read()
            by_op = collective_bytes(hlo)
        except FileNotFoundError:  # same graph as an earlier phase: compiled once, no new dump
            by_op = {}
        return {"n": n, "path": name, "dist": dist, "bytes": by_op, "ms": 1000 * statistics.median(times[2:]),
                "exec_ms": statistics.median(execs),
                "compiles_timed": compiles_timed, "fallbacks": sorted(met.executed_fallback_ops()),
                "overflow": overflow, "largest_load": load}

    out = []
    for dist in ("uniform", "zipf"):
        out.append(phase("library", library, dist))
    default = default_capacity(IDS, n)
    for scheme in args.schemes:
        for dist in ("uniform", "zipf"):
            r = phase(f"exchange/{scheme}/default", lambda s=scheme: exchange(s, default), dist)
            r["capacity"] = default
            out.append(r)
        # Sized from the Zipf loads just seen (uniform ids need what the default gives them).
        cap = capacity_for_load(out[-1]["largest_load"])
        r = phase(f"exchange/{scheme}/sized", lambda s=scheme, c=cap: exchange(s, c), "zipf")
        r["capacity"] = cap
        out.append(r)
    print("RESULT " + json.dumps(out))


def parent(args: argparse.Namespace) -> None:
    rows: list[dict[str, Any]] = []
    for n in args.devices:
        with tempfile.TemporaryDirectory() as dump:
            env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(n),
                   "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep + \
                env.get("PYTHONPATH", "")
            cmd = [sys.executable, __file__, "--child", "--dump", dump, "--steps", str(args.steps), "--batch", str(B),
                   "--schemes", *args.schemes]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"n={n} failed:\n{proc.stderr[-4000:]}")
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
            rows.extend(json.loads(line[len("RESULT "):]))
    # A phase that reused an earlier phase's graph has the same bytes.
    for r in rows:
        if not r["bytes"]:
            same = [q for q in rows if q["n"] == r["n"] and q["bytes"] and q.get("capacity") == r.get("capacity")
                    and q["path"].rsplit("/", 1)[0] == r["path"].rsplit("/", 1)[0]]
            r["bytes"] = same[0]["bytes"] if same else {}
    print(f"rows={ROWS:,} D={D} per device: {B} examples × ({L}-id bag + 1 id) = {IDS} ids; Adam; "
          f"ideal 2·ids·D·4 = {IDEAL:,} B; torch threads={torch.get_num_threads()}; timed steps={args.steps}")
    head = ("| n | path | ids | capacity | bytes/device | all-to-all | all-reduce | all-gather | vs ideal | vs n=2 "
            "| ms/step | ms exec | dropped ids | largest load |")
    print(head)
    print("|" + "|".join(["---"] * (head.count("|") - 1)) + "|")
    first: dict[tuple[str, str], int] = {}
    for r in rows:
        total = sum(r["bytes"].values())
        key = (r["path"], r["dist"])
        first.setdefault(key, total)
        print(f"| {r['n']} | {r['path']} | {r['dist']} | {r.get('capacity', '-')} | {total:,} "
              f"| {r['bytes'].get('all-to-all', 0):,} | {r['bytes'].get('all-reduce', 0):,} "
              f"| {r['bytes'].get('all-gather', 0):,} | {total / IDEAL:.2f} | {total / max(first[key], 1):.2f} "
              f"| {r['ms']:.1f} | {r['exec_ms']:.1f} | {r['overflow']} | {r['largest_load'] or '-'} |")
        if r["compiles_timed"] or r["fallbacks"]:
            print(f"  !! {r['path']} n={r['n']}: {r['compiles_timed']} compiles in timed steps, "
                  f"fallbacks {r['fallbacks']}")
    lo, hi = min(args.devices), max(args.devices)
    for path in sorted({r["path"] for r in rows if r["path"].startswith("exchange")}):
        for dist in ("uniform", "zipf"):
            sel = {r["n"]: r for r in rows if r["path"] == path and r["dist"] == dist}
            if lo in sel and hi in sel:
                b_lo, b_hi = sum(sel[lo]["bytes"].values()), sum(sel[hi]["bytes"].values())
                ok = b_hi <= 1.3 * b_lo and b_hi <= 3 * IDEAL and sel[hi]["overflow"] == 0
                print(f"goal {path} {dist}: n={hi}/n={lo} = {b_hi / b_lo:.2f} (≤ 1.3), n={hi} vs ideal = "
                      f"{b_hi / IDEAL:.2f} (≤ 3), dropped ids {sel[hi]['overflow']}: {'met' if ok else 'MISSED'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="examples per device")
    ap.add_argument("--schemes", nargs="+", default=["interleaved", "range"])
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--dump", default="")
    args = ap.parse_args()
    global B, IDS, IDEAL
    B, IDS = args.batch, args.batch * (L + 1)
    IDEAL = 2 * IDS * D * 4
    child(args) if args.child else parent(args)


if __name__ == "__main__":
    main()
