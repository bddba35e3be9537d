"""Checkpoints of models sharded over a process group: each rank writes and reads only its own rows.

:func:`save_sharded` writes a directory: ``rows-<rank>.pt`` per rank (the rows of each row- or table-sharded
table that rank stores, in ascending logical id, with their ids and the rows of every optimizer row slot; the
table's whole-table slots and ``step``; its pending accumulation buffers, with logical ids) and ``meta.pt`` from
rank 0 (the world size, each sharded table's placement, rows and ``state_dict`` key, the rest of the model's and
optimizer's ``state_dict``, and ``extra``). Rows are in logical order whatever the ownership scheme, written a
window at a time (``checkpoint/row_writer.py``; :func:`_in_order`): a save's memory grows by a window.

:func:`load_sharded` loads such a directory, or a ``tte.checkpoint.save_distributed`` one, into a model sharded
over any number of ranks, or into one holding every table whole (one process; ``load_distributed`` sends an SPMD
model here). Into a sharded model each rank copies the rows it stores into its shard and slots, reading the row
files in windows of at most ``checkpoint/publish.py``'s ``BUFFER`` bytes (``checkpoint/logical_rows.py``;
:func:`_locator`): its memory grows by at most one chunk, never by a shard. A ``save_distributed`` directory is
read through the host first (DCP reads a table whole): for tables that fit in one host's memory.

Saves are crash-safe and loads verify before they write, as ``tte.checkpoint.save_distributed``'s
(``checkpoint/publish.py``): ranks write into a sibling staging directory, which rank 0 seals (``meta.pt``, a
manifest of each file's size and sha256) and publishes by renames: a process killed at any point leaves the old
checkpoint or the new one. A load checks every file and the whole state (names, shapes, dtypes, hyper-parameters,
accumulation buffers) before it changes anything; a part failing on some ranks raises on every rank (``agreement``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_tpu_embedding._rows.placement import stored_rows
from torch_tpu_embedding.checkpoint.agreement import Attempt, agree, given_on_every_rank
from torch_tpu_embedding.checkpoint.checks import (
    CheckpointMismatchError,
    apply_payload,
    model_problems,
    optimizer_problems,
    slots_for_a_load,
)
from torch_tpu_embedding.checkpoint.dcp import META, logical_payload, read_meta
from torch_tpu_embedding.checkpoint.files import check_loadable, load_refusal, through
from torch_tpu_embedding.checkpoint.host import own_layout_state, to_cpu
from torch_tpu_embedding.checkpoint.logical_rows import ACC, Locate, Source, select_accumulation
from torch_tpu_embedding.checkpoint.publish import (
    SHARDED_META,
    CheckpointCorruptError,
    begin_save,
    is_sharded,
    publish,
    staging_path,
    verify,
    write_manifest,
)
from torch_tpu_embedding.checkpoint.row_writer import Rows, write_rows
from torch_tpu_embedding.checkpoint.snapshot import Seal, identity, pinned
from torch_tpu_embedding.distributed.exchange import GroupSharding, group_sharding
from torch_tpu_embedding.modules.collection import EmbeddingCollection
from torch_tpu_embedding.modules.table import EmbeddingTable
from torch_tpu_embedding.optim._state.state_check import accumulation_problems

__all__ = ["group_sharded", "load_sharded", "open_checkpoint", "save_sharded", "sharded_payload"]

Tensor = torch.Tensor
#: Rows a save places at a time where it counts a table's real rows (a few int64 each).
_WINDOW = 8192


def _tables(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Every table of every collection in ``model``: name → (its ``state_dict`` key, the table module)."""
    out: dict[str, tuple[str, nn.Module]] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, EmbeddingCollection):
            for name, t in m.tables.items():
                out[name] = (f"{prefix}.tables.{name}.weight" if prefix else f"tables.{name}.weight", t)
    return out


def group_sharded(model: nn.Module) -> dict[str, tuple[str, EmbeddingTable, GroupSharding]]:
    """The tables of ``model`` sharded over a process group: name → (``state_dict`` key, table, sharding)."""
    out: dict[str, tuple[str, EmbeddingTable, GroupSharding]] = {}
    for name, (key, t) in _tables(model).items():
        s = group_sharding(t.weight) if isinstance(t, EmbeddingTable) else None
        if s is not None and isinstance(t, EmbeddingTable):
            out[name] = (key, t, s)
    return out


def _in_order(s: GroupSharding) -> Callable[[int, int], Tensor]:
    """``at(a, b)``: this rank's local rows holding the ``a``-th to ``b``-th of its rows in ascending logical id
    (padding rows last), worked out per window from the ownership (sorting the shard's ids would copy them).

    A row-sharded table's rank holds ``m`` blocks of ``run`` rows (``"interleaved"``; ``"range"`` and ``"mod"``:
    one block), block ``i``'s row ``j`` holding logical id ``j·stride + q_i`` with every ``q_i < stride``: in
    ascending order, row ``k`` is row ``k // m`` of the block with the ``(k % m)``-th smallest ``q``."""
    own = s.ownership
    if s.placement == "table" or own.scheme == "range":
        return lambda a, b: torch.arange(a, b, dtype=torch.int64)
    per, first = own.rows_per_shard, s.rank * own.rows_per_shard
    m = own.chunks // own.num_shards if own.scheme == "interleaved" else 1  # "mod": ids rank + j·n, ascending
    run = per // m
    order = torch.argsort(own.logical_id(torch.arange(first, first + per, run, dtype=torch.int64)))
    return lambda a, b: order[torch.arange(a, b, dtype=torch.int64) % m] * run + torch.arange(a, b) // m


def _logical(s: GroupSharding, local: Tensor) -> Tensor:
    """The logical ids of this rank's rows ``local`` (``>= s.rows``: padding rows)."""
    if s.placement == "table":
        return local
    return s.ownership.logical_id(local + s.rank * s.ownership.rows_per_shard)


def _real_rows(s: GroupSharding, at: Callable[[int, int], Tensor]) -> int:
    """How many of this rank's rows are real (not padding): a prefix in ascending order, counted per window."""
    n, total = 0, s.local_rows
    for a in range(0, total, _WINDOW):
        n += int((_logical(s, at(a, min(a + _WINDOW, total))) < s.rows).sum())
    return n


def _rows(n: int, src: Tensor, at: Callable[[int, int], Tensor]) -> Rows:
    """The first ``n`` rows of ``src`` in ascending logical id (``at``), written a window at a time."""
    def fill(a: int, b: int, out: Tensor) -> None:
        pos = at(a, b).to(src.device)
        if src.device.type == "cpu" and src.dtype == out.dtype:
            torch.index_select(src.detach(), 0, pos, out=out)
        else:
            out.copy_(src.detach().index_select(0, pos))
    return Rows((n, *src.shape[1:]), src.dtype, fill)


def _ids(n: int, s: GroupSharding, at: Callable[[int, int], Tensor]) -> Rows:
    """The logical ids of the first ``n`` rows in ascending order (``at``), written a window at a time."""
    def fill(a: int, b: int, out: Tensor) -> None:
        out.copy_(_logical(s, at(a, b)))
    return Rows((n,), torch.int64, fill)


def _locator(s: GroupSharding) -> Locate:
    """Where this rank stores logical ids (``_ckpt_rows.Locate``), worked out per window of ids from the
    ownership: no per-row table of the shard is built (it would grow a load's memory with the shard)."""
    if s.placement == "table":
        here = s.rank == s.owner
        return lambda ids: (torch.full_like(ids, here, dtype=torch.bool) & (ids >= 0) & (ids < s.rows), ids)
    per, first = s.ownership.rows_per_shard, s.rank * s.ownership.rows_per_shard

    def locate(ids: Tensor) -> tuple[Tensor, Tensor]:
        local = s.ownership.physical_row(ids) - first  # padding ids: the sentinel, owned by no rank
        return (local >= 0) & (local < per) & (ids < s.rows), local

    return locate


def _logical_accumulation(state: dict[str, Tensor], s: GroupSharding, local: int) -> dict[str, Tensor]:
    """A sharded table's pending accumulation buffers with logical ids (``-1``: padding): the owner's
    buffers hold its local rows (``local``: padding)."""
    ids = state["acc_ids"].detach().cpu()
    valid = (ids >= 0) & (ids < local)
    logical = _logical(s, ids.clamp(0, local - 1)) if local else torch.zeros_like(ids)
    return {"acc_ids": torch.where(valid, logical, torch.full_like(ids, -1)),
            "acc_rows": state["acc_rows"].detach().cpu().clone()}


def _stored_state(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` with sharded tables as their stored rows, even under ``dtensor_state_dict``
    (whose DTensor entries are collectives: rank 0 alone reads the state_dict here)."""
    with stored_rows():
        return dict(model.state_dict())


def save_sharded(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any = None,
                 extra: dict[str, Any] | None = None) -> None:
    """Write ``model`` (and ``optimizer``), sharded by ``tte.distributed.shard``, to ``directory``: call it on every
    rank of the group (an optimizer on every rank or on none). Each rank writes its own rows (``rows-<rank>.pt``);
    rank 0 the rest, with its ``extra`` (as ``tte.checkpoint.save``'s: a training step, published with the rows;
    :func:`load_sharded` returns it). Pending accumulation buffers too: a run resumed mid-window goes on alike."""
    tables = group_sharded(model)
    if not tables:
        raise ValueError("Argument `model` has no table sharded over a process group (tte.distributed.shard); "
                         "save it with tte.checkpoint.save.")
    first = next(iter(tables.values()))[2]
    rank, world, group = first.rank, first.world, first.group
    target = os.path.realpath(os.fspath(directory))  # a symlinked directory: the save replaces what it points to
    lock = begin_save(target, rank == 0, group)  # a refusal on every rank, nothing changed
    with Attempt() as published:
        try:
            _write(target, rank, world, group, model, optimizer, tables, extra)
        finally:
            if lock is not None:
                lock.release()
    # No rank returns before the checkpoint is published, and rank 0's failure to publish it is raised on
    # every rank (none waits for it at its next collective).
    agree(published.error, group, done=f"the save did not finish: {target} holds the previous checkpoint or this "
          "one, complete", other=RuntimeError)


def _write(target: str, rank: int, world: int, group: Any, model: nn.Module, optimizer: Any,
           tables: dict[str, tuple[str, EmbeddingTable, GroupSharding]], extra: dict[str, Any] | None) -> None:
    """:func:`save_sharded`'s files, each rank's rows streamed a window at a time (``checkpoint/row_writer.py``:
    a save's memory grows by a window, never by a shard), published by rank 0."""
    staging = staging_path(target)
    with Attempt() as wrote:  # (a full disk, an unwritable directory: on some ranks only)
        extra = to_cpu(extra)
        check_loadable(extra, "extra")  # (what load_sharded could not read back: refused on the rank given it)
        part: dict[str, Any] = {}
        for name, (_, t, s) in tables.items():
            at = _in_order(s)
            n = _real_rows(s, at)
            entry: dict[str, Any] = {"ids": _ids(n, s, at), "weight": _rows(n, t.weight, at)}
            if optimizer is not None:
                state = optimizer.state.get(t.weight, {})
                local = t.weight.shape[0]
                entry["rows"] = {k: _rows(n, v, at) for k, v in state.items()
                                 if k not in ACC and v.dim() and v.shape[0] == local}
                entry["whole"] = {k: v for k, v in state.items()
                                  if k not in ACC and not (v.dim() and v.shape[0] == local)}
                if "acc_ids" in state:
                    entry["acc"] = _logical_accumulation(state, s, local)
            part[name] = entry
        write_rows(os.path.join(staging, f"rows-{rank}.pt"), part)
    # Every rank's rows are written (rank 0 fsyncs them before publishing), or none publishes.
    given = agree(wrote.error, group, optimizer is not None, done=f"nothing was published: {target} is as it was",
                  other=RuntimeError)
    given_on_every_rank(given, "optimizer", "save_sharded", f"nothing was published: {target} is as it was")
    if rank == 0:
        keys = {key for key, _, _ in tables.values()}
        meta: dict[str, Any] = {
            "world": world,
            "tables": {n: {"placement": s.placement, "rows": s.rows, "owner": s.owner, "key": key}
                       for n, (key, _, s) in tables.items()},
            "model": {k: v for k, v in _stored_state(model).items() if k not in keys},
            "extra": extra,
        }
        if optimizer is not None:
            sd = own_layout_state(optimizer)  # (its state_dict() may be a collective: rank 0 alone is here)
            sd["state"] = {k: v for k, v in sd["state"].items() if k.split(":", 1)[-1] not in tables}
            meta["optimizer"] = sd
        torch.save(meta, os.path.join(staging, SHARDED_META))
        write_manifest(staging)
        publish(staging, target)


def open_checkpoint(path: str) -> Source:
    """The verified checkpoint at ``path`` (a ``save_sharded`` or a ``save_distributed`` directory; pinned,
    ``checkpoint/snapshot.py``: the source reads its rank files later)."""
    return _open(path)[0]


def _open(path: str) -> tuple[Source, Seal]:
    """:func:`open_checkpoint`, with the files as verified (check the seal before writing: the rank files and
    ``meta.pt`` are read by name, after they were verified)."""
    if is_sharded(path):
        seal = Seal(path, verify(path, required=(SHARDED_META,)))  # every file whole and as saved
        file = os.path.join(path, SHARDED_META)
        try:
            meta = torch.load(through(file), map_location="cpu", weights_only=True)
        except Exception as e:  # weights-only refusals and damaged files raise several types
            raise CheckpointCorruptError(f"{file} is not a readable checkpoint file: {load_refusal(e)}. "
                                         "Nothing was loaded.") from e
        return Source.sharded(path, meta), seal
    if os.path.isfile(os.path.join(path, META)):
        seal = Seal(path, verify(path))
        payload = logical_payload(path, read_meta(path))
        return Source(payload["model"], payload["optimizer"], extra=payload["extra"]), seal
    raise FileNotFoundError(f"No distributed checkpoint at {path} (neither {SHARDED_META} of "
                            f"tte.distributed.save_sharded nor {META} of tte.checkpoint.save_distributed)")


def _saved_keys(source: Source, tables: dict[str, tuple[str, nn.Module]]) -> dict[str, tuple[str, int]]:
    """Each table held in ``source``'s rank files: its ``state_dict`` key (as saved; else the model's) and rows."""
    out = {}
    for n, info in source.tables.items():
        key = info.get("key") or (tables[n][0] if n in tables else f"tables.{n}.weight")
        out[n] = (str(key), int(info["rows"]))
    return out


def sharded_payload(path: str) -> dict[str, Any]:
    """The :func:`save_sharded` directory at ``path`` (verified) as one ``tte.checkpoint.save`` payload."""
    with pinned(os.fspath(path)) as pin:
        source, seal = _open(pin)
        payload = source.payload(_saved_keys(source, {}))
        seal.check()
        return payload


def _stand_in(like: Tensor, rows: int) -> Tensor:
    """A ``[rows, *like.shape[1:]]`` tensor of ``like``'s dtype without memory (zeros, expanded): what the
    checks see of a shard, and what ``load_state_dict`` writes before the rows are copied in."""
    return torch.zeros((), dtype=like.dtype).expand(rows, *like.shape[1:])


def _optimizer_state(
    source: Source, optimizer: Any, mine: dict[str, tuple[str, EmbeddingTable, GroupSharding]],
    whole: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, list[str]], list[str]]:
    """The optimizer ``state_dict`` to check (each shard's row slots as stand-ins), each sharded table's
    row slots and the problems of its saved pending accumulation buffers (logical ids: checked before each
    rank keeps its own, which would drop an id outside the table unseen). ``whole``: the logical entries of
    the tables sharded when saved and whole here."""
    assert source.optimizer is not None
    state = dict(own_layout_state(optimizer)["state"])
    state.update({k: v for k, v in source.optimizer["state"].items() if k.split(":", 1)[-1] not in mine})
    state.update(whole)
    row_slots: dict[str, list[str]] = {}
    problems: list[str] = []
    for name, (_, t, _) in mine.items():
        local = t.weight.shape[0]
        # (no local name for the slots: load_state_dict replaces them, and the old ones must go then)
        row_slots[name] = [k for k, v in optimizer.state[t.weight].items()
                           if k not in ACC and v.dim() and v.shape[0] == local]
        entry = source.whole_slots(name, set(row_slots[name]))
        for slot in row_slots[name]:
            like = source.row_slot(name, slot)
            if like is not None:
                entry[slot] = _stand_in(like, local)
        acc = source.accumulation(name)
        bad = [] if acc is None else accumulation_problems(
            f"table:{name}", {"acc_ids": acc[0], "acc_rows": acc[1]}, t.config.num_embeddings, t.weight.shape[-1])
        problems += bad
        if acc is not None and not bad:
            entry["acc_ids"], entry["acc_rows"] = select_accumulation(acc, _locator(mine[name][2]))
        state[f"table:{name}"] = entry
    return {**source.optimizer, "state": state}, row_slots, problems


def load_sharded(directory: str | os.PathLike[str], model: nn.Module, optimizer: Any = None
                 ) -> dict[str, Any] | None:
    """Load a :func:`save_sharded` or ``tte.checkpoint.save_distributed`` directory into ``model`` (and
    ``optimizer``); returns the save's ``extra`` (``None``: none). Sharded over any number of ranks (call it on
    every rank, after ``shard``, DDP and building the optimizer) or not sharded at all (one process, torch_xla
    SPMD: every table whole). Each rank reads only the rows it stores. Nothing changes unless everything fits
    (files, names, shapes, dtypes, the optimizer's hyper-parameters): :class:`CheckpointCorruptError` or
    :class:`CheckpointMismatchError` otherwise, on every rank when any rank's checks fail (that rank its own
    error, the others one naming it): nothing is loaded on any rank, none is left waiting.

    Into a sharded model: two small collectives (``all_gather_object`` of each rank's outcome), once every
    rank has checked, before any writes (the ranks' saves compared too), and after the writes (a rank file
    cut while a rank copied its rows: every rank raises, saying that the others loaded their part)."""
    # One directory read throughout (checkpoint/snapshot.py); the slots made for the checks go if it fails.
    with pinned(os.fspath(directory)) as path, slots_for_a_load(optimizer):
        return _load(path, model, optimizer)


def _load(path: str, model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
    """:func:`load_sharded` of the pinned directory ``path``."""
    tables = _tables(model)
    mine = group_sharded(model)
    if not mine:  # every table whole here: the logical payload, checked and loaded as tte.checkpoint.load's
        source, seal = _open(path)
        payload = source.payload(_saved_keys(source, tables))
        seal.check()  # what was read is what was verified
        return apply_payload(payload, path, model, optimizer, strict=True)
    group = next(iter(mine.values()))[2].group
    plan, save = None, None
    with Attempt() as checks:  # every check, on this rank's files and model: one rank may fail alone
        plan = _checked(path, model, optimizer, tables, mine)
        save = identity(path)
    saves = agree(checks.error, group, (save, optimizer is not None),
                  done="every rank refused the load: nothing was loaded on any rank")
    given_on_every_rank([g for _, g in saves], "optimizer", "load_sharded", "nothing was loaded on any rank")
    if len({save for save, _ in saves}) > 1:  # a save published while the ranks opened the path: some have the old one
        raise CheckpointCorruptError(f"The ranks opened different saves of {path} (another save was published "
                                     "while they opened it); nothing was loaded. Load it again.")
    assert plan is not None
    with Attempt() as writes:  # (a rank file cut or replaced since it was verified; a failed allocation)
        _write_state(plan, model, optimizer, mine)
    agree(writes.error, group, done="the other ranks loaded their part: the job holds values of two states. "
          "Load a checkpoint again on every rank")
    return plan[0].extra


#: :func:`_checked`'s source, seal, model and optimizer ``state_dict`` to load, each sharded table's row slots.
_Plan = tuple[Source, Seal, dict[str, Any], "dict[str, Any] | None", dict[str, list[str]]]


def _checked(path: str, model: nn.Module, optimizer: Any, tables: dict[str, tuple[str, nn.Module]],
             mine: dict[str, tuple[str, EmbeddingTable, GroupSharding]]) -> _Plan:
    """Open and check the pinned directory ``path`` against ``model`` and ``optimizer`` on this rank: raises
    before anything is written."""
    source, seal = _open(path)
    problems: list[str] = []
    sd = _stored_state(model)
    sd.update(source.model)
    whole = {n: k for n, k in _saved_keys(source, tables).items() if n not in mine}
    # sharded when saved, whole here (a replicated table): every logical row
    payload = source.payload(whole) if whole else {"model": {}, "optimizer": {"state": {}}}
    sd.update(payload["model"])
    for name, (key, t, _) in mine.items():
        like = source.row_slot(name, None) if name in source.tables else source.weight(key, name)
        saved = int(source.tables[name]["rows"]) if name in source.tables else None if like is None else like.shape[0]
        if like is None:
            sd.pop(key, None)  # reported as a missing key
        else:
            sd[key] = _stand_in(like, t.weight.shape[0])
        if saved is not None and saved != t.config.num_embeddings:
            problems.append(f"model: table `{name}` has {saved} rows saved, {t.config.num_embeddings} here")
    problems += [f"model: {p}" for p in model_problems(model, sd, strict=True)]
    osd: dict[str, Any] | None = None
    row_slots: dict[str, list[str]] = {}
    if optimizer is not None:
        if source.optimizer is None:
            raise CheckpointMismatchError(f"{path} holds no optimizer state (nothing was loaded).")
        whole_state = {f"table:{n}": payload["optimizer"]["state"][f"table:{n}"] for n in whole}
        osd, row_slots, pending = _optimizer_state(source, optimizer, mine, whole_state)
        problems += [f"optimizer: {p}" for p in pending + optimizer_problems(optimizer, osd)]
        # Loaded without the row slots' stand-ins (the optimizer would copy them whole): its fresh slots
        # get their rows below.
        osd["state"].update({f"table:{n}": {k: v for k, v in osd["state"][f"table:{n}"].items()
                                            if k not in row_slots[n]} for n in mine})
    if problems:
        raise CheckpointMismatchError(f"{path} does not match (nothing was loaded): " + "; ".join(problems))
    seal.check()  # the files read since they were verified too
    return source, seal, sd, osd, row_slots


def _write_state(plan: _Plan, model: nn.Module, optimizer: Any,
                 mine: dict[str, tuple[str, EmbeddingTable, GroupSharding]]) -> None:
    """Write the checked ``plan`` (:func:`_checked`) into ``model`` and ``optimizer``: each rank its rows."""
    source, seal, sd, osd, row_slots = plan
    with stored_rows():  # the sharded tables' entries are their stored rows (as _stored_state read them)
        model.load_state_dict(sd)  # the shards get zeros from their stand-ins: their rows are copied next
    for name, (key, t, s) in mine.items():
        source.copy_rows(name, key, None, _locator(s), t.weight.data)
    if optimizer is not None:
        optimizer.load_state_dict(osd)
        for name, (key, t, s) in mine.items():
            slots = optimizer.state[t.weight]
            for slot in row_slots[name]:
                source.copy_rows(name, key, slot, _locator(s), slots[slot])
    seal.check(written=True)  # the rows were read by name as they were copied


class _Checkpoints:
    """This module as the public checkpoint functions reach it (``checkpoint.sharded.ShardedCheckpoints``)."""

    def owns(self, model: nn.Module) -> bool:
        return bool(group_sharded(model))

    def save(self, path: str | os.PathLike[str], model: nn.Module, optimizer: Any,
             extra: dict[str, Any] | None) -> None:
        save_sharded(path, model, optimizer, extra)

    def load(self, path: str | os.PathLike[str], model: nn.Module, optimizer: Any) -> dict[str, Any] | None:
        return load_sharded(path, model, optimizer)

    def payload(self, path: str) -> dict[str, Any]:
        return sharded_payload(path)


CHECKPOINTS = _Checkpoints()
