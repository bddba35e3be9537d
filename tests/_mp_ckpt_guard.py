"""Checkpoint scenarios of tests/_mp_guard_worker.py (``ckpt_*``): one rank's part of a load or a save fails, the
others' would pass. Each rank records the error it got and whether its model and optimizer are bitwise unchanged,
then meets the others at a barrier (the job's next collective), which it reaches only if no rank hangs.

* ``ckpt_damaged_file``: each rank loads its own copy of a ``save_sharded`` directory (as on disks of their own),
  rank 1's ``rows-1.pt`` has a byte flipped (its size kept): only rank 1's checks fail, before any collective.
* ``ckpt_mismatch``: the same directory, rank 1 loads with Adam a checkpoint of Adagrad: only rank 1's checks fail.
* ``ckpt_dcp_damaged_file``: data parallel, a ``save_distributed`` directory loaded through
  ``torch.distributed.checkpoint`` (its collectives), rank 1's copy of ``tte_meta.pt`` damaged.
* ``ckpt_dcp_write_fails``: data parallel, a ``save_distributed`` directory read in place through
  ``torch.distributed.checkpoint``; on rank 1 alone the check after the read finds a file changed (injected: as
  a file copied into that rank's directory while DCP read it), after every rank's checks agreed.
* ``ckpt_dcp_extra_state_fails``: data parallel, a ``save_distributed`` directory of a model with a module's extra
  state, whose ``set_extra_state`` raises on rank 1 alone (the user's load code, run before anything is written).
* ``ckpt_dtensor_wrong_table``: ``shard(..., dtensor_state_dict=True)``; rank 1's ``load_state_dict`` is given another
  table's DTensor for table ``item``: refused there before the rows' move, which every other rank makes.
* ``ckpt_dtensor_optim_wrong_slot``: the same sharding, Adagrad; torch's ``set_optimizer_state_dict`` where rank 1's
  state holds table ``who``'s accumulator DTensor for table ``item``: refused there before the slots' moves.
* ``ckpt_dtensor_optim_bad_lr_on_one_rank``: the same; rank 1's state has a negative ``lr``, refused by the
  checks that run after the slots' moves.
* ``ckpt_dtensor_optim_plain_on_one_rank`` / ``ckpt_dtensor_optim_plain_on_every_rank``: the same; every table's
  DTensor slots given as plain tensors (the rank's stored rows, as the optimizer's own layout holds them) on rank 1 only
  (the others give the DTensors), or on every rank.
* ``ckpt_dtensor_plain_on_one_rank`` / ``ckpt_dtensor_plain_on_every_rank``: the same sharding; ``load_state_dict`` of
  a state taken a step earlier, where table ``item``'s entry is a plain tensor (the rank's stored rows) on rank 1
  only (the others give the DTensor), or on every rank.
* ``ckpt_dtensor_whole_plain_on_every_rank``: the same, every rank given table ``who``'s whole logical rows (other
  values) as a plain tensor: rank 0, which stores ``who`` whole, would take them, rank 1 (which stores none) not.
* ``ckpt_dtensor_item_missing_on_one_rank``: the same, ``strict=False``; rank 1's state has no entry for table
  ``item``, so its first move is table ``who``'s while rank 0's is table ``item``'s.
* ``ckpt_save_rows`` / ``ckpt_save_publish``: ``save_sharded`` over a good checkpoint; rank 1's rows file cannot be
  written (a full disk), or rank 0 cannot publish: nothing is published, the old checkpoint stays.
* ``ckpt_optimizer_on_rank_0_save`` / ``ckpt_optimizer_on_rank_0_load``: ``save_sharded`` over a good checkpoint, or
  ``load_sharded`` of it, given the optimizer on rank 0 and ``None`` on rank 1.
* ``ckpt_file_cut``: ``tte.checkpoint.load`` of a one-process ``save`` file into the sharded model, each rank its own
  copy, rank 1's cut short: only rank 1's read fails; then rank 0's copy, loaded on every rank.
* ``ckpt_torch_layout`` / ``ckpt_torch_layout_dtensor``: the optimizer made to give torch.optim's layout
  (``tte.optim.use_torch_layout``; the second sharded with ``dtensor_state_dict=True``, where its ``state_dict()``
  is a collective): ``save_sharded`` after 2 steps, ``load_sharded`` after a third; ``restored``: the model and
  optimizer bitwise as saved.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from suite_helpers import same_state, snapshot_state
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.placement import stored_rows
from torch_tpu_embedding.checkpoint import snapshot
from torch_tpu_embedding.distributed import sharded_save
from torch_tpu_embedding.optim._state import state_load

__all__ = ["run"]


def _train(model: nn.Module, opt: Any, rank: int, steps: range, batch: Any) -> None:
    for step in steps:
        ids, label = batch(rank, step)
        F.binary_cross_entropy_with_logits(model(ids), label).backward()
        opt.step()
        opt.zero_grad()


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the size kept: found by the checksum
    file.write_bytes(bytes(data))


def _own_copy(saved: Path, out: Path, rank: int, damaged: str) -> Path:
    """Rank ``rank``'s copy of ``saved``; rank 1's file ``damaged`` altered."""
    mine = out / f"copy{rank}"
    shutil.copytree(saved, mine)
    if rank == 1:
        _flip(mine / damaged)
    return mine


def _load(load: Any, path: Path, model: nn.Module, opt: Any) -> dict[str, Any]:
    """``load(path, model, opt)``'s error, whether it changed nothing, and how often it checked the optimizer's
    state (``checks``: once per load, tests/optim/test_state_checked_once.py, here over a process group too)."""
    before = snapshot_state(model, opt, stored=True)  # (no collective: each rank's stored rows)
    real, checks = state_load.state_problems, []

    def counted(*args: Any) -> list[str]:
        checks.append(1)
        return real(*args)

    state_load.state_problems = counted  # (the module's name: every check of a load goes through it)
    try:
        load(path, model, opt)
        got: dict[str, Any] = {"errors": []}
    except Exception as e:  # noqa: BLE001 - recorded
        got = {"errors": [{"type": type(e).__name__, "message": str(e)}]}
    finally:
        state_load.state_problems = real
    return got | {"unchanged": same_state(before, snapshot_state(model, opt, stored=True)), "checks": len(checks)}


def _digest(path: Path) -> dict[str, str]:
    return {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in sorted(os.listdir(path))}


def run(scenario: str, rank: int, model: nn.Module, batch: Any, out: Path) -> dict[str, Any]:
    """``scenario`` on this rank (``model``: built, not sharded; ``batch(rank, step)``: a training batch)."""
    saved = out / "saved"
    if scenario == "ckpt_dcp_damaged_file":
        dp = tte.distributed.data_parallel(model)
        opt = tte.optim.Adagrad(dp.parameters(), lr=0.1)
        _train(dp, opt, rank, range(2), batch)
        tte.checkpoint.save_distributed(saved, model=model, optimizer=opt)
        mine = _own_copy(saved, out, rank, "tte_meta.pt")
        _train(dp, opt, rank, range(2, 3), batch)
        got = _load(lambda p, m, o: tte.checkpoint.load_distributed(p, model=m, optimizer=o), mine, model, opt)
        dist.barrier()
        return got
    if scenario == "ckpt_dcp_write_fails":
        dp = tte.distributed.data_parallel(model)
        opt = tte.optim.Adagrad(dp.parameters(), lr=0.1)
        _train(dp, opt, rank, range(2), batch)
        tte.checkpoint.save_distributed(saved, model=model, optimizer=opt)
        if rank == 1:
            check = snapshot.Seal.check

            def changed(self: Any, written: bool = False) -> None:
                if written:
                    raise tte.checkpoint.CheckpointCorruptError(f"{saved}: a file changed while read (injected)")
                check(self, written)
            snapshot.Seal.check = changed  # type: ignore[method-assign]
        got = _load(lambda p, m, o: tte.checkpoint.load_distributed(p, model=m, optimizer=o), saved, model, opt)
        dist.barrier()
        return got
    if scenario == "ckpt_dcp_extra_state_fails":
        dp = tte.distributed.data_parallel(model)
        opt = tte.optim.Adagrad(dp.parameters(), lr=0.1)
        _train(dp, opt, rank, range(2), batch)
        whole = nn.ModuleDict({"model": model, "tally": _Tally(4)})
        tte.checkpoint.save_distributed(saved, model=whole, optimizer=opt)
        _train(dp, opt, rank, range(2, 3), batch)
        tally = whole["tally"]
        assert isinstance(tally, _Tally)
        tally.seen, tally.refuse = 9, rank == 1
        got = _load(lambda p, m, o: tte.checkpoint.load_distributed(p, model=m, optimizer=o), saved, whole, opt)
        dist.barrier()
        return got | {"tally": tally.seen}
    if scenario == "ckpt_dtensor_wrong_table":  # rank 1 loads table `who`'s DTensor into table `item`
        tte.distributed.shard(model, dtensor_state_dict=True)
        sd = model.state_dict()  # (a collective: every rank's rows to their logical blocks)
        if rank == 1:
            sd["ec.tables.item.weight"] = sd["ec.tables.who.weight"]
        try:
            model.load_state_dict(sd)
            got: dict[str, Any] = {"errors": []}
        except Exception as e:  # noqa: BLE001 - recorded
            got = {"errors": [{"type": type(e).__name__, "message": str(e)}]}
        dist.barrier()
        return got
    if scenario.startswith("ckpt_dtensor_"):
        return _dtensor(scenario, rank, model, batch)
    if scenario.startswith("ckpt_torch_layout"):
        return _torch_layout(scenario, rank, model, batch, saved)
    if scenario == "ckpt_file_cut":
        return _file(rank, model, batch, out)
    tte.distributed.shard(model)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = tte.optim.Adagrad(ddp.parameters(), lr=0.1)
    _train(ddp, opt, rank, range(2), batch)
    tte.distributed.save_sharded(saved, model, opt)
    if scenario.startswith("ckpt_save_"):
        before = _digest(saved)
        _train(ddp, opt, rank, range(2, 3), batch)
        failing, name = (1, "write_rows") if scenario == "ckpt_save_rows" else (0, "publish")
        if rank == failing:
            def full(*args: Any, **kwargs: Any) -> None:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            setattr(sharded_save, name, full)
        try:
            tte.distributed.save_sharded(saved, model, opt)
            got = {"errors": []}
        except Exception as e:  # noqa: BLE001 - recorded
            got = {"errors": [{"type": type(e).__name__, "message": str(e)}]}
        dist.barrier()
        return got | {"kept": _digest(saved) == before, "left": sorted(os.listdir(out))}
    if scenario.startswith("ckpt_optimizer_on_rank_0_"):
        before = _digest(saved)
        _train(ddp, opt, rank, range(2, 3), batch)
        given = opt if rank == 0 else None
        call = tte.distributed.save_sharded if scenario.endswith("_save") else tte.distributed.load_sharded
        got = _load(lambda p, m, o: call(p, m, given), saved, model, opt)
        dist.barrier()
        return got | {"kept": _digest(saved) == before}
    if scenario == "ckpt_damaged_file":
        mine = _own_copy(saved, out, rank, "rows-1.pt")
    elif scenario == "ckpt_mismatch":
        mine = saved
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    _train(ddp, opt, rank, range(2, 3), batch)
    if scenario == "ckpt_mismatch" and rank == 1:
        opt = tte.optim.Adam(ddp.parameters(), lr=0.1)  # (its slots are made by the load, for its checks)
    got = _load(tte.distributed.load_sharded, mine, model, opt)
    dist.barrier()
    return got


def _file(rank: int, model: nn.Module, batch: Any, out: Path) -> dict[str, Any]:
    """``ckpt_file_cut``: a one-process ``tte.checkpoint.save`` file (the model whole, Adagrad, 2 steps of rank 0's
    batches on every rank: equal everywhere), each rank its own copy, rank 1's cut short; the sharded model loads
    its copy (refused), then rank 0's (``rows``: whether each rank's stored rows and accumulators of the sharded
    tables are bitwise the file's at their logical ids)."""
    opt = tte.optim.Adagrad(model.parameters(), lr=0.1)
    _train(model, opt, 0, range(2), lambda _, step: batch(0, step))
    tte.checkpoint.save(out / f"one{rank}.pt", model=model, optimizer=opt)
    if rank == 1:
        (out / "one1.pt").write_bytes((out / "one1.pt").read_bytes()[:-100])
    saved = torch.load(out / "one0.pt", weights_only=True)
    tte.distributed.shard(model)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = tte.optim.Adagrad(ddp.parameters(), lr=0.1)
    _train(ddp, opt, rank, range(2, 3), batch)
    got = _load(lambda p, m, o: tte.checkpoint.load(p, model=m, optimizer=o), out / f"one{rank}.pt", model, opt)
    dist.barrier()
    tte.checkpoint.load(out / "one0.pt", model=model, optimizer=opt)
    rows = True
    for name in ("item", "who"):
        table = model.ec.tables[name]
        ids = tte.distributed.logical_ids(table)
        real = ids < table.config.num_embeddings
        want = saved["model"][f"ec.tables.{name}.weight"][ids[real]]
        slot = saved["optimizer"]["state"][f"table:{name}"]["accumulators"][ids[real]]
        rows &= torch.equal(table.weight.detach()[real], want)
        rows &= torch.equal(opt.state[table.weight]["accumulators"][real], slot)
    return got | {"rows": rows}


class _Tally(nn.Module):
    """A module with an extra state whose ``set_extra_state`` refuses it where ``refuse`` is set."""

    def __init__(self, seen: int) -> None:
        super().__init__()
        self.seen, self.refuse = seen, False

    def get_extra_state(self) -> Any:
        return {"seen": self.seen}

    def set_extra_state(self, state: Any) -> None:
        if self.refuse:
            raise ValueError("the tally refused its saved state (injected)")
        self.seen = state["seen"]


def _dtensor(scenario: str, rank: int, model: nn.Module, batch: Any) -> dict[str, Any]:
    """The ``ckpt_dtensor_*`` scenarios after the first: a state taken after 2 steps, loaded after a third."""
    tte.distributed.shard(model, dtensor_state_dict=True)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = tte.optim.Adagrad(ddp.parameters(), lr=0.1)
    _train(ddp, opt, rank, range(2), batch)
    if scenario == "ckpt_dtensor_optim_wrong_slot":  # rank 1: table `who`'s accumulator DTensor for table `item`
        osd = get_optimizer_state_dict(ddp, opt)  # (collectives: every rank's slots to their logical blocks)
        _train(ddp, opt, rank, range(2, 3), batch)
        key = {k.split(".")[-2]: k for k in osd["state"]}
        if rank == 1:
            osd["state"][key["item"]]["accumulators"] = osd["state"][key["who"]]["accumulators"]
        got = _load(lambda p, m, o: set_optimizer_state_dict(ddp, o, osd), Path(), model, opt)
        dist.barrier()
        return got
    if scenario.startswith("ckpt_dtensor_optim_"):
        return _optim(scenario, rank, model, ddp, opt, batch)
    sd = model.state_dict()  # (a collective)
    with stored_rows():
        stored = model.state_dict()["ec.tables.item.weight"].detach().clone()
    if scenario == "ckpt_dtensor_whole_plain_on_every_rank":  # table `who` (table-wise: rank 0 stores it whole)
        sd["ec.tables.who.weight"] = sd["ec.tables.who.weight"].full_tensor() + 1  # (a collective)
        got = _load(lambda p, m, o: m.load_state_dict(sd), Path(), model, opt)  # (nothing trained since sd)
        dist.barrier()
        return got
    if scenario == "ckpt_dtensor_item_missing_on_one_rank":
        if rank == 1:  # (strict=False on every rank: rank 1's first move is table `who`'s)
            del sd["ec.tables.item.weight"]
    elif scenario == "ckpt_dtensor_plain_on_every_rank" or rank == 1:
        sd["ec.tables.item.weight"] = stored  # this rank's stored rows, as a plain tensor
    elif scenario != "ckpt_dtensor_plain_on_one_rank":
        raise SystemExit(f"unknown scenario {scenario!r}")
    _train(ddp, opt, rank, range(2, 3), batch)
    got = _load(lambda p, m, o: m.load_state_dict(sd, strict=False), Path(), model, opt)
    dist.barrier()
    return got | {"item_loaded": torch.equal(model.ec.tables["item"].weight.detach(), stored)}


def _optim(scenario: str, rank: int, model: nn.Module, ddp: Any, opt: Any, batch: Any) -> dict[str, Any]:
    """The other ``ckpt_dtensor_optim_*`` scenarios: torch's ``set_optimizer_state_dict`` of a state taken after 2
    steps, loaded after a third, changed on rank 1 (or every rank)."""
    osd = get_optimizer_state_dict(ddp, opt)  # (collectives: every rank's slots to their logical blocks)
    ours = opt.state_dict()["state"]  # our layout: this rank's stored rows, plain tensors
    plain = {k.split(".")[-2]: {n: v.detach().clone() for n, v in ours[f"table:{k.split('.')[-2]}"].items()
                                if isinstance(v, torch.Tensor)} for k in osd["state"] if k.startswith("ec.tables.")}
    _train(ddp, opt, rank, range(2, 3), batch)
    if scenario == "ckpt_dtensor_optim_bad_lr_on_one_rank":
        if rank == 1:  # a hyper-parameter refused by the checks after the slots' moves
            osd["param_groups"][0]["lr"] = -1.0
    elif scenario in ("ckpt_dtensor_optim_plain_on_one_rank", "ckpt_dtensor_optim_plain_on_every_rank"):
        if rank == 1 or scenario.endswith("every_rank"):  # every table's DTensor slots as plain stored rows
            moved = {n for entry in osd["state"].values() for n, v in entry.items() if isinstance(v, DTensor)}
            for k, entry in osd["state"].items():
                mine = plain.get(k.split(".")[-2], {})
                osd["state"][k] = {n: mine[n] if isinstance(v, DTensor) else v for n, v in entry.items()}
            plain = {t: {n: v for n, v in slots.items() if n in moved} for t, slots in plain.items()}
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    got = _load(lambda p, m, o: set_optimizer_state_dict(ddp, o, osd), Path(), model, opt)
    dist.barrier()
    live = opt.state_dict()["state"]["table:item"]  # (our layout, as `plain` was read; its replaced slots)
    loaded = bool(plain["item"]) and all(torch.equal(live[k], v) for k, v in plain["item"].items())
    return got | {"item_loaded": loaded}


def _torch_layout(scenario: str, rank: int, model: nn.Module, batch: Any, saved: Path) -> dict[str, Any]:
    """``ckpt_torch_layout[_dtensor]``: a save and a load of an optimizer whose ``state_dict()`` is torch's layout."""
    tte.distributed.shard(model, dtensor_state_dict=scenario.endswith("_dtensor"))
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = tte.optim.use_torch_layout(tte.optim.Adagrad(ddp.parameters(), lr=0.1))
    _train(ddp, opt, rank, range(2), batch)
    try:
        tte.distributed.save_sharded(saved, model, opt)
        got: dict[str, Any] = {"errors": []}
    except Exception as e:  # noqa: BLE001 - recorded
        got = {"errors": [{"type": type(e).__name__, "message": str(e)}]}
    at_save = snapshot_state(model, opt, stored=True)
    _train(ddp, opt, rank, range(2, 3), batch)
    if not got["errors"]:
        got = _load(tte.distributed.load_sharded, saved, model, opt)
    dist.barrier()
    return got | {"restored": same_state(at_save, snapshot_state(model, opt, stored=True))}
