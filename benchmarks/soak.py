"""Soak: many training steps with flat memory and a constant compile count.

Eager CPU: 10,000 steps; XLA (PJRT_DEVICE=CPU, one device): 2,000 steps. A model with 3 tables (one
shared by two features), Adafactor with EMA and gradient accumulation on the tables' group, a dense
head; fresh random ids every step, a checkpoint every 250 steps (`--ckpt-every`). Prints the resident set size
after warm-up and at the end (growth must stay under 5%) and, on XLA, the compile count after
warm-up and at the end (must not change).

Run: PJRT_DEVICE=CPU python benchmarks/soak.py [--eager-steps 10000] [--xla-steps 2000] [--ckpt-every 250]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

import torch_tpu_embedding as tte


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run(device: torch.device, steps: int, warmup: int, ckpt_every: int) -> dict[str, float]:
    xla = device.type == "xla"
    met: Any = None
    if xla:
        import torch_xla
        import torch_xla.debug.metrics as met
    torch.manual_seed(0)
    user = tte.TableConfig(100_000, 16, name="user")
    item = tte.TableConfig(50_000, 16, name="item", combiner="sqrtn")
    tag = tte.TableConfig(1_000, 16, name="tag", combiner="sum")
    features = {"user": tte.FeatureConfig(user), "history": tte.FeatureConfig(item, max_ids_per_bag=8),
                "item": tte.FeatureConfig(item), "tags": tte.FeatureConfig(tag, max_ids_per_bag=4)}
    ec = tte.EmbeddingCollection(features, device=device)
    head = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    opt = tte.optim.Adafactor([{"params": list(ec.parameters())},
                               {"params": list(head.parameters())}], lr=0.01, use_ema=True,
                              gradient_accumulation_steps=2)
    opt.init_state()
    if xla:
        torch_xla.sync()
    folder = tempfile.mkdtemp()
    g = torch.Generator().manual_seed(1)
    b = 256
    marks: dict[str, float] = {}
    trace: list[int] = []
    start = time.perf_counter()
    for s in range(steps):
        lengths = torch.randint(0, 9, (b,), generator=g)
        batch = {"user": torch.randint(0, 100_000, (b,), generator=g),
                 "history": tte.Jagged(torch.randint(0, 50_000, (int(lengths.sum()),), generator=g), lengths=lengths),
                 "item": torch.randint(0, 50_000, (b,), generator=g),
                 "tags": tte.Padded(torch.randint(0, 1_000, (b, 4), generator=g))}
        out = ec(batch)
        x = torch.cat([out["user"], out["history"], out["item"], out["tags"]], 1)
        loss = torch.nn.functional.softplus(head(x)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if xla:
            torch_xla.sync()
        if (s + 1) % ckpt_every == 0:
            before = (met.counter_value("UncachedCompile") or 0) if xla else 0
            tte.checkpoint.save(os.path.join(folder, "soak.pt"), model=ec, optimizer=opt)
            # Reading the state to the host traces a few small graphs of its own: not training compiles.
            marks["compiles_ckpt"] = marks.get("compiles_ckpt", 0.0) + (
                (met.counter_value("UncachedCompile") or 0) - before if xla else 0)
            trace.append(round(rss_mib()))
        if s + 1 == warmup:
            marks["rss_warm"] = rss_mib()
            marks["compiles_warm"] = float(met.counter_value("UncachedCompile") or 0) if xla else 0.0
            marks["ckpt_at_warm"] = marks.get("compiles_ckpt", 0.0)
    marks["rss_end"] = rss_mib()
    marks["compiles_end"] = float(met.counter_value("UncachedCompile") or 0) if xla else 0.0
    # Training-step compiles after warm-up: total growth minus what checkpoint reads traced.
    marks["train_compiles_after_warm"] = (marks["compiles_end"] - marks["compiles_warm"]
                                          - (marks.get("compiles_ckpt", 0.0) - marks.get("ckpt_at_warm", 0.0)))
    print(f"  {device.type}: RSS (MiB) at each checkpoint: {trace}", flush=True)
    marks["ms_per_step"] = 1000 * (time.perf_counter() - start) / steps
    marks["steps"] = steps
    return marks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eager-steps", type=int, default=10_000)
    ap.add_argument("--xla-steps", type=int, default=2_000)
    ap.add_argument("--ckpt-every", type=int, default=250, help="steps between checkpoint saves")
    args = ap.parse_args()
    print(f"torch threads={torch.get_num_threads()} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}")
    xla_device = None
    if args.xla_steps:
        import torch_xla

        xla_device = torch_xla.device()  # before any backward: autograd sizes its device queues once
    # Warm-up ends after a checkpoint: the first save's host buffers are part of the steady state.
    rows = []
    if args.eager_steps:
        eager = run(torch.device("cpu"), args.eager_steps, max(1000, args.ckpt_every), args.ckpt_every)
        rows.append(("eager CPU", eager))
    if xla_device is not None:
        xla = run(xla_device, args.xla_steps, max(200, args.ckpt_every), args.ckpt_every)
        rows.append(("XLA:CPU, 1 device", xla))
    print(f"{'':20s} {'steps':>6s} {'ms/step':>8s} {'RSS warm':>9s} {'RSS end':>8s} {'growth':>7s} "
          f"{'step compiles after warm-up':>28s}")
    for name, m in rows:
        growth = 100 * (m["rss_end"] - m["rss_warm"]) / m["rss_warm"]
        compiles = f"{m['train_compiles_after_warm']:.0f}" if name.startswith("XLA") else "-"
        print(f"{name:20s} {m['steps']:6.0f} {m['ms_per_step']:8.2f} {m['rss_warm']:8.0f}M {m['rss_end']:7.0f}M "
              f"{growth:6.2f}% {compiles:>28s}")


if __name__ == "__main__":
    main()
