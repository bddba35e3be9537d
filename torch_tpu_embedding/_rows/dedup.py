"""Deduplicating ids and summing their gradient rows, on static shapes where the device needs them.

Padding positions carry the *sentinel* id ``rows`` (one past the last physical row of the table). On
XLA, gather clamps that index and scatter drops it, so a step keeps static shapes; in eager mode the
sentinel entries are dropped before the update (``-1`` is never a sentinel: XLA wraps it to ``V-1``).
Only torch: the optimizer core, the routing plan and every transport use these.

Example::

    >>> import torch
    >>> uniq, summed = coalesce_rows(torch.tensor([3, 1, 3]), torch.ones(3, 2), sentinel=4)
    >>> uniq.tolist(), summed.tolist()
    ([1, 3], [[1.0, 1.0], [2.0, 2.0]])
"""

from __future__ import annotations

import torch

__all__ = ["coalesce_rows", "dedup_static", "drop_sentinel", "is_static_device", "unique_ids"]


def is_static_device(device: torch.device) -> bool:
    """Devices that need static shapes (XLA): dedup by sort + sentinel, no host round trips."""
    return device.type == "xla"


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
    before it (TF's gradient accumulation). On static-shape devices ``U == N`` and the tail of
    ``uniq`` is the sentinel with zero rows; elsewhere sentinel entries are dropped and ``U`` is the
    number of distinct ids.
    """
    if is_static_device(ids.device):
        uniq, inv = dedup_static(ids, sentinel)
    else:
        uniq, inv = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(uniq.shape[0], rows.shape[1], dtype=rows.dtype, device=rows.device)
    summed.index_add_(0, inv, rows)
    if is_static_device(ids.device):
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
    """Remove padding entries in eager mode; static-shape devices keep them (scatter drops them)."""
    if is_static_device(ids.device):
        return ids, rows
    keep = ids != sentinel
    if torch.compiler.is_compiling():  # no host read of a tensor: it would split the graph
        return ids[keep], rows[keep]
    if bool(keep.all()):  # no padding: no masked copy of the rows
        return ids, rows
    return ids[keep], rows[keep]


def unique_ids(ids: torch.Tensor, sentinel: int) -> torch.Tensor:
    """Distinct ids (static shape with a sentinel tail on XLA; padding dropped elsewhere)."""
    if is_static_device(ids.device):
        return dedup_static(ids, sentinel)[0]
    uniq: torch.Tensor = torch.unique(ids[ids != sentinel])
    return uniq
