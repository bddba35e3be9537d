"""``tte.TrainPipeline`` over a process group, for tests/distributed/test_mp_pipeline.py: one process per rank (gloo,
CPU), and the same models, batches and schedules written out by hand for the single-process references.

Two setups, each the one its own suite checks without a pipeline: tables sharded over the group
(``tte.distributed.shard`` of tests/_mp_worker.py's model: row-, table-wise and replicated tables, a DDP head; each
rank trains its share of tests/_mp_worker.py's global batches) and data parallel (tests/_dp_worker.py's model in
``tte.distributed.DistributedDataParallel``, the shares of its global batches). Each rank runs every optimizer of
:data:`OPTS` through ``TrainPipeline`` with input prefetch, and with pipelined execution
(``pipeline_execution_with_tensor_core=True``); the parent compares them with one process running the global
batches through tests/suite_helpers.py's ``train_by_hand``: the plain loop, and TF's one-step-stale schedule
written out.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import _dp_worker as DP
import _mp_worker as MP
import torch
import torch.distributed as dist
from suite_helpers import finish_rank, init_rank, train_by_hand

import torch_tpu_embedding as tte

OPTS = ("sgd", "adagrad", "lazy_adam")  # settings of tests/_dp_worker.py's OPTIMIZERS
SCHEDULES = ("prefetch", "pipelined")
STEPS = 6
DTYPE = torch.float64
Batch = dict[str, Any]


def _shares(suite: Any, rank: int, world: int, *model: Any) -> list[Batch]:
    """``suite``'s (tests/_mp_worker.py's or tests/_dp_worker.py's) global batches (``world == 1``), or rank
    ``rank``'s share of each; ``model``: for tests/_dp_worker.py's, the model they are drawn for."""
    out = []
    for s in range(STEPS):
        sparse, y = suite.share(*suite.global_batch(s, DTYPE, *model), rank, world)
        out.append({"sparse": sparse, "y": y})
    return out


def pg_batches(rank: int = 0, world: int = 1) -> list[Batch]:
    """tests/_mp_worker.py's global batches (``world == 1``), or rank ``rank``'s share of each."""
    return _shares(MP, rank, world)


def dp_batches(model: DP.Model, rank: int = 0, world: int = 1) -> list[Batch]:
    """tests/_dp_worker.py's global batches for ``model`` (``world == 1``), or rank ``rank``'s share of each."""
    return _shares(DP, rank, world, model)


def step(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """A step's loss, as both suites compute it: the mean squared error over the batch (a rank's share)."""
    return ((model(batch["sparse"]) - batch["y"]) ** 2).mean()


def make_opt(name: str, params: Any) -> torch.optim.Optimizer:
    cls, kw = DP.OPTIMIZERS[name]
    opt: torch.optim.Optimizer = cls(params, **kw)
    return opt


def pg_reference(name: str, schedule: str) -> dict[str, Any]:
    """One process on the global batches of the process-group setup (tests/_mp_worker.py's model, every table whole),
    in tests/_mp_worker.py's result form."""
    model = MP.Model(DTYPE)
    opt = make_opt(name, model.parameters())
    train_by_hand(model, [opt], pg_batches(), step, stale=schedule == "pipelined")
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict()}


def dp_reference(name: str, schedule: str) -> dict[str, Any]:
    """One process on the global batches of the data-parallel setup, in tests/_dp_worker.py's result form."""
    model = DP.build(name, DTYPE, seed=0)
    opt = make_opt(name, model.parameters())
    train_by_hand(model, [opt], dp_batches(model), step, stale=schedule == "pipelined")
    return DP.state(model, opt)


def _pipeline(wrapped: torch.nn.Module, opt: torch.optim.Optimizer, batches: list[Batch], schedule: str) -> None:
    pipe = tte.TrainPipeline(wrapped, opt, step=step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=schedule == "pipelined")
    assert sum(1 for _ in pipe.run(batches)) == STEPS and pipe.steps == STEPS
    assert not [t for t in threading.enumerate() if t.name == "tte-prefetch"]


def _pg_run(name: str, schedule: str, rank: int, world: int) -> dict[str, Any]:
    """The tables sharded over the group, the head in tte.distributed.DistributedDataParallel."""
    model = MP.Model(DTYPE)
    tte.distributed.shard(model)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = make_opt(name, ddp.parameters())
    _pipeline(ddp, opt, pg_batches(rank, world), schedule)
    return MP._result(model, opt)


def _dp_run(name: str, schedule: str, rank: int, world: int) -> dict[str, Any]:
    """Data parallel: every rank starts from other tables (the wrapper broadcasts rank 0's)."""
    model = DP.build(name, DTYPE, seed=rank)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = make_opt(name, ddp.parameters())
    _pipeline(ddp, opt, dp_batches(model, rank, world), schedule)
    return DP.state(model, opt)


RUNS: dict[str, Callable[[str, str, int, int], dict[str, Any]]] = {"pg": _pg_run, "dp": _dp_run}


class Recording(MP.Recording):
    """tests/_mp_worker.py's recording backend (every collective, DDP's C++ ones too, on gloo), each collective
    with the thread that issued it."""

    def _log(self, name: str, tensors: list[torch.Tensor], splits: tuple[Any, ...] = ()) -> None:
        super()._log(name, tensors, splits)
        MP.LOG[-1]["thread"] = threading.current_thread().name


def _create_recording(store: Any, rank: int, size: int, timeout: Any) -> Recording:
    return Recording(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size)


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_rank(rank, world, port, "recording", _create_recording)  # gloo, every collective recorded
    results: dict[str, Any] = {}
    for setup, run in RUNS.items():
        for name in OPTS:
            for schedule in SCHEDULES:
                MP.LOG.clear()
                results[f"{setup}/{name}/{schedule}"] = run(name, schedule, rank, world)
                results[f"collectives/{setup}/{name}/{schedule}"] = [(c["name"], c["thread"]) for c in MP.LOG]
    finish_rank(results, out_dir, rank)
