"""tte.distributed.shard's entry points on a gloo group, for tests/test_mp_entry.py: one process per rank, every
case in one spawn.

:func:`copies` checks that a sharded model's copies (``copy.deepcopy``, ``.float()``) keep its
``dtensor_state_dict`` choice in the model's ``state_dict`` and in its optimizer's (torch's helpers) alike.
:func:`refusals` makes the wrong calls a user can make on a process group and records each error and
whether the model changed.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import _mp_worker as W
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import torch_tpu_embedding as tte
from torch_tpu_embedding._pg_exchange import send_to_owners


def _kinds(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What each sharded table is in the model's ``state_dict`` and in torch's ``get_optimizer_state_dict`` (its
    row slots): ``"DTensor"`` or ``"Tensor"``, and the logical values of the model's entry gathered whole (the
    test compares copies by value)."""
    sd = model.state_dict()
    osd = get_optimizer_state_dict(model, opt)
    out: dict[str, Any] = {}
    for t in W.SHARDED:
        v = sd[f"ec.tables.{t}.weight"]
        slots = osd["state"][f"ec.tables.{t}.weight"]
        out[t] = {"model": type(v).__name__,
                  "value": v.full_tensor() if isinstance(v, DTensor) else v.clone(),
                  "slots": {k: type(s).__name__ for k, s in slots.items() if isinstance(s, torch.Tensor) and s.dim()}}
    return out


def copies(rank: int, world: int) -> dict[str, Any]:
    """For ``dtensor_state_dict`` True and False: a sharded model trained 2 steps, its ``copy.deepcopy`` (with a
    new optimizer of the copy's parameters, its slots created), and the copy moved by ``.float()``."""
    out: dict[str, Any] = {}
    for flag in (True, False):
        model = W.Model(torch.float64)
        tte.distributed.shard(model, dtensor_state_dict=flag)
        opt = W.make_opt("adagrad", model.parameters())
        W.train(model, model, opt, torch.float64, rank, world, steps=range(2))
        twin = copy.deepcopy(model)
        twin_opt = W.make_opt("adagrad", twin.parameters())
        out[f"{flag}/original"] = _kinds(model, opt)
        out[f"{flag}/deepcopy"] = _kinds(twin, twin_opt)
        twin.float()
        out[f"{flag}/float"] = _kinds(twin, W.make_opt("adagrad", twin.parameters()))
    return out


def _items(rank: int, world: int, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``m`` items of :func:`transport`: destinations, int64 tags ``rank·1000 + i`` and float64
    rows ``[m, 3]`` (every rank can draw every rank's)."""
    g = torch.Generator().manual_seed(rank * 100 + m)
    dest = torch.randint(0, world, (m,), generator=g)
    return dest, rank * 1000 + torch.arange(m), torch.randn(m, 3, generator=g, dtype=torch.float64)


def transport(rank: int, world: int) -> dict[str, Any]:
    """``_pg_exchange.send_to_owners`` for ``m`` items per rank (0 on every rank included): what this rank got,
    and what it should have got, worked out from every rank's draws (each sender's items to this rank in their
    order, padded to the largest bucket of any rank with the fill values)."""
    out = {}
    for m in (0, 1, 5, 17):
        dest, tags, rows = _items(rank, world, m)
        got_tags, got_rows = send_to_owners(dest, (tags, rows), (-1, 0.5), world, dist.group.WORLD)
        every = [_items(r, world, m) for r in range(world)]
        cap = max(1, max(int((d == o).sum()) for d, _, _ in every for o in range(world)))
        want_tags = torch.full((world * cap,), -1, dtype=torch.int64)
        want_rows = torch.full((world * cap, 3), 0.5, dtype=torch.float64)
        for r, (d, t, x) in enumerate(every):
            mine = d == rank
            want_tags[r * cap : r * cap + int(mine.sum())] = t[mine]
            want_rows[r * cap : r * cap + int(mine.sum())] = x[mine]
        out[m] = {"tags": torch.equal(got_tags, want_tags), "rows": torch.equal(got_rows, want_rows)}
    return out


def worker(rank: int, world: int, port: int, out_dir: str, job: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {"transport": transport(rank, world), "copies": copies(rank, world)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
