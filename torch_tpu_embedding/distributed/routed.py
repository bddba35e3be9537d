"""Lookups of a table sharded over a process group (``tte.distributed.shard``).

:class:`ProcessGroupLayout` is the table's layout (``TableInfo.sharding``): the collection asks it for
the lookup of each forward call (:meth:`ProcessGroupLayout.routed_lookup`), as it asks the SPMD layout
(``torch_tpu_embedding/xla/sharding.py``), so the collection never imports a transport. Every feature
of one table is looked up together (:class:`GroupLookup`): one route plan of all the rank's ids of the
table, two ``all_to_all_single`` in the forward and one in the backward
(:mod:`torch_tpu_embedding.distributed.exchange`), then each bag combined locally with the table's combiner and
per-id weights (the same :func:`~torch_tpu_embedding.combiners.bag_gains` and the same kernel as one process's
lookup, so each bag's sum rounds as there).

The gradient rows are divided by the group's size before they travel, as data parallel divides them
(each rank's loss is the mean over its equal share of the global batch, as DDP assumes), so the
owner's update is that of one process on the global batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torch_tpu_embedding._rows.placement import is_looking_ahead
from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.nest import Path
from torch_tpu_embedding.combiners import bag_gains
from torch_tpu_embedding.distributed.exchange import GroupSharding, fetch_rows, grad_payload, plan, send_grads
from torch_tpu_embedding.distributed.optim_agreement import explain, fingerprint
from torch_tpu_embedding.distributed.state import (
    from_logical_shard,
    from_logical_slot,
    gather_whole,
    pending_from_logical,
    pending_to_logical,
    stored_from_whole,
    to_logical_shard,
    to_logical_slot,
    whole_from_saved,
    whole_to_saved,
)
from torch_tpu_embedding.modules.lookup_batch import LookupBatch

__all__ = ["GroupLookup", "LoadCounts", "ProcessGroupLayout", "send_pending"]

Tensor = torch.Tensor


@dataclasses.dataclass
class LoadCounts:
    """A table's exchange since the last ``check_ids`` (``EmbeddingCollection.largest_loads``): the largest
    load, and the last step's capacity. The one all-reduce of a step gives only the largest load over every
    rank and owner, so every owner reports that. Eager capacity drops nothing: ``dropped`` is 0."""

    largest: list[int]
    capacity: int

    def per_shard(self) -> tuple[list[int], list[int]]:
        return [0] * len(self.largest), list(self.largest)


@dataclasses.dataclass(frozen=True)
class ProcessGroupLayout(GroupSharding):
    """A table's layout over a process group, with the lookup that goes with it."""

    def routed_lookup(
        self, table: str, weight: Tensor, configured: int | None, features: list[str], counts: dict[str, Any],
    ) -> GroupLookup:
        """The lookup of this table for one forward call (``configured``, the static capacity of the
        SPMD exchange, is not needed: the eager capacity follows the step)."""
        return GroupLookup(self, table, weight, features, counts)

    def to_logical(self, local: Tensor, slot: bool = False) -> Any:
        """This rank's stored rows (or a row slot's) as a DTensor ``Shard(0)`` of the logical rows (a collective)."""
        return to_logical_slot(local, self) if slot else to_logical_shard(local, self)

    def from_logical(self, value: Any, name: str, base: Tensor | None = None, slot: bool = False) -> Tensor:
        """A DTensor of the logical rows as this rank's stored rows; a plain tensor (this rank's stored rows,
        given so on every rank) as it is, once every rank agrees (a collective either way)."""
        return from_logical_slot(value, self, name, base) if slot else from_logical_shard(value, self, name, base)

    def gather_whole(self, local: Tensor) -> Tensor:
        """This rank's stored rows as the whole logical rows, on every rank (a collective)."""
        return gather_whole(local, self)

    def stored_from_whole(self, value: Tensor, name: str, base: Tensor) -> Tensor:
        """The whole logical rows (alike on every rank) as this rank's stored rows (a collective)."""
        return stored_from_whole(value, self, name, base)

    def whole_to_saved(self, value: Tensor) -> Tensor:
        """A slot of the whole table as saved: the same on every rank (a collective)."""
        return whole_to_saved(value, self)

    def whole_from_saved(self, value: Tensor, live: Tensor | None) -> Tensor:
        """A saved slot of the whole table as this rank keeps it."""
        return whole_from_saved(value, self, live)

    def pending_to_logical(self, ids: Tensor | None, rows: Tensor | None, k: int, width: int,
                           dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """This rank's pending accumulation window as every rank's, in logical ids (a collective)."""
        return pending_to_logical(ids, rows, k, width, dtype, self)

    def pending_from_logical(self, ids: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """A saved window (every rank's, logical ids) as this rank's ``acc_ids`` / ``acc_rows``."""
        return pending_from_logical(ids, rows, self)


@dataclasses.dataclass
class _Route:
    sharding: GroupSharding
    row_grad: RowGrad
    tables: frozenset[str]
    grad_dtype: torch.dtype
    #: a lookup that records gradients (training, the table not frozen): part of the step's agreement (evaluation
    #: or a frozen table on one rank only is refused, not paired with another rank's training step). Read outside
    #: the autograd Function, whose forward always runs without gradients.
    grad: bool = False
    slot: Tensor | None = None
    local: Tensor | None = None
    k: int = 0
    #: the table's row width, and its stored rows (the padding id of ``local``)
    width: int = 0
    pad: int = 0
    device: torch.device | None = None
    #: what the backward sends the owners (:func:`~.exchange.grad_payload`), until it is this lookup's turn
    payload: Tensor | None = None
    #: this rank's optimizers, as a number (:func:`~.optim_agreement.fingerprint`): part of a training lookup's
    #: agreement
    config: int = 0
    #: looked up ahead of its step (``look_up_ahead``: ``tte.TrainPipeline``'s stale lookups, whose backward comes
    #: after the next step, every rank alike): not pending, its backward sends its gradient at once
    ahead: bool = False
    #: how many lookup backwards this process had run when it was made (:data:`_BACKWARDS`)
    made_at: int = 0


#: This process's training lookups whose gradients the owners have not had yet, in lookup order. Every rank's
#: lookups agree (one agreement each, :func:`~.exchange.agree_capacity`), so this order is the same on every rank,
#: and the gradients travel in it, never in the order autograd happens to run the backwards: a rank whose backward
#: never ran for a lookup (a batch it skipped, an error it caught) sends the owners an empty gradient at its step
#: (:func:`send_pending`), where the others' backward waits for it, instead of every rank waiting on another.
_PENDING: list[_Route] = []
#: the lookup backwards this process has run (one number: a lookup's ``made_at`` against it tells whether a backward
#: ran after it)
_BACKWARDS = [0]


def _send(route: _Route) -> None:
    """``route``'s gradient (its backward's, or none) to the owners, and the rows other ranks sent this one into
    the table's gradient; the rows of a rank that sent none are padding (dropped)."""
    assert route.local is not None
    payload = route.payload
    if payload is None:  # (no backward here: the others' rows still arrive)
        payload = grad_payload(None, route.local, route.k, route.sharding, route.width, route.grad_dtype,
                               route.local.device if route.device is None else route.device)
    try:
        rows, present = send_grads(payload, route.sharding, route.width)
    except RuntimeError as e:  # (gloo's timeout, or a peer gone: name what usually leaves the others waiting here)
        raise RuntimeError(
            f"Table `{route.sharding.table}`: rank {route.sharding.rank} could not exchange the gradients of a lookup "
            "with the rows' owners (the other ranks did not arrive within the exchange group's timeout, or left). "
            "Every rank must give each training lookup a backward, or call opt.step() (or tte.clip_grad_norm_) "
            "after it: a rank that skips a batch's backward and then steps sends an empty gradient there, but one "
            "that skips both and looks up its next batch leaves the others waiting here, and itself in that lookup. "
            "Skip a batch on every rank alike, or call opt.step() on the rank that skips it. "
            f"Received: {e}"
        ) from e
    local = torch.where(present.unsqueeze(1), route.local, torch.full_like(route.local, route.pad))
    route.row_grad.add(local.reshape(-1), rows)
    if route.payload is not None:
        route.row_grad.reached.update(route.tables)
    route.payload = route.slot = route.local = None


def _drain() -> None:
    """Send the gradients ready at the front of :data:`_PENDING` (the backward's: in lookup order)."""
    while _PENDING and _PENDING[0].payload is not None:
        _send(_PENDING.pop(0))


def send_pending(param_groups: Any = None) -> None:
    """Before an optimizer's step (or ``tte.clip_grad_norm_``), on every rank alike: the pending lookups' gradients
    to their owners, in lookup order, those whose backward never ran on this rank as empty ones (this rank then
    adds nothing, and the owners still get every other rank's rows: the update of one process on the batches
    that had a backward). ``param_groups`` is not read: every pending lookup of this process goes, as on every
    other rank; but for a lookup made before the backward of an earlier one (``next_out = model(batch)``, then
    ``loss.backward()`` and ``opt.step()``: a loop that looks its next batch up before this step's update) and
    with none after it that had its backward: it is a look-ahead, every rank alike, and its own backward, after
    this step, sends it.

    (A lookup made after this step's backward, with no backward after it, is sent empty: on this rank nothing
    tells it from a skipped batch. Its backward then raises; ``ec.look_up_ahead`` or ``tte.TrainPipeline`` look a
    batch up ahead of its step.)"""
    if not _PENDING:  # (the steady case; also what torch.compile traces of a step: no loop to trace)
        return
    ready = max((i for i, r in enumerate(_PENDING) if r.payload is not None), default=-1)
    kept = []
    for i, route in enumerate(_PENDING):
        if route.payload is not None or i < ready or route.made_at == _BACKWARDS[0]:
            _send(route)
        else:
            kept.append(route)
    _PENDING[:] = kept


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: Tensor, ids: Tensor, route: _Route) -> Tensor:  # type: ignore[override]
        group = route.sharding.group  # (a training lookup also agrees on the ranks' optimizers: optim_agreement.py)
        disagree = (lambda: explain(group)) if route.grad else None
        routes, k = plan(ids, route.sharding, route.grad, route.config, disagree)
        rows, local = fetch_rows(weight.detach(), routes.send, route.sharding)
        route.slot, route.local, route.k = routes.slot, local, k
        route.width, route.pad, route.device = int(weight.shape[1]), int(weight.shape[0]), weight.device
        ctx.route = route
        got = rows.index_select(0, routes.slot.clamp(max=rows.shape[0] - 1))
        return got * (routes.slot < rows.shape[0]).unsqueeze(-1).to(got.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        route: _Route = ctx.route
        _BACKWARDS[0] += 1
        if route.slot is None or route.local is None:  # (sent empty by a step before this backward)
            raise RuntimeError(
                f"Table `{route.sharding.table}`: the backward of a lookup reached it after an opt.step() (or "
                "tte.clip_grad_norm_) had sent its gradient to the rows' owners as an empty one: this rank had run no "
                "backward since the lookup, as a rank that skips a batch's backward and steps (the other ranks' "
                "backward waits for it there). To look a batch up before the step of the one before it, use "
                "ec.look_up_ahead(ec.prepare(batch)) or tte.TrainPipeline(..., pipeline_execution_with_tensor_core="
                "True), or run the previous batch's backward before this lookup. Received: a backward after its "
                "lookup's step"
            )
        # Data parallel's average over the ranks; 16-bit tables send float32 rows (the update's dtype).
        g = grad.to(route.grad_dtype) / route.sharding.world
        route.payload = grad_payload(g, route.slot, route.k, route.sharding, route.width, route.grad_dtype, g.device)
        ctx.route = None
        if route.ahead:
            _send(route)
        else:
            _drain()  # this one, once every lookup before it has its gradient (or was sent by a step)
        return None, None, None


def _combine(rows: Tensor, gains: Tensor, n: int, width: int) -> Tensor:
    """``n`` bags of ``width`` rows each (``rows [n·width, D]``) combined with ``gains [n, width]``, by the
    kernel one process's lookup uses (``_lookup._RowSparseLookup``): ``embedding_bag`` where the gains are in
    the rows' dtype, else the float32 ``bmm`` of a 16-bit table. The same kernel rounds each bag's sum the
    same way, so a rank's activations are one process's (measured: ``bmm`` here moved AdagradMomentum's
    float32 momenta up to 5.1e-5 from one process after 10 steps, against 1.9e-5 with ``embedding_bag``)."""
    if gains.dtype == rows.dtype and width and rows.device.type != "xla":
        idx = torch.arange(n * width, device=rows.device).reshape(n, width)
        return torch.nn.functional.embedding_bag(idx, rows, per_sample_weights=gains, mode="sum")
    return torch.bmm(gains.unsqueeze(1), rows.reshape(n, width, -1).to(gains.dtype)).squeeze(1)


@dataclasses.dataclass
class GroupLookup:
    """Every lookup of one process-group-sharded table in a forward call: its :class:`LookupBatch` es
    (one per bag width and combiner), routed together."""

    layout: ProcessGroupLayout
    table: str
    weight: Tensor
    features: list[str]
    counts: dict[str, Any]
    batches: list[LookupBatch] = dataclasses.field(default_factory=list)

    def run(self) -> dict[Path, Tensor]:
        """Look every batch up through the exchange: each feature's activations ``[*out_shape, D]``."""
        weight, layout = self.weight, self.layout
        info = table_info(weight)
        assert info is not None
        items = [(path, bags, b.combiner) for b in self.batches for path, bags in b.items]
        flat = [bags.ids.reshape(-1).to(weight.device) for _, bags, _ in items]
        ids = flat[0] if len(flat) == 1 else torch.cat(flat)
        tables = frozenset(t for b in self.batches for t in b.tables)
        # (a backward follows, with its all-to-all, only where the table trains: one frozen on some ranks only
        # makes every rank raise at this lookup's agreement instead of the others waiting in their backward)
        grad = torch.is_grad_enabled() and weight.requires_grad
        route = _Route(layout, info.row_grad, tables, math_dtype(weight), grad, config=fingerprint() if grad else 0,
                       ahead=is_looking_ahead())
        rows: Tensor = _Exchange.apply(weight, ids, route)  # type: ignore[no-untyped-call]
        if grad and not route.ahead:  # a backward (or the step, for a rank that skips it) sends its gradient
            route.made_at = _BACKWARDS[0]
            _PENDING.append(route)
        self._count(route)
        out: dict[Path, Tensor] = {}
        for (path, bags, combiner), piece in zip(items, torch.split(rows, [f.shape[0] for f in flat]), strict=True):
            n, width = bags.ids.shape
            w = None if bags.weights is None else bags.weights.to(weight.device)
            gains = bag_gains(bags.valid.to(weight.device), w, combiner, weight.dtype)
            pooled = _combine(piece, gains, n, width).to(weight.dtype)
            out[path] = pooled.reshape(*bags.out_shape, pooled.shape[-1])
        return out

    def _count(self, route: _Route) -> None:
        """Record the step's capacity (the largest load of any rank for any owner)."""
        prev = self.counts.get(self.table)
        n = route.sharding.world
        largest = [route.k] * n if prev is None else [max(a, route.k) for a in prev.largest]
        self.counts[self.table] = LoadCounts(largest, route.k)
