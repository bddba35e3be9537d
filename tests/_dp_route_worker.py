"""Ranks for tests/distributed/test_dp_exchange_route.py: data parallel's two exchange routes on 2 gloo CPU
processes, and the host reads each exchange makes.

Each run trains tests/_dp_worker.py's model (no DDP, the head averaged by hand) for its steps and records,
per call of the exchange, how many times a tensor's values were read on the host inside it (on an
accelerator, each a wait for the device): ``aten::_local_scalar_dense`` (``.item()``, ``int(t)``,
``bool(t)``) and ``Tensor.tolist()``, which reads without dispatching an operator.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import _dp_worker as W
import torch
import torch.distributed as dist
from suite_helpers import finish_rank, init_rank
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows import dedup
from torch_tpu_embedding.distributed import grad_sync

#: the optimizers run both ways: one that sums duplicates first, one lazy with two slots, one without
#: gradient accumulation (its rows are sent as they are on both routes)
NAMES = ("adagrad", "lazy_adam", "adagrad-noaccum")


class ScalarReads(TorchDispatchMode):
    """Counts ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``bool(t)``) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.reads += 1
        return func(*args, **(kwargs or {}))


class ListReads(TorchFunctionMode):
    """Counts ``Tensor.tolist()`` while active."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.tolist:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_exchanges(static_on_cpu: bool) -> Iterator[list[tuple[int, int]]]:
    """Every exchange's host reads ``(_local_scalar_dense, tolist)``, in call order; ``static_on_cpu``: the
    CPU takes the static route. Sizes checked by an earlier run are forgotten (each run checks its own)."""
    real, per_call = grad_sync._exchange, []

    def exchange(items: Any, group: Any) -> None:
        with ListReads() as lists, ScalarReads() as scalars:
            real(items, group)
        per_call.append((scalars.reads, lists.reads))

    grad_sync._CHECKED_SIZES.clear()

    grad_sync._exchange = exchange  # type: ignore[assignment]
    if static_on_cpu:
        grad_sync.DEDUP_DEVICE_TYPES.discard("cpu")
    try:
        yield per_call
    finally:
        grad_sync._exchange = real  # type: ignore[assignment]
        grad_sync.DEDUP_DEVICE_TYPES.add("cpu")


def jagged(batch: dict[str, Any]) -> dict[str, Any]:
    """The padded features of a batch as jagged bags (row counts that follow each rank's ids)."""
    def cut(x: Any) -> Any:
        if not isinstance(x, tte.Padded):
            return x
        mask = torch.ones_like(x.ids, dtype=torch.bool) if x.mask is None else x.mask
        return tte.Jagged(x.ids[mask], lengths=mask.sum(1))

    return {k: cut(x) for k, x in batch.items()}


def _jagged_run(rank: int, world: int) -> dict[str, Any]:
    """Adagrad on jagged bags, as _dp_worker's plain run."""
    dtype = torch.float64
    model = W.build("adagrad", dtype, seed=0)
    opt = W.make_opt("adagrad", model.parameters())
    for step in range(W.STEPS):
        batch, y = W.share(*W.global_batch(step, dtype, model), rank, world)
        loss = ((model(jagged(batch)) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.head.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
    return W.state(model, opt)


@contextmanager
def sync_free_step(on: bool) -> Iterator[None]:
    """``on``: the optimizer takes an accelerator's path on the CPU (``_rows.dedup.HOST_READ_DEVICE_TYPES``
    emptied: static shapes, the sentinel tail written through the sink row), as a CUDA rank's step."""
    before = set(dedup.HOST_READ_DEVICE_TYPES)
    if on:
        dedup.HOST_READ_DEVICE_TYPES.clear()
    try:
        yield
    finally:
        dedup.HOST_READ_DEVICE_TYPES.update(before)


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    init_rank(rank, world, port)
    results: dict[str, Any] = {}
    for name in NAMES:
        # "accelerator": what a CUDA rank runs, the static route and the optimizer's sync-free path
        for route, static in (("dedup", False), ("static", True), ("accelerator", True)):
            with counted_exchanges(static) as reads, sync_free_step(route == "accelerator"):
                results[f"{route}/{name}"] = W._plain_run(name, torch.float64, rank, world)
            results[f"{route}/{name}/reads"] = reads
    with counted_exchanges(True) as reads:
        results["jagged"] = _jagged_run(rank, world)
    results["jagged/reads"] = reads
    finish_rank(results, out_dir, rank)
