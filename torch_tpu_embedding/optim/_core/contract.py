"""What an optimizer declares: its slots and its pure per-row rule.

An optimizer of this package is a :class:`~torch_tpu_embedding.optim.RowSparseOptimizer` subclass
that sets ``algorithm`` (its registry name), ``slot_names``, and a pure function

``rule(w [U, D], g [U, D], slots, lr (0-d), step (0-d), hp, ctx) -> (w_new, slots_new)``

over the rows it is given: every row of a dense parameter, or the touched rows of a table. The rule
does no gathering, scattering or in-place writing; the core does that once for every optimizer and
every device. Its name is entered in the registry (:mod:`torch_tpu_embedding._util.registry`). Adding an
optimizer is one module (see ``docs/design.md``, "The optimizer core").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torch_tpu_embedding._util.transfer import upload

__all__ = [
    "LANES",
    "LANE_ELEMENTS",
    "RowContext",
    "Rule",
    "SlotSpec",
    "Slots",
    "common_defaults",
    "identity",
    "is_number",
    "is_set",
    "kept_for_steps",
    "lanes_of",
    "member_sums",
    "spreads",
]

Tensor = torch.Tensor
Slots = dict[str, Tensor]


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """One optimizer state tensor of a parameter.

    ``rows``: dim 0 indexes the parameter's rows — gathered and scattered per touched row, given
    trash rows on XLA, and trimmed to the table's logical rows in checkpoints. Otherwise the slot
    belongs to the whole parameter (e.g. Adafactor's column statistic) and is passed whole.
    """

    shape: tuple[int, ...]
    init: float = 0.0
    rows: bool = True
    dtype: torch.dtype | None = None  # None: the parameter's dtype (float32 for a 16-bit parameter)


def kept_for_steps(like: Tensor) -> bool:
    """Whether a tensor made for a step on ``like`` may be kept for later steps (a cache of constants: a stacked
    group's member boundaries, its rows per member): not while ``torch.compile`` traces (it is then a constant of
    the graph), nor for a fake tensor (a tracing mode outside ``torch.compile``, such as ``make_fx``'s) or under
    inference mode, whose tensors a later real step cannot use.

    >>> kept_for_steps(torch.zeros(2)), kept_for_steps(torch.nn.Parameter(torch.zeros(2)))
    (True, True)
    """
    return not (torch.compiler.is_compiling() or type(like) not in (torch.Tensor, torch.nn.Parameter)
                or torch.is_inference_mode_enabled())


def is_set(v: Any) -> bool:
    """Whether hyper-parameter ``v`` is on (not ``None``, 0 or ``False``). A rule asks this, not ``bool(v)``: the
    update kernel (``optim/_kernels/row_update.py``) takes a number other than 0 and 1 as a tensor, whose truth
    cannot be read while it compiles; 0 and 1 stay numbers there, so a branch on them is its configuration's."""
    return isinstance(v, Tensor) or bool(v)


def is_number(v: Any, x: float) -> bool:
    """Whether hyper-parameter ``v`` is the plain number ``x`` (0 or 1, the values the compiled update folds into
    its code); a tensor never is, as in :func:`is_set`."""
    return not isinstance(v, Tensor) and v == x


def identity(x: Tensor) -> Tensor:
    """``x`` itself: ``RowContext.all_reduce`` when an update is not split over shards."""
    return x


#: Lanes per member of a spread per-member sum (:func:`member_sums`): ``index_add``'s adds land on ``members ×
#: lanes`` rows instead of ``members``, so each address takes ``U / (members · lanes)`` of them.
LANES = 1024
#: Elements of the lanes' buffer (``members × lanes × columns``) at most: fewer lanes for many members or columns.
LANE_ELEMENTS = 2**22


def spreads(x: Tensor) -> bool:
    """Whether :meth:`RowContext.row_sum` sums ``x`` per member by :func:`member_sums`: on CUDA, where
    ``index_add`` into a few rows is atomic adds on as many addresses, which the GPU serialises (what that cost
    Adafactor's step on an H200 is in docs/benchmarks.md). The CPU adds row by row and XLA's scatter is its own:
    there ``index_add`` stays, in the order the references use."""
    return x.device.type == "cuda"


def lanes_of(members: int, cols: int) -> int:
    """Lanes per member of :func:`member_sums` for ``members`` of ``cols`` columns: :data:`LANES`, fewer where the
    buffer (``members × lanes × cols``) would pass :data:`LANE_ELEMENTS`, at least one."""
    return max(1, min(LANES, LANE_ELEMENTS // max(1, members * cols)))


def member_sums(x: Tensor, segment: Tensor, members: int) -> Tensor:
    """``Σ`` of the rows of ``x [U, *rest]`` per member ``segment [U]`` (int64 in ``[0, members)``):
    ``[members, *rest]``, as ``zeros.index_add(0, segment, x)``, with the adds spread first over
    :func:`lanes_of` lanes per member (row ``i`` into lane ``i % lanes``) and the lanes then summed. The same
    adds in another order, in ``x``'s dtype (integers exact); a NaN or infinity stays in its own member, as with
    ``index_add``.
    Static shapes, no host read; under ``torch.compile`` with dynamic shapes one graph for every ``U ≥ 2``.

    >>> member_sums(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), torch.tensor([0, 0, 2]), 3)
    tensor([[4., 6.],
            [0., 0.],
            [5., 6.]])
    """
    cols = math.prod(x.shape[1:])
    lanes = lanes_of(members, cols)
    at = segment * lanes + torch.arange(x.shape[0], device=segment.device) % lanes
    spread = torch.zeros((members * lanes, cols), dtype=x.dtype, device=x.device)
    spread.index_add_(0, at, x.reshape(x.shape[0], cols))
    return spread.view(members, lanes, cols).sum(1, dtype=x.dtype).reshape(members, *x.shape[1:])


@dataclasses.dataclass(frozen=True, init=False)
class RowContext:
    """What a rule may need beyond its rows: which of them are real, the table's size, and how to
    reduce over every row of the update.

    ``mask [U]`` is True for touched rows and False for the static-shape padding tail on XLA;
    ``count`` is the number of touched rows of the whole update. Both are ``None`` for a dense update
    (every row real). ``all_reduce(x)`` sums ``x`` over every part of the update: the identity, except
    when each shard of a row-sharded table updates its own rows (the owner-local path, or a table split over
    a process group), where it is a sum over the shards — so ``all_reduce(f(rows).sum())`` is the sum over all
    touched rows on every device. Per-row rules ignore the context; rules with reductions over rows (Adafactor)
    use it, and :meth:`counted_sums` sums several of their values and the count with one collective.

    ``count`` is summed over the shards when it is first read (``part_count``: this part's touched rows), so
    a rule that never reads it costs no collective for it.

    In a stacked table group (several tables stacked in one parameter, ``torch_tpu_embedding/modules/stacking.py``)
    statistics stay per table: ``segment [U]`` is the table (member) of each row, ``member_rows`` the
    logical rows of each member, ``count`` is ``[members]`` (touched rows per member), and a whole-table
    slot has a leading ``[members]`` dim. :meth:`row_sum` sums per member, :meth:`per_row` hands each row
    its member's value; without a segment they are a plain sum and the identity.
    """

    mask: Tensor | None
    num_rows: int  # logical rows of the whole parameter
    all_reduce: Callable[[Tensor], Tensor]
    segment: Tensor | None  # [U] member index of each row (stacked groups only)
    member_rows: tuple[int, ...]  # logical rows of each member (stacked groups only)
    part_count: Tensor | None  # this part's touched rows (``count`` before the sum over shards)
    summed_count: Tensor | None  # ``count`` once known

    def __init__(self, mask: Tensor | None, count: Tensor | None, num_rows: int,
                 all_reduce: Callable[[Tensor], Tensor] = identity, segment: Tensor | None = None,
                 member_rows: tuple[int, ...] = (), part_count: Tensor | None = None) -> None:
        put = object.__setattr__  # (frozen: as the dataclass's own __init__ writes)
        put(self, "mask", mask)
        put(self, "num_rows", num_rows)
        put(self, "all_reduce", all_reduce)
        put(self, "segment", segment)
        put(self, "member_rows", member_rows)
        put(self, "part_count", part_count)
        put(self, "summed_count", count)

    @property
    def count(self) -> Tensor | None:
        """Touched rows of the whole update (``[members]`` in a stacked group); ``None`` for a dense update."""
        if self.summed_count is None and self.part_count is not None:
            object.__setattr__(self, "summed_count", self.all_reduce(self.part_count))
        return self.summed_count

    def counted_sums(self, *xs: Tensor) -> tuple[Tensor | None, list[Tensor]]:
        """``(count, [all_reduce(x) for x in xs])`` with one collective where the update is split over shards:
        every element of ``xs`` (and of this part's count, while ``count`` is not yet known) in one vector of
        ``xs[0]``'s dtype, summed element by element as each would be alone. The count travels in that dtype:
        exact while the touched rows stay below ``2**24`` in float32 (a rule converts it to its dtype anyway)."""
        if self.all_reduce is identity:
            return self.count, list(xs)
        count = self.part_count if self.summed_count is None else None
        parts = list(xs) if count is None else [count, *xs]
        dtype = xs[0].dtype
        summed = self.all_reduce(torch.cat([x.reshape(-1).to(dtype) for x in parts]))
        out, at = [], 0
        for x in parts:
            out.append(summed[at : at + x.numel()].reshape(x.shape).to(x.dtype))
            at += x.numel()
        if count is not None:
            object.__setattr__(self, "summed_count", out.pop(0))
        return self.count, out

    def part_sum(self, x: Tensor) -> Tensor:
        """``Σ`` of ``x [U, *rest]`` over this part's rows, per member in a stacked group, not yet summed over
        shards (:meth:`row_sum` is ``all_reduce`` of it)."""
        if self.segment is None:
            return x.sum(0)
        members = len(self.member_rows)
        if spreads(x):
            return member_sums(x, self.segment, members)
        out = torch.zeros((members, *x.shape[1:]), dtype=x.dtype, device=x.device)
        return out.index_add(0, self.segment, x)

    def row_sum(self, x: Tensor) -> Tensor:
        """``Σ`` over every row of the update of ``x [U, *rest]``: ``[*rest]``, or ``[members, *rest]``
        per member in a stacked group (all-reduced over shards either way)."""
        return self.all_reduce(self.part_sum(x))

    def per_row(self, v: Tensor) -> Tensor:
        """A per-table value ``v`` (``[members, *rest]`` in a stacked group) for each row: ``[U, *rest]``;
        ``v`` itself for one table."""
        return v if self.segment is None else v.index_select(0, self.segment)

    def rows_of_table(self, like: Tensor) -> Tensor | float:
        """Logical rows of the table: ``num_rows``, or ``[members]`` in a stacked group (``like``'s dtype and
        device; made and moved once per group, dtype and device, not at every step, and shared: read-only)."""
        if self.segment is None:
            return float(self.num_rows)
        if not kept_for_steps(like):
            return torch.tensor(self.member_rows, dtype=like.dtype, device=like.device)
        key = (self.member_rows, like.dtype, like.device)
        rows = _TABLE_ROWS.get(key)
        if rows is None:
            if len(_TABLE_ROWS) >= 256:  # (collections come and go in a long process)
                _TABLE_ROWS.clear()
            rows = _TABLE_ROWS[key] = upload(torch.tensor(self.member_rows, dtype=like.dtype), like.device)
        return rows

    @classmethod
    def touched(cls, mask: Tensor, num_rows: int, all_reduce: Callable[[Tensor], Tensor] = identity,
                segment: Tensor | None = None, member_rows: tuple[int, ...] = ()) -> RowContext:
        """The context of an update of touched rows ``[U]``: ``mask`` the real ones (False on the static-shape
        padding tail), ``count`` how many, per member of a stacked group (``member_rows``, with each row's member
        ``segment``), all-reduced over shards. Made by the reference path and by the compiled kernel alike
        (constructed, not ``dataclasses.replace``d: the kernel's tracer follows a constructor).

        >>> RowContext.touched(torch.tensor([True, True, False]), num_rows=10).count
        tensor(2)
        """
        if member_rows:
            assert segment is not None, "a stacked group's rows need their members (segment)"
            unmasked = cls(mask=mask, count=None, num_rows=num_rows, segment=segment, member_rows=member_rows)
            part = unmasked.part_sum(mask.to(torch.int64))
        else:
            part, segment = mask.sum(), None
        # Summed over the shards only when read (RowContext.count): where the sum is a collective, a rule that
        # never reads it does not pay for it, and one that does may sum it with its own sums (counted_sums).
        return cls(mask=mask, count=part if all_reduce is identity else None, num_rows=num_rows,
                   all_reduce=all_reduce, segment=segment, member_rows=member_rows, part_count=part)


#: :meth:`RowContext.rows_of_table`'s tensors, by (member rows, dtype, device)
_TABLE_ROWS: dict[tuple[tuple[int, ...], torch.dtype, torch.device], Tensor] = {}


#: ``rule(w [U, D], g [U, D], slots, lr (0-d), step (0-d), hp, ctx) -> (w_new, slots_new)``
Rule = Callable[[Tensor, Tensor, Slots, Tensor, Tensor, Mapping[str, Any], RowContext], tuple[Tensor, Slots]]


def common_defaults(
    lr: Any,
    use_gradient_accumulation: bool,
    clip_weight_min: float | None,
    clip_weight_max: float | None,
    weight_decay_factor: float | None,
    multiply_weight_decay_factor_by_learning_rate: bool | None,
    clipvalue: Any,
    slot_creation_fn: Any = None,
) -> dict[str, Any]:
    """The hyper-parameters every optimizer shares (TF's ``_Optimizer`` arguments), as a defaults dict
    (:func:`~.keywords.constructor_options` builds it from a constructor's arguments)."""
    return {
        "lr": lr,
        "use_gradient_accumulation": use_gradient_accumulation,
        "clip_weight_min": clip_weight_min,
        "clip_weight_max": clip_weight_max,
        "weight_decay_factor": weight_decay_factor,
        "multiply_weight_decay_factor_by_learning_rate": multiply_weight_decay_factor_by_learning_rate,
        "clipvalue": clipvalue,
        "slot_creation_fn": slot_creation_fn,
    }
