"""Checkpoints that move between CPU, one XLA device and any sharded layout.

A checkpoint holds the *logical* state: one ``[num_embeddings, D]`` tensor per table and per row slot
(no device padding rows, no trash rows), keyed by table name, on the CPU. It loads into a model on
any device and any placement; :func:`save` writes atomically and the file loads with
``torch.load(weights_only=True)`` (no pickled code).

Example::

    >>> tte.checkpoint.save("ckpt.pt", model=ec, optimizer=opt, extra={"step": 1000})
    >>> extra = tte.checkpoint.load("ckpt.pt", model=ec2, optimizer=opt2)   # another device/layout
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import torch

from torch_tpu_embedding._rows.row_order import Description, describe, from_logical, layout_of, to_logical
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import dtype_kind
from torch_tpu_embedding.checkpoint.agreement import Attempt, agree
from torch_tpu_embedding.checkpoint.checks import (
    CheckpointMismatchError,
    aliases,
    apply_payload,
    check_payload,
    is_row_sparse,
    meta_problems,
    named_keys,
    slots_for_a_load,
    write_payload,
)
from torch_tpu_embedding.checkpoint.dcp import (
    FORMAT,
    META,
    dcp,
    logical_payload,
    present,
    read_meta,
    read_tensors,
    read_torch_dcp,
    saved_groups,
    saved_sizes,
    uses_xla,
    xla_planner,
)
from torch_tpu_embedding.checkpoint.files import check_loadable, check_records, dcp_quiet, write_atomic
from torch_tpu_embedding.checkpoint.host import (
    host_model_state,
    host_optimizer_state,
    refuse_process_group_shards,
    to_cpu,
)
from torch_tpu_embedding.checkpoint.publish import (
    CheckpointCorruptError,
    barrier,
    begin_save,
    is_sharded,
    publish,
    rank,
    resolve,
    staging_path,
    verify,
    write_manifest,
)
from torch_tpu_embedding.checkpoint.rollback import extra_states, put_extra_states
from torch_tpu_embedding.checkpoint.sharded import sharded
from torch_tpu_embedding.checkpoint.snapshot import Seal, UnverifiedCheckpointWarning, pinned
from torch_tpu_embedding.modules.collection import EmbeddingCollection
from torch_tpu_embedding.modules.screening import warn_unreported
from torch_tpu_embedding.optim._state.state_load import rest_problems

__all__ = [
    "FORMAT", "CheckpointCorruptError", "CheckpointMismatchError", "UnverifiedCheckpointWarning", "convert_distributed",
    "load", "load_distributed", "read_torch_dcp", "save", "save_distributed", "to_cpu",
]


def save(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``{"format", "model", "optimizer", "extra"}`` to ``path`` atomically (temp file + rename).

    Under multi-host SPMD call it from every process, each with a path on its own disk: reading a
    sharded tensor to the host is a computation over all devices, so a process that skips it
    stalls the others. Tables larger than one host's memory: :func:`save_distributed`.

    Raises:
        ValueError: ``model`` or ``optimizer`` holds tables sharded over a process group
            (``tte.distributed.shard``), of which this process stores only its rows: use :func:`save_distributed`.
    """
    refuse_process_group_shards(model, optimizer)  # before anything on disk changes
    payload = {
        "format": FORMAT,
        "model": None if model is None else host_model_state(model),
        "optimizer": None if optimizer is None else host_optimizer_state(optimizer),
        "extra": to_cpu(extra),
    }
    check_loadable(payload["extra"], "extra")  # before anything on disk changes
    check_loadable(payload, "checkpoint")
    write_atomic(payload, path)


def load(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> dict[str, Any] | None:
    """Load a :func:`save` file (``weights_only=True``) into ``model`` / ``optimizer``; returns ``extra``.

    Build the model on its device and layout first (and ``optimizer.init_state()`` on XLA); the
    tensors are copied into the existing parameters and slots, which keep their sharding. ``strict``: the
    model's keys, as ``Module.load_state_dict``'s; an optimizer's state loads whole (as torch's optimizers do).
    Into a model sharded over a process group (``tte.distributed.shard``): call it on every rank (each keeps its rows).
    """
    target = os.fspath(path)
    if model is not None and sharded().owns(model):  # each rank keeps its rows (read inside the ranks' agreement)
        return sharded().load_file(target, lambda: _read(target, digest=True), model, optimizer, strict)
    return apply_payload(_read(target)[0], target, model, optimizer, strict)


def _read(target: str, digest: bool = False) -> tuple[dict[str, Any], str]:
    """The :func:`save` file ``target`` (``weights_only``) and (``digest``) the sha256 of the bytes read."""
    if not os.path.exists(target):
        raise FileNotFoundError(f"No checkpoint at {target}")
    try:
        with open(target, "rb") as f:  # (hashed and read through one descriptor: a file renamed over is not mixed in)
            sha = hashlib.sha256()
            while digest and (block := f.read(1 << 22)):
                sha.update(block)
            check_records(f)  # (before anything is loaded: torch.load checks no CRC)
            payload = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged zip / pickle stream
        raise ValueError(f"{target} is not a readable checkpoint (truncated or corrupt): {e}") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{target} is not a torch_tpu_embedding checkpoint ({FORMAT}). Found: {found!r}")
    return payload, sha.hexdigest() if digest else ""


# ---------------------------------------------------------------------------------------------
# Distributed checkpoints (torch.distributed.checkpoint): huge tables, written shard by shard
# ---------------------------------------------------------------------------------------------
def _physical(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[
    dict[str, torch.Tensor], dict[str, int | None], dict[str, Any]
]:
    """Every model parameter/buffer and optimizer slot as it is on the device, plus the rest (with
    ``rest["layouts"]``: how each table-indexed tensor is stored, see ``_layout.describe``)."""
    tensors: dict[str, torch.Tensor] = {}
    rows: dict[str, int | None] = {}
    layouts: dict[str, Description] = {}
    members: dict[str, Any] = {}  # stacked groups: their tables, for convert_distributed
    # (a non-persistent buffer is no state: as in state_dict(), neither saved nor loaded)
    unsaved = _non_persistent(model)
    buffers = [(n, b) for n, b in model.named_buffers() if n not in unsaved]
    for name, p in [*model.named_parameters(), *buffers]:
        info = table_info(p)
        tensors[f"model/{name}"] = p.detach()
        rows[f"model/{name}"] = None if info is None else info.num_embeddings
        if info is not None:
            layouts[f"model/{name}"] = describe(info.layout)
        if info is not None and info.members is not None:
            members[f"model/{name}"] = info.members
    rest: dict[str, Any] = {"members": members}
    if optimizer is not None:
        physical = _row_sparse(optimizer).physical_state()
        rest = {**physical.rest(),
                "members": {**members, **{f"optim/{k}": m for k, m in physical.members.items()}}}
        tensors.update({f"optim/{k}": v for k, v in physical.tensors.items()})
        rows.update({f"optim/{k}": v for k, v in physical.logical_rows.items()})
        layouts.update({f"optim/{k}": v for k, v in physical.layouts.items()})
    rest["layouts"] = layouts
    return tensors, rows, rest


def _non_persistent(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s non-persistent buffers (which ``state_dict()`` leaves out)."""
    return {f"{name}.{b}" if name else b for name, m in model.named_modules() for b in m._non_persistent_buffers_set}


def _row_sparse(optimizer: torch.optim.Optimizer) -> Any:
    if not is_row_sparse(optimizer):
        raise TypeError("Distributed checkpoints need a torch_tpu_embedding.optim optimizer.")
    return optimizer


def save_distributed(
    path: str | os.PathLike[str], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a ``torch.distributed.checkpoint`` directory: each device's shards of every table and slot, and
    ``extra`` as :func:`save` takes it (a training step, a data loader's position: published with the tensors, so
    never from another save; :func:`load_distributed` returns it; on several processes, rank 0's).

    No table is gathered: on XLA the tensors are written shard by shard with torch_xla's
    ``SPMDSavePlanner``. Physical shapes include padding and trash rows, which are the same in every
    sharded layout (``torch_tpu_embedding.xla.ROW_ALIGNMENT``), so :func:`load_distributed` reshards
    in place (4 → 2 → 1 devices, row ↔ column); a CPU model or :func:`convert_distributed` reads the
    logical rows. On several hosts every process calls it (each writes its shards).

    Crash-safe: written into a sibling staging directory and published with renames once every
    file and a manifest of their sizes and sha256 are on disk, so a process killed at any point
    leaves the previous checkpoint or this one, complete. Refuses to replace a directory holding
    other files than a checkpoint's.

    A model sharded over a process group (``tte.distributed.shard``) is written as
    ``tte.distributed.save_sharded`` writes it (each rank its own rows, logical row order): every
    process calls it; the directory loads with :func:`load_distributed` at any world size, in one
    process and into a torch_xla SPMD model.
    """
    if sharded().owns(model):
        sharded().save(path, model, optimizer, extra)
        return
    api = dcp()
    for name, m in model.named_modules():  # what state_dict() warns of, for a save that does not call it
        if isinstance(m, EmbeddingCollection):
            warn_unreported(m, name)
    tensors, rows, rest = _physical(model, optimizer)
    planner = xla_planner("SPMDSavePlanner") if uses_xla(tensors) else None
    members = rest.pop("members")
    layouts = rest.pop("layouts")
    # "layouts": the stored row order of each table-indexed tensor (absent in checkpoints written
    # before the id exchange: every tensor in logical order).
    # The modules' extra states (state_dict()'s "<module>._extra_state"), as :func:`save` keeps them: loaded with
    # weights_only=True, so they hold what such a load reads (tensors, numbers, strings, lists, dicts).
    states = {key: to_cpu(m.get_extra_state()) for key, m in extra_states(model).items()}
    check_loadable(states, "extra_state")  # before anything on disk changes
    given = to_cpu(extra)
    check_loadable(given, "extra")
    meta = {"format": FORMAT, "rows": rows, "members": members, "layouts": layouts,
            "optimizer": to_cpu(rest) if optimizer is not None else None, "extra_state": states, "extra": given,
            "aliases": aliases(model)}
    # Written into a staging directory beside the target and published whole (checkpoint/publish.py): a
    # process killed at any point leaves the previous checkpoint or this one, complete, never a mix. Rank 0
    # holds the save lock throughout: a second save to the path (another job) is refused, not mixed in.
    target = os.path.realpath(os.fspath(path))  # a symlinked directory: the save replaces what it points to
    staging = staging_path(target)
    lock = begin_save(target, rank() == 0)
    with Attempt() as published:  # (DCP's own errors reach every rank: a CheckpointException goes through)
        try:
            with dcp_quiet():
                api.save(tensors, storage_writer=api.FileSystemWriter(staging, sync_files=True), planner=planner)
            barrier()  # every rank's files are written and fsynced
            if rank() == 0:
                write_atomic(meta, os.path.join(staging, META))
                write_manifest(staging)
                publish(staging, target)
        finally:
            if lock is not None:
                lock.release()
    # No rank returns before the checkpoint is published, and rank 0's failure to publish it (a full disk)
    # is raised on every rank: none waits for it at its next collective.
    agree(published.error, done=f"the save did not finish: {target} holds the previous checkpoint or this one, "
          "complete", other=RuntimeError)


def load_distributed(
    path: str | os.PathLike[str], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any] | None:
    """Load a :func:`save_distributed` directory into ``model`` (and ``optimizer``) on any device/layout; returns
    the save's ``extra`` (``None``: none).

    Tensors whose physical shape matches the saved one are loaded in place, shard by shard (sharded
    XLA tensors through ``SPMDLoadPlanner``, which reshards). Others (a CPU model without padding
    rows) are read into host staging tensors and their logical rows copied. Build the model and
    call ``optimizer.init_state()`` first. Mismatched tables or slots raise one ``ValueError``.
    A checkpoint whose tables are stacked in other groups than the model's is read per table through
    the host, as :func:`convert_distributed` reads it.

    Every file is checked against the save's manifest (sizes, sha256) before anything is written:
    a truncated, missing or altered file raises :class:`CheckpointCorruptError` naming it, and the
    model and optimizer are unchanged. Under a process group (whose ranks read together) a check that
    fails on one rank raises on every rank, before any reads in place (``checkpoint/agreement.py``).

    Between the two kinds of distributed checkpoint: a directory written from a model sharded over a
    process group (``tte.distributed.save_sharded``, or this module's :func:`save_distributed` of such
    a model) loads into any model here, SPMD included (its tables through the host: logical rows,
    resharded as the model lays them out); into a model sharded over a process group either kind loads
    through ``tte.distributed.load_sharded`` (each rank its own rows).
    """
    if sharded().owns(model) or is_sharded(resolve(os.fspath(path))):
        return sharded().load(path, model, optimizer)  # (the optimizer's slots made as below)
    # One directory read throughout (a save publishing meanwhile changes nothing read here): checkpoint/snapshot.py
    with pinned(os.fspath(path)) as target, slots_for_a_load(optimizer):
        return _load_dcp(target, model, optimizer)


def _load_dcp(target: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
              ) -> dict[str, Any] | None:
    """:func:`load_distributed` of the ``save_distributed`` directory ``target`` (pinned). Every check runs
    before the ranks of the default process group (if any) agree (``checkpoint/agreement.py``: an
    ``all_gather_object``): a rank whose checks fail makes every rank raise, before any of them writes or enters
    DCP's read, whose collectives it would not join. They agree again after the writes: a file found changed
    after the read on one rank (a file system of its own), or the user's load code raising there, raises on
    every rank, saying that the others loaded their part (two small collectives per load besides DCP's). A model
    with extra states (``get_extra_state``) has them set first, and the ranks agree on that too (a third)."""
    write, extra = None, None
    with Attempt() as checks:
        write, extra = _checked_dcp(target, model, optimizer)
    agree(checks.error, done="every rank refused the load: nothing was loaded on any rank")
    assert write is not None
    if extra:  # the user's set_extra_state first: one that raises, on any rank, leaves everything as it was
        undo = None
        with Attempt() as user:
            undo = put_extra_states(model, extra)
        try:
            agree(user.error, done="every rank refused the load: nothing was loaded on any rank")
        except BaseException as e:
            if undo is not None:  # (another rank's set_extra_state raised: this rank's are put back)
                undo(e)
            raise
    given = None
    with Attempt() as writes:
        given = write()
    agree(writes.error, done="the other ranks loaded their part: the job holds values of two states. Load a "
          "checkpoint again on every rank")
    return given


def _checked_dcp(target: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                 ) -> tuple[Callable[[], dict[str, Any] | None], dict[str, Any] | None]:
    """Check the ``save_distributed`` directory ``target`` against ``model`` and ``optimizer`` (raises, writing
    nothing); returns what writes it and returns the save's ``extra`` (DCP's read in place, or the logical payload
    read here) and the modules'
    extra states to set before (``None``: that write sets them, or the checkpoint, written before 2026-12-02,
    saved none)."""
    present(target)
    seal = Seal(target, verify(target))  # every file whole and as saved, before anything is written
    meta = read_meta(target)
    dest, rows, rest = _physical(model, optimizer)  # the optimizer's slots made (slots_for_a_load)
    saved_layouts, layouts = meta.get("layouts", {}), rest["layouts"]
    saved, saved_dtypes = saved_sizes(target)
    regrouped = saved_groups(meta.get("members", {})) != saved_groups(rest["members"])
    if regrouped and (set(saved) != set(dest) or "members" in meta):
        # Tables stacked in other groups than here (stack_tables, or a mesh's placements), or a group of the same
        # name and size whose tables differ (another table's rows at a table's place): per table, through the host.
        payload = logical_payload(target, meta)
        seal.check()  # what was read is what was verified
        # (non-persistent buffers, which checkpoints written before 2026-12-02 hold: no state, not loaded)
        unsaved = _non_persistent(model)
        payload["model"] = {k: v for k, v in payload["model"].items() if k not in unsaved}
        checked = check_payload(payload, target, model, optimizer, strict=True)

        def write_logical() -> dict[str, Any] | None:
            return write_payload(checked, model, optimizer, strict=True)

        return write_logical, None
    missing = sorted(set(dest) - set(saved))
    unsaved = {f"model/{k}" for k in _non_persistent(model)}  # (saved before 2026-12-02: not loaded)
    unexpected = sorted(k for k in set(saved) - set(dest) - unsaved if optimizer is not None or k.startswith("model/"))
    problems = [f"missing {named_keys(missing, rest['members'])}"] if missing else []
    problems += meta_problems(model)  # (DCP's read into a meta tensor fails: refused as the host path refuses it)
    if unexpected:
        problems.append(f"unexpected {named_keys(unexpected, meta.get('members', {}))}")
    extra = meta.get("extra_state")
    if extra is not None:
        here = extra_states(model, loaded=True)
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            problems.append("its extra states are not a mapping of module keys to values")
        else:
            if set(here) - set(extra):
                problems.append(f"missing the extra state of {sorted(set(here) - set(extra))}")
            if set(extra) - set(here):
                problems.append(f"unexpected extra state {sorted(set(extra) - set(here))} (no module here "
                                "overrides set_extra_state)")
    for k in sorted(set(dest) & set(saved)):
        n_saved, n_here = meta["rows"].get(k), rows[k]
        logical_saved = (n_saved, *saved[k][1:]) if n_saved is not None else tuple(saved[k])
        logical_here = (n_here, *dest[k].shape[1:]) if n_here is not None else tuple(dest[k].shape)
        name = named_keys([k], rest["members"])[0]
        if tuple(logical_saved) != tuple(logical_here):
            problems.append(f"{name} has shape {tuple(logical_saved)} saved, {tuple(logical_here)} here")
        elif dtype_kind(saved_dtypes[k]) != dtype_kind(dest[k].dtype):
            problems.append(f"{name} holds {saved_dtypes[k]} values saved, {dest[k].dtype} here")
    if optimizer is not None and meta["optimizer"] is None:
        raise ValueError(f"{target} holds no optimizer state.")
    if optimizer is not None:  # hyper-parameters too, before any tensor is read in place
        problems += rest_problems(_row_sparse(optimizer), meta["optimizer"])
    if problems:
        raise CheckpointMismatchError(f"Distributed checkpoint {target} does not match (nothing was loaded): "
                                      + "; ".join(problems))
    wanted = {k: dest[k] for k in dest}
    staged: dict[str, torch.Tensor] = {}
    for k, t in dest.items():
        # Same shape and row order: read in place, shard by shard. Otherwise through the host.
        if tuple(t.shape) != tuple(saved[k]) or saved_layouts.get(k) != layouts.get(k):
            staged[k] = torch.empty(saved[k], dtype=t.dtype)
            wanted[k] = staged[k]
    seal.check()  # the metadata read above is the one verified: nothing written yet

    def write() -> dict[str, Any] | None:
        read_tensors(target, wanted)  # (DCP's collectives: a read error reaches every rank)
        # A file replaced while DCP read it (a copy into the directory): found by the ranks whose files it is
        # (every rank on a file system they share), then raised on every rank (_load_dcp's second agreement).
        seal.check(written=True)  # the tensors read in place too
        with torch.no_grad():
            for k, host in staged.items():
                t, n = dest[k], rows[k]
                if n is None:
                    t.copy_(host.to(t.device))
                    continue
                saved_order, saved_k = layout_of(saved_layouts.get(k))
                value = to_logical(host, n, saved_order, saved_k)
                order, slot_k = layout_of(layouts.get(k))
                current = t.detach().cpu() if order is not None or t.device.type == "cpu" else t
                # Copied from the host tensor itself: an XLA destination keeps its sharding (copying a
                # replicated device tensor into it would leave the table replicated).
                t.copy_(from_logical(value.to(current.device), current, order, slot_k))
        if optimizer is not None:
            _row_sparse(optimizer).load_physical_rest(meta["optimizer"])
        given: dict[str, Any] | None = meta.get("extra")  # (absent before 2026-12-02)
        return given

    return write, extra


def convert_distributed(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Turn a :func:`save_distributed` directory into one :func:`save` file (logical rows, CPU).

    Reads on the host without torch_xla; the result loads anywhere with :func:`load`. A
    ``tte.distributed.save_sharded`` directory converts too.
    """
    if is_sharded(resolve(os.fspath(path))):
        write_atomic(sharded().payload(os.fspath(path)), out)
        return
    with pinned(os.fspath(path)) as target:
        present(target)
        seal = Seal(target, verify(target))
        payload = logical_payload(target, read_meta(target))
        seal.check()
    write_atomic(payload, out)
