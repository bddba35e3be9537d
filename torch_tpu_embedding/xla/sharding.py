"""Tables and optimizer slots laid out on a torch_xla SPMD device mesh.

Placements (``TableConfig.placement``):

* ``"row"``: rows split over the mesh axis (``mark_sharding(w, mesh, ("x", None))``). On a 1-D mesh
  of ``n > 1`` devices the table trains through the id exchange
  (:mod:`torch_tpu_embedding.xla.routed`): the rows are stored in the interleaved order of
  :class:`~torch_tpu_embedding._rows.row_order.RowLayout`, each device sends its ids to the shards that own
  them and gets the rows back, and the optimizer updates every shard's rows where they live. Other
  meshes: a local masked gather plus an all-reduce of the ``[N, D]`` result. Rows are padded to a
  multiple of the device count (an uneven split makes XLA silently replicate the table after an
  in-place update, measured on torch_xla 2.9) — in fact of ``lcm(ROW_ALIGNMENT, n)`` (512 up to 512
  devices), so that every layout up to 512 devices has the same physical shapes (distributed
  checkpoints reshard in place).
* ``"column"``: the embedding dimension split (``(None, "x")``); needs ``D % devices == 0``.
* ``"replicated"``: a full copy per device, for small tables (TF's mode without the embedding
  accelerator).
* ``"auto"``: replicated below ``replicate_below_bytes``, else row-sharded.

Optimizer slots are created with their table's layout (the optimizer calls :func:`shard_slot` and
:func:`slot_extra_rows`, :mod:`torch_tpu_embedding.xla.mesh`), so no slot is ever materialised whole on
one device. The lookups of a table trained through the id exchange come from its layout
(:meth:`TableSharding.routed_lookup`): the collection asks the table's layout, so it never imports this
placement code or torch_xla.

Example (single-process SPMD; on Cloud TPU the same code runs on every host)::

    import torch_xla, torch_xla.runtime as xr
    xr.use_spmd()                      # before any XLA tensor exists
    from torch_tpu_embedding.xla import shard, device_mesh
    ec = tte.EmbeddingCollection(features, device=torch_xla.device())
    shard(ec, device_mesh())           # before building the optimizer
    opt = tte.optim.Adam(ec.parameters(), lr=1e-3)
    opt.init_state(); torch_xla.sync()
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torch_tpu_embedding._rows.placement import TablePlacement
from torch_tpu_embedding._rows.row_order import RowLayout
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.validation import arg_error, check_int
from torch_tpu_embedding.config import DEFAULT_REPLICATE_BELOW_BYTES, TableConfig, auto_placement
from torch_tpu_embedding.modules.collection import EmbeddingCollection
from torch_tpu_embedding.modules.table import EmbeddingTable
from torch_tpu_embedding.xla.manual import all_reduce, on_shards, reshard, spec
from torch_tpu_embedding.xla.mesh import Mesh, device_mesh, shard_slot, sharding_spec, slot_extra_rows, xr, xs
from torch_tpu_embedding.xla.routed import ExchangeCounts, RoutedLookup

__all__ = [
    "DEFAULT_REPLICATE_BELOW_BYTES",
    "ROW_ALIGNMENT",
    "TableSharding",
    "choose_placement",
    "device_mesh",
    "replicate",
    "shard",
    "shard_batch",
    "shard_slot",
    "sharding_spec",
    "slot_extra_rows",
    "uses_exchange",
]

#: Sharded tables get rows up to a multiple of ``lcm(ROW_ALIGNMENT, devices)`` and slot ``k`` gets
#: ``k`` such blocks of trash rows. For device counts dividing 512 the physical shapes are then the
#: same in every layout — row or column, 1 to 512 devices — which lets a distributed checkpoint be
#: resharded in place on load. On other device counts the block is larger (the device count above 512,
#: ``3 · 512`` for 6 or 768 devices): such a checkpoint loads on other device counts through the host.
ROW_ALIGNMENT = 512


@dataclasses.dataclass(frozen=True)
class TableSharding(TablePlacement):
    """A table's layout: ``placement`` in ``("row", "column", "replicated")`` over ``mesh[axis]``;
    ``exchange``: a row-sharded table trained through the id exchange (ids routed to their owner)."""

    placement: str
    mesh: Any
    axis: str
    exchange: bool = False

    @property
    def num_shards(self) -> int:
        return int(self.mesh.shape()[self.axis])

    @property
    def row_block(self) -> int:
        """Physical rows are a multiple of this: ``lcm(ROW_ALIGNMENT, num_shards)``."""
        return math.lcm(ROW_ALIGNMENT, self.num_shards)

    def routed_lookup(
        self, table: str, weight: torch.Tensor, configured: int | None, features: list[str],
        counts: dict[str, ExchangeCounts],
    ) -> RoutedLookup:
        """The lookup of a table laid out this way (``exchange`` only) for one forward call: every batch
        of its ids routed through the id exchange (see :class:`~torch_tpu_embedding.xla.routed.RoutedLookup`)."""
        return RoutedLookup(table, weight, configured, features, counts)

    def on_shards(self, fn: Callable[..., list[torch.Tensor]], sharded: Mapping[str, torch.Tensor],
                  small: Mapping[str, torch.Tensor], inputs: Sequence[torch.Tensor],
                  replicated: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """:func:`~torch_tpu_embedding.xla.manual.on_shards` over this table's shards."""
        return on_shards(fn, sharded, small, inputs, replicated, mesh=self.mesh, axis=self.axis)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Inside :meth:`on_shards`: ``x`` summed over the table's shards."""
        return all_reduce(x, self.mesh, self.axis)

    def row_sharded(self, t: torch.Tensor) -> torch.Tensor:
        """``t [n, ...]`` resharded with dim 0 over the table's shards."""
        return reshard(t, spec(self.axis, 0, t.dim()), self.mesh)

    def spec(self, dim: int, rows: bool = True) -> tuple[str | None, ...]:
        """The partition spec of a ``dim``-d tensor laid out like the table (``rows``: dim 0 = rows)."""
        none: tuple[str | None, ...] = (None,) * dim
        if self.placement == "row" and rows and dim >= 1:
            return (self.axis, *none[1:])
        if self.placement == "column" and rows and dim == 2:
            return (None, self.axis)
        return none


def uses_exchange(placement: str, mesh: Mesh, axis: str) -> bool:
    """Whether a table of ``placement`` on ``mesh[axis]`` trains through the id exchange: row-sharded
    over a 1-D mesh of ``n > 1`` devices (stored in the interleaved row order of
    ``lcm(ROW_ALIGNMENT, n)`` chunks). On a mesh of more axes row-sharded tables use the
    partitioner's lookup, and :func:`shard` warns."""
    n = int(mesh.shape()[axis])
    return placement == "row" and n > 1 and len(mesh.axis_names) == 1


def choose_placement(config: TableConfig, num_devices: int, replicate_below_bytes: int) -> str:
    """``config.placement``, with ``"auto"`` resolved by the size rule."""
    if config.placement == "table":
        raise ValueError(
            f"Table `{config.name}`: placement 'table' (the whole table on one process) is for process groups "
            "(torch_tpu_embedding.distributed.shard); under torch_xla SPMD use 'row', 'column', 'replicated' or "
            "'auto'. Received: placement='table'"
        )
    if config.placement != "auto":
        return config.placement
    return auto_placement(config, num_devices, replicate_below_bytes)


def shard(
    collection: EmbeddingCollection,
    mesh: Mesh | None = None,
    *,
    axis: str | None = None,
    replicate_below_bytes: int = DEFAULT_REPLICATE_BELOW_BYTES,
) -> dict[str, str]:
    """Lay every table of ``collection`` out on ``mesh`` by its placement; returns name → placement.

    Each table's placement is resolved first (``"auto"`` by the table's own size); then stacked
    tables are re-grouped by it (:meth:`EmbeddingCollection.restack`), so stacking never changes a
    table's placement, and a group is laid out once, as one table.

    Call after moving the collection to the XLA device and before building the optimizer (padding
    rows up to a multiple of ``lcm(ROW_ALIGNMENT, devices)`` replace the weight parameter). Padding rows are never
    looked up, never updated and never saved: ``state_dict`` holds ``[num_embeddings, D]``. Calling
    it again (say with another ``replicate_below_bytes``) lays the tables out anew, values kept;
    build the optimizer after the last call.
    """
    if not xr.is_spmd():
        raise RuntimeError(
            "torch_tpu_embedding.xla.shard needs SPMD mode: call torch_xla.runtime.use_spmd() before "
            "any XLA tensor is created."
        )
    mesh, axis = _mesh_axis(mesh, axis)
    check_int("replicate_below_bytes", replicate_below_bytes, minimum=0)
    n = int(mesh.shape()[axis])
    for name, table in collection.physical_tables().items():
        if table.weight.device.type != "xla":
            raise ValueError(
                f"{_tables_of(name, table)} on {table.weight.device}; move the collection to the XLA device "
                "(EmbeddingCollection(..., device=torch_xla.device())) before sharding it."
            )
    placements = {t: choose_placement(c, n, replicate_below_bytes) for t, c in collection.table_configs.items()}
    # Checked per table before anything is laid out: a refused call leaves the collection as it was.
    narrow = [f"Table `{t}`: placement 'column' needs embedding_dim divisible by the {n} devices of mesh axis "
              f"'{axis}'. Received: embedding_dim={c.embedding_dim}"
              for t, c in sorted(collection.table_configs.items())
              if placements[t] == "column" and c.embedding_dim % n]
    if narrow:
        raise ValueError("; ".join(narrow))
    collection.restack(placements)
    if n > 1 and not uses_exchange("row", mesh, axis) and (rows := [t for t, p in placements.items() if p == "row"]):
        warnings.warn(
            f"Row-sharded table(s) {', '.join(f'`{t}`' for t in rows)} cannot train through the id exchange on "
            f"this mesh (shape {dict(mesh.shape())}, sharded over axis '{axis}'): it needs a 1-D mesh. They use "
            "the SPMD partitioner's lookup, which all-gathers the global batch's ids and all-reduces its rows: "
            "the bytes each device moves per step grow with the number of devices (docs/sharding.md).",
            stacklevel=2)
    for name, table in collection.physical_tables().items():  # a stacked group is laid out once
        members = table.members()
        placement = placements[name if members is None else members[0][0]]
        layout = TableSharding(placement, mesh, axis, uses_exchange(placement, mesh, axis))
        table.pad_rows(layout.row_block)
        if layout.exchange and table.row_layout is None:
            table.permute_rows(RowLayout(layout.row_block))  # lcm(512, n) chunks
        if sharding_spec(table.weight):  # laid out by an earlier call: XLA refuses a second annotation
            xs.clear_sharding(table.weight)
        xs.mark_sharding(table.weight, mesh, layout.spec(2))
        info = table_info(table.weight)
        assert info is not None  # pad_rows / the constructor registered it
        info.sharding = layout
    return placements


def _tables_of(name: str, table: EmbeddingTable) -> str:
    """The user's names of a physical table: ``Table `t` is`` or, for a stacked group, its tables'."""
    members = table.members()
    if members is None:
        return f"Table `{name}` is"
    return f"Tables {', '.join(f'`{m[0]}`' for m in members)} (stacked into one buffer) are"


def shard_batch(x: torch.Tensor, mesh: Mesh | None = None, axis: str | None = None) -> torch.Tensor:
    """Mark dim 0 of an XLA tensor as split over ``axis`` (data parallelism); returns ``x``."""
    mesh, axis = _mesh_axis(mesh, axis)
    if not isinstance(x, torch.Tensor) or x.device.type != "xla" or x.dim() == 0:
        got = f"a {x.dim()}-d tensor on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise arg_error("x", "of shard_batch must be a tensor with a batch dimension on the XLA device "
                        "(x.to(torch_xla.device()))", got)
    xs.mark_sharding(x, mesh, (axis, *([None] * (x.dim() - 1))))
    return x


def replicate(params: Any, mesh: Mesh | None = None) -> None:
    """Mark dense parameters (a module or an iterable of tensors) replicated on the mesh.

    Data-parallel parameters should carry an explicit layout: left unmarked, XLA may give the
    updated parameter a sharded layout after the first step, and the second step compiles again.
    """
    mesh, _ = _mesh_axis(mesh, None)
    named = list(params.named_parameters() if isinstance(params, torch.nn.Module) else enumerate(params))
    for name, p in named:  # all checked before any is marked
        if not isinstance(p, torch.Tensor) or p.device.type != "xla":
            got = f"parameter {name!r} on {p.device}" if isinstance(p, torch.Tensor) else f"item {name!r}: {p!r}"
            raise arg_error("params", "of replicate must be tensors on the XLA device: move the module there first "
                            "(module.to(torch_xla.device()))", got)
    for _, p in named:
        if table_info(p) is None and p.dim():
            xs.mark_sharding(p, mesh, (None,) * p.dim())


def _mesh_axis(mesh: Mesh | None, axis: str | None) -> tuple[Mesh, str]:
    """``mesh`` (default: :func:`device_mesh`) and ``axis`` (default: its first), checked."""
    mesh = device_mesh() if mesh is None else mesh
    if not isinstance(mesh, xs.Mesh):
        raise arg_error("mesh", "must be a torch_xla.distributed.spmd.Mesh, e.g. tte.xla.device_mesh()", mesh)
    axis = mesh.axis_names[0] if axis is None else axis
    if axis not in mesh.axis_names:
        raise arg_error("axis", f"must be one of the mesh axes {tuple(mesh.axis_names)}", axis)
    return mesh, axis
