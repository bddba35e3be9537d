"""Per-table optimizer behaviour inside a stacked table group (``torch_tpu_embedding/modules/stacking.py``).

A stacked group stacks several tables (its *members*) in one parameter; an update runs once per group.
What an optimizer does per table stays per table:

* statistics over a table's rows (Adafactor's ``c``, ``r_sum``, touched-row count, ``RMS(w)``,
  ``RMS(u)``): the rule gets each row's member (:func:`segment_of`, ``RowContext.segment``) and sums
  per member (``RowContext.row_sum``); whole-table slots get a leading ``[members]`` dim
  (:func:`member_specs`), split back to each table's own shape in ``state_dict``;
* ``clipnorm``: each table's gradient clipped by its own norm (:func:`clip_members`);
* ``slot_creation_fn``: called once per table with that table's rows, as for a table of its own
  (:func:`created_member_slots`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.transfer import upload
from torch_tpu_embedding.optim._core.contract import SlotSpec, kept_for_steps

__all__ = ["boundaries", "check_created", "clip_members", "created_member_slots", "member_rows", "member_specs",
           "members_by_compare", "members_by_search", "segment_of"]

Tensor = torch.Tensor


_T = TypeVar("_T")


def _kept(cache: dict[Any, tuple[tuple[Any, ...], _T]], key: Any, members: tuple[Any, ...],
          make: Callable[[], _T]) -> _T:
    """``cache[key]``'s value, made by ``make()`` the first time: asked at every step, for a group's members tuple
    (which never changes). The entry holds the tuple, so that no other tuple takes its id while it is kept; the
    cache keeps up to 256 entries at a time (collections come and go in a long process)."""
    known = cache.get(key)
    if known is None or known[0] is not members:
        if len(cache) >= 256:
            cache.clear()
        known = cache[key] = (members, make())
    return known[1]


#: each group's member rows, by the identity of its members tuple (:func:`_kept`)
_ROWS: dict[int, tuple[tuple[Any, ...], tuple[int, ...]]] = {}


def member_rows(p: Tensor) -> tuple[int, ...]:
    """Logical rows of each member of stacked group ``p`` (``()`` for a table of its own or a dense parameter)."""
    info = table_info(p)
    members = None if info is None else info.members
    if members is None:
        return ()
    if torch.compiler.is_compiling():  # (traced once per graph: no cache to keep)
        return tuple(n for _, _, n in members)
    return _kept(_ROWS, id(members), members, lambda: tuple(n for _, _, n in members))


def member_specs(p: Tensor, out: Mapping[str, SlotSpec]) -> dict[str, SlotSpec]:
    """``out`` with every whole-table slot (``rows=False``) given a leading ``[members]`` dim when ``p``
    is a stacked group."""
    m = len(member_rows(p))
    if not m:
        return dict(out)
    return {k: s if s.rows else dataclasses.replace(s, shape=(m, *s.shape)) for k, s in out.items()}


#: each group's member boundaries on a device (:func:`boundaries`), by the identity of its members tuple and the device
_BOUNDS: dict[tuple[int, torch.device], tuple[tuple[Any, ...], Tensor]] = {}


def boundaries(members: tuple[Any, ...], device: torch.device, keep: bool = True) -> Tensor:
    """The first logical row of every member of a group but the first, ascending: ``int64 [members - 1]`` on
    ``device``, made and moved once per group and device (not at every step), kept as :func:`_kept` keeps it;
    made afresh and not kept where ``keep`` is False (:func:`~.contract.kept_for_steps` of the step's rows)."""
    def made(on: torch.device) -> Tensor:
        return torch.tensor([first for _, first, _ in members[1:]], dtype=torch.int64, device=on)

    if not keep or torch.compiler.is_compiling():  # (under torch.compile: a constant of the graph)
        return made(device)
    return _kept(_BOUNDS, (id(members), device), members, lambda: upload(made(torch.device("cpu")), device))


def members_by_search(rows: Tensor, bounds: Tensor) -> Tensor:
    """The member of each logical row of ``rows`` (int64, any shape) of a group of member boundaries ``bounds``
    (:func:`boundaries`): how many boundaries are at or below the row, by one binary search per row."""
    return torch.searchsorted(bounds, rows.contiguous(), right=True)  # (it warns on strided rows; clamp keeps strides)


def members_by_compare(rows: Tensor, bounds: Tensor) -> Tensor:
    """:func:`members_by_search`'s result, counted by comparing every row with every boundary: XLA's form, where
    ``searchsorted`` falls back to the host; the compare and its sum fuse into one pass over the rows there."""
    return (rows.unsqueeze(-1) >= bounds).sum(-1)


def segment_of(p: Tensor, rows: Tensor, *, owned: bool = False) -> Tensor | None:
    """The member of each row of ``rows`` (stored rows of group ``p``, any shape): ``int64``, same shape;
    ``None`` when ``p`` is not a stacked group. Padding and sentinel rows get some member (callers mask them).
    A fixed number of ops, however many members the group has.

    ``owned``: ``rows [n, U]`` are shard-local rows, device-major (the owner-local path), row ``d`` on
    shard ``d``.
    """
    info = table_info(p)
    if info is None or info.members is None:
        return None
    rows = rows.to(torch.int64)
    if owned:
        n = info.num_shards
        shard = torch.arange(n, dtype=torch.int64).to(rows.device).reshape(n, *([1] * (rows.dim() - 1)))
        rows = rows + shard * (p.shape[0] // n)
    rows = rows.clamp(max=p.shape[0] - 1)
    if info.layout is not None:  # stored permuted: the logical row decides the member
        rows = info.layout.ownership(p.shape[0]).logical_id(rows)
    bounds = boundaries(info.members, rows.device, kept_for_steps(rows))
    if rows.device.type == "xla":
        return members_by_compare(rows, bounds)
    return members_by_search(rows, bounds)


def clip_members(g: Tensor, seg: Tensor, members: int, clipnorm: float) -> Tensor:
    """Keras ``clipnorm`` per member: rows ``g [..., D]`` of member ``seg [...]`` scaled by
    ``c / max(‖g_member‖₂, c)``. Masked sums (no scatter, no cross-member NaN): fine on a sharded ``g``."""
    sq = (g * g).sum(-1)
    # (made where it is used: an iota of the graph on XLA, a kernel on CUDA; no host copy per step)
    which = seg.unsqueeze(-1) == torch.arange(members, dtype=seg.dtype, device=seg.device)
    per = torch.where(which, sq.unsqueeze(-1), torch.zeros_like(sq).unsqueeze(-1))
    norms = torch.sqrt(per.reshape(-1, members).sum(0))
    scale = clipnorm / torch.clamp(norms, min=clipnorm)
    row = torch.where(which, scale.expand(which.shape), torch.zeros_like(scale).expand(which.shape)).sum(-1)
    return g * row.unsqueeze(-1).to(g.dtype)


def check_created(made: Any, shapes: Mapping[str, tuple[int, ...]], where: str = "") -> None:
    """Raise unless ``slot_creation_fn``'s result ``made`` holds a tensor of each shape in ``shapes``."""
    for k, shape in shapes.items():
        s = made.get(k) if isinstance(made, Mapping) else None
        if not isinstance(s, Tensor) or tuple(s.shape) != shape:
            raise ValueError(
                f"slot_creation_fn must return a dict with a tensor of shape {shape} for slot '{k}'{where}. "
                f"Received: {type(s).__name__}" + (f" {tuple(s.shape)}" if isinstance(s, Tensor) else "")
            )


def created_member_slots(
    p: Tensor, fn: Callable[..., Any], names: list[str], specs: Mapping[str, SlotSpec],
    table_specs: Callable[[tuple[int, ...]], Mapping[str, SlotSpec]],
) -> dict[str, Tensor]:
    """``slot_creation_fn`` of stacked group ``p``, called once per member with that table's rows
    (``[rows, D]``, logical order) as for a table of its own; row slots are stacked in the group's row
    order (padding rows at their initial value), whole-table slots along the leading ``[members]`` dim."""
    info = table_info(p)
    assert info is not None and info.members is not None
    w = p.detach()
    logical = None
    if info.layout is not None:
        logical = info.layout.positions(sum(n for _, _, n in info.members), p.shape[0]).to(w.device)
    parts: list[Mapping[str, Any]] = []
    for tname, first, n in info.members:
        rows = w[first : first + n] if logical is None else w.index_select(0, logical[first : first + n])
        want = table_specs((n, *p.shape[1:]))
        made = fn(rows, names, {k: want[k].init for k in names})
        check_created(made, {k: want[k].shape for k in names}, f" of table '{tname}'")
        parts.append(made)
    out: dict[str, Tensor] = {}
    for k in names:
        values = [part[k].detach().to(w.device) for part in parts]
        if not specs[k].rows:
            out[k] = torch.stack(values)
            continue
        stacked = torch.cat(values)
        full = torch.full((p.shape[0], *stacked.shape[1:]), specs[k].init, dtype=stacked.dtype).to(w.device)
        if logical is None:
            full[: stacked.shape[0]] = stacked
        else:
            full[logical] = stacked
        out[k] = full
    return out
