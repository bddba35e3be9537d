"""Loading checkpoints of models sharded over a process group: each rank reads only its own rows.

:func:`load_sharded` loads a ``sharded_save.save_sharded`` directory, or a ``tte.checkpoint.save_distributed`` one,
into a model sharded over any number of ranks, or into one holding every table whole (one process;
``load_distributed`` sends an SPMD model here). Into a sharded model each rank copies the rows it stores into its
shard and slots, reading the row files in windows of at most ``checkpoint/publish.py``'s ``BUFFER`` bytes
(``checkpoint/logical_rows.py``; :func:`_locator`): its memory grows by at most one chunk, never by a shard. A
``save_distributed`` directory is read through the host first (DCP reads a table whole): for tables that fit in one
host's memory.

Loads verify before they write, as ``tte.checkpoint.save_distributed``'s (``checkpoint/publish.py``): a load checks
every file and the whole state (names, shapes, dtypes, hyper-parameters, accumulation buffers) before it changes
anything; a part failing on some ranks raises on every rank (``agreement``).
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
from torch_tpu_embedding.checkpoint.files import load_refusal, through
from torch_tpu_embedding.checkpoint.host import own_layout_state
from torch_tpu_embedding.checkpoint.logical_rows import ACC, Locate, Source, select_accumulation
from torch_tpu_embedding.checkpoint.publish import (
    SHARDED_META,
    CheckpointCorruptError,
    is_sharded,
    verify,
)
from torch_tpu_embedding.checkpoint.snapshot import Seal, identity, pinned
from torch_tpu_embedding.distributed.exchange import GroupSharding
from torch_tpu_embedding.distributed.sharded_save import all_tables, group_sharded, save_sharded
from torch_tpu_embedding.modules.table import EmbeddingTable
from torch_tpu_embedding.optim._state.state_check import accumulation_problems

__all__ = ["load_sharded", "open_checkpoint", "sharded_payload"]

Tensor = torch.Tensor


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
        return _load(path, model, optimizer, lambda: (*_open(path), identity(path)))


def load_file(path: str, read: Callable[[], tuple[dict[str, Any], str]], model: nn.Module, optimizer: Any,
              strict: bool) -> dict[str, Any] | None:
    """``tte.checkpoint.load`` of the ``tte.checkpoint.save`` file ``path`` into ``model``, sharded here: every rank
    reads it whole (``read()``: the payload and the sha256 of its bytes, which the ranks compare) and keeps its rows,
    as a ``save_distributed`` directory loads (its tables read through the host)."""
    def opened() -> tuple[Source, Seal, str]:
        payload, digest = read()
        if payload.get("model") is None:
            raise ValueError(f"{path} holds no model state.")
        return Source(payload["model"], payload.get("optimizer"), extra=payload.get("extra")), Seal(path, {}), digest

    with slots_for_a_load(optimizer):
        return _load(path, model, optimizer, opened, strict)


def _load(path: str, model: nn.Module, optimizer: Any, opened: Callable[[], tuple[Source, Seal, str]],
          strict: bool = True) -> dict[str, Any] | None:
    """:func:`load_sharded` of the pinned directory ``path`` (or :func:`load_file` of a file); ``opened()``: its
    source, the seal of its files and which save it is (read on each rank inside the ranks' agreement)."""
    tables = all_tables(model)
    mine = group_sharded(model)
    if not mine:  # every table whole here: the logical payload, checked and loaded as tte.checkpoint.load's
        source, seal, _ = opened()
        payload = source.payload(_saved_keys(source, tables))
        seal.check()  # what was read is what was verified
        return apply_payload(payload, path, model, optimizer, strict=strict)
    group = next(iter(mine.values()))[2].group
    plan, save = None, None
    with Attempt() as checks:  # every check, on this rank's files and model: one rank may fail alone
        source, seal, save = opened()
        plan = _checked(path, model, optimizer, tables, mine, source, seal, strict)
    saves = agree(checks.error, group, (save, optimizer is not None),
                  done="every rank refused the load: nothing was loaded on any rank")
    given_on_every_rank([g for _, g in saves], "optimizer", "load_sharded", "nothing was loaded on any rank")
    if len({save for save, _ in saves}) > 1:  # a save published while the ranks opened the path: some have the old one
        raise CheckpointCorruptError(f"The ranks opened different saves of {path} (another save was published "
                                     "while they opened it" + (", or the ranks' copies of the file differ" if
                                                               os.path.isfile(path) else "")
                                     + "); nothing was loaded. Load it again.")
    assert plan is not None
    with Attempt() as writes:  # (a rank file cut or replaced since it was verified; a failed allocation)
        _write_state(plan, model, optimizer, mine, strict)
    agree(writes.error, group, done="the other ranks loaded their part: the job holds values of two states. "
          "Load a checkpoint again on every rank")
    return plan[0].extra


#: :func:`_checked`'s source, seal, model and optimizer ``state_dict`` to load, each sharded table's row slots.
_Plan = tuple[Source, Seal, dict[str, Any], "dict[str, Any] | None", dict[str, list[str]]]


def _checked(path: str, model: nn.Module, optimizer: Any, tables: dict[str, tuple[str, nn.Module]],
             mine: dict[str, tuple[str, EmbeddingTable, GroupSharding]], source: Source, seal: Seal,
             strict: bool) -> _Plan:
    """Check the checkpoint ``path`` (opened: ``source``, ``seal``) against ``model`` and ``optimizer`` on this rank:
    raises before anything is written. ``strict``: the model's keys, as ``Module.load_state_dict``'s."""
    problems: list[str] = []
    # The checkpoint's keys alone (a key the model has and the save lacks is reported missing, as a load into one
    # process reports it, instead of keeping the model's own value), the sharded tables' as stand-ins below.
    sd: dict[str, Any] = dict(source.model)
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
    problems += [f"model: {p}" for p in model_problems(model, sd, strict)]
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
                 mine: dict[str, tuple[str, EmbeddingTable, GroupSharding]], strict: bool) -> None:
    """Write the checked ``plan`` (:func:`_checked`) into ``model`` and ``optimizer``: each rank its rows."""
    source, seal, sd, osd, row_slots = plan
    with stored_rows():  # the sharded tables' entries are their stored rows (as stored_state read them)
        model.load_state_dict(sd, strict=strict)  # the shards get zeros from their stand-ins: their rows come next
    for name, (key, t, s) in mine.items():
        if key in sd:  # (strict=False: a table the checkpoint lacks keeps its rows)
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

    def load_file(self, path: str, read: Callable[[], tuple[dict[str, Any], str]], model: nn.Module,
                  optimizer: Any, strict: bool) -> dict[str, Any] | None:
        return load_file(path, read, model, optimizer, strict)

    def payload(self, path: str) -> dict[str, Any]:
        return sharded_payload(path)


CHECKPOINTS = _Checkpoints()
