"""Writing a checkpoint file whose large tensors are produced a window of rows at a time.

``torch.save`` takes whole tensors: a rank's rows in logical order would be gathered into a copy of its shard
and of every row slot first (+1.2 GB at a 1 GiB table). :func:`write_rows` writes the same file (a
``torch.save`` zip that ``torch.load(weights_only=True)`` and ``checkpoint/logical_rows.py`` read) in two
passes: ``torch.save`` under ``torch.serialization.skip_data`` writes the structure with each tensor's bytes
left as room, each :class:`Rows` standing in as a tensor over an anonymous mapping that is never touched
(address space, no memory); then each record's offset is found as the loader finds it
(``logical_rows.storage_offsets``) and the rows are written there window by window from one buffer of at
most ``WINDOW_BYTES`` (its memory goes back to the system when the table is done). The zip records' CRC-32
fields are left 0, as with ``torch.serialization.set_crc32_options(False)``, which ``torch.load`` accepts; the
checkpoint's manifest holds each file's sha256.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from torch_tpu_embedding.checkpoint.logical_rows import WINDOW_BYTES, mapped, storage_offsets

__all__ = ["Rows", "write_rows"]

#: The most rows a window holds, whatever their width: what a :class:`Rows` ``fill`` computes for a window
#: beside the rows (positions, ids: a few int64 per row) stays within a few hundred KiB.
_MAX_WINDOW = 8192


class Rows(NamedTuple):
    """A ``[rows, *row]`` tensor of ``dtype`` written a window at a time: ``fill(a, b, out)`` writes its rows
    ``a`` to ``b`` into ``out`` (``[b - a, *row]``, CPU)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Callable[[int, int, torch.Tensor], None]


def _untouched(spec: Rows) -> torch.Tensor:
    """A tensor of ``spec``'s shape and dtype over an anonymous mapping whose pages are never touched."""
    (t,) = mapped((spec.shape, spec.dtype))
    return t


def _skeleton(obj: Any, leaves: list[Any]) -> Any:
    """``obj`` with each :class:`Rows` replaced by an untouched tensor and each tensor by a contiguous CPU copy
    (small: whole-table slots, buffers), both listed in ``leaves`` in order."""
    if isinstance(obj, Rows):
        leaves.append(obj)
        return _untouched(obj)
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu", copy=True).contiguous()
        leaves.append(t)
        return t
    if isinstance(obj, dict):
        return {k: _skeleton(v, leaves) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v, leaves) for v in obj)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a loaded skeleton, in :func:`_skeleton`'s order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _pwrite(fd: int, t: torch.Tensor, at: int) -> None:
    """The bytes of contiguous CPU tensor ``t`` at offset ``at`` of ``fd``."""
    size = t.numel() * t.element_size()
    if not size:
        return
    view = memoryview((ctypes.c_char * size).from_address(t.data_ptr())).cast("B")
    done = 0
    while done < size:
        done += os.pwrite(fd, view[done:], at + done)


def _materialized(obj: Any) -> Any:
    """``obj`` with each :class:`Rows` filled whole (where the records' offsets are not found)."""
    if isinstance(obj, Rows):
        out = torch.empty(obj.shape, dtype=obj.dtype)
        if obj.shape[0]:
            obj.fill(0, obj.shape[0], out)
        return out
    if isinstance(obj, dict):
        return {k: _materialized(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_materialized(v) for v in obj)
    return obj


def write_rows(file: str, obj: Any) -> None:
    """Write ``obj`` (dicts, lists and tuples of tensors, :class:`Rows` and plain values) to ``file`` as
    ``torch.save`` would with each :class:`Rows` a tensor, a window of rows at a time (module docstring),
    and fsync it."""
    leaves: list[Any] = []
    skeleton = _skeleton(obj, leaves)
    with open(file, "wb") as f, torch.serialization.skip_data():
        torch.save(skeleton, f)
    del skeleton
    loaded = torch.load(file, mmap=True, weights_only=True)
    offsets = storage_offsets(file, loaded)
    tensors = _tensors(loaded)
    if offsets is None or len(tensors) != len(leaves):  # another storage layout: torch.save of the whole
        del loaded, tensors
        with open(file, "wb") as f:
            torch.save(_materialized(obj), f)
            f.flush()
            os.fsync(f.fileno())
        return
    starts = [offsets.get(t.untyped_storage().data_ptr(), 0) + int(t.storage_offset()) * t.element_size()
              for t in tensors]
    del loaded, tensors  # the file's mapping: only its record offsets were read
    fd = os.open(file, os.O_WRONLY)
    try:
        for leaf, at in zip(leaves, starts, strict=True):
            if isinstance(leaf, torch.Tensor):
                _pwrite(fd, leaf, at)
                continue
            n, row = leaf.shape[0], leaf.shape[1:]
            if not n:
                continue
            row_bytes = math.prod(row) * torch.empty((), dtype=leaf.dtype).element_size()
            window = max(1, min(_MAX_WINDOW, n, (WINDOW_BYTES - mmap.PAGESIZE) // max(1, row_bytes)))
            (buffer,) = mapped(((window, *row), leaf.dtype))
            for a in range(0, n, window):
                b = min(a + window, n)
                out = buffer[: b - a]
                leaf.fill(a, b, out)
                _pwrite(fd, out, at + a * row_bytes)
            del buffer, out  # the mapping goes back to the system before the next tensor's
        os.fsync(fd)
    finally:
        os.close(fd)
