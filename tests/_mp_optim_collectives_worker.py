"""One rank of tests/distributed/test_mp_optim_collectives.py: two row-sharded tables over 2 gloo processes.

Run as ``python tests/_mp_optim_collectives_worker.py CASE OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` set (``suite_helpers.run_ranks``); writes ``OUT_DIR/rank<r>.pt``. ``CASE``:

- ``counts``: for every optimizer of tte.optim (``CONFIGS``) with each option that sums over the ranks
  (``OPTIONS``), the ``torch.distributed.all_reduce`` calls its third ``step()`` makes (wrapped here), by name.
- ``clip_skip``: SGD with ``clipnorm`` and ``skip_nonfinite``, three steps, the second with a NaN gradient row on
  rank 1 only: each table's rows after each step, and the reference of plain torch in float64 written here.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from suite_helpers import finish_rank, init_rank
from torch import nn

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741
WORLD, B, STEPS = 2, 4, 3
VOCAB = {"a": 24, "b": 16}
DIM = {"a": 3, "b": 2}
INIT = {t: torch.randn(VOCAB[t], DIM[t], generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        for i, t in enumerate(VOCAB)}
#: every optimizer of tte.optim, at its defaults but for the learning rate (Adam lazy and not)
CONFIGS: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd": (O.SGD, {"lr": 0.2}),
    "adagrad": (O.Adagrad, {"lr": 0.2}),
    "adagrad_momentum": (O.AdagradMomentum, {"lr": 0.05, "momentum": 0.5}),
    "adam": (O.Adam, {"lr": 0.01}),
    "adam-nonlazy": (O.Adam, {"lr": 0.01, "lazy_adam": False}),
    "lazy_adam": (O.LazyAdam, {"lr": 0.01}),
    "ftrl": (O.FTRL, {"lr": 0.2}),
    "adafactor": (O.Adafactor, {"lr": 0.1}),
    "rowwise_adagrad": (O.RowWiseAdagrad, {"lr": 0.2}),
}
#: the options whose statistics are summed over the ranks
OPTIONS: dict[str, dict[str, Any]] = {
    "": {},
    "clipnorm": {"clipnorm": 0.05},
    "global_clipnorm": {"global_clipnorm": 0.05},
    "skip_nonfinite": {"skip_nonfinite": True},
    "global_clipnorm+skip_nonfinite": {"global_clipnorm": 0.05, "skip_nonfinite": True},
    "clipnorm+skip_nonfinite": {"clipnorm": 0.05, "skip_nonfinite": True},
}
CLIP, LR, NAN_STEP = 0.3, 0.5, 1


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        features = {f"f{t}": tte.FeatureConfig(tte.TableConfig(
            VOCAB[t], DIM[t], name=t, combiner="sum", dtype=torch.float64, initializer=INIT[t].clone(),
            placement="row")) for t in VOCAB}
        self.ec = tte.EmbeddingCollection(features)


def ids(rank: int, step: int, table: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + (table == "b"))
    return torch.randint(0, VOCAB[table], (B,), generator=g)


def act_grad(rank: int, step: int, table: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(5000 + 1000 * step + 10 * rank + (table == "b"))
    out = torch.randn(B, DIM[table], generator=g, dtype=torch.float64)
    if step == NAN_STEP and rank == 1 and table == "a":
        out[2, 1] = float("nan")
    return out


def backward(model: Model, rank: int, step: int) -> None:
    out = model.ec({f"f{t}": ids(rank, step, t) for t in VOCAB})
    sum((out[f"f{t}"] * act_grad(rank, step, t)).sum() for t in VOCAB).backward()


def counts(rank: int) -> dict[str, int]:
    calls = [0]
    inner = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return inner(*args, **kwargs)

    out = {}
    for name, (cls, kw) in CONFIGS.items():
        for option, more in OPTIONS.items():
            model = Model()
            tte.distributed.shard(model)
            opt = cls(model.parameters(), **kw, **more)
            for step in range(10, 10 + STEPS):  # (no NaN: the last one a steady step, every slot made)
                backward(model, rank, step)
                calls[0] = 0
                dist.all_reduce = counted  # the step's own calls: not the lookup's nor the backward's
                try:
                    opt.step()
                finally:
                    dist.all_reduce = inner
                opt.zero_grad()
            out[f"{name}+{option}" if option else name] = calls[0]
    return out


def reference_clip_skip() -> list[dict[str, torch.Tensor]]:
    """Each table after each step: the mean over the ranks of their losses' row gradients, clipped by its own norm
    (clipnorm), one SGD step; a step where any gradient is not finite changes nothing."""
    w = {t: INIT[t].clone() for t in VOCAB}
    out = []
    for step in range(STEPS):
        g = {t: torch.zeros(VOCAB[t], DIM[t], dtype=torch.float64) for t in VOCAB}
        for r in range(WORLD):
            for t in VOCAB:
                g[t].index_add_(0, ids(r, step, t), act_grad(r, step, t) / WORLD)
        if all(bool(torch.isfinite(x).all()) for x in g.values()):
            for t in VOCAB:
                norm = float(g[t].norm())
                w[t] = w[t] - LR * g[t] * (CLIP / max(norm, CLIP))
        out.append({t: w[t].clone() for t in VOCAB})
    return out


def unclipped_first_step() -> dict[str, torch.Tensor]:
    """The first step without the clip (to show that the clip is exercised)."""
    out = {}
    for t in VOCAB:
        g = torch.zeros(VOCAB[t], DIM[t], dtype=torch.float64)
        for r in range(WORLD):
            g.index_add_(0, ids(r, 0, t), act_grad(r, 0, t) / WORLD)
        out[t] = INIT[t] - LR * g
    return out


def clip_skip(rank: int) -> dict[str, Any]:
    model = Model()
    tte.distributed.shard(model)
    opt = O.SGD(model.parameters(), lr=LR, clipnorm=CLIP, skip_nonfinite=True)
    want = reference_clip_skip()
    dist_each: list[dict[str, float]] = []
    for step in range(STEPS):
        backward(model, rank, step)
        opt.step()
        opt.zero_grad()
        far = {}
        for t in VOCAB:
            table = getattr(model.ec.tables, t)
            lids = tte.distributed.logical_ids(table)
            real = lids < VOCAB[t]
            far[t] = float((table.weight.detach()[real] - want[step][t][lids[real]]).abs().max())
        dist_each.append(far)
    plain = unclipped_first_step()
    return {"distance": dist_each, "skipped": opt.skipped_steps,
            "clip_moves": min(float((want[0][t] - plain[t]).abs().max()) for t in VOCAB)}


CASES = {"counts": counts, "clip_skip": clip_skip}


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
