"""Distributed checkpoints of tables sharded over a process group (tests/distributed/test_mp_ckpt.py,
tests/distributed/test_mp_from_spmd.py, tests/xla_spmd/test_mp_interop.py): gloo workers, one process per rank.

The model, batches and loop are tests/_mp_worker.py's. :func:`model_with` builds that model with other
placements (torch_xla SPMD has no ``"table"`` placement) and the same initial values.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import os
from typing import Any

import _mp_worker as W
import torch
import torch.distributed as dist
from suite_helpers import finish_rank, init_rank, same_state, snapshot_state

import torch_tpu_embedding as tte

ACCUM = "adagrad-accum2-ema"  # gradient accumulation over 2 calls: a save after 5 steps is mid-window
#: the memory test's tables, row-sharded over 2 ranks: 2**12 rows of 64 float32 (warms the load's code
#: paths, not measured), then 2**19 and 2**20 rows (128 and 256 MiB: shards of 64 and 128 MiB)
MEMORY_ROWS, BIG_DIM = (1 << 12, 1 << 19, 1 << 20), 64


def model_with(placements: dict[str, str], dtype: torch.dtype = torch.float64, seed: int = 0,
               device: Any = None) -> W.Model:
    """tests/_mp_worker.py's model, each table placed by ``placements`` (its placement → another; e.g.
    ``{"table": "row"}``), on ``device``, with the values ``W.Model(dtype, seed)`` starts from."""
    base = W.Model(dtype, seed)
    tables: dict[str, tte.TableConfig] = {}

    def table(t: tte.TableConfig) -> tte.TableConfig:
        return tables.setdefault(t.name, dataclasses.replace(t, placement=placements.get(t.placement, t.placement)))

    features = {f: dataclasses.replace(fc, table=table(fc.table)) for f, fc in base.features.items()}
    ec = tte.EmbeddingCollection(features, device=device)
    ec.load_state_dict(base.ec.state_dict())
    base.features, base.ec = features, ec
    base.head.to(device)
    return base


def result(model: W.Model, opt: torch.optim.Optimizer) -> dict[str, Any]:
    tables = model.ec.physical_tables()
    sharded = {t: {"ids": tte.distributed.logical_ids(tables[t]), "rows": tables[t].weight.detach().clone()}
               for t in W.SHARDED}
    return {"sharded": sharded, "optimizer": opt.state_dict(),
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "skipped": getattr(opt, "skipped_steps", 0)}


def _resume(path: str, name: str, rank: int, w: int, steps: range) -> dict[str, Any] | None:
    """Ranks ``0 .. w-1`` of a new group load ``path`` (tte.checkpoint.load_distributed) into a model drawn
    from another seed and train ``steps``; every rank of the default group takes part in making the groups."""
    group, dense = dist.new_group(list(range(w))), dist.new_group(list(range(w)))
    out = None
    if rank < w:
        model = W.Model(torch.float64, seed=100 + rank)  # other values everywhere: all must come from the files
        tte.distributed.shard(model, group)
        ddp = tte.distributed.DistributedDataParallel(model, process_group=dense)
        opt = W.make_opt(name, ddp.parameters())
        extra = tte.checkpoint.load_distributed(path, model=model, optimizer=opt)
        W.train(model, ddp, opt, torch.float64, rank, w, steps=steps)
        out = result(model, opt) | {"extra": extra}
    dist.barrier()
    return out


def _refusal(path: str, rank: int) -> dict[str, Any]:
    """Loading ``path`` (saved with Adagrad) into a sharded model with an Adam optimizer, and into one
    whose table `big` is 8 wide: refused, and the model and optimizer are bitwise as before."""
    out: dict[str, Any] = {}
    for case in ("optimizer", "width"):
        model = W.Model(torch.float64, seed=5)
        if case == "width":
            features = dict(model.features)
            wide = dataclasses.replace(features["u"].table, embedding_dim=8)
            features["u"] = dataclasses.replace(features["u"], table=wide)
            features["u_seq"] = dataclasses.replace(features["u_seq"], table=wide)
            model.ec = tte.EmbeddingCollection(features)
            model.head = torch.nn.Linear(8 + 3 * 8 + 4 + 3 + 3 + 2 + 2, 1, dtype=torch.float64)
        tte.distributed.shard(model)
        ddp = tte.distributed.DistributedDataParallel(model)
        opt = W.make_opt("adam" if case == "optimizer" else ACCUM, ddp.parameters())
        opt.init_state()
        before = snapshot_state(model, opt)
        try:
            tte.checkpoint.load_distributed(path, model=model, optimizer=opt)
            out[case] = "loaded"
        except tte.checkpoint.CheckpointMismatchError as e:
            out[case] = str(e)
        out[f"{case}_unchanged"] = same_state(before, snapshot_state(model, opt))
    return out


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """World 4: the accumulation configuration saved after 5 steps (one call of a 2-call window pending)
    with tte.checkpoint.save_distributed, resumed at 2 and 3 ranks; a mismatched load refused."""
    init_rank(rank, world, port)
    path = os.path.join(out_dir, "accum")
    model = W.Model(torch.float64)
    tte.distributed.shard(model)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = W.make_opt(ACCUM, ddp.parameters())
    W.train(model, ddp, opt, torch.float64, rank, world, steps=range(5))
    pending = {n: opt.state[model.ec.physical_tables()[n].weight]["acc_ids"].clone() for n in W.SHARDED}
    # (each rank gives its own: rank 0's is saved)
    tte.checkpoint.save_distributed(path, model=model, optimizer=opt, extra={"step": 5, "rank": rank})
    results: dict[str, Any] = {"pending": pending}
    for w in (2, 3):
        results[w] = _resume(path, ACCUM, rank, w, range(5, W.STEPS))
    results["refusal"] = _refusal(path, rank)
    finish_rank(results, out_dir, rank)


def save_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """World ``world``: W.CKPT's configuration, 5 steps, tte.checkpoint.save_distributed to ``out_dir``/ckpt."""
    init_rank(rank, world, port)
    model = W.Model(torch.float64)
    tte.distributed.shard(model)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = W.make_opt(W.CKPT, ddp.parameters())
    W.train(model, ddp, opt, torch.float64, rank, world, steps=range(5))
    tte.checkpoint.save_distributed(os.path.join(out_dir, "ckpt"), model=model, optimizer=opt)
    dist.barrier()
    dist.destroy_process_group()


def resume_worker(rank: int, world: int, port: int, path: str, out_dir: str, name: str = W.CKPT) -> None:
    """World ``world``: load ``path`` (any kind of distributed checkpoint of optimizer configuration ``name``
    after 5 steps) and train 5 more; each rank's result to ``out_dir``/rank<r>.pt."""
    init_rank(rank, world, port)
    out = _resume(path, name, rank, world, range(5, W.STEPS))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _release_freed() -> None:
    """Give the memory already freed back to the system before a measurement (glibc's ``malloc_trim``;
    nothing elsewhere): freed memory left in malloc's heap would be reused by the load unseen, which
    could only hide part of its growth."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _sharded_table(rows: int, group: Any = None) -> tuple[tte.EmbeddingCollection, torch.optim.Optimizer]:
    """A ``rows``-row table (64 float32) row-sharded over ``group`` with Adagrad, every stored row and
    accumulator set from its logical id."""
    cfg = tte.TableConfig(rows, BIG_DIM, name="huge", placement="row", initializer=torch.nn.init.zeros_)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(cfg)})
    tte.distributed.shard(ec, group)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    opt.init_state()
    w = ec.tables["huge"].weight
    ids = tte.distributed.logical_ids(w).to(torch.float32)
    with torch.no_grad():
        w.copy_(ids[:, None] + torch.arange(BIG_DIM, dtype=torch.float32) / BIG_DIM)
        opt.state[w]["accumulators"].copy_(ids[:, None] * 2)
    return ec, opt


def _measured_load(rows: int, path: str, saved_alone: bool = False) -> dict[str, Any]:
    """:func:`_sharded_table` saved (``saved_alone``: by rank 0 alone, sharded over a group of one: every
    rank then keeps only some rows of each window it reads), then loaded into the table sharded over the
    default group, zeroed: the peak resident memory of the load over the memory before it (Linux: VmHWM
    after resetting it through /proc/self/clear_refs), and whether every row and accumulator came back."""
    if saved_alone:
        alone = dist.new_group([0])
        if dist.get_rank() == 0:
            model, optimizer = _sharded_table(rows, alone)
            tte.checkpoint.save_distributed(path, model=model, optimizer=optimizer)
            del model, optimizer
        dist.barrier()
    ec, opt = _sharded_table(rows)
    w = ec.tables["huge"].weight
    want_w, want_a = w.detach().clone(), opt.state[w]["accumulators"].clone()
    if not saved_alone:
        tte.checkpoint.save_distributed(path, model=ec, optimizer=opt)
    with torch.no_grad():
        w.zero_()
        opt.state[w]["accumulators"].zero_()
    dist.barrier()
    _release_freed()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident memory
    before = _kib("VmRSS")
    tte.checkpoint.load_distributed(path, model=ec, optimizer=opt)
    peak = _kib("VmHWM")
    w = ec.tables["huge"].weight
    out = {"delta": (peak - before) * 1024, "shard": w.numel() * w.element_size(),
           "weight": torch.equal(w, want_w), "accumulators": torch.equal(opt.state[w]["accumulators"], want_a)}
    dist.barrier()
    return out


def memory_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """:func:`_measured_load` of each of :data:`MEMORY_ROWS` in turn (the first warms the code paths a load
    runs: their first pages of code and lazily built state are not what a load stages), then of the
    second saved by rank 0 alone (``"resharded"``)."""
    init_rank(rank, world, port)
    out: dict[Any, Any] = {rows: _measured_load(rows, os.path.join(out_dir, f"t{rows}")) for rows in MEMORY_ROWS}
    out["resharded"] = _measured_load(MEMORY_ROWS[1], os.path.join(out_dir, "alone"), saved_alone=True)
    torch.save(out, os.path.join(out_dir, f"mem{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _measured_save(rows: int, path: str) -> dict[str, Any]:
    """:func:`_sharded_table` saved (tte.checkpoint.save_distributed → save_sharded): the peak resident memory
    of the save over the memory before it (VmHWM after resetting it), and whether a load into the table,
    zeroed, gives every row and accumulator back."""
    ec, opt = _sharded_table(rows)
    w = ec.tables["huge"].weight
    dist.barrier()
    _release_freed()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident memory
    before = _kib("VmRSS")
    tte.checkpoint.save_distributed(path, model=ec, optimizer=opt)
    peak = _kib("VmHWM")
    want_w, want_a = w.detach().clone(), opt.state[w]["accumulators"].clone()
    with torch.no_grad():
        w.zero_()
        opt.state[w]["accumulators"].zero_()
    tte.checkpoint.load_distributed(path, model=ec, optimizer=opt)
    out = {"delta": (peak - before) * 1024, "shard": w.numel() * w.element_size(),
           "weight": torch.equal(w, want_w), "accumulators": torch.equal(opt.state[w]["accumulators"], want_a)}
    dist.barrier()
    return out


def save_memory_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """:func:`_measured_save` of the first and the last of :data:`MEMORY_ROWS` (the first warms the code
    paths a save runs)."""
    init_rank(rank, world, port)
    out = {rows: _measured_save(rows, os.path.join(out_dir, f"s{rows}")) for rows in (MEMORY_ROWS[0], MEMORY_ROWS[2])}
    torch.save(out, os.path.join(out_dir, f"save{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def two_saves_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """World 2: two saves of a sharded table (the second with other values); rank r then loads save r, as if
    a third save had been published between the ranks' opening the path: every rank must refuse, unchanged.
    Then a save into a directory holding a user's file: refused by rank 0, raised on every rank."""
    init_rank(rank, world, port)
    ec, opt = _sharded_table(MEMORY_ROWS[0])
    paths = [os.path.join(out_dir, f"save{i}") for i in range(2)]
    tte.checkpoint.save_distributed(paths[0], model=ec, optimizer=opt)
    with torch.no_grad():
        ec.tables["huge"].weight.add_(1)
    tte.checkpoint.save_distributed(paths[1], model=ec, optimizer=opt)
    fresh, fresh_opt = _sharded_table(MEMORY_ROWS[0])
    with torch.no_grad():
        fresh.tables["huge"].weight.fill_(-1)
    before = snapshot_state(fresh, fresh_opt)
    try:
        tte.checkpoint.load_distributed(paths[rank], model=fresh, optimizer=fresh_opt)
        out: dict[str, Any] = {"error": None}
    except tte.checkpoint.CheckpointCorruptError as e:
        out = {"error": str(e)}
    out["unchanged"] = same_state(before, snapshot_state(fresh, fresh_opt))
    mine = os.path.join(out_dir, "mine")  # a save refused by rank 0 (a foreign file): raised on every rank
    if rank == 0:
        os.makedirs(mine)
        with open(os.path.join(mine, "notes.txt"), "w") as f:
            f.write("keep")
    dist.barrier()
    try:
        tte.checkpoint.save_distributed(mine, model=ec, optimizer=opt)
        out["refused"] = None
    except FileExistsError as e:
        out["refused"] = str(e)
    torch.save(out, os.path.join(out_dir, f"two{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
