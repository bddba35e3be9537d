"""One rank of tests/distributed/test_mp_optim_collectives.py: two row-sharded tables over 2 gloo processes.

Run as ``python tests/_mp_optim_collectives_worker.py CASE OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` set (``suite_helpers.run_ranks``); writes ``OUT_DIR/rank<r>.pt``. ``CASE``:

- ``counts``: for every optimizer of tte.optim (``CONFIGS``) with each option that sums over the ranks
  (``OPTIONS``), the ``torch.distributed.all_reduce`` calls its third ``step()`` makes (wrapped here), by name.
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
    return torch.randn(B, DIM[table], generator=g, dtype=torch.float64)


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
            for step in range(STEPS):  # the last one steady: every slot made
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


CASES = {"counts": counts}


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
