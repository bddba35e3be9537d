"""Deduplicating ids and summing their gradient rows, on static shapes where the device needs them.

Padding positions carry the *sentinel* id ``rows`` (one past the last physical row of the table). On a
*sync-free* device (:func:`sync_free`: XLA, and eager accelerators such as CUDA) a step keeps static shapes
and reads no tensor value on the host: the duplicate sum keeps ``N`` entries with a sentinel tail. On XLA,
gather clamps the sentinel and scatter drops it; an eager accelerator does neither (an out-of-range index is
a device assert), so there the sentinel entries are written into the last row with the value that row gets
anyway (:func:`sink_rows`, :func:`sink_padding`). On the CPU the sentinel entries are dropped before the
update (``-1`` is never a sentinel: XLA wraps it to ``V-1``). Only torch: the optimizer core, the routing
plan and every transport use these.

Example::

    >>> import torch
    >>> uniq, summed = coalesce_rows(torch.tensor([3, 1, 3]), torch.ones(3, 2), sentinel=4)
    >>> uniq.tolist(), summed.tolist()
    ([1, 3], [[1.0, 1.0], [2.0, 2.0]])
"""

from __future__ import annotations

import torch

__all__ = [
    "HOST_READ_DEVICE_TYPES", "coalesce_rows", "dedup_static", "drop_sentinel", "is_static_device", "sink_padding",
    "sink_rows", "sinks_sentinel", "sync_free", "unique_ids",
]

#: Device types whose steps may read tensor values on the host (a read there waits for no device) and make
#: data-dependent shapes. (A test empties it to run the sync-free path on the CPU, where an out-of-range
#: index raises as CUDA's asserts.)
HOST_READ_DEVICE_TYPES: set[str] = {"cpu"}


def is_static_device(device: torch.device) -> bool:
    """Devices that trace a graph (XLA): static shapes, gather clamps an out-of-range index, scatter drops it."""
    return device.type == "xla"


def sync_free(device: torch.device) -> bool:
    """Devices whose step reads no tensor value on the host and keeps static shapes: XLA, and eager
    accelerators (CUDA: each read is a host–device sync, and the host would wait for the device every step)."""
    return device.type not in HOST_READ_DEVICE_TYPES


def sinks_sentinel(device: torch.device) -> bool:
    """Devices whose step keeps the sentinel tail and writes it into the table's last row (the *sink row*,
    :func:`sink_rows`, :func:`sink_padding`): the eager accelerators (CUDA), :func:`sync_free` but not XLA.

    Both keep the tail (no host read of how many entries are real), but XLA's scatter drops an out-of-range
    index, so the sentinel needs nothing there; CUDA's asserts on it, so there it must land on a real row."""
    return sync_free(device) and not is_static_device(device)


def dedup_static(ids: torch.Tensor, sentinel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Static-shape unique: ``ids [N] -> (uniq [N], inv [N])`` with ``uniq[inv] == ids``.

    ``uniq[:U]`` holds the sorted unique ids, ``uniq[U:]`` the sentinel. Padding ids must already
    equal ``sentinel`` (they sort last). Only sort, cumsum and scatter: no host fallback on XLA.
    """
    if ids.numel() == 0:  # an empty batch (a static shape: no sync); XLA cannot lower a cumsum of 0
        return ids.clone(), ids.clone()
    sorted_ids, perm = torch.sort(ids)
    is_start = torch.ones_like(sorted_ids, dtype=torch.bool)
    is_start[1:] = sorted_ids[1:] != sorted_ids[:-1]
    seg = torch.cumsum(is_start.to(torch.int32), 0).to(ids.dtype) - 1
    inv = torch.zeros_like(seg).scatter(0, perm, seg)
    # Slots of the same segment all write the same value, so the scatter is deterministic.
    uniq = torch.full_like(ids, sentinel).scatter(0, seg, sorted_ids)
    return uniq, inv


def coalesce_rows(
    ids: torch.Tensor, rows: torch.Tensor, sentinel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradient rows of duplicate ids: ``(ids [N], rows [N, D]) -> (uniq [U], g [U, D])``.

    The update of every optimizer is non-linear in the gradient, so duplicates must be summed
    before it (TF's gradient accumulation). On sync-free devices ``U == N`` and the tail of
    ``uniq`` is the sentinel with zero rows; elsewhere sentinel entries are dropped and ``U`` is the
    number of distinct ids.
    """
    static = sync_free(ids.device)
    if static:
        uniq, inv = dedup_static(ids, sentinel)
    else:
        uniq, inv = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(uniq.shape[0], rows.shape[1], dtype=rows.dtype, device=rows.device)
    summed.index_add_(0, inv, rows)
    if static:
        return uniq, summed
    if torch.compiler.is_compiling():
        # No host read of a tensor under torch.compile (it would split the graph): a mask, whose
        # data-dependent length the graph carries as torch.unique's is carried.
        keep = uniq != sentinel
        return uniq[keep], summed[keep]
    if uniq.numel() and int(uniq[-1]) == sentinel:
        # Padding sorts last: drop it as a prefix view (no masked copy of the [N, D] rows).
        uniq, summed = uniq[:-1], summed[:-1]
    return uniq, summed


def drop_sentinel(
    ids: torch.Tensor, rows: torch.Tensor, sentinel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Remove padding entries on the CPU; sync-free devices keep them (see :func:`sink_padding`)."""
    if sync_free(ids.device):
        return ids, rows
    keep = ids != sentinel
    if torch.compiler.is_compiling():  # no host read of a tensor: it would split the graph
        return ids[keep], rows[keep]
    if bool(keep.all()):  # no padding: no masked copy of the rows
        return ids, rows
    return ids[keep], rows[keep]


def unique_ids(ids: torch.Tensor, sentinel: int) -> torch.Tensor:
    """Distinct ids (static shape with a sentinel tail on sync-free devices; padding dropped on the CPU)."""
    if sync_free(ids.device):
        return dedup_static(ids, sentinel)[0]
    uniq: torch.Tensor = torch.unique(ids[ids != sentinel])
    return uniq


def sink_padding(ids: torch.Tensor, rows: torch.Tensor, sentinel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N], rows [N, ...])`` for an ``index_add_`` that must not see the sentinel (an eager accelerator):
    padding entries add ``-0.0`` to row ``sentinel - 1``, which changes no value (``x + -0.0`` is ``x`` for every
    ``x``, ``-0.0`` and NaN included), with no read of which entries are padding."""
    keep = (ids < sentinel).view(-1, *[1] * (rows.dim() - 1))
    return ids.clamp(max=sentinel - 1), torch.where(keep, rows, -0.0)


def sink_rows(
    ids: torch.Tensor, new: torch.Tensor, old: torch.Tensor, sentinel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where and what an ``index_copy_`` of deduplicated rows writes on an eager accelerator: ``(at [N], values)``.

    ``ids [N]``: sorted distinct ids with a sentinel tail (:func:`dedup_static`); ``new [N, ...]``: their rows
    after the update; ``old``: the rows gathered at ``ids.clamp(max=sentinel - 1)`` before it. The tail is
    written into row ``sentinel - 1`` with the value that row gets anyway: its new value when it is among the
    ids (then the last real one, at position ``U - 1``), else its old one. Duplicate indices of one
    ``index_copy_`` then carry the same bytes, and nothing reads ``U`` on the host.
    """
    if not ids.numel():
        return ids, new
    real = ids < sentinel
    at = ids.clamp(max=sentinel - 1)
    last = (real.sum() - 1).clamp(min=0).view(1)  # position of the last real id (0 when there is none)
    shape = (-1, *[1] * (new.dim() - 1))
    touched = (ids.index_select(0, last) == sentinel - 1).view(shape)  # is the sink row one of the ids?
    tail = torch.where(touched, new.index_select(0, last), old)
    return at, torch.where(real.view(shape), new, tail)
