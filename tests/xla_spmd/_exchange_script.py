"""Training steps through the id exchange (torch_tpu_embedding.xla.exchange) against a float64 CPU reference.

A row-sharded table ``[R, D]`` in an ownership's physical order, lazy Adam slots ``m``, ``v`` in the chunked
slot layout (slot k: k trash rows after each of C chunks), a bag feature (mean over L ids, padding -1) and a
single-id feature per example, loss ``Σ ((mean_a · e_b) - y)²``. Each step is one graph: route ids → gather at
the owner → rows back → combine → backward → gradient rows to the owner → owner-local Adam (gated on overflow).

Used in process by test_exchange.py (4 devices) and as a script for other device counts:
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=n python _exchange_script.py '{"scheme": "interleaved", ...}'`` prints one
JSON line (errors vs the reference, compiles, fallbacks, shardings, overflow).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch

B1, B2, EPS = 0.9, 0.999, 1e-8
CHUNKS = 512  # the row block of a sharded table on 1..512 devices


def make_batches(n: int, cfg: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``steps`` batches ``(a [n·B, L] with -1 padding, b [n·B], y [n·B])``; ids uniform or Zipf over
    ``[0, V)`` (id 0 the most frequent)."""
    g = np.random.default_rng(cfg["seed"])
    b, length, v = cfg["B"], cfg["L"], cfg["V"]
    p = 1.0 / np.arange(1, v + 1) ** 1.1
    p /= p.sum()
    out = []
    for _ in range(cfg["steps"]):
        def draw(shape: tuple[int, ...]) -> np.ndarray:
            if cfg["dist"] == "zipf":
                return g.choice(v, size=shape, p=p)
            return g.integers(0, v, size=shape)
        a = draw((n * b, length))
        a[g.random((n * b, length)) < cfg["pad"]] = -1
        a[:, 0] = np.abs(a[:, 0])  # at least one id per bag
        bb = draw((n * b,))
        if cfg.get("dups"):  # every device repeats some of its ids
            a[:, -1] = a[:, 0]
        y = g.standard_normal(n * b)
        out.append((torch.from_numpy(a), torch.from_numpy(bb), torch.from_numpy(y)))
    return out


def loss_fn(rows_a: torch.Tensor, a: torch.Tensor, rows_b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``rows_a [N, L, D]`` (zero at padding), ``rows_b [N, D]``."""
    mask = (a >= 0).to(rows_a.dtype)
    mean = (rows_a * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    return (((mean * rows_b).sum(-1) - y) ** 2).sum()


def reference(w0: torch.Tensor, batches: list, lr: float) -> dict[str, torch.Tensor]:
    """Float64 lazy Adam (bias-corrected) on the logical table; every row touched in a step is updated once
    with the gradient summed over the global batch."""
    w, m, v = w0.double().clone(), torch.zeros_like(w0, dtype=torch.float64), torch.zeros_like(w0, dtype=torch.float64)
    gsum = []
    for t, (a, b, y) in enumerate(batches, 1):
        ra = w[a.clamp(min=0)].clone().requires_grad_()
        rb = w[b].clone().requires_grad_()
        loss_fn(ra * (a >= 0).unsqueeze(-1), a, rb, y.double()).backward()
        ids = torch.cat([a.reshape(-1), b])
        grads = torch.cat([(ra.grad * (a >= 0).unsqueeze(-1)).reshape(-1, w.shape[1]), rb.grad])
        keep = ids >= 0
        u, inv = torch.unique(ids[keep], return_inverse=True)
        g = torch.zeros(len(u), w.shape[1], dtype=torch.float64).index_add_(0, inv, grads[keep])
        gsum.append(g.sum(0))
        m[u] = B1 * m[u] + (1 - B1) * g
        v[u] = B2 * v[u] + (1 - B2) * g * g
        w[u] -= lr * np.sqrt(1 - B2**t) / (1 - B1**t) * m[u] / (v[u].sqrt() + EPS)
    return {"w": w, "m": m, "v": v, "gsum": torch.stack(gsum)}


def expected_load(n: int, a: torch.Tensor, b: torch.Tensor, own: Any) -> np.ndarray:
    """``[n_src, n_dst]`` distinct ids each device has for each shard, counted on the host."""
    ids = torch.cat([a.reshape(n, -1), b.reshape(n, -1)], 1)
    out = np.zeros((n, n), dtype=np.int64)
    for s in range(n):
        u = torch.unique(ids[s][ids[s] >= 0])
        out[s] = np.bincount(own.owner(u).numpy(), minlength=n)
    return out


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train ``cfg["steps"]`` steps on the current SPMD mesh; return the comparison (JSON-able)."""
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from torch_tpu_embedding.xla.exchange import exchange_grad, exchange_lookup, largest_load
    from torch_tpu_embedding.xla.manual import all_reduce, local_row_update, shard_local
    from torch_tpu_embedding.xla.ownership import RowOwnership, slot_from_table_order, slot_table_order
    from torch_tpu_embedding.xla.sharding import sharding_spec

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("x",))
    dev = torch_xla.device()
    r, d, b, length, lr = cfg["V"], cfg["D"], cfg["B"], cfg["L"], cfg["lr"]
    cap = cfg["capacity"] if "capacity" in cfg else cfg["total_slots"] // n
    own = RowOwnership(cfg["scheme"], r, n, CHUNKS)
    chunk_rows = r // CHUNKS
    w0 = torch.randn(r, d, generator=torch.Generator().manual_seed(1)) * 0.5
    phys_to_logical = own.logical_id(torch.arange(r))
    table = w0[phys_to_logical].to(dev)
    km, kv = cfg.get("slot_trash", (1, 2))  # trash rows per chunk of m and v
    m = slot_from_table_order(torch.zeros(r, d), km, CHUNKS).to(dev)
    v = slot_from_table_order(torch.zeros(r, d), kv, CHUNKS).to(dev)
    for t in (table, m, v):
        xs.mark_sharding(t, mesh, ("x", None))
    step = torch.zeros(1).to(dev).reshape(())
    lr_t = torch.tensor([lr]).to(dev).reshape(())
    torch_xla.sync()
    before = [sharding_spec(t) for t in (table, m, v)]
    met.clear_all()

    def adam_on_shard(shards: list, inputs: list, rep: list) -> tuple[list, list]:
        w, ms, vs = shards
        ids, rows, overflow = inputs
        lr_l, t = rep
        gate = all_reduce(overflow.sum(), mesh) == 0  # nothing updated in a step that dropped ids
        bc = torch.sqrt(1 - B2**t) / (1 - B1**t)

        def rule(w_r: torch.Tensor, g: torch.Tensor, s: dict) -> tuple[torch.Tensor, dict]:
            m1 = B1 * s["m"] + (1 - B1) * g
            v1 = B2 * s["v"] + (1 - B2) * g * g
            return w_r - lr_l * bc * m1 / (v1.sqrt() + EPS), {"m": m1, "v": v1}

        w1, s1 = local_row_update(rule, w, {"m": (ms, km), "v": (vs, kv)}, ids, rows, chunk_rows, gate)
        # Every shard's gradient rows summed over the mesh: the global [D] column sum.
        return [w1, s1["m"], s1["v"]], [all_reduce(rows.sum(0), mesh)]

    batches = make_batches(n, cfg)
    overflow, loads, gsum, compiles = [], [], [], []
    for a, bb, y in batches:
        a_x, b_x, y_x = a.to(dev), bb.to(dev), y.float().to(dev)
        for x in (a_x, b_x, y_x):
            xs.mark_sharding(x, mesh, ("x",) + (None,) * (x.dim() - 1))  # batch-sharded inputs
        ids = torch.cat([a_x.reshape(n, b * length), b_x.reshape(n, b)], 1)
        rows, routing = exchange_lookup(table, ids, own, cap, mesh)
        rows = rows.detach().requires_grad_()
        rows_a = rows[:, : b * length].reshape(n * b, length, d)
        rows_b = rows[:, b * length :].reshape(n * b, d)
        loss_fn(rows_a, a_x, rows_b, y_x).backward()
        local_ids, local_rows = exchange_grad(rows.grad, routing)
        with torch.no_grad():
            step.copy_(step + 1)
            (colsum,) = shard_local(adam_on_shard, [table, m, v], [local_ids, local_rows, routing.overflow],
                                    [lr_t, step], mesh=mesh)
        ov, ld = routing.overflow, largest_load(routing)
        torch_xla.sync()
        compiles.append(met.counter_value("UncachedCompile") or 0)
        overflow.append(ov.cpu().numpy())
        loads.append(int(ld.cpu()))
        gsum.append(colsum.cpu()[0].double())
    fallbacks = sorted(met.executed_fallback_ops())
    after = [sharding_spec(t) for t in (table, m, v)]
    logical = own.physical_row(torch.arange(r))
    got = {"w": table.cpu()[logical].double(),
           "m": slot_table_order(m.cpu(), km, CHUNKS)[logical].double(),
           "v": slot_table_order(v.cpu(), kv, CHUNKS)[logical].double()}
    exp_load = [expected_load(n, a, bb, own) for a, bb, _ in batches]
    exp_over = [np.maximum(x - cap, 0) for x in exp_load]
    out: dict[str, Any] = {
        "n": n, "capacity": cap, "compiles": compiles, "fallbacks": fallbacks, "before": before, "after": after,
        "overflow": [o.tolist() for o in overflow], "expected_overflow": [o.tolist() for o in exp_over],
        "largest_load": loads, "expected_largest_load": [int(x.max()) for x in exp_load],
        # how far the state moved from its initial value (w0, zero slots)
        "changed": {"w": float((got["w"] - w0.double()).abs().max()),
                    "m": float(got["m"].abs().max()), "v": float(got["v"].abs().max())},
    }
    if not any(o.any() for o in exp_over):
        ref = reference(w0, batches, lr)
        out["err"] = {k: float((got[k] - ref[k]).abs().max()) for k in got}
        out["err"]["gsum"] = float((torch.stack(gsum) - ref["gsum"]).abs().max())
        out["scale"] = {k: float(ref[k].abs().max()) for k in (*got, "gsum")}
    return out


DEFAULTS: dict[str, Any] = {"scheme": "interleaved", "V": 8192, "D": 8, "B": 16, "L": 4, "lr": 0.05, "pad": 0.25,
                            "dist": "zipf", "dups": True, "steps": 4, "seed": 0, "total_slots": 128}

if __name__ == "__main__":
    import torch_xla.runtime as xr

    xr.use_spmd()
    cfg = {**DEFAULTS, **(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})}
    print(json.dumps(run(cfg)))
