"""``tte.TrainPipeline`` against the plain loop: a step with heavy host input, with and without prefetch.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/pipeline.py [--device cpu|xla] [--steps 20] [--threads 1]

The input is deliberately heavy on the host: 26 jagged features (lengths 0–``--max-len``), each padded to a
``Padded [B, max_len]`` by the data source (as a user's input function does), then prepared by the collection
(range checks, the group's id assembly, the transfer). One stacked group of 26 tables, ``mean`` bags, a
``Linear`` head on ``concat=True``, Adagrad; ``--device xla`` runs on XLA:CPU (``PJRT_DEVICE=CPU``) with
``after_step=torch_xla.sync``.

Printed per round (``--rounds``, each measuring everything in turn), median ms per steady step over
``--steps`` steps (after 3 warm-up steps, before the last), in one process (defaults: batch 2048, bags of
up to 8 ids, tables of 1,000 × 4: a light step, so the input's share shows):

* ``host input``: the source's padding plus ``EmbeddingCollection.prepare`` for one batch, alone;
* ``step, inputs ready``: a step whose inputs were prepared before the clock started;
* ``plain loop``: the two one after the other (what a loop without the pipeline pays);
* ``prefetch``: ``TrainPipeline`` (the input work on its thread) — goal ≤ 1.2 × max(host input, step);
* ``pipelined``: with ``pipeline_execution_with_tensor_core=True`` as well, against ``prefetch``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import torch_tpu_embedding as tte

F = 26


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except Exception:  # noqa: BLE001 (a figure's label only)
        return platform.processor() or "unknown"


def build(device: Any, vocab: int, dim: int) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], Any]:
    torch.manual_seed(0)
    feats = {f"f{i:02d}": tte.FeatureConfig(tte.TableConfig(vocab, dim, name=f"t{i:02d}")) for i in range(F)}
    ec = tte.EmbeddingCollection(feats, device=device)
    head = torch.nn.Linear(F * dim, 1).to(device)
    model = torch.nn.ModuleDict({"ec": ec, "head": head})
    tables, dense = tte.split_parameters(model)
    return model, [tte.optim.Adagrad(tables, lr=0.05), torch.optim.SGD(dense, lr=0.01)], ec


def raw_batches(n: int, batch: int, max_len: int, vocab: int) -> list[dict[str, Any]]:
    """Jagged features as a reader gives them: values and lengths (padding is the source's work, per step)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        feats = {}
        for i in range(F):
            lengths = torch.randint(0, max_len + 1, (batch,), generator=g)
            feats[f"f{i:02d}"] = (torch.randint(0, vocab, (int(lengths.sum()),), generator=g), lengths)
        out.append({"jagged": feats, "label": torch.rand(batch, generator=g)})
    return out


def pad(raw: dict[str, Any], max_len: int) -> dict[str, Any]:
    """The source's host work: every jagged feature padded to ``Padded [B, max_len]``."""
    sparse = {}
    for name, (values, lengths) in raw["jagged"].items():
        mask = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)
        ids = torch.zeros(lengths.shape[0], max_len, dtype=torch.int64)
        ids[mask] = values
        sparse[name] = tte.Padded(ids, mask)
    return {"sparse": sparse, "label": raw["label"]}


def step_fn(device: Any) -> Callable[[Any, Any], torch.Tensor]:
    def step(model: Any, batch: Any) -> torch.Tensor:
        act = model["ec"](batch["sparse"], concat=True)
        return torch.nn.functional.mse_loss(model["head"](act).squeeze(1), batch["label"].to(device))
    return step


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=["cpu", "xla"], default="cpu")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dim", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="rounds of every measurement, one after the other")
    p.add_argument("--threads", type=int, default=1,
                   help="torch's intra-op threads (1: the step on one core, the prefetch thread on another)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sync: Callable[[], Any] = lambda: None  # noqa: E731
    if args.device == "xla":
        import torch_xla  # (an optional dependency: only for --device xla)

        device: Any = torch_xla.device()
        sync = torch_xla.sync
    else:
        device = torch.device("cpu")
    warm, n = 3, args.steps + 1
    raws = raw_batches(warm + n, args.batch, args.max_len, args.vocab)
    step = step_fn(device)

    def finish() -> None:
        sync()
        if args.device == "xla":
            import torch_xla.core.xla_model as xm

            xm.wait_device_ops()

    def one_round() -> dict[str, float]:
        # host input alone
        model, opts, ec = build(device, args.vocab, args.dim)
        host = []
        for r in raws:
            t0 = time.perf_counter()
            prepared = ec.prepare(pad(r, args.max_len)["sparse"])
            host.append(time.perf_counter() - t0)
            del prepared
        # step, inputs ready
        ready = [pad(r, args.max_len) for r in raws]
        prepared_all = [ec.prepare(b["sparse"]) for b in ready]
        finish()
        alone = []
        for i, (b, pr) in enumerate(zip(ready, prepared_all, strict=True)):
            t0 = time.perf_counter()
            with ec.use_prepared(pr):
                step(model, b).backward()
            for o in opts:
                o.step()
                o.zero_grad()
            finish()
            if i >= warm:
                alone.append(time.perf_counter() - t0)

        def timed(make: Callable[[], Iterator[Any]]) -> list[float]:
            """Each step's time from the end of the one before; the last step is not counted: it has no next batch
            to look up ahead (on XLA another graph, compiled once)."""
            times, t0 = [], time.perf_counter()
            for i, _ in enumerate(make()):
                if args.device == "xla":
                    import torch_xla.core.xla_model as xm

                    xm.wait_device_ops()
                now = time.perf_counter()
                if i >= warm:
                    times.append(now - t0)
                t0 = now
            return times[:-1]

        def source() -> Iterator[Any]:
            for r in raws:
                yield pad(r, args.max_len)

        def plain() -> Iterator[Any]:
            model, opts, _ = build(device, args.vocab, args.dim)
            for b in source():
                loss = step(model, b)
                loss.backward()
                for o in opts:
                    o.step()
                    o.zero_grad()
                finish()
                yield loss

        def piped(stale: bool) -> Callable[[], Iterator[Any]]:
            def run() -> Iterator[Any]:
                model, opts, _ = build(device, args.vocab, args.dim)
                pipe = tte.TrainPipeline(model, opts, step=step, features=lambda b: b["sparse"], concat=True,
                                         pipeline_execution_with_tensor_core=stale, after_step=sync)
                yield from pipe.run(source())
            return run

        results = {"plain loop": timed(plain), "prefetch": timed(piped(False)), "pipelined": timed(piped(True))}
        return {"host input": median_ms(host[warm:]), "step, inputs ready": median_ms(alone),
                **{name: median_ms(times) for name, times in results.items()}}

    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model()}; torch {torch.__version__}; "
          f"device {args.device}; threads {torch.get_num_threads()}; OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', '')}; batch {args.batch}, {F} features, max_len {args.max_len}; "
          f"median ms of {args.steps} steady steps per round, the rounds one after the other")
    names = ["host input", "step, inputs ready", "plain loop", "prefetch", "pipelined"]
    print("round | " + " | ".join(names) + " | prefetch / max(host, step) (goal ≤ 1.2) | plain / (host + step)"
          " | pipelined / prefetch")
    ratios = []
    for r in range(args.rounds):
        m = one_round()
        ratio = (m["prefetch"] / max(m["host input"], m["step, inputs ready"]),
                 m["plain loop"] / (m["host input"] + m["step, inputs ready"]), m["pipelined"] / m["prefetch"])
        ratios.append(ratio)
        print(f"{r + 1:>5} | " + " | ".join(f"{m[k]:.2f}" for k in names) + " | "
              + " | ".join(f"{x:.2f}" for x in ratio))
    print("ranges: " + "; ".join(f"{label} {min(x[i] for x in ratios):.2f}–{max(x[i] for x in ratios):.2f}"
                                 for i, label in enumerate(["prefetch / max", "plain / sum", "pipelined / prefetch"])))


if __name__ == "__main__":
    main()
