"""Runs for tests/distributed/test_mp_dcp_optim.py: one process per rank (gloo, CPU).

``clip``: tests/_dp_worker.py's data-parallel model with ``use_gradient_accumulation=False``, trained with
``tte.clip_grad_norm_`` at a ``max_norm`` it never reaches and without it: every value must be the same, bit
for bit. ``dcp``: tests/_mp_worker.py's model (row-wise, table-wise and replicated tables, a DDP head) sharded
with ``dtensor_state_dict=True``, trained 3 steps (in the middle of an accumulation window where the
optimizer accumulates), saved with torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` + ``dcp.save``, loaded into a model and
optimizer of other values through a fresh template (the same helpers + ``dcp.load`` + ``set_model_state_dict`` / ``set_optimizer_state_dict``),
and both trained 3 steps more: every rank's model and optimizer state must be the same, bit for bit.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import _dp_worker as D
import _mp_worker as W
import torch
import torch.distributed.checkpoint as dcp
from suite_helpers import finish_rank, init_rank
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.placement import stored_rows

O = tte.optim  # noqa: E741
#: every optimizer of tests/optim_registry.py at its registry defaults, and the options that keep state
#: beside the slots (a pending accumulation window, EMA, Adafactor's whole-table statistics)
DCP_CONFIGS: dict[str, tuple[Any, dict[str, Any]]] = {
    "sgd": (O.SGD, {"lr": 0.1}),
    "adagrad": (O.Adagrad, {"lr": 0.1}),
    "adagrad_momentum": (O.AdagradMomentum, {"lr": 0.1, "momentum": 0.9}),
    "adam": (O.Adam, {"lr": 0.1}),
    "lazy_adam": (O.LazyAdam, {"lr": 0.1}),
    "ftrl": (O.FTRL, {"lr": 0.1}),
    "adafactor": (O.Adafactor, {"lr": 0.1}),
    "rowwise_adagrad": (O.RowWiseAdagrad, {"lr": 0.1}),
    "adagrad-accum2": (O.Adagrad, {"lr": 0.1, "gradient_accumulation_steps": 2}),
    "adafactor-accum2-ema": (O.Adafactor, {"lr": 0.1, "gradient_accumulation_steps": 2, "use_ema": True}),
    "adam-accum2-ema": (O.Adam, {"lr": 0.1, "gradient_accumulation_steps": 2, "use_ema": True}),
}


def _state(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """The model's and the optimizer's state as stored on this rank (no collective), copied (the optimizer's
    ``state_dict`` shares its live tensors, which training on changes in place)."""
    with stored_rows():
        return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})


def clip(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for with_clip in (True, False):
        model = D.build("adagrad-noaccum", torch.float64, seed=0)
        ddp = tte.distributed.DistributedDataParallel(model)
        opt = D.make_opt("adagrad-noaccum", ddp.parameters())
        for step in range(3):
            batch, y = D.share(*D.global_batch(step, torch.float64, model), rank, world)
            opt.zero_grad()
            ((ddp(batch) - y) ** 2).mean().backward()
            if with_clip:
                tte.clip_grad_norm_(ddp.parameters(), 1e9)  # scales nothing
            opt.step()
        out[with_clip] = D.state(model, opt)
    return out


def _sharded(name: str, seed: int) -> tuple[W.Model, torch.nn.Module, Any]:
    model = W.Model(torch.float64, seed=seed)
    tte.distributed.shard(model, dtensor_state_dict=True)
    ddp = tte.distributed.DistributedDataParallel(model)
    cls, kw = DCP_CONFIGS[name]
    return model, ddp, cls(ddp.parameters(), **kw)


def dcp_round_trip(name: str, rank: int, world: int, path: str) -> dict[str, Any]:
    model, ddp, opt = _sharded(name, 0)
    W.train(model, ddp, opt, torch.float64, rank, world, steps=range(3))
    # the model's state through the model itself (torch's set_model_state_dict of the DDP wrapper looks a
    # stacked group's parameter up by its own name, which the model's state_dict keys per table)
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(ddp, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    fresh, ddp2, opt2 = _sharded(name, 300 + rank)  # other values: everything must come from the files
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(ddp2, opt2)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(ddp2, opt2, sd["optim"])
    loaded = (_state(model, opt), _state(fresh, opt2))
    W.train(model, ddp, opt, torch.float64, rank, world, steps=range(3, 6))
    W.train(fresh, ddp2, opt2, torch.float64, rank, world, steps=range(3, 6))
    return {"loaded": loaded, "trained": (_state(model, opt), _state(fresh, opt2)), "path": path}


def worker(rank: int, world: int, port: int, out_dir: str, job: str) -> None:
    init_rank(rank, world, port)
    results: dict[str, Any] = {}
    if job == "clip":
        results["clip"] = clip(rank, world)
    else:
        names = job.split(":", 1)[1].split(",") if ":" in job else list(DCP_CONFIGS)
        for name in names:
            results[name] = dcp_round_trip(name, rank, world, os.path.join(out_dir, f"dcp-{name}"))
    finish_rank(results, out_dir, rank)
