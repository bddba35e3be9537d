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

from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.nest import Path
from torch_tpu_embedding.combiners import bag_gains
from torch_tpu_embedding.distributed.exchange import GroupSharding, fetch_rows, plan, send_grads
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
from torch_tpu_embedding.modules.lookup import keep_table, records_rows, unused_bags
from torch_tpu_embedding.modules.lookup_batch import LookupBatch

__all__ = ["GroupLookup", "LoadCounts", "ProcessGroupLayout"]

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
    #: this rank's optimizers, as a number (:func:`~.optim_agreement.fingerprint`): part of a training lookup's
    #: agreement
    config: int = 0


class _Exchange(torch.autograd.Function):
    """The rows of every id position, one output per item (``splits`` positions each), and in the backward
    their gradient rows sent to the owners. An item the loss does not use gets ``None`` (not zeros): its
    positions count as unused, and an owner's row that only unused positions asked for is not touched
    (``modules/lookup.py`` does the same for one process's lookup)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, weight: Tensor, ids: Tensor, route: _Route, splits: tuple[int, ...]
    ) -> tuple[Tensor, ...]:
        group = route.sharding.group  # (a training lookup also agrees on the ranks' optimizers: optim_agreement.py)
        disagree = (lambda: explain(group, [weight])) if route.grad else None
        routes, k = plan(ids, route.sharding, route.grad, route.config, disagree)
        rows, local = fetch_rows(weight.detach(), routes.send, route.sharding)
        route.slot, route.local, route.k = routes.slot, local, k
        ctx.route, ctx.splits, ctx.rows = route, splits, weight.shape[0]
        keep_table(ctx, route.tables, weight)
        if not torch.compiler.is_compiling():  # (as modules/lookup.py: compiled, unused outputs get zeros)
            ctx.set_materialize_grads(False)
        got = rows.index_select(0, routes.slot.clamp(max=rows.shape[0] - 1))
        out = got * (routes.slot < rows.shape[0]).unsqueeze(-1).to(got.dtype)
        return tuple(out.split_with_sizes(list(splits)))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, None, None, None]:  # type: ignore[override]
        route: _Route = ctx.route
        if route.slot is None or route.local is None:  # (every rank alike: the same graph backwarded again)
            raise RuntimeError(
                f"Table `{route.sharding.table}`: a second backward reached a lookup of this sharded table (loss."
                "backward(retain_graph=True), then another backward through the same activations): its gradient went "
                "to the rows' owners at the first, and a lookup over a process group sends one. Sum the losses and run "
                "one backward, or look the batch up again for the second. Received: a second backward of one lookup"
            )
        # Asked by torch.autograd.grad for the table's weight: refused here, before the exchange (every rank that
        # asks raises alike); a backward that accumulates into the table records its rows.
        record = records_rows(ctx)
        # Every rank takes part in the exchange, also where its loss uses none of the items (all None): an extra
        # column counts each bucket slot's used positions, so that the owner touches only rows some loss used.
        # It travels on every rank (the same size everywhere: whether another rank has unused items is not known).
        n, dev, dtype = sum(ctx.splits), route.slot.device, route.grad_dtype
        present = [x for x in grads if x is not None]
        if not present:
            whole = torch.zeros(n, ctx.weight_shape[1], dtype=dtype, device=dev)
            used = torch.zeros(n, 1, dtype=dtype, device=dev)
        elif len(present) < len(grads):
            unused, filled = unused_bags(grads, ctx.splits, 0, dev)
            whole, used = torch.cat(filled), (~unused).to(dtype).unsqueeze(1)
        else:
            whole = present[0] if len(present) == 1 else torch.cat(present)
            used = torch.ones(n, 1, dtype=dtype, device=dev)
        # Data parallel's average over the ranks; 16-bit tables send float32 rows (the update's dtype). The column
        # is made on the rows' device: a host tensor here would be a host-to-device copy in every step.
        g = torch.cat([whole.to(dtype) / route.sharding.world, used], dim=1)
        try:
            got = send_grads(g, route.slot, route.k, route.sharding)
        except RuntimeError as e:  # (gloo's timeout, or a peer gone: name what usually leaves a rank waiting here)
            raise RuntimeError(
                f"Table `{route.sharding.table}`: rank {route.sharding.rank} could not send a lookup's gradient rows "
                "to their owners: the other ranks did not arrive within the exchange group's timeout, or left. A rank "
                "that skips the backward of a batch the others train (a batch it chose to skip, an error caught in "
                "its loss) leaves them waiting here: every rank must run the backward of each training lookup, or "
                f"skip the batch on every rank alike. Received: {e}"
            ) from e
        if record:
            local = torch.where(got[:, -1] > 0, route.local.reshape(-1), ctx.rows)
            route.row_grad.add(local, got[:, :-1])
            route.row_grad.reached.update(route.tables)
        route.slot = route.local = None  # (sent: a second backward of this lookup is refused above)
        return None, None, None, None


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
        config = fingerprint([weight]) if grad else 0  # (the optimizers of this table: a copy's are not)
        route = _Route(layout, info.row_grad, tables, math_dtype(weight), grad, config=config)
        pieces: tuple[Tensor, ...] = _Exchange.apply(  # type: ignore[no-untyped-call]
            weight, ids, route, tuple(f.shape[0] for f in flat))
        self._count(route)
        out: dict[Path, Tensor] = {}
        for (path, bags, combiner), piece in zip(items, pieces, strict=True):
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
