"""Lookups of a row-sharded table through the id exchange (what ``placement="row"`` does under SPMD).

Every device handles its part of the batch: batch-sharded inputs (``shard_batch``) as they are, and
host or replicated inputs sliced (each device takes rows ``[d·B/n, (d+1)·B/n)``, the batch padded to a
multiple of ``n`` with padding rows; the outputs of such a padded batch are replicated, not
batch-sharded). All features of one table are routed together, so an id that several features (or
examples) of a device look up travels once:

1. each device's ids, device-major ``[n, N]`` (:mod:`torch_tpu_embedding.xla.exchange`), are
   deduplicated and bucketed by owner shard, ``k`` per bucket (the capacity: ``TableConfig.
   max_unique_ids_per_shard`` or :func:`~torch_tpu_embedding.routing.default_capacity`), and sent
   to their owners (one ``all-to-all`` of ``[n, n, k]`` int32);
2. each owner gathers its rows and sends them back (one ``all-to-all`` of ``[n, n, k, D]``);
3. each device combines its bags from the rows (the table's combiner, per-id weights).

The backward sends the gradient rows to the owners (one ``all-to-all`` of ``[n, n, k, D]``; duplicates
of a device summed first) and hands the table's :class:`~torch_tpu_embedding._rows.row_grad.RowGrad` owner-local
``(local rows [n, n·k], rows [n, n·k, D])``, which the optimizer's ``OWNER_LOCAL`` path updates where
they live. Per device and step that is ``n·k·(4 + 2·D·4)`` bytes for float32 rows, against ``N·(2·D·4)``
ideally; ``n·k`` is ``N`` plus the capacity's headroom, not ``n`` times the batch.

Ids over a bucket's capacity are dropped (zero rows, no gradient), counted per shard on the device, and
the optimizer that holds the table drops the whole step (``ok``, read by ``RowGrad.exchange_ok``);
:meth:`EmbeddingCollection.check_ids` raises at a sync point naming the features, the shard and the
capacity that would have sufficed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, cast

import torch

from torch_tpu_embedding._rows.routing import RowOwnership, default_capacity
from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.nest import Path
from torch_tpu_embedding.combiners import bag_gains
from torch_tpu_embedding.modules.lookup import keep_table, records_rows, unused_bags
from torch_tpu_embedding.modules.lookup_batch import LookupBatch
from torch_tpu_embedding.xla.exchange import Routing, exchange_grad, exchange_lookup
from torch_tpu_embedding.xla.manual import Mesh, annotate, reshard, spec

if TYPE_CHECKING:
    from torch_tpu_embedding.xla.sharding import TableSharding

__all__ = ["ExchangeCounts", "RoutedLookup", "capacity"]


def capacity(ids_per_device: int, num_shards: int, configured: int | None) -> int:
    """A table's bucket capacity: ``configured`` (``TableConfig.max_unique_ids_per_shard``), else the
    default for ``ids_per_device`` id positions per device (at most that many)."""
    if configured is not None:
        return configured
    return default_capacity(ids_per_device, num_shards)


@dataclasses.dataclass
class ExchangeCounts:
    """Device-side counters of one table's exchange since the last check, ``[n_src, n_dst]`` int32
    sharded on dim 0 (each device keeps its own row: no collective): ``dropped`` ids over capacity
    (summed over steps) and ``largest`` the most distinct ids the device had for a shard in one step;
    ``capacity`` the last step's capacity. Reduced over the sources on the host when read. ``features``:
    those counted, kept for the report (the table's group may be re-formed before the next check)."""

    dropped: torch.Tensor
    largest: torch.Tensor
    capacity: int
    features: tuple[str, ...] = ()

    @staticmethod
    def zeros(n: int, device: torch.device, capacity: int, mesh: Mesh, axis: str) -> ExchangeCounts:
        # Uploaded (not created on the device) so that every step traces the same graph.
        zeros = [torch.zeros(n, n, dtype=torch.int32).to(device) for _ in range(2)]
        for z in zeros:
            annotate(z, spec(axis, 0, 2), mesh)
        return ExchangeCounts(zeros[0], zeros[1], capacity)

    def per_shard(self) -> tuple[list[int], list[int]]:
        """``(dropped, largest)`` per destination shard (syncs XLA)."""
        dropped, largest = self.dropped.cpu(), self.largest.cpu()
        return [int(x) for x in dropped.sum(0)], [int(x) for x in largest.amax(0)]


@dataclasses.dataclass
class _Route:
    """What the autograd function needs to route one step's ids and send the gradient back."""

    ownership: RowOwnership
    capacity: int
    mesh: Mesh
    axis: str
    row_grad: RowGrad
    grad_dtype: torch.dtype
    #: the tables looked up (a stacked group's members), named where torch.autograd.grad asks for the weight
    tables: frozenset[str] = frozenset()
    routing: Routing | None = None
    ok: torch.Tensor | None = None


class _Exchange(torch.autograd.Function):
    """The rows ``[n, N_i, D]`` of each item's device-major id positions (``splits``: the ``N_i``), and in the
    backward their gradient rows sent to the owners. An item the loss does not use gets ``None`` (not zeros):
    where some item is unused (the same on every device: one program), an extra column counts each bucket slot's
    used positions, and an owner's row that only unused positions asked for is not touched
    (``modules/lookup.py`` does the same for one device's lookup)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, weight: torch.Tensor, ids: torch.Tensor, route: _Route, splits: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        rows, routing = exchange_lookup(weight, ids, route.ownership, route.capacity, route.mesh, route.axis)
        route.routing = routing
        ctx.route, ctx.splits = route, splits
        keep_table(ctx, route.tables, weight)
        if not torch.compiler.is_compiling():  # (as modules/lookup.py: compiled, unused outputs get zeros)
            ctx.set_materialize_grads(False)
        return tuple(torch.split(rows, list(splits), dim=1))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None, None]:  # type: ignore[override]
        route: _Route = ctx.route
        assert route.routing is not None and route.ok is not None
        present = [g for g in grads if g is not None]
        if not records_rows(ctx) or not present:  # (torch.autograd.grad of the weight raises)
            ctx.route = route.routing = route.ok = None
            return None, None, None, None
        used = None
        if len(present) < len(grads):
            unused, filled = unused_bags(grads, ctx.splits, 0, present[0].device)
            grad = torch.cat(filled, dim=1)
            used = (~unused).to(route.grad_dtype).view(1, -1, 1).expand(grad.shape[0], -1, 1)
        else:
            grad = present[0] if len(present) == 1 else torch.cat(present, dim=1)
        # 16-bit tables: gradient rows travel and are summed in the update's float32.
        grad = grad.to(route.grad_dtype)
        if used is None:
            ids, rows = exchange_grad(grad, route.routing)
        else:
            ids, rows = exchange_grad(torch.cat([grad, used], dim=-1), route.routing)
            ids = torch.where(rows[..., -1] > 0, ids, route.ownership.rows_per_shard)
            rows = rows[..., :-1]
        route.row_grad.add_owned(ids, rows, route.ok)
        # Released: the caller may keep the outputs (and so this node) past the step; the routing would
        # then be live tensors, materialized as extra outputs of every step.
        ctx.route = route.routing = route.ok = None
        return None, None, None, None


class _NoIds(torch.autograd.Function):
    """Zeros of ``shape`` from ``weight`` with no gradient for it (the lookups of an empty batch)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:  # type: ignore[override]
        return weight.new_zeros(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:  # type: ignore[override]
        return None, None


class _Replicated(torch.autograd.Function):
    """``x`` replicated over the mesh, and so is its gradient (one all-gather of ``[B, D]`` each way)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh = mesh
        return reshard(x, (None,) * x.dim(), mesh)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return reshard(grad, (None,) * grad.dim(), ctx.mesh), None


@dataclasses.dataclass
class RoutedLookup:
    """Every lookup of one row-sharded table in a forward call: its :class:`LookupBatch` es (one per
    bag width and combiner), routed together. ``features``: their names (for overflow reports);
    ``counts``: the collection's counters, updated under ``table``."""

    table: str
    weight: torch.Tensor
    configured: int | None
    features: list[str]
    counts: dict[str, ExchangeCounts]
    batches: list[LookupBatch] = dataclasses.field(default_factory=list)

    def run(self) -> dict[Path, torch.Tensor]:
        """Look every batch up through the exchange: each feature's activations ``[*out_shape, D]``."""
        weight = self.weight
        info = table_info(weight)
        assert info is not None and info.owner_local and info.layout is not None
        if info.frozen_tables:
            raise ValueError(
                f"Tables {sorted(info.frozen_tables)} are frozen (requires_grad_(False)) members of group "
                f"`{self.table}`, which is row-sharded and trained through the id exchange: freezing one table of "
                "such a group is not supported. Give the frozen tables a TableConfig.optimizer override of their own "
                "(they then stack apart) and freeze their group, or build the collection with stack_tables=False."
            )
        sharding = cast("TableSharding", info.sharding)
        mesh, axis, n = sharding.mesh, sharding.axis, sharding.num_shards
        rows_total, dim = int(weight.shape[0]), int(weight.shape[1])
        items = [(path, bags, b.combiner, b.resident) for b in self.batches for path, bags in b.items]
        if all(bags.ids.numel() == 0 for _, bags, _, _ in items):
            # An empty batch: nothing to route (a bucket needs at least one id position per device). Zero
            # outputs [*out_shape, D] that join the autograd graph and hand the table no gradient rows.
            return {path: _NoIds.apply(weight, (*bags.out_shape, int(weight.shape[1])))  # type: ignore[no-untyped-call]
                    for path, bags, _, _ in items}
        # Device-major ids [n, ·] per item: batch padded to a multiple of n, device d's part in row d.
        pads = [-(-bags.ids.shape[0] // n) * n - bags.ids.shape[0] for _, bags, _, _ in items]
        host = [i for i, it in enumerate(items) if not it[3]]
        parts: dict[int, torch.Tensor] = {}
        weights: dict[int, torch.Tensor | None] = {i: it[1].weights for i, it in enumerate(items)}
        if host:  # one transfer of every host item's ids (and one of their weights), each device its slice
            ids_h = [_device_major(items[i][1].ids, pads[i], rows_total, n) for i in host]
            up = _upload(torch.cat(ids_h, dim=1), weight.device, mesh, axis)
            for i, piece in zip(host, torch.split(up, [x.shape[1] for x in ids_h], dim=1), strict=True):
                parts[i] = piece
            with_w = [i for i in host if items[i][1].weights is not None]
            if with_w:
                w_h = [_device_major(_weights(items[i][1]), pads[i], 0, n).to(weight.dtype) for i in with_w]
                up_w = _upload(torch.cat(w_h, dim=1), weight.device, mesh, axis)
                for i, piece in zip(with_w, torch.split(up_w, [x.shape[1] for x in w_h], dim=1), strict=True):
                    weights[i] = piece.reshape(-1, items[i][1].ids.shape[1])
        for i, (_, bags, _, resident) in enumerate(items):
            if resident:
                parts[i] = reshard(_device_major(bags.ids, pads[i], rows_total, n), spec(axis, 0, 2), mesh)
                if bags.weights is not None and pads[i]:
                    weights[i] = torch.cat([bags.weights, bags.weights.new_zeros(pads[i], bags.weights.shape[1])])
        ordered = [parts[i] for i in range(len(items))]
        ids = ordered[0] if len(ordered) == 1 else torch.cat(ordered, dim=1)
        cap = capacity(ids.shape[1], n, self.configured)
        route = _Route(info.layout.ownership(rows_total, n), cap, mesh, axis, info.row_grad, math_dtype(weight),
                       frozenset(t for b in self.batches for t in b.tables))
        pieces: tuple[torch.Tensor, ...] = _Exchange.apply(  # type: ignore[no-untyped-call]
            weight, ids, route, tuple(p.shape[1] for p in ordered))
        assert route.routing is not None
        route.ok = self._count(route.routing, n, weight.device, cap, mesh, axis)
        out: dict[Path, torch.Tensor] = {}
        for i, piece in enumerate(pieces):
            path, bags, combiner, _ = items[i]
            width = bags.ids.shape[1]
            local_ids = ordered[i].reshape(-1, width)  # [B + pad, L], batch-sharded
            gains = bag_gains(local_ids != rows_total, weights[i], combiner, weight.dtype)
            got = piece.reshape(-1, width, dim)
            pooled = got[:, 0] * gains if width == 1 else torch.bmm(gains.unsqueeze(1), got).squeeze(1)
            if pads[i]:
                # Replicated (forward and gradient) before the padding rows are cut off: left batch-sharded,
                # the sliced [B, D] (B not a multiple of n) carries its sharding into whatever the user joins it
                # with (a torch.cat with a replicated table's output), and XLA's partitioner aborts the process
                # on the step's sort of the other table's ids (issue 28: Check failed IsScalarWithElementType).
                pooled = _Replicated.apply(pooled, mesh)[: bags.ids.shape[0]]  # type: ignore[no-untyped-call]
            out[path] = pooled.reshape(*bags.out_shape, dim)
        return out

    def _count(self, routing: Routing, n: int, device: torch.device, cap: int, mesh: Mesh, axis: str) -> torch.Tensor:
        """Add this step's overflow and loads to the counters; return the step's ``ok`` (no id dropped:
        one scalar all-reduce)."""
        prev = self.counts.get(self.table)
        if prev is None or prev.dropped.shape[0] != n:
            prev = ExchangeCounts.zeros(n, device, cap, mesh, axis)
        # Re-annotated, so the counters enter the next step with the layout they entered this one. New
        # tensors every step (made in the forward, like the lookup's outputs), so the step's graph keeps one
        # order of outputs from the first step on.
        self.counts[self.table] = ExchangeCounts(
            reshard(prev.dropped + routing.overflow, spec(axis, 0, 2), mesh),
            reshard(torch.maximum(prev.largest, routing.load), spec(axis, 0, 2), mesh),
            cap,
            tuple(dict.fromkeys([*prev.features, *self.features])),
        )
        ok: torch.Tensor = routing.overflow.sum() == 0
        return ok


def _weights(bags: Any) -> torch.Tensor:
    w: torch.Tensor = bags.weights
    return w


def _device_major(x: torch.Tensor, pad: int, fill: int, n: int) -> torch.Tensor:
    """``x [B, L]`` padded with ``pad`` rows of ``fill`` and laid out ``[n, (B + pad)/n · L]``."""
    if pad:
        x = torch.cat([x, torch.full((pad, x.shape[1]), fill, dtype=x.dtype, device=x.device)])
    return x.reshape(n, -1)


def _upload(x: torch.Tensor, device: torch.device, mesh: Mesh, axis: str) -> torch.Tensor:
    """A host ``[n, ...]`` tensor on the devices, row ``d`` on device ``d`` (sharded on dim 0)."""
    t = x.to(device)
    annotate(t, spec(axis, 0, t.dim()), mesh)
    return t
