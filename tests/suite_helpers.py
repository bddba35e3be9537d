"""Helpers the test suites share (tests/ is on ``sys.path``: tests/conftest.py; a spawned rank inherits it).

* A process-group test's ranks: :func:`free_port` (the parent's), :func:`init_rank` and :func:`finish_rank` (each
  rank's start and end in the ``tests/_*_worker.py`` modules); :func:`run_ranks`, each rank a worker script run as
  its ``__main__`` under a timeout, so that a hang fails the test instead of the suite; :func:`start_ranks`, each
  rank a function (``torch.multiprocessing.start_processes``). Both fork every rank, a fresh process per case, from
  one server that imported torch and the package once (:func:`rank_context`): a rank started as its own
  interpreter spent about 3 s importing them, most of such a case's time.
* ``tte.TrainPipeline``'s references: :func:`pipeline_batches`, the batches of the pipeline suites (tests/train,
  tests/xla), and :func:`train_by_hand`, the plain loop and TF's one-step-stale schedule written out by hand, which
  the pipeline must equal (tests/train/test_pipeline.py in one process, tests/_mp_pipe_worker.py over a group).
* A load that must change nothing when refused: :func:`snapshot_state` and :func:`same_state` (the checkpoint
  workers, tests/_mp_ckpt_worker.py and tests/_mp_ckpt_guard.py).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.placement import stored_rows

__all__ = ["finish_rank", "free_port", "init_rank", "pipeline_batches", "rank_context", "run_ranks", "run_script",
           "same_state", "same_tree", "snapshot_state", "start_ranks", "summed_bag_rows", "train_by_hand"]

#: the repository root (on a spawned rank's PYTHONPATH)
ROOT = Path(__file__).parents[1]


# ---------------------------------------------------------------------------------- process-group ranks
def free_port() -> int:
    """A TCP port free on this machine now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: what every rank imports before its own code: imported once, by the fork server (:func:`rank_context`).
#: ``torch._dynamo``: DistributedDataParallel imports it at its first forward (about 1 CPU s in every rank that
#: wraps a head in DDP); importing it starts no thread, so the server stays safe to fork.
PRELOAD = ["numpy", "pytest", "torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
           "torch.nn.parallel", "torch_tpu_embedding"]


def rank_context() -> multiprocessing.context.ForkServerContext:
    """The ``forkserver`` context the ranks start from. Its server (one per test process, started here the first
    time) imports :data:`PRELOAD` and nothing else: it runs no torch op, so it has no OpenMP threads and no
    process group, and each rank forked from it is a fresh process with those modules imported. The server's
    ``PYTHONPATH`` ends with the repository, as a rank's does (:func:`run_ranks`), so that the package is found
    there; every other setting is the test process's."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    # (the server inherits this process's environment: the only way to give it the package's path)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [before, str(ROOT)]))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], world: int) -> None:
    """``fn(rank, *args)`` in ``world`` ranks forked from :func:`rank_context`'s server; returns when every one
    has ended, and raises (stopping the others) with a failing rank's traceback, as
    ``torch.multiprocessing.start_processes`` does."""
    rank_context()
    mp.start_processes(fn, args=args, nprocs=world, start_method="forkserver")


def _script_rank(worker: str, args: list[str], env: dict[str, str], log: str) -> None:
    """One rank of :func:`run_ranks` (in a process forked from the server): ``python worker *args`` as that
    would run it, with ``env`` as its whole environment, its output (stdout and stderr) to the file ``log``."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)  # (the descriptors: what C++ (gloo, torch) writes goes there too)
    os.dup2(out, 2)
    os.close(out)
    # line-buffered: a worker may end in os._exit, which flushes nothing
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    # the server imported torch before OMP_NUM_THREADS was set: the rank's thread count set as the variable says
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [worker, *args]
    sys.path.insert(0, os.path.dirname(worker))  # as ``python worker`` puts the script's folder first
    runpy.run_path(worker, run_name="__main__")


def run_ranks(worker: Path, args: Sequence[str], world: int = 2, hang: float = 240, what: str = "") -> list[str]:
    """Run ``world`` ranks of ``python worker *args`` (``RANK``, ``WORLD_SIZE``, ``MASTER_*`` set, one OpenMP
    thread), each a process forked from :func:`rank_context`'s server that runs ``worker`` as its ``__main__``,
    and return each one's output, in rank order. A rank still running ``hang`` seconds after the one before it
    ended (two processes on a loaded machine take a few) is killed with the others, and the test fails naming
    ``what``, with the end of every rank's output."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
           "OMP_NUM_THREADS": "1"}
    ctx = rank_context()
    with tempfile.TemporaryDirectory(prefix="tte_ranks_") as logs:
        paths = [os.path.join(logs, f"rank{r}.log") for r in range(world)]
        procs = [ctx.Process(target=_script_rank, args=(str(worker), list(args), {**env, "RANK": str(r)}, paths[r]),
                             name=f"rank {r}") for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(hang)
            if p.is_alive():
                break
        hung = any(p.is_alive() for p in procs)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") if os.path.exists(f) else "" for f in paths]
    if hung:
        tails = "".join(f"\n--- rank {r}'s output (end):\n{t[-2000:]}" for r, t in enumerate(texts))
        pytest.fail(f"{what + ': ' if what else ''}a rank hung (still running after {hang} s){tails}", pytrace=False)
    return texts


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
