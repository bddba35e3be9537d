"""A model for tests/checkpoint/test_ckpt_crash_safe.py, and (run as a script) ``save_distributed`` killed at each step.

``python _crash_child.py WORK`` (see :func:`main`) saves a checkpoint, then saves another over it
in a forked child process that counts the disk operations of the save (each fsync, rename, replace,
unlink, rmdir, the first write to each file ``torch.distributed.checkpoint`` opens, and each
``torch.save`` into our temporary files) and kills itself with SIGKILL at operation ``k``: before
that operation, or, for a write, after half its bytes. Once per ``k``, until a save finishes. The
process imports torch once and forks per kill (a fresh interpreter per kill took ~30 s on 2 loaded cores).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from typing import Any

import torch

import torch_tpu_embedding as tte

D = 3


def build() -> tuple[torch.nn.ModuleDict, torch.optim.Optimizer]:
    """Two stacked tables, one unstacked (another width), a dense head; Adam with accumulation and EMA (every kind of state)."""
    torch.manual_seed(0)
    a = tte.TableConfig(12, D, name="a", dtype=torch.float64)
    b = tte.TableConfig(9, D, name="b", dtype=torch.float64)
    c = tte.TableConfig(7, D + 1, name="c", dtype=torch.float64, combiner="sum")  # another width: not stacked
    feats = {"fa": tte.FeatureConfig(a, max_ids_per_bag=2), "fb": tte.FeatureConfig(b), "fc": tte.FeatureConfig(c)}
    ec = tte.EmbeddingCollection(feats)
    m = torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(3 * D + 1, 1).to(torch.float64)})
    return m, tte.optim.Adam(m.parameters(), lr=0.05, gradient_accumulation_steps=2, use_ema=True)


def train(m: torch.nn.ModuleDict, opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` steps, then one more backward without a step (pending row gradients)."""
    for s in range(steps + 1):
        g = torch.Generator().manual_seed(s)
        batch = {"fa": tte.Jagged(torch.randint(0, 12, (5,), generator=g), lengths=torch.tensor([2, 1, 2])),
                 "fb": torch.randint(0, 9, (3,), generator=g), "fc": torch.randint(0, 7, (3,), generator=g)}
        out = m["ec"](batch)
        m["head"](torch.cat([out["fa"], out["fb"], out["fc"]], 1)).square().sum().backward()
        if s < steps:
            opt.step()
            opt.zero_grad()


class _Killer:
    def __init__(self, k: int) -> None:
        self.k, self.count = k, 0

    def due(self) -> bool:
        self.count += 1
        return self.count == self.k

    @staticmethod
    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class _Stream:
    """A file ``torch.distributed.checkpoint`` writes: killed half-way through its first write when due."""

    def __init__(self, stream: Any, killer: _Killer) -> None:
        self._stream, self._killer, self._first = stream, killer, True

    def write(self, data: Any) -> int:
        if self._first:
            self._first = False
            if self._killer.due():
                view = memoryview(data).cast("B")
                self._stream.write(view[: len(view) // 2])
                self._stream.flush()
                self._killer.die()
        return int(self._stream.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def patch(k: int) -> _Killer:
    killer = _Killer(k)

    def before(real: Any) -> Any:
        def op(*args: Any, **kwargs: Any) -> Any:
            if killer.due():
                killer.die()
            return real(*args, **kwargs)
        return op

    for name in ("fsync", "rename", "replace", "unlink", "rmdir"):
        setattr(os, name, before(getattr(os, name)))
    fs = __import__("torch.distributed.checkpoint.filesystem", fromlist=["FileSystem"]).FileSystem
    real_stream = fs.create_stream

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with real_stream(self, path, mode) as stream:
            yield _Stream(stream, killer) if "w" in mode else stream

    fs.create_stream = create_stream
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if ".tte-tmp-" in str(getattr(f, "name", "")) and killer.due():  # our temporary: half of it
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            killer.die()
        real_save(obj, f, *args, **kwargs)

    torch.save = save
    return killer


def _save_in_child(folder: str, model: torch.nn.Module, opt: torch.optim.Optimizer, k: int, counts: str) -> int:
    """Fork; the child saves with operation ``k`` killing it. Returns the child's exit status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            killer = patch(k)
            tte.checkpoint.save_distributed(folder, model=model, optimizer=opt)
            with open(counts, "w") as f:
                f.write(str(killer.count))
            code = 0
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1]


def main(work: str) -> None:
    """Save the old state (2 steps) as ``base``; then for k = 1, 2, ... until a save finishes: copy
    ``base`` to ``k<k>/ck`` and save the new state (4 steps) over it in a child killed at operation k.
    ``old.pt`` / ``new.pt``: both states written by ``tte.checkpoint.save`` (another code path)."""
    torch.set_num_threads(1)  # no thread pool in the forked children
    old, old_opt = build()
    train(old, old_opt, 2)
    new, new_opt = build()
    train(new, new_opt, 4)
    tte.checkpoint.save(os.path.join(work, "old.pt"), model=old, optimizer=old_opt)
    tte.checkpoint.save(os.path.join(work, "new.pt"), model=new, optimizer=new_opt)
    base = os.path.join(work, "base")
    tte.checkpoint.save_distributed(base, model=old, optimizer=old_opt)
    counts = os.path.join(work, "operations")
    for k in range(1, 200):
        folder = os.path.join(work, f"k{k}")
        os.makedirs(folder)
        shutil.copytree(base, os.path.join(folder, "ck"))
        status = _save_in_child(os.path.join(folder, "ck"), new, new_opt, k, counts)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        print(f"k={k} {'killed' if killed else f'status {status}'}", flush=True)
        if not killed:
            break


def ranks_worker(rank: int, world: int, port: int, work: str) -> None:
    """One rank of ``world`` (gloo): save over a checkpoint together, then load it; results in ``work``."""
    dist = __import__("torch.distributed", fromlist=["init_process_group"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = build()
    folder = os.path.join(work, "ck")
    train(model, opt, 2)
    tte.checkpoint.save_distributed(folder, model=model, optimizer=opt)
    train(model, opt, 2)
    tte.checkpoint.save_distributed(folder, model=model, optimizer=opt)  # over the first: every rank's files
    listing = sorted(os.listdir(work))  # published before any rank returns
    other, other_opt = build()
    tte.checkpoint.load_distributed(folder, model=other, optimizer=other_opt)
    tte.checkpoint.save(os.path.join(work, f"rank{rank}.pt"), model=other, optimizer=other_opt,
                        extra={"listing": listing, "files": sorted(os.listdir(folder))})
    if rank == 0:
        tte.checkpoint.save(os.path.join(work, "ref.pt"), model=model, optimizer=opt)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
