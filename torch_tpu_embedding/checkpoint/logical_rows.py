"""Reading a checkpoint's tables by logical row, whichever kind of directory wrote it.

A :class:`Source` answers for each table: its logical rows (``copy_rows`` writes the rows a
:data:`Locate` places on this rank straight into a destination tensor), its row slots, its whole-table
slots and its pending accumulation buffers (logical ids, ``-1`` padding). Two kinds of directory feed it:

* ``tte.distributed.save_sharded``'s (``meta.pt`` + ``rows-<rank>.pt``): each sharded table's rows are
  in the rank files, in ascending logical id; the rest (replicated tables, dense layers) is logical in
  ``meta.pt``. The rank files are read in windows, each window's ids placed by a :data:`Locate` as they
  are read, so a reader's memory grows by one chunk, never by a file or a shard (:class:`_RowFiles`);
* a logical payload (``tte.checkpoint.save``'s form: what ``tte.checkpoint.save_distributed``'s
  directories read into on the host, ``_ckpt_dcp.logical_payload``): every table whole.

:meth:`Source.payload` is the whole checkpoint in the logical form, for a model that holds every table
whole (one process, or torch_xla SPMD, whose host stages a table to shard it).

The memory of a window, by construction within ``_ckpt_publish.CHUNK`` (4 MiB): ``_ckpt_publish.BUFFER``
(``CHUNK`` less ``RESERVE``, 512 KiB) is split between two terms, alive together.

* Everything a window holds in proportion to its rows lives in one anonymous mapping (:class:`Window`),
  sized by :func:`window_rows` so that its length, rounded up to whole pages, is at most
  :data:`WINDOW_BYTES` (2 MiB). Per row (:data:`_INDEX_BYTES` and the rows): its logical id as read
  (int64) and where it goes here, whether it is ours (bool) and its row here (int64), copied in from the
  :data:`Locate`'s results; when only some rows are ours, their positions in the window and their rows
  here (int64 each); the row as read and the row gathered when only some are ours (the source's dtype),
  and once more in the destination's dtype when it differs (the cast). Each buffer is rounded up to 64
  bytes and the mapping to a page: :data:`_SEGMENTS` · 64 bytes and a page come off the budget first.
* The :data:`Locate` runs on :data:`_PIECE` ids at a time, and its temporaries come from malloc
  (``RowOwnership.physical_row``'s: a few int64 and bools per id, freed before the next piece's): charged
  :data:`_LOCATE_BYTES` per id of a piece, 1.5 MiB, whatever the window or the table. (The heap keeps what
  it grew by; the next piece, table or slot reuses it.)

The checksums' buffer (``_ckpt_publish._sha256``, ``BUFFER`` bytes) is gone before the first window's
mapping is made, and each table's or slot's mapping is unmapped before the next one's. ``RESERVE`` holds
what no size here bounds: the interpreter's objects and the pages of the rank files' pickles and headers
read through their mappings. A row wider than the budget (over about 1 MiB of float32) is read one at a
time and costs its own size; where the storages' offsets are not found the windows are read through
file mappings (:class:`_RowFiles`), whose pages count beside the budget.
"""

from __future__ import annotations

import ctypes
import functools
import io
import math
import mmap
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from torch_tpu_embedding.checkpoint.dcp import FORMAT
from torch_tpu_embedding.checkpoint.files import load_refusal, through
from torch_tpu_embedding.checkpoint.publish import BUFFER, CHUNK, CheckpointCorruptError

__all__ = ["BUFFER", "CHUNK", "WINDOW_BYTES", "Locate", "Source", "Window", "copy_window", "everything", "mapped",
           "merge_accumulation", "select_accumulation", "storage_offsets", "window_buffers", "window_bytes",
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
#: ``mine`` is false). Called on a piece of a window's ids at a time (:data:`_PIECE`).
Locate = Callable[[Tensor], tuple[Tensor, Tensor]]

#: Bytes of a window's index bookkeeping per row, in its mapping (:class:`Window`): the id as read, whether
#: it is ours, its row here, and for the rows ours when only some are their positions and rows here.
_INDEX_BYTES = 8 + 1 + 8 + 8 + 8
#: The buffers of a :class:`Window`: each rounded up to 64 bytes in its mapping.
_SEGMENTS = 8
#: Ids placed by one call of a :data:`Locate` (the module docstring). Each call costs the ownership's few
#: dozen ops whatever its length (pieces of 2048 made a 2^20-row load's copies 25% slower than one call a
#: window): one piece covers a window of 64 float32 columns.
_PIECE = 8192
#: What the :data:`Locate`'s temporaries may add to resident memory per id of a piece, charged against
#: ``BUFFER``: ``_pg_ckpt._locator``'s grew it by 43-122 bytes (interleaved rows at 2, 3, 5 and 1024
#: ranks, the odd factors' the most: RowOwnership.physical_row's int64 temporaries, up to about seven
#: alive at once, and malloc's placing of them), checked by
#: tests/checkpoint/test_ckpt_rows.py::test_placing_ids_stays_within_its_charge.
_LOCATE_BYTES = 192
#: The most a :class:`Window`'s mapping takes, in whole pages: ``BUFFER`` less the :data:`Locate`'s charge.
WINDOW_BYTES = BUFFER - _PIECE * _LOCATE_BYTES


def everything(ids: Tensor) -> tuple[Tensor, Tensor]:
    """The :data:`Locate` of a reader holding every logical row at its own index (a whole table)."""
    return torch.ones_like(ids, dtype=torch.bool), ids


def window_rows(src: Tensor, dest: Tensor) -> int:
    """Rows of ``src`` read at a time into ``dest``: the most whose :class:`Window` (:func:`window_bytes`)
    fits :data:`WINDOW_BYTES`, pages and alignment included (the module docstring); at least one."""
    per = _INDEX_BYTES + math.prod(src.shape[1:]) * (
        2 * src.element_size() + (dest.element_size() if dest.dtype != src.dtype else 0))
    return max(1, (WINDOW_BYTES - _SEGMENTS * 64 - mmap.PAGESIZE) // per)


class Window(NamedTuple):
    """The buffers of one window of rows, reused for every window of a table or slot (the module docstring;
    the first rows of each are used when a window is shorter or only some of its rows are ours)."""

    ids: Tensor  # [n] the window's logical ids as read
    mine: Tensor  # [n] bool: whether each is stored here
    local: Tensor  # [n] int64: its row here (any value where not ours)
    hit: Tensor  # [n, 1] int64: positions of the rows ours, when only some are
    picked: Tensor  # [n] int64: their rows here
    rows: Tensor  # [n, ...] the rows as read
    gathered: Tensor  # [n, ...] the rows ours, when only some are
    cast: Tensor  # [n, ...] in the destination's dtype where it differs (else no rows)


def _window_specs(n: int, src: Tensor, dest: Tensor, ids: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    row = tuple(src.shape[1:])
    return [((n,), ids), ((n,), torch.bool), ((n,), torch.int64), ((n, 1), torch.int64), ((n,), torch.int64),
            ((n, *row), src.dtype), ((n, *row), src.dtype), ((n if dest.dtype != src.dtype else 0, *row), dest.dtype)]


def window_bytes(n: int, src: Tensor, dest: Tensor, ids: torch.dtype = torch.int64) -> int:
    """The length of the mapping of :func:`window_buffers` (``n``, ``src``, ``dest``, ``ids``), in whole
    pages: what it can add to resident memory."""
    return -(-_layout(_window_specs(n, src, dest, ids))[1][-1] // mmap.PAGESIZE) * mmap.PAGESIZE


def window_buffers(n: int, src: Tensor, dest: Tensor, ids: torch.dtype = torch.int64) -> Window:
    """A :class:`Window` of ``n`` rows of ``src`` (its logical ids of dtype ``ids``) read into ``dest``."""
    return Window(*mapped(*_window_specs(n, src, dest, ids)))


def copy_window(read: Callable[[], Tensor], ids: Tensor, locate: Locate, dest: Tensor, window: Window) -> None:
    """Write those of the rows ``read()`` returns (logical ids ``ids``) that ``locate`` places here into
    their rows of ``dest`` (read only when some are), through ``window``'s buffers (at least as many rows
    as ``ids``): nothing here allocates in proportion to the window but the :data:`Locate` (a piece at a
    time) and ``read``."""
    n = ids.shape[0]
    mine, local = window.mine[:n], window.local[:n]
    for a in range(0, n, _PIECE):
        got, at = locate(ids[a : a + _PIECE])
        mine[a : a + _PIECE].copy_(got)
        local[a : a + _PIECE].copy_(at)
        del got, at  # (freed before the next piece's: malloc reuses them)
    if bool(mine.all()):
        rows = read()
    else:
        # nonzero resizes its output within the buffer (a storage over a mapping cannot grow: it raises)
        hit = torch.nonzero(mine, out=window.hit[:0]).reshape(-1)
        if not hit.numel():
            return
        local = torch.index_select(local, 0, hit, out=window.picked[: hit.shape[0]])
        rows = torch.index_select(read(), 0, hit, out=window.gathered[: hit.shape[0]])
    if rows.dtype != dest.dtype:
        rows = window.cast[: rows.shape[0]].copy_(rows)
    with torch.no_grad():
        dest.index_copy_(0, local.to(dest.device), rows.to(dest.device))


def storage_offsets(file: str, part: Any) -> dict[int, int] | None:
    """The offset in ``file`` of every tensor storage of ``part`` (``file`` loaded with ``mmap=True``), by
    its address in the mapping: each is the mapping's start (page-aligned) plus its record's offset.
    ``None`` unless exactly one start fits them all (another storage layout): windows are then read
    through mappings."""
    if not hasattr(os, "preadv"):  # (Linux and the BSDs have it; elsewhere windows are read through mappings)
        return None
    # get_record_offset: torch.load's own, missing from the stubs
    reader: Any = torch._C.PyTorchFileReader(through(file))
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
        self.offsets = [storage_offsets(f, p) for f, p in zip(self.files, self.parts, strict=True)]

    def _load(self, r: int) -> dict[str, Any]:
        try:
            part: dict[str, Any] = torch.load(through(self.files[r]), mmap=True, weights_only=True)
        except Exception as e:  # weights-only refusals and damaged files raise several types
            raise CheckpointCorruptError(f"{self.files[r]} is not a readable checkpoint file: {load_refusal(e)}. "
                                         "Nothing was loaded.") from e
        if not isinstance(part, dict):
            raise CheckpointCorruptError(f"{self.files[r]} holds a {type(part).__name__}, not a rank's rows (a "
                                         "dict by table). Nothing was loaded.")
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
            buffers = window_buffers(min(window, n), src, dest, part[name]["ids"].dtype)
            with open(through(self.files[r]), "rb", buffering=0) as f:
                for a in range(0, n, window):
                    self._copy_window(r, f, (name, slot), slice(a, min(a + window, n)), locate, dest, buffers)
            del buffers  # the mapping goes with it, before the next file's is made
        return found

    def _copy_window(self, r: int, f: io.FileIO, which: tuple[str, str | None], rows: slice, locate: Locate,
                     dest: Tensor, buffers: Window) -> None:
        """Window ``rows`` of file ``r``'s table ``which[0]`` (weight or row slot ``which[1]``) into ``dest``
        through ``buffers``."""
        part = self.parts[r][which[0]]
        src = _pick(part, which[1])
        assert src is not None
        offsets = self.offsets[r]
        if offsets is None or not (src.is_contiguous() and part["ids"].is_contiguous()):
            entry = self._load(r)[which[0]]  # a mapping of its own, dropped on return with the pages it read
            got = _pick(entry, which[1])
            assert got is not None
            copy_window(lambda: got[rows], entry["ids"][rows], locate, dest, buffers)
            return
        ids = _read(f, offsets, part["ids"], rows, buffers.ids)
        copy_window(lambda: _read(f, offsets, src, rows, buffers.rows), ids, locate, dest, buffers)


def _layout(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], list[int]]:
    """The bytes of each tensor of ``specs`` (shape, dtype) and where each starts in their mapping (64-byte
    aligned; the last entry: the bytes of them all)."""
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    return sizes, [sum(-(-k // 64) * 64 for k in sizes[:i]) for i in range(len(sizes) + 1)]


def mapped(*specs: tuple[tuple[int, ...], torch.dtype]) -> list[Tensor]:
    """Tensors of the given shapes and dtypes in one anonymous mapping of their own, unmapped when the last
    tensor over it is freed (``torch.frombuffer`` holds the mapping): freed to malloc instead, they would
    stay resident in its heap, and the next table's or slot's buffers would add to them. Its pages count
    in resident memory only once written."""
    sizes, starts = _layout(list(specs))
    memory = mmap.mmap(-1, max(1, starts[-1]))
    return [torch.frombuffer(memory, dtype=torch.uint8, count=k, offset=at).view(dtype).view(shape) if k
            else torch.empty(shape, dtype=dtype)  # (no bytes: frombuffer refuses a count of 0)
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
    or ``None``; ``files``: the rank files, ``None`` for a logical payload; ``extra``: what the save was given
    as ``extra`` (``None``: nothing).
    """

    def __init__(self, model: dict[str, Any], optimizer: dict[str, Any] | None,
                 tables: dict[str, dict[str, Any]] | None = None, files: tuple[str, int] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        self.model, self.optimizer, self.tables, self.extra = model, optimizer, dict(tables or {}), extra
        self.files = None if files is None else _RowFiles(*files)

    @classmethod
    def sharded(cls, path: str, meta: dict[str, Any]) -> Source:
        return cls(meta["model"], meta.get("optimizer"), meta["tables"], (path, int(meta["world"])),
                   meta.get("extra"))

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
        buffers = window_buffers(min(window, n), src, dest)
        for a in range(0, n, window):
            k = min(window, n - a)
            ids = torch.arange(a, a + k, out=buffers.ids[:k])
            copy_window(functools.partial(src.narrow, 0, a, k), ids, locate, dest, buffers)
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
        return {"format": FORMAT, "model": model, "optimizer": optimizer, "extra": self.extra}


def merge_accumulation(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Several ranks' buffers of one table (logical ids, ``-1`` padding; the same ``k`` calls) as one:
    call ``j``'s entries side by side, padded to the widest call (at least 1). Every id but ``-1`` is kept (a
    crafted negative one too: the load's checks refuse it by name, it is not padding to drop unseen)."""
    k, dim, dtype = parts[0][0].shape[0], parts[0][1].shape[-1], parts[0][1].dtype
    calls = [[(ids[j][ids[j] != -1], rows[j][ids[j] != -1]) for ids, rows in parts] for j in range(k)]
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
