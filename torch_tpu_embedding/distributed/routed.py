"""Lookups of a table sharded over a process group (``tte.distributed.shard``).

:class:`ProcessGroupLayout` is the table's layout (``TableInfo.sharding``): the collection asks it for
the lookup of each forward call (:meth:`ProcessGroupLayout.routed_lookup`), as it asks the SPMD layout
(``torch_tpu_embedding/xla/sharding.py``), so the collection never imports a transport. Every feature
of one table is looked up together (:class:`GroupLookup`): one route plan of all the rank's ids of the
table; and every table of the forward call over one group together (:meth:`GroupLookup.together`, which the
collection's lookup plan calls: :class:`GroupLookups`): one agreement, two ``all_to_all_single`` in the forward
and one in the backward for all of them (:mod:`torch_tpu_embedding.distributed.lookup_exchange`), then each bag
combined locally with its table's combiner and per-id weights (the same
:func:`~torch_tpu_embedding.combiners.bag_gains` and the same kernel as one process's lookup, so each bag's sum
rounds as there). A table that records no gradient in a training forward (frozen, or evaluation) takes part in
the forward's exchange only, its activations recording no gradient, as its own lookup's would not.

The gradient rows are divided by the group's size before they travel, as data parallel divides them
(each rank's loss is the mean over its equal share of the global batch, as DDP assumes), so the
owner's update is that of one process on the global batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.nest import Path
from torch_tpu_embedding.combiners import bag_gains
from torch_tpu_embedding.distributed.exchange import GroupSharding
from torch_tpu_embedding.distributed.lookup_exchange import fetch_rows, plan, send_grads
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
from torch_tpu_embedding.modules.lookup import records_rows, unused_bags
from torch_tpu_embedding.modules.lookup_batch import LookupBatch

__all__ = ["GroupLookup", "GroupLookups", "LoadCounts", "ProcessGroupLayout"]

Tensor = torch.Tensor


@dataclasses.dataclass
class LoadCounts:
    """A table's exchange since the last ``check_ids`` (``EmbeddingCollection.largest_loads``): the largest
    load, and the last step's capacity (the table's own largest load that step). The exchange gives each table's
    largest load over every rank and owner (``lookup_exchange.fetch_rows``), so every owner reports that. Kept on
    the device, read when asked (no host read in a step). Eager capacity drops nothing: ``dropped`` is 0."""

    #: the largest load since the last ``check_ids``, and the last step's, 0-d on the device
    most: Tensor
    last: Tensor
    world: int

    @property
    def largest(self) -> list[int]:
        return [max(1, int(self.most))] * self.world

    @property
    def capacity(self) -> int:
        return max(1, int(self.last))

    def per_shard(self) -> tuple[list[int], list[int]]:
        return [0] * self.world, self.largest


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
class _Table:
    """One table of a forward's exchange (:class:`_Exchange`)."""

    sharding: GroupSharding
    row_grad: RowGrad
    tables: frozenset[str]
    grad_dtype: torch.dtype
    ids: Tensor
    #: the id positions of each item (a feature's bags) of the table, in order
    splits: tuple[int, ...]
    #: a lookup that records gradients (training, the table not frozen): part of the step's agreement (evaluation
    #: or a frozen table on one rank only is refused, not paired with another rank's training step), and of the
    #: backward's exchange. Read outside the autograd Function, whose forward always runs without gradients.
    grad: bool = False
    slot: Tensor | None = None
    local: Tensor | None = None
    #: its gradient rows went to the owners (a backward reached it)
    sent: bool = False


@dataclasses.dataclass
class _Joint:
    """Every table a forward call looks up over one process group, exchanged together."""

    tables: list[_Table]
    #: this rank's optimizers of the training tables, as a number (:func:`~.optim_agreement.fingerprint`): part of
    #: a training lookup's agreement
    config: int = 0
    k: int = 0
    #: each table's largest load of any rank this step, ``[m]`` on the device (``largest_loads()``)
    largest: Tensor | None = None


class _Ctx:
    """Table ``t``'s view of the exchange's ``ctx``, as :func:`~..modules.lookup.records_rows` reads one lookup's
    (its first input the table's weight)."""

    def __init__(self, ctx: Any, t: int, tables: frozenset[str]) -> None:
        # (needs_input_grad counts every argument of apply, the joint first; next_functions the tensors only)
        self.needs_input_grad = (ctx.needs_input_grad[1 + t],)
        self.next_functions = (ctx.next_functions[t],)
        self.tables, self.weight_info, self.weight_shape = tables, ctx.weight_infos[t], ctx.weight_shapes[t]


class _Exchange(torch.autograd.Function):
    """The rows of every id position of every table, one output per item (``splits`` positions each), and in the
    backward the gradient rows of the tables that record gradients sent to the owners, in one exchange. An item
    the loss does not use gets ``None`` (not zeros): its positions count as unused, and an owner's row that only
    unused positions asked for is not touched (``modules/lookup.py`` does the same for one process's lookup)."""

    @staticmethod
    def forward(ctx: Any, joint: _Joint, *weights: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        s0 = joint.tables[0].sharding
        trained = [w for w, t in zip(weights, joint.tables, strict=True) if t.grad]
        # (a training lookup also agrees on the ranks' optimizers: optim_agreement.py)
        disagree = (lambda: explain(s0.group, trained)) if trained else None
        routes, joint.k, loads = plan([t.ids for t in joint.tables], [t.sharding for t in joint.tables],
                                      [t.grad for t in joint.tables], joint.config, disagree)
        rows, local, joint.largest = fetch_rows([w.detach() for w in weights], [r.send for r in routes], loads,
                                                [t.sharding for t in joint.tables])
        ctx.joint = joint
        ctx.weight_shapes = [tuple(w.shape) for w in weights]
        ctx.weight_infos = [table_info(w) for w in weights]  # (their tables' names, for an error)
        if not torch.compiler.is_compiling():  # (as modules/lookup.py: compiled, unused outputs get zeros)
            ctx.set_materialize_grads(False)
        out: list[Tensor] = []
        for table, route, r, lo in zip(joint.tables, routes, rows, local, strict=True):
            table.slot, table.local = route.slot, lo
            got = r.index_select(0, route.slot.clamp(max=r.shape[0] - 1))
            pieces = (got * (route.slot < r.shape[0]).unsqueeze(-1).to(got.dtype)).split_with_sizes(list(table.splits))
            if not table.grad:  # (a frozen table's activations record no gradient, as its own lookup's would not)
                ctx.mark_non_differentiable(*pieces)
            out += pieces
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        joint: _Joint = ctx.joint
        starts = [0]
        for table in joint.tables:
            starts.append(starts[-1] + len(table.splits))
        mine = [grads[starts[t]:starts[t + 1]] for t in range(len(joint.tables))]
        # The tables this backward sends: every training table not sent yet (the same on every rank, so every rank's
        # exchange has the same size), zeros where this rank's loss uses none of a table's items. A table is sent
        # (recorded, and refused a second time) by the backward that reaches it: a loss that leaves a table out on
        # every rank moves no row of it, and two losses of one forward, each backwarded in turn, send each table once.
        trained = [t for t, table in enumerate(joint.tables) if table.grad and not table.sent]
        reached = {t for t, table in enumerate(joint.tables) if table.grad and any(g is not None for g in mine[t])}
        again = [t for t in sorted(reached) if joint.tables[t].sent]
        if again:  # (every rank alike: the same graph backwarded again)
            raise RuntimeError(
                f"Table `{joint.tables[again[0]].sharding.table}`: a second backward reached a lookup of this sharded "
                "table (loss.backward(retain_graph=True), then another backward through the same activations): its "
                "gradient went to the rows' owners at the first, and a lookup over a process group sends one. Sum the "
                "losses and run one backward, or look the batch up again for the second. Received: a second backward "
                "of one lookup"
            )
        if not trained:  # (every training table sent already, and none reached again: nothing to send)
            return (None,) * (1 + len(joint.tables))
        names = ", ".join(f"table `{joint.tables[t].sharding.table}`" for t in trained)
        # Asked by torch.autograd.grad for a table's weight: refused here, before the exchange (every rank that
        # asks raises alike); a backward that accumulates into a table records its rows.
        record = [t in reached and records_rows(_Ctx(ctx, t, joint.tables[t].tables))
                  for t in trained]
        payloads = [_payload(mine[t], joint.tables[t], ctx.weight_shapes[t][1]) for t in trained]
        s0 = joint.tables[0].sharding
        flags = torch.ones(len(trained), dtype=torch.uint8, device=payloads[0].device)  # (made on the device)
        for i, t in enumerate(trained):
            if t not in reached:
                flags[i] = 0
        try:
            got, anyone = send_grads(payloads, [_slot(joint.tables[t]) for t in trained], joint.k, s0, flags)
        except RuntimeError as e:  # (gloo's timeout, or a peer gone: name what usually leaves a rank waiting here)
            raise RuntimeError(
                f"{names[0].upper()}{names[1:]}: rank {s0.rank} could not send a lookup's gradient rows to their "
                "owners: the other ranks did not arrive within the exchange group's timeout, or left. A rank that "
                "skips the backward of a batch the others train (a batch it chose to skip, an error caught in its "
                "loss) leaves them waiting here: every rank must run the backward of each training lookup, or skip "
                f"the batch on every rank alike. Received: {e}"
            ) from e
        # A table this rank's loss left out that another rank's used: the rows sent here for it are that rank's
        # gradient, recorded as if this rank's loss had used it (one process on the global batch uses it), and the
        # table is sent on every rank alike. Only then is the exchange's flag read (a host read).
        late = [i for i, t in enumerate(trained) if t not in reached]
        used = anyone.tolist() if late else []
        for i in late:
            if used[i]:
                reached.add(trained[i])
                record[i] = records_rows(_Ctx(ctx, trained[i], joint.tables[trained[i]].tables))
        for t, rows, rec in zip(trained, got, record, strict=True):
            table = joint.tables[t]
            if rec and table.local is not None:
                local = torch.where(rows[:, -1] > 0, table.local.reshape(-1), ctx.weight_shapes[t][0])
                table.row_grad.add(local, rows[:, :-1])
                table.row_grad.reached.update(table.tables)
            if t in reached:  # (sent: a second backward of this lookup is refused above)
                table.sent = True
        return (None,) * (1 + len(joint.tables))


def _slot(table: _Table) -> Tensor:
    assert table.slot is not None  # (cleared only after the exchange, refused above once sent)
    return table.slot


def _payload(grads: tuple[Tensor | None, ...], table: _Table, dim: int) -> Tensor:
    """What a table's backward sends, ``[N, D + 1]`` in the update's dtype: each position's gradient row over the
    group's size, then a column that counts each position where some loss used it. Every rank takes part in the
    exchange, also where its loss uses none of the items (all ``None``): the column lets the owner touch only rows
    some loss used. It travels on every rank (the same size everywhere: whether another rank has unused items is
    not known)."""
    assert table.slot is not None
    n, dev, dtype = sum(table.splits), table.slot.device, table.grad_dtype
    present = [x for x in grads if x is not None]
    if not present:
        whole = torch.zeros(n, dim, dtype=dtype, device=dev)
        used = torch.zeros(n, 1, dtype=dtype, device=dev)
    elif len(present) < len(grads):
        unused, filled = unused_bags(grads, table.splits, 0, dev)
        whole, used = torch.cat(filled), (~unused).to(dtype).unsqueeze(1)
    else:
        whole = present[0] if len(present) == 1 else torch.cat(present)
        used = torch.ones(n, 1, dtype=dtype, device=dev)
    # Data parallel's average over the ranks; 16-bit tables send float32 rows (the update's dtype). The column
    # is made on the rows' device: a host tensor here would be a host-to-device copy in every step.
    return torch.cat([whole.to(dtype) / table.sharding.world, used], dim=1)


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
    (one per bag width and combiner), routed together, and with the forward's other tables over the same group
    (:meth:`together`)."""

    layout: ProcessGroupLayout
    table: str
    weight: Tensor
    features: list[str]
    counts: dict[str, Any]
    batches: list[LookupBatch] = dataclasses.field(default_factory=list)

    @staticmethod
    def together(lookups: list[Any]) -> list[Any]:
        """A forward's routed lookups (``modules/plan.py``), those of tables over one process group joined into
        one :class:`GroupLookups` (one agreement, one exchange); any other as it is."""
        out: list[Any] = []
        joined: dict[int, GroupLookups] = {}
        for lookup in lookups:
            if not isinstance(lookup, GroupLookup):
                out.append(lookup)
            elif id(lookup.layout.group) in joined:
                joined[id(lookup.layout.group)].lookups.append(lookup)
            else:
                joined[id(lookup.layout.group)] = GroupLookups([lookup])
                out.append(joined[id(lookup.layout.group)])
        return out

    def run(self) -> dict[Path, Tensor]:
        """Look every batch up through the exchange: each feature's activations ``[*out_shape, D]``."""
        return GroupLookups([self]).run()

    def _table(self) -> tuple[_Table, list[tuple[Path, Any, str]]]:
        """The table's part of the exchange, and its items (position, bags, combiner) in order."""
        weight = self.weight
        info = table_info(weight)
        assert info is not None
        items = [(path, bags, b.combiner) for b in self.batches for path, bags in b.items]
        flat = [bags.ids.reshape(-1).to(weight.device) for _, bags, _ in items]
        ids = flat[0] if len(flat) == 1 else torch.cat(flat)
        tables = frozenset(t for b in self.batches for t in b.tables)
        # (a backward follows, with its all-to-all, only where the table trains: one frozen on some ranks only
        # makes every rank raise at this lookup's agreement instead of the others waiting in their backward)
        grad = torch.is_grad_enabled() and weight.requires_grad
        return _Table(self.layout, info.row_grad, tables, math_dtype(weight), ids, tuple(f.shape[0] for f in flat),
                      grad), items

    def _pool(self, items: list[tuple[Path, Any, str]], pieces: Sequence[Tensor]) -> dict[Path, Tensor]:
        weight, out = self.weight, {}
        for (path, bags, combiner), piece in zip(items, pieces, strict=True):
            n, width = bags.ids.shape
            w = None if bags.weights is None else bags.weights.to(weight.device)
            gains = bag_gains(bags.valid.to(weight.device), w, combiner, weight.dtype)
            pooled = _combine(piece, gains, n, width).to(weight.dtype)
            out[path] = pooled.reshape(*bags.out_shape, pooled.shape[-1])
        return out

    def _count(self, largest: Tensor) -> None:
        """Record the step's largest load of the table (of any rank for any owner), ``largest`` 0-d on the device."""
        prev = self.counts.get(self.table)
        n = self.layout.world
        self.counts[self.table] = LoadCounts(largest if prev is None else torch.maximum(prev.most, largest),
                                             largest, n)


@dataclasses.dataclass
class GroupLookups:
    """The lookups of a forward's tables over one process group (:meth:`GroupLookup.together`), exchanged together:
    one agreement (one host read) and two ``all_to_all_single`` in the forward, one in the backward, for all of
    them (:mod:`~.lookup_exchange`)."""

    lookups: list[GroupLookup]

    @property
    def batches(self) -> list[LookupBatch]:
        """Every table's :class:`LookupBatch` es (what a prepared lookup reads: ``modules/ahead.py``)."""
        return [b for lookup in self.lookups for b in lookup.batches]

    def run(self) -> dict[Path, Tensor]:
        """Look every table's batches up through one exchange: each feature's activations ``[*out_shape, D]``."""
        parts = [lookup._table() for lookup in self.lookups]
        weights = [lookup.weight for lookup in self.lookups]
        trained = [w for w, (t, _) in zip(weights, parts, strict=True) if t.grad]
        joint = _Joint([t for t, _ in parts], fingerprint(trained) if trained else 0)  # (a copy's optimizers are not)
        pieces: tuple[Tensor, ...] = _Exchange.apply(joint, *weights)  # type: ignore[no-untyped-call]
        out: dict[Path, Tensor] = {}
        at = 0
        assert joint.largest is not None
        for t, (lookup, (_, items)) in enumerate(zip(self.lookups, parts, strict=True)):
            lookup._count(joint.largest[t])
            out.update(lookup._pool(items, pieces[at:at + len(items)]))
            at += len(items)
        return out
