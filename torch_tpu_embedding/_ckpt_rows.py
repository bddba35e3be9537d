"""Reading a checkpoint's tables by logical row, whichever kind of directory wrote it.

A :class:`Source` answers for each table: its logical rows (``copy_rows`` writes the rows a
:data:`Locate` places on this rank straight into a destination tensor), its row slots, its whole-table
slots and its pending accumulation buffers (logical ids, ``-1`` padding). Two kinds of directory feed it:

* ``tte.distributed.save_sharded``'s (``meta.pt`` + ``rows-<rank>.pt``): each sharded table's rows are
  in the rank files, in ascending logical id; the rest (replicated tables, dense layers) is logical in
  ``meta.pt``. The rank files are read in windows that fit ``_ckpt_publish.CHUNK`` bytes (4 MiB) with
  their bookkeeping, each window's ids placed by a :data:`Locate` as they are read, so a reader's
  memory grows by one chunk, never by a file or a shard (:class:`_RowFiles`);
* a logical payload (``tte.checkpoint.save``'s form: what ``tte.checkpoint.save_distributed``'s
  directories read into on the host, ``_ckpt_dcp.logical_payload``): every table whole.

:meth:`Source.payload` is the whole checkpoint in the logical form, for a model that holds every table
whole (one process, or torch_xla SPMD, whose host stages a table to shard it).
"""

from __future__ import annotations

import ctypes
import functools
import io
import math
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch

from torch_tpu_embedding._ckpt_dcp import FORMAT
from torch_tpu_embedding._ckpt_publish import CHUNK, CheckpointCorruptError

__all__ = ["CHUNK", "Locate", "Source", "copy_window", "everything", "merge_accumulation", "select_accumulation",
           "window_rows"]

Tensor = torch.Tensor
ACC = ("acc_ids", "acc_rows")


def _pick(entry: dict[str, Any], slot: str | None) -> Tensor | None:
    if slot is None:
        return entry.get("weight")
    rows = entry.get("rows", {})
    return rows.get(slot) if isinstance(rows, dict) else None


#: Where one rank stores a table's logical rows: ``locate(ids)`` is ``(mine, local)``, whether it stores
#: each logical id of ``ids`` (``-1`` and other padding: never) and at which of its rows (any value where
#: ``mine`` is false). Called on one window of ids at a time.
Locate = Callable[[Tensor], tuple[Tensor, Tensor]]

#: Bytes of index bookkeeping per row of a window, alive at once: the window's stored ids, the ownership's
#: temporaries while it places them (``RowOwnership.physical_row``: a few int64 per id) and the rows hit.
_INDEX_BYTES = 6 * 8


def everything(ids: Tensor) -> tuple[Tensor, Tensor]:
    """The :data:`Locate` of a reader holding every logical row at its own index (a whole table)."""
    return torch.ones_like(ids, dtype=torch.bool), ids


def window_rows(src: Tensor, dest: Tensor) -> int:
    """Rows of ``src`` read at a time into ``dest`` so that one window's memory stays within :data:`CHUNK`:
    its rows as read, as many gathered when only some are ours, one more copy in ``dest``'s dtype when it
    differs, and the index bookkeeping (:data:`_INDEX_BYTES`)."""
    row = src[0].numel() * src.element_size() if src.shape[0] else src.element_size()
    cast = row // src.element_size() * dest.element_size() if dest.dtype != src.dtype else 0
    return max(1, CHUNK // (2 * row + cast + _INDEX_BYTES))


def copy_window(read: Callable[[], Tensor], ids: Tensor, locate: Locate, dest: Tensor, gathered: Tensor) -> None:
    """Write those of the rows ``read()`` returns (logical ids ``ids``) that ``locate`` places here into
    their rows of ``dest`` (read only when some are); ``gathered``: a buffer of at least their size for
    them when only some are ours."""
    mine, local = locate(ids)
    if bool(mine.all()):
        rows = read()
    else:
        hit = torch.nonzero(mine).reshape(-1)
        if not hit.numel():
            return
        del mine
        local, rows = local.index_select(0, hit), torch.index_select(read(), 0, hit, out=gathered[: hit.shape[0]])
    with torch.no_grad():
        dest.index_copy_(0, local.to(dest.device), rows.to(dtype=dest.dtype, device=dest.device))


def _storage_offsets(file: str, part: Any) -> dict[int, int] | None:
    """The offset in ``file`` of every tensor storage of ``part`` (``file`` loaded with ``mmap=True``), by
    its address in the mapping: each is the mapping's start (page-aligned) plus its record's offset.
    ``None`` unless exactly one start fits them all (another storage layout): windows are then read
    through mappings."""
    if not hasattr(os, "preadv"):  # (Linux and the BSDs have it; elsewhere windows are read through mappings)
        return None
    reader: Any = torch._C.PyTorchFileReader(file)  # get_record_offset: torch.load's own, missing from the stubs
    offsets = {reader.get_record_offset(n) for n in reader.get_all_records() if n.split("/")[-2:-1] == ["data"]}
    ptrs = {t.untyped_storage().data_ptr() for t in _tensors(part) if t.untyped_storage().nbytes()}
    if not ptrs:
        return {}
    starts = [start for start in {min(ptrs) - o for o in offsets}
              if start % mmap.PAGESIZE == 0 and all(p - start in offsets for p in ptrs)]
    return {p: p - starts[0] for p in ptrs} if len(starts) == 1 else None


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _RowFiles:
    """The ``rows-<rank>.pt`` files of a ``save_sharded`` directory.

    Rows are read a window at a time with ``os.preadv`` into buffers reused for every window: the
    reader's memory grows by those buffers alone. (A page read through a file mapping counts in the
    process's resident memory until the mapping goes, and the kernel maps a file's page cache in folios of
    up to 2 MiB: read through a mapping, each window would cost up to a folio more at each of its ends.)
    """

    def __init__(self, path: str, world: int) -> None:
        self.files = [os.path.join(path, f"rows-{r}.pt") for r in range(world)]
        # Kept mapped for shapes, whole-table slots and accumulation buffers (small); rows are read in windows.
        self.parts = [self._load(r) for r in range(world)]
        self.offsets = [_storage_offsets(f, p) for f, p in zip(self.files, self.parts, strict=True)]

    def _load(self, r: int) -> dict[str, Any]:
        part: dict[str, Any] = torch.load(self.files[r], mmap=True, weights_only=True)
        return part

    def copy_rows(self, name: str, slot: str | None, locate: Locate, dest: Tensor) -> bool:
        """Write the rows held in any file that ``locate`` places here into ``dest`` (see :data:`Locate`)."""
        found = False
        for r, part in enumerate(self.parts):
            src = _pick(part.get(name, {}), slot)
            if src is None:
                continue
            found = True
            n = int(src.shape[0])
            if not n:
                continue
            window = window_rows(src, dest)
            shape = (min(window, n), *src.shape[1:])
            ids, rows, gathered = _mapped((shape[:1], part[name]["ids"].dtype), (shape, src.dtype), (shape, src.dtype))
            with open(self.files[r], "rb", buffering=0) as f:
                for a in range(0, n, window):
                    self._copy_window(r, f, (name, slot), slice(a, min(a + window, n)), locate, dest,
                                      (ids, rows, gathered))
            del ids, rows, gathered  # the mapping goes with them, before the next file's is made
        return found

    def _copy_window(self, r: int, f: io.FileIO, which: tuple[str, str | None], rows: slice, locate: Locate,
                     dest: Tensor, buffers: tuple[Tensor, Tensor, Tensor]) -> None:
        """Window ``rows`` of file ``r``'s table ``which[0]`` (weight or row slot ``which[1]``) into ``dest``;
        ``buffers``: its ids, its rows and the rows gathered."""
        part = self.parts[r][which[0]]
        src = _pick(part, which[1])
        assert src is not None
        offsets = self.offsets[r]
        if offsets is None or not (src.is_contiguous() and part["ids"].is_contiguous()):
            entry = self._load(r)[which[0]]  # a mapping of its own, dropped on return with the pages it read
            got = _pick(entry, which[1])
            assert got is not None
            copy_window(lambda: got[rows], entry["ids"][rows], locate, dest, buffers[2])
            return
        ids = _read(f, offsets, part["ids"], rows, buffers[0])
        copy_window(lambda: _read(f, offsets, src, rows, buffers[1]), ids, locate, dest, buffers[2])


def _mapped(*specs: tuple[tuple[int, ...], torch.dtype]) -> list[Tensor]:
    """Tensors of the given shapes and dtypes in one anonymous mapping of their own, unmapped when the last
    tensor over it is freed (``torch.frombuffer`` holds the mapping): freed to malloc instead, they would
    stay resident in its heap, and the next table's or slot's buffers would add to them."""
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    starts = [sum(-(-k // 64) * 64 for k in sizes[:i]) for i in range(len(sizes) + 1)]  # 64-byte aligned
    memory = mmap.mmap(-1, max(1, starts[-1]))
    return [torch.frombuffer(memory, dtype=torch.uint8, count=k, offset=at).view(dtype).view(shape)
            for (shape, dtype), k, at in zip(specs, sizes, starts, strict=False)]


def _read(f: io.FileIO, offsets: dict[int, int], src: Tensor, rows: slice, out: Tensor) -> Tensor:
    """Rows ``rows`` of ``src`` (a contiguous tensor of file ``f`` mapped whole; ``offsets``: its storages'
    offsets in the file) read from the file into ``out``'s first rows."""
    n = rows.stop - rows.start
    got = out[:n]
    size = got.numel() * got.element_size()
    at = offsets[src.untyped_storage().data_ptr()] + (src.storage_offset() + rows.start * src.stride(0)) * \
        src.element_size()
    view = memoryview((ctypes.c_char * size).from_address(got.data_ptr())).cast("B")
    done = 0
    while done < size:
        k = os.preadv(f.fileno(), [view[done:]], at + done)
        if not k:
            raise CheckpointCorruptError(f"{f.name!s} ended {size - done} bytes early, at byte {at + done} (changed "
                                         "since it was verified?); some rows may have been loaded.")
        done += k
    return got


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

    def copy_rows(self, name: str, key: str, slot: str | None, locate: Locate, dest: Tensor) -> bool:
        """Write the rows of table ``name``'s weight (``slot`` ``None``; ``key``: its ``state_dict`` key) or
        row slot that ``locate`` places here into ``dest``, a window at a time; ``False``: nothing saved."""
        if name in self.tables:
            assert self.files is not None
            return self.files.copy_rows(name, slot, locate, dest)
        src = self.model.get(key) if slot is None else self._state(name).get(slot)
        if not isinstance(src, Tensor):
            return False
        n = int(src.shape[0])
        window = window_rows(src, dest)
        gathered = torch.empty((min(window, n), *src.shape[1:]), dtype=src.dtype)
        for a in range(0, n, window):
            read = functools.partial(src.narrow, 0, a, min(window, n - a))
            copy_window(read, torch.arange(a, min(a + window, n)), locate, dest, gathered)
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
            src = self.row_slot(name, None)
            assert src is not None
            model[key] = torch.zeros((n, *src.shape[1:]), dtype=src.dtype)
            self.copy_rows(name, key, None, everything, model[key])
            if optimizer is None:
                continue
            assert self.files is not None
            slots = sorted({s for p in self.files.parts for s in p.get(name, {}).get("rows", {})})
            entry = self.whole_slots(name, set(slots))
            for slot in slots:
                like = self.row_slot(name, slot)
                assert like is not None
                entry[slot] = torch.zeros((n, *like.shape[1:]), dtype=like.dtype)
                self.copy_rows(name, key, slot, everything, entry[slot])
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


def select_accumulation(acc: tuple[Tensor, Tensor], locate: Locate) -> tuple[Tensor, Tensor]:
    """The entries of ``acc`` (logical ids) that ``locate`` places here, with each id replaced by its row
    here (``-1`` padding): what one rank's optimizer holds of a merged buffer."""
    ids, rows = acc
    mine, at = locate(ids.reshape(-1))
    keep = (ids >= 0) & mine.reshape(ids.shape)
    local = torch.where(keep, at.reshape(ids.shape), torch.full_like(ids, -1))
    return merge_accumulation([(local, rows)])  # packed: the entries kept, each call to the front
