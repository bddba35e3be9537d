"""Helpers the test suites share (tests/ is on ``sys.path``: tests/conftest.py; a spawned rank inherits it).

* A process-group test's ranks: :func:`free_port` (the parent's), :func:`init_rank` and :func:`finish_rank` (each
  rank's start and end in the ``tests/_*_worker.py`` modules); :func:`run_ranks`, ranks started as torchrun
  starts them (one ``python`` each) under a timeout, so that a hang fails the test instead of the suite.
* ``tte.TrainPipeline``'s references: :func:`pipeline_batches`, the batches of the pipeline suites (tests/train,
  tests/xla), and :func:`train_by_hand`, the plain loop and TF's one-step-stale schedule written out by hand, which
  the pipeline must equal (tests/train/test_pipeline.py in one process, tests/_mp_pipe_worker.py over a group).
* A load that must change nothing when refused: :func:`snapshot_state` and :func:`same_state` (the checkpoint
  workers, tests/_mp_ckpt_worker.py and tests/_mp_ckpt_guard.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.placement import stored_rows

__all__ = ["finish_rank", "free_port", "init_rank", "pipeline_batches", "run_ranks", "run_script", "same_state", "same_tree",
           "summed_bag_rows",
           "snapshot_state", "train_by_hand"]

#: the repository root (on a spawned rank's PYTHONPATH)
ROOT = Path(__file__).parents[1]


# ---------------------------------------------------------------------------------- process-group ranks
def free_port() -> int:
    """A TCP port free on this machine now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(worker: Path, args: Sequence[str], world: int = 2, hang: float = 240, what: str = "") -> list[str]:
    """Start ``world`` ranks of ``python worker *args`` (``RANK``, ``WORLD_SIZE``, ``MASTER_*`` set, one OpenMP
    thread) and return each one's output, in rank order. A rank still running after ``hang`` seconds (two
    processes importing torch on a loaded machine take a few) is killed with the others, and the test fails
    naming ``what``."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(worker), *args], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=hang)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{what + ': ' if what else ''}a rank hung (still running after {hang} s)", pytrace=False)
    return logs


def run_script(script: str, timeout: float = 300) -> str:
    """Run ``python -c script`` with this checkout's package first on its path; assert it exits 0 (its stderr
    shown otherwise) and return its output (a process of its own: its exit, or its interpreter's, is the test)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def init_rank(rank: int, world: int, port: int, backend: str = "gloo",
              create: Callable[..., dist.ProcessGroup] | None = None) -> None:
    """Join the default group as rank ``rank`` of ``world`` on this machine, with one intra-op thread (ranks share
    the CPUs). ``create``: registers ``backend`` first (a recording backend of tests/_mp_worker.py)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if create is not None:
        dist.Backend.register_backend(backend, create, devices=["cpu"])
    dist.init_process_group(backend, rank=rank, world_size=world)


def finish_rank(results: dict[str, Any], out_dir: str, rank: int) -> None:
    """Save this rank's ``results`` as ``out_dir/rank<rank>.pt`` for the parent, then leave the group together."""
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------- a refused load changes nothing
def snapshot_state(model: torch.nn.Module, opt: torch.optim.Optimizer, stored: bool = False) -> list[torch.Tensor]:
    """Copies of ``model``'s state-dict tensors and ``opt``'s slots, for :func:`same_state` after a load. ``stored``:
    the tables' stored rows (``stored_rows()``), so that a model sharded with ``dtensor_state_dict=True`` runs no
    collective here (a rank whose load failed must not wait in one for the others)."""
    with stored_rows() if stored else contextlib.nullcontext():
        out = [v.detach().clone() for v in model.state_dict().values() if isinstance(v, torch.Tensor)]
    for slots in opt.state.values():
        out += [v.detach().clone() for v in slots.values() if isinstance(v, torch.Tensor)]
    return out


def same_state(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two :func:`snapshot_state` lists are bitwise equal."""
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def same_tree(a: Any, b: Any) -> bool:
    """Whether two nested structures (dicts, lists, tuples; a state dict) are equal: tensors of one dtype and equal
    values, containers of one type and length, other leaves ``==``."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def summed_bag_rows(table: str, features: Sequence[str], table_of: dict[str, str], ids: dict[str, Any],
                    act_grads: dict[str, Any], shape: tuple[int, int]) -> tuple[Any, set[int]]:
    """float64 numpy reference of one table's row gradient for bags of one id, sum combiner: each id's row gets its
    bag's activation gradient (``act_grads[f][i]`` for ``ids[f][i]``), summed over ``features`` that look ``table``
    up (``table_of[f]``); with the set of rows touched."""
    g, touched = np.zeros(shape), set()
    for f in features:
        if table_of[f] == table:
            for i, r in enumerate(ids[f]):
                g[r] += act_grads[f][i]
                touched.add(int(r))
    return g, touched


# ---------------------------------------------------------------------------------- the pipeline's references
def pipeline_batches(n: int, seed: int = 0, dtype: torch.dtype = torch.float64, last: int | None = None,
                     size: int = 6) -> list[dict[str, Any]]:
    """``n`` batches of ``size`` (the last of ``last`` where given): three features over two tables of 7 and 5 rows
    (``"a"`` padded with a mask, ``"b"`` dense, ``"c"`` jagged; ids repeat within and across batches, so a stale
    lookup reads rows updated since) and a ``"label"`` of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b = last if (last is not None and i == n - 1) else size
        lengths = torch.randint(0, 3, (b,), generator=g)
        out.append({
            "sparse": {
                "a": tte.Padded(torch.randint(0, 7, (b, 2), generator=g), torch.rand(b, 2, generator=g) > 0.3),
                "b": torch.randint(0, 5, (b,), generator=g),
                "c": tte.Jagged(torch.randint(0, 7, (int(lengths.sum()),), generator=g), lengths=lengths),
            },
            "label": torch.rand(b, generator=g, dtype=dtype),
        })
    return out


def train_by_hand(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], batches: Sequence[Any],
                  step: Callable[[Any, Any], torch.Tensor], stale: bool = False,
                  clip: Callable[[], Any] | None = None) -> None:
    """One process, by hand: per batch ``step(model, batch)``, backward, ``clip()`` (where given), every optimizer's
    ``step()``, then every ``zero_grad()``. ``stale``: TF's pipelined execution written out: step ``n`` looks up the tables as they were
    before update ``n - 1`` (steps 0 and 1 both read the initial tables), and its gradient is applied to the
    tables as they are."""
    tables = tte.split_parameters(model)[0] if stale else []
    before = [t.detach().clone() for t in tables]  # what the next step looks up
    for batch in batches:
        if stale:
            live = [t.detach().clone() for t in tables]
            with torch.no_grad():
                for t, s in zip(tables, before, strict=True):
                    t.copy_(s)
            loss = step(model, batch)  # (a lookup's backward reads its ids and gains, never the table's values)
            with torch.no_grad():
                for t, v in zip(tables, live, strict=True):
                    t.copy_(v)
            before = live
        else:
            loss = step(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        if clip is not None:
            clip()
        for o in optimizers:
            o.step()
        for o in optimizers:
            o.zero_grad()
