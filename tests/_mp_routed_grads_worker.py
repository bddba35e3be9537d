"""One rank of tests/distributed/test_mp_routed_grads.py: a table sharded over 2 gloo processes, looked up by two
features, against plain torch in float64 written here (one process on the global batch).

Run as ``python tests/_mp_routed_grads_worker.py CASE OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (``suite_helpers.run_ranks``); writes ``OUT_DIR/rank<r>.pt``: the case's largest distances
from the reference, or the error it raised. ``CASE``:

- ``unused``: features ``u`` and ``v`` of one row-sharded table, lazy Adam, three steps: both used on both ranks,
  then ``u`` alone, then ``v`` used by rank 0's loss only. A feature a loss does not use touches no row (its rows and
  moments stay as they were), and every rank still takes part in the backward's exchange (no rank waits).
- ``autograd_grad``: ``torch.autograd.grad`` of the per-id weights adds no row, so the next ``backward`` and SGD
  step are one step; ``torch.autograd.grad`` of the table's weight is refused by table name, on every rank, before
  any exchange, and records nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from suite_helpers import finish_rank, init_rank
from torch import nn

import torch_tpu_embedding as tte

V, D, B, LR = 24, 3, 4, 0.1
WORLD = 2
INIT = torch.randn(V, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def ids(rank: int, step: int, feature: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + (feature == "v"))
    return torch.randint(0, V, (B,), generator=g)


def act_grad(rank: int, step: int, feature: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + 1000 * step + 10 * rank + (feature == "v"))
    return torch.randn(B, D, generator=g, dtype=torch.float64)


def used(rank: int, step: int) -> tuple[str, ...]:
    return (("u", "v"), ("u",), ("u", "v") if rank == 0 else ("u",))[step]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        t = tte.TableConfig(V, D, name="t", combiner="sum", dtype=torch.float64, initializer=INIT.clone(),
                            placement="row")
        self.ec = tte.EmbeddingCollection({"u": tte.FeatureConfig(t), "v": tte.FeatureConfig(t)})


def _by_logical(model: Model, stored: torch.Tensor) -> dict[int, torch.Tensor]:
    lids = tte.distributed.logical_ids(model.ec.tables.t)
    return {int(i): stored[j] for j, i in enumerate(lids) if int(i) < V}


def _distance(model: Model, stored: torch.Tensor, want: torch.Tensor) -> float:
    return max(float((row - want[i]).abs().max()) for i, row in _by_logical(model, stored).items())


def reference_adam() -> dict[str, torch.Tensor]:
    """Lazy Adam (betas 0.9, 0.999, eps 1e-7 inside the sqrt, no bias correction) on the global batch: each step the
    mean over the ranks of their losses' row gradients, on the rows the used features looked up only."""
    w, m, v = INIT.clone(), torch.zeros(V, D, dtype=torch.float64), torch.zeros(V, D, dtype=torch.float64)
    for step in range(3):
        g, touched = torch.zeros(V, D, dtype=torch.float64), torch.zeros(V, dtype=torch.bool)
        for r in range(WORLD):
            for f in used(r, step):
                g.index_add_(0, ids(r, step, f), act_grad(r, step, f) / WORLD)
                touched[ids(r, step, f)] = True
        m[touched] = 0.9 * m[touched] + 0.1 * g[touched]
        v[touched] = 0.999 * v[touched] + 0.001 * g[touched] ** 2
        w[touched] -= LR * m[touched] / torch.sqrt(v[touched] + 1e-14)
    return {"weight": w, "momenta": m, "velocities": v}


def unused(rank: int) -> dict[str, Any]:
    model = Model()
    tte.distributed.shard(model)
    opt = tte.optim.Adam(model.parameters(), lr=LR)
    for step in range(3):
        out = model.ec({f: ids(rank, step, f) for f in "uv"})
        sum((out[f] * act_grad(rank, step, f)).sum() for f in used(rank, step)).backward()
        opt.step()
        opt.zero_grad()
    want = reference_adam()
    weight = model.ec.tables.t.weight
    state = opt.state[weight]
    return {k: _distance(model, weight.detach() if k == "weight" else state[k], v) for k, v in want.items()}


_PER_ID = torch.tensor([0.5, 2.0, -1.0, 3.0], dtype=torch.float64)


def _loss(model: Model, rank: int, w: torch.Tensor) -> torch.Tensor:
    u = tte.Jagged(ids(rank, 0, "u"), lengths=torch.ones(B, dtype=torch.int64))
    out = model.ec({"u": u, "v": ids(rank, 0, "v")}, {"u": w, "v": None})
    return (out["u"] * act_grad(rank, 0, "u")).sum() + out["v"].square().sum()


def reference_sgd(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d loss_rank / d per-id weights, and the table after one SGD step of the mean of the ranks' losses."""
    t = INIT.clone().requires_grad_()
    losses = []
    for r in range(WORLD):
        w = _PER_ID.clone().requires_grad_()
        rows = t[ids(r, 0, "u")] * w.unsqueeze(1)
        losses.append(((rows * act_grad(r, 0, "u")).sum() + t[ids(r, 0, "v")].square().sum(), w))
    (gw,) = torch.autograd.grad(losses[rank][0], [losses[rank][1]], retain_graph=True)
    (gt,) = torch.autograd.grad(sum(loss for loss, _ in losses) / WORLD, [t])
    return gw, INIT - LR * gt


def autograd_grad(rank: int) -> dict[str, Any]:
    model = Model()
    tte.distributed.shard(model)
    opt = tte.optim.SGD(model.parameters(), lr=LR)
    want_gw, want_t = reference_sgd(rank)
    weight = model.ec.tables.t.weight
    out: dict[str, Any] = {}
    w = _PER_ID.clone().requires_grad_()
    try:
        torch.autograd.grad(_loss(model, rank, w), [weight, w])
    except RuntimeError as e:
        out["weight_refused"] = str(e)
    out["rows_after_refusal"] = sorted(model.ec.row_grads())
    (gw,) = torch.autograd.grad(_loss(model, rank, w), [w])
    out["gw"] = float((gw - want_gw).abs().max())
    out["rows_after_grad"] = sorted(model.ec.row_grads())
    _loss(model, rank, w).backward()
    opt.step()
    out["table"] = _distance(model, weight.detach(), want_t)
    return out


CASES = {"unused": unused, "autograd_grad": autograd_grad}


def main() -> None:
    rank, case, out_dir = int(os.environ["RANK"]), sys.argv[1], sys.argv[2]
    init_rank(rank, WORLD, int(os.environ["MASTER_PORT"]))
    try:
        results = CASES[case](rank)
    except Exception as e:  # (recorded for the test, which shows it)
        results = {"error": f"{type(e).__name__}: {e}"}
    finish_rank(results, out_dir, rank)


if __name__ == "__main__":
    main()
