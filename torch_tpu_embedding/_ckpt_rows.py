"""Reading a checkpoint's tables by logical row, whichever kind of directory wrote it.

A :class:`Source` answers for each table: its logical rows (``copy_rows`` writes the rows of any set of
logical ids straight into a destination tensor), its row slots, its whole-table slots and its pending
accumulation buffers (logical ids, ``-1`` padding). Two kinds of directory feed it:

* ``tte.distributed.save_sharded``'s (``meta.pt`` + ``rows-<rank>.pt``): each sharded table's rows are
  in the rank files, in ascending logical id; the rest (replicated tables, dense layers) is logical in
  ``meta.pt``. The rank files are read in windows of about ``_ckpt_publish.CHUNK`` bytes (4 MiB), each through its own
  memory map that is dropped before the next (a page read through a mapping counts in the process's
  resident memory until the mapping goes), so a reader's memory grows by one window, never a file;
* a logical payload (``tte.checkpoint.save``'s form: what ``tte.checkpoint.save_distributed``'s
  directories read into on the host, ``_ckpt_dcp.logical_payload``): every table whole.

:meth:`Source.payload` is the whole checkpoint in the logical form, for a model that holds every table
whole (one process, or torch_xla SPMD, whose host stages a table to shard it).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from torch_tpu_embedding._ckpt_dcp import FORMAT
from torch_tpu_embedding._ckpt_publish import CHUNK

__all__ = ["CHUNK", "Source", "merge_accumulation", "select_accumulation"]

Tensor = torch.Tensor
ACC = ("acc_ids", "acc_rows")


def _pick(entry: dict[str, Any], slot: str | None) -> Tensor | None:
    if slot is None:
        return entry.get("weight")
    rows = entry.get("rows", {})
    return rows.get(slot) if isinstance(rows, dict) else None


class _RowFiles:
    """The ``rows-<rank>.pt`` files of a ``save_sharded`` directory."""

    def __init__(self, path: str, world: int) -> None:
        self.files = [os.path.join(path, f"rows-{r}.pt") for r in range(world)]
        # Kept mapped for shapes, whole-table slots and accumulation buffers (small); rows are read in windows.
        self.parts = [self._load(r) for r in range(world)]

    def _load(self, r: int) -> dict[str, Any]:
        part: dict[str, Any] = torch.load(self.files[r], mmap=True, weights_only=True)
        return part

    def copy_rows(self, name: str, slot: str | None, need: Tensor, dest: Tensor, pos: Tensor) -> bool:
        """Write the rows of logical ids ``need`` (ascending) held in any file into ``dest[pos]``."""
        found = False
        for r, part in enumerate(self.parts):
            src = _pick(part.get(name, {}), slot)
            if src is None:
                continue
            found = True
            n = int(src.shape[0])
            if not n or not need.numel():
                continue
            window = max(1, CHUNK // (src[0].numel() * src.element_size() + 8))
            # One buffer for every window's rows (a new tensor per window would leave the allocator holding
            # several windows' worth of freed memory).
            buffer = torch.empty((min(window, n), *src.shape[1:]), dtype=src.dtype)
            for a in range(0, n, window):
                self._copy_window(r, name, slot, slice(a, a + window), need, dest, pos, buffer)
        return found

    def _copy_window(self, r: int, name: str, slot: str | None, rows: slice, need: Tensor, dest: Tensor,
                     pos: Tensor, buffer: Tensor) -> None:
        entry = self._load(r)[name]  # a mapping of its own, dropped on return with the pages it read
        ids: Tensor = entry["ids"][rows]
        lo = int(torch.searchsorted(need, ids[0]))
        hi = int(torch.searchsorted(need, ids[-1], right=True))
        if hi <= lo:
            return
        want = need[lo:hi]
        at = torch.searchsorted(ids, want).clamp(max=ids.shape[0] - 1)
        hit = torch.nonzero(ids[at] == want).reshape(-1)
        src = _pick(entry, slot)
        assert src is not None
        got = torch.index_select(src[rows], 0, at[hit], out=buffer[: hit.shape[0]])
        with torch.no_grad():
            dest.index_copy_(0, pos[lo:hi][hit].to(dest.device), got.to(dtype=dest.dtype, device=dest.device))


class Source:
    """One checkpoint's state, table by table (see the module docstring).

    ``tables``: name → logical rows of each table read from rank files; ``model``: the logical model
    state (without those tables); ``optimizer``: the optimizer's ``state_dict`` (without their entries)
    or ``None``; ``files``: the rank files, ``None`` for a logical payload.
    """

    def __init__(self, model: dict[str, Any], optimizer: dict[str, Any] | None,
                 tables: dict[str, dict[str, Any]] | None = None, files: tuple[str, int] | None = None) -> None:
        self.model, self.optimizer, self.tables = model, optimizer, dict(tables or {})
        self.files = None if files is None else _RowFiles(*files)

    @classmethod
    def sharded(cls, path: str, meta: dict[str, Any]) -> Source:
        return cls(meta["model"], meta.get("optimizer"), meta["tables"], (path, int(meta["world"])))

    def _entry(self, name: str) -> dict[str, Any]:
        """The rank-file entry of table ``name`` that holds its whole-table slots: any rank's for a
        row-sharded table (they are equal), its owner's for a table-wise one."""
        assert self.files is not None
        info = self.tables[name]
        entry: dict[str, Any] = self.files.parts[0 if info["placement"] == "row" else info["owner"]][name]
        return entry

    def _state(self, name: str) -> dict[str, Tensor]:
        state = {} if self.optimizer is None else self.optimizer["state"]
        entry: dict[str, Tensor] = state.get(f"table:{name}", {})
        return entry

    def weight(self, key: str, name: str) -> Tensor | None:
        """Table ``name``'s logical weight when it is held whole (``key``: its ``state_dict`` key)."""
        if name in self.tables:
            return None
        value = self.model.get(key)
        return value if isinstance(value, Tensor) else None

    def row_slot(self, name: str, slot: str | None) -> Tensor | None:
        """A tensor with the dtype and trailing shape of table ``name``'s row slot (``None``: the weight),
        or ``None`` where the checkpoint has no such slot (its rows are not read)."""
        if name in self.tables:
            assert self.files is not None
            for part in self.files.parts:
                src = _pick(part.get(name, {}), slot)
                if src is not None:
                    return src
            return None
        value = self._state(name).get(slot) if slot is not None else None
        return value if isinstance(value, Tensor) and value.dim() else None

    def copy_rows(self, name: str, key: str, slot: str | None, need: Tensor, dest: Tensor, pos: Tensor) -> bool:
        """Write the rows of logical ids ``need`` (ascending) of table ``name``'s weight (``slot`` ``None``;
        ``key``: its ``state_dict`` key) or row slot into ``dest[pos]``; ``False``: nothing saved."""
        if name in self.tables:
            assert self.files is not None
            return self.files.copy_rows(name, slot, need, dest, pos)
        src = self.model.get(key) if slot is None else self._state(name).get(slot)
        if not isinstance(src, Tensor):
            return False
        with torch.no_grad():
            dest.index_copy_(0, pos.to(dest.device), src.index_select(0, need).to(dtype=dest.dtype,
                                                                                   device=dest.device))
        return True

    def whole_slots(self, name: str, row_slots: set[str]) -> dict[str, Tensor]:
        """Table ``name``'s optimizer slots that are not row slots (``row_slots``: the logical entry's)."""
        if name in self.tables:
            return {k: v.clone() for k, v in self._entry(name).get("whole", {}).items()}
        return {k: v for k, v in self._state(name).items() if k not in row_slots and k not in ACC}

    def accumulation(self, name: str) -> tuple[Tensor, Tensor] | None:
        """Table ``name``'s pending accumulation buffers: logical ids ``[k, cap]`` (``-1``: padding) and
        their rows ``[k, cap, D]``; ``None``: none pending."""
        if name not in self.tables:
            s = self._state(name)
            return (s["acc_ids"], s["acc_rows"]) if "acc_ids" in s and "acc_rows" in s else None
        assert self.files is not None
        got = [(p[name]["acc"]["acc_ids"], p[name]["acc"]["acc_rows"])
               for p in self.files.parts if "acc" in p.get(name, {})]
        return merge_accumulation(got) if got else None

    def payload(self, num_rows: dict[str, tuple[str, int]]) -> dict[str, Any]:
        """The whole checkpoint in ``tte.checkpoint.save``'s logical form (``num_rows``: each table's
        ``state_dict`` key and logical rows, for the tables read from rank files)."""
        model = dict(self.model)
        optimizer = None if self.optimizer is None else {**self.optimizer, "state": dict(self.optimizer["state"])}
        for name, (key, n) in num_rows.items():
            everything = torch.arange(n)
            src = self.row_slot(name, None)
            assert src is not None
            model[key] = torch.zeros((n, *src.shape[1:]), dtype=src.dtype)
            self.copy_rows(name, key, None, everything, model[key], everything)
            if optimizer is None:
                continue
            assert self.files is not None
            slots = sorted({s for p in self.files.parts for s in p.get(name, {}).get("rows", {})})
            entry = self.whole_slots(name, set(slots))
            for slot in slots:
                like = self.row_slot(name, slot)
                assert like is not None
                entry[slot] = torch.zeros((n, *like.shape[1:]), dtype=like.dtype)
                self.copy_rows(name, key, slot, everything, entry[slot], everything)
            acc = self.accumulation(name)
            if acc is not None:
                entry["acc_ids"], entry["acc_rows"] = acc
            optimizer["state"][f"table:{name}"] = entry
        return {"format": FORMAT, "model": model, "optimizer": optimizer, "extra": None}


def merge_accumulation(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Several ranks' buffers of one table (logical ids, ``-1`` padding; the same ``k`` calls) as one:
    call ``j``'s entries side by side, padded to the widest call (at least 1)."""
    k, dim, dtype = parts[0][0].shape[0], parts[0][1].shape[-1], parts[0][1].dtype
    calls = [[(ids[j][ids[j] >= 0], rows[j][ids[j] >= 0]) for ids, rows in parts] for j in range(k)]
    width = max([1] + [sum(int(i.numel()) for i, _ in call) for call in calls])
    out_ids = torch.full((k, width), -1, dtype=torch.int64)
    out_rows = torch.zeros((k, width, dim), dtype=dtype)
    for j, call in enumerate(calls):
        ids = torch.cat([i for i, _ in call])
        out_ids[j, : ids.numel()] = ids
        out_rows[j, : ids.numel()] = torch.cat([r.to(dtype) for _, r in call])
    return out_ids, out_rows


def select_accumulation(acc: tuple[Tensor, Tensor], need: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """The entries of ``acc`` (logical ids) whose ids are in ``need`` (ascending), with each id replaced by
    its row ``pos`` here (``-1`` padding): what one rank's optimizer holds of a merged buffer."""
    ids, rows = acc
    if not need.numel():
        keep = torch.zeros_like(ids, dtype=torch.bool)
        local = torch.full_like(ids, -1)
    else:
        at = torch.searchsorted(need, ids.clamp(min=0)).clamp(max=need.shape[0] - 1)
        keep = (ids >= 0) & (need[at] == ids)
        local = torch.where(keep, pos[at], torch.full_like(ids, -1))
    return merge_accumulation([(local, rows)])  # packed: the entries kept, each call to the front
