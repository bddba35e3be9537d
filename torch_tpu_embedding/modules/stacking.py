"""Stacked table groups: tables stacked in one buffer, so a step updates a group at once.

Tables with the same ``embedding_dim``, ``dtype``, ``placement`` and per-table optimizer override
share one ``[Σ rows, D]`` parameter (keras-rs and SparseCore call this *table stacking*; TorchRec's
TBE groups tables the same way). A feature of a stacked table looks up ``id + first row``; every
feature of the group adds to one row-sparse gradient, so the optimizer does one dedup, one gather
and one scatter per group instead of one per table. On XLA that removes the per-table part of
tracing and of the compiled graph, and it stops equally sized tables from being separate buffers
that XLA's donation pairing can mix up (see ``optim/_core/slots.py``, ``trash_rows``).

Only the layout changes: every feature still reads its own table's rows, and the per-row update is
the same. ``state_dict`` stays per table (``tables.<name>.weight``; optimizer state keyed
``table:<name>``, split and joined by :mod:`torch_tpu_embedding._rows.stacked_state`), so checkpoints move
between stacked and unstacked collections.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from torch_tpu_embedding._rows.placement import device_backend
from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.stacked_state import Members
from torch_tpu_embedding._rows.tables import StackedRows, TableInfo, register_view, table_info
from torch_tpu_embedding._util.validation import check_bool
from torch_tpu_embedding.config import TableConfig
from torch_tpu_embedding.modules.deferred_init import defer
from torch_tpu_embedding.modules.later_writes import later_writes
from torch_tpu_embedding.modules.table import EmbeddingTable, host_empty, write_rows

__all__ = [
    "stacking_argument",
    "GROUP_KEY_PREFIX",
    "FusedTables",
    "StackedTables",
    "TableView",
    "stack_key",
    "join_fused_weights",
    "join_stacked_weights",
    "plan_groups",
    "split_fused_weights",
    "split_stacked_weights",
    "stack_groups",
]

#: the saved name of stacked groups in state dicts and checkpoints (``groups.fused_0.weight``); kept so
#: every existing checkpoint loads
GROUP_KEY_PREFIX = "fused_"


def stack_key(config: TableConfig, placement: str | None = None) -> tuple[Any, ...]:
    """Tables with equal keys can share one buffer (the optimizer override compares by identity,
    a name by value). ``placement``: the table's resolved placement (default: as configured).

    A table with its own exchange capacity (``max_unique_ids_per_shard``) stacks only with tables
    that have one too: the group's capacity is their sum, and a derived one would override it."""
    opt = config.optimizer
    where = config.placement if placement is None else placement
    capped = config.max_unique_ids_per_shard is not None
    return (config.embedding_dim, config.dtype, where, opt if isinstance(opt, str) else id(opt), capped)


class StackedTables(EmbeddingTable):
    """Several tables stacked in one ``weight`` ``[Σ num_embeddings (+ padding), D]``.

    Table ``i`` holds rows ``[offset_i, offset_i + num_embeddings_i)``; padding rows for sharding
    come after the last table. Built by :class:`~torch_tpu_embedding.EmbeddingCollection` with
    ``stack_tables=True`` from tables whose weights are already drawn, so a seed gives the same
    values stacked or not.
    """

    def __init__(self, tables: Sequence[EmbeddingTable], name: str, placement: str | None = None) -> None:
        first = tables[0].config
        offsets, total = [], 0
        for t in tables:
            offsets.append(total)
            total += t.config.num_embeddings
        self.member_configs: dict[str, TableConfig] = {t.name: t.config for t in tables}
        self._members: Members = tuple(
            (t.name, off, t.config.num_embeddings) for t, off in zip(tables, offsets, strict=True)
        )
        caps = [t.config.max_unique_ids_per_shard for t in tables]
        config = TableConfig(
            num_embeddings=total,
            embedding_dim=first.embedding_dim,
            name=name,
            optimizer=first.optimizer,
            dtype=first.dtype,
            placement=first.placement if placement is None else placement,
            # The group routes its tables' ids together: their capacities add up (stack_key groups
            # tables that all set one, or none).
            max_unique_ids_per_shard=None if None in caps else sum(c for c in caps if c is not None),
        )
        parts = [t.weight.detach()[: t.config.num_embeddings] for t in tables]
        on_host = all(w.device.type == "cpu" for w in parts)  # (one dtype: stack_key holds it)
        # On the host, into a buffer on huge pages (host_empty); elsewhere (meta, a device) as torch.cat places it
        out = host_empty(name, (total, first.embedding_dim), parts[0].dtype) if on_host else None
        weight = torch.cat(parts, out=out)
        #: member tables frozen with ``TableView.requires_grad_(False)``: no gradient, never updated
        self.frozen: frozenset[str] = frozenset()
        super().__init__(config, name, weight=weight)
        # Tables built on the meta device: their recorded draws, at their rows of the group
        self.deferred = tuple(
            (off + first, d) for t, off in zip(tables, offsets, strict=True) for first, d in t.deferred
        )

    def members(self) -> Members:
        return self._members

    def set_frozen(self, table: str, frozen: bool) -> None:
        """Freeze (or unfreeze) member ``table``: its rows get no gradient and no update."""
        self.frozen = self.frozen | {table} if frozen else self.frozen - {table}
        info = table_info(self.weight)
        self._mark_frozen(self._register() if info is None else info)

    def _register(self, *args: Any, **kwargs: Any) -> TableInfo:
        # A new weight (padded, permuted, moved): its frozen rows in its stored order.
        return self._mark_frozen(super()._register(*args, **kwargs))

    def _mark_frozen(self, info: TableInfo) -> TableInfo:
        frozen = self.__dict__.get("frozen", frozenset())
        info.frozen_tables, info.frozen_rows = frozen, None
        if frozen:
            rows = int(self.weight.shape[0])
            logical = torch.arange(rows)
            if self.row_layout is not None:
                logical = self.row_layout.ownership(rows).logical_id(logical)
            mask = torch.zeros(rows, dtype=torch.bool)
            for name, off, n in self._members:
                if name in frozen:
                    mask |= (logical >= off) & (logical < off + n)
            info.frozen_rows = mask.to(self.weight.device)
        return info

    def reset_parameters(self) -> None:
        """Draw each table's rows from its own initializer, in table order (on the meta device: record
        each draw, as :meth:`EmbeddingTable.reset_parameters` does)."""
        if self.weight.is_meta:
            self.deferred = tuple((off, defer(name, self.member_configs[name])) for name, off, _ in self._members)
            return
        with torch.no_grad():
            for name, off, n in self._members:
                t = EmbeddingTable(self.member_configs[name], name)
                self.weight[off : off + n].copy_(t.weight.detach().to(self.weight.device))

    def extra_repr(self) -> str:
        c = self.config
        tables = ", ".join(f"{name} at row {off} ({n} rows)" for name, off, n in self._members)
        return (f"name={self.name!r}, num_embeddings={c.num_embeddings}, embedding_dim={c.embedding_dim}, "
                f"dtype={c.dtype}, placement={c.placement!r}, tables=[{tables}]")


class TableView(nn.Module):
    """A table stacked in a :class:`StackedTables`: its config, and its rows of the group's weight.

    Holds no parameter (the group does); ``weight`` is a view of the group's rows, for reading.
    Write a table's values with ``load_state_dict`` (``tables.<name>.weight``).
    """

    def __init__(self, config: TableConfig, name: str, group: StackedTables, offset: int) -> None:
        super().__init__()
        self.config = config
        self.name = name
        self.offset = offset
        self.__dict__["group"] = group  # not a submodule: the group is registered once, in `groups`

    @property
    def group(self) -> StackedTables:
        """The group whose weight holds this table's rows."""
        group: StackedTables = self.__dict__["group"]
        return group

    @property
    def weight(self) -> torch.Tensor:
        """``[num_embeddings, D]`` rows of the group's weight: a view, or a host copy when the group is
        stored in a permuted row order (``row_layout``)."""
        group = self.group
        rows = StackedRows(self.name, group.name, self.offset, self.config.num_embeddings, group.weight,
                           group.logical_rows)
        stored = group.weight if group.row_layout is None else group.weight.detach()
        return register_view(rows.of(stored), rows)  # optimizers recognise it (and refuse it)

    def logical_weight(self) -> torch.Tensor:
        """The table's ``[num_embeddings, D]`` logical rows (as :meth:`EmbeddingTable.logical_weight`)."""
        return self.weight.detach()

    def requires_grad_(self, requires_grad: bool = True) -> TableView:
        """Freeze (``False``) or unfreeze this table's rows of its group, as ``nn.Module.requires_grad_``
        freezes a table of its own: its lookups record no row gradient and no optimizer step changes its
        rows or their slots, while the other tables of the group train. Its per-id weights still get
        gradients. Not saved in ``state_dict`` (as ``requires_grad`` is not)."""
        if not isinstance(requires_grad, bool):
            raise ValueError(f"Argument `requires_grad` must be a bool. Received: {requires_grad!r}")
        self.group.set_frozen(self.name, not requires_grad)
        return self

    @property
    def trainable(self) -> bool:
        """False after ``requires_grad_(False)``."""
        return self.name not in self.group.frozen

    @property
    def padding_rows(self) -> int:
        return 0

    @property
    def row_grad(self) -> RowGrad:
        return self.group.row_grad

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"name={self.name!r}, num_embeddings={c.num_embeddings}, embedding_dim={c.embedding_dim}, "
            f"combiner={c.combiner!r}, dtype={c.dtype}, stacked in {self.group.name!r} at row {self.offset}"
        )


# ------------------------------------------------------------------ building groups, module state
def plan_groups(configs: Mapping[str, TableConfig], placements: Mapping[str, str]) -> list[tuple[str, ...]]:
    """The groups :func:`stack_groups` forms: names of tables with equal :func:`stack_key` (two or more), in
    table order, groups in the order of their first table."""
    by_key: dict[tuple[Any, ...], list[str]] = {}
    for name, config in configs.items():
        by_key.setdefault(stack_key(config, placements.get(name)), []).append(name)
    return [tuple(names) for names in by_key.values() if len(names) > 1]


def stack_groups(
    tables: dict[str, nn.Module], groups: nn.ModuleDict, located: dict[str, tuple[EmbeddingTable, int]],
    placements: Mapping[str, str] | None = None,
) -> dict[str, nn.Module]:
    """Stack tables with equal :func:`stack_key` (two or more) into :class:`StackedTables`.

    Each group is added to ``groups`` (:data:`GROUP_KEY_PREFIX` ``<i>``); returns ``tables`` with each stacked
    table replaced by its :class:`TableView`, and records in ``located`` each stacked table's group and
    first row there. ``placements``: each table's resolved placement (by name), which its group then
    takes; default: as configured.
    """
    where = {} if placements is None else placements
    out: dict[str, nn.Module] = dict(tables)
    for names in plan_groups({n: cast(EmbeddingTable, t).config for n, t in tables.items()}, where):
        same = [cast(EmbeddingTable, tables[n]) for n in names]
        name = f"{GROUP_KEY_PREFIX}{len(groups)}"
        while name in tables:  # a table may have that name already
            name = "_" + name
        group = StackedTables(same, name, where.get(same[0].name))
        groups[name] = group
        for (tname, off, _), t in zip(group.members(), same, strict=True):
            out[tname] = TableView(t.config, tname, group, off)
            located[tname] = (group, off)
    return out


def _stacked_members(module: nn.Module) -> dict[str, Members]:
    groups = cast(nn.ModuleDict, module.groups)
    return {n: cast(StackedTables, g).members() for n, g in groups.items()}


def split_stacked_weights(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` hook: each stacked group's weight becomes its tables' ``tables.<name>.weight``
    (in table order, as an unstacked collection's)."""
    stacked = _stacked_members(module)
    if not stacked:
        return
    mine = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    lazy: list[torch.Tensor] = []
    for gname, members in stacked.items():
        value = mine.pop(prefix + f"groups.{gname}.weight", None)
        if value is not None:
            rows = {prefix + f"tables.{t}.weight": value[off : off + n] for t, off, n in members}
            if isinstance(value, nn.Parameter):  # keep_vars=True: each table's rows as ec.tables.<name>.weight
                group = cast(StackedTables, cast(nn.ModuleDict, module.groups)[gname])
                for (t, off, n), view in zip(members, rows.values(), strict=True):
                    register_view(view, StackedRows(t, gname, off, n, group.weight, group.logical_rows))
            if value.device.type == "xla":  # copies: a view of a parameter updated in place is recomputed
                rows = {k: v.clone() for k, v in rows.items()}  # from it on every read, one compile per shape
                lazy.extend(rows.values())
            mine.update(rows)
    if lazy:  # one graph for every table's rows (a copy of the group, for the time the state_dict lives)
        device_backend("xla").materialize(lazy)
    order = [prefix + f"tables.{t}.weight" for t in cast(nn.ModuleDict, module.tables)]
    state_dict.update({k: mine.pop(k) for k in order if k in mine})
    state_dict.update(mine)


def join_stacked_weights(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
    missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    """Load pre-hook: per-table weights of stacked tables joined into their group's weight.

    Tables absent from ``state_dict`` keep their values (and are reported missing when ``strict``);
    a state_dict that holds the group's weight itself (a distributed checkpoint) loads as is.
    """
    later = later_writes()
    for gname, members in _stacked_members(module).items():
        gkey = prefix + f"groups.{gname}.weight"
        keys = [prefix + f"tables.{tname}.weight" for tname, _, _ in members]
        group = cast(StackedTables, cast(nn.ModuleDict, module.groups)[gname])
        if gkey in state_dict or not any(k in state_dict for k in keys):
            if gkey not in state_dict and strict:
                missing_keys.extend(keys)
                # (the rows as they are: nothing to write when the writes are held back)
                state_dict[gkey] = _current_rows(module, gname) if later is None else later.stand_in(group.weight)
            continue
        if later is not None:  # tte.checkpoint.load: joined and written once the user's load code has run
            given = {k: state_dict.pop(k) for k in keys if k in state_dict}
            state_dict[gkey] = later.stand_in(group.weight)
            later.later(functools.partial(_join_and_write, module, prefix, gname, given))
            continue
        device = next(state_dict[k].device for k in keys if k in state_dict)
        pieces = []
        for key, (_, off, n) in zip(keys, members, strict=True):
            value = state_dict.pop(key, None)
            current = _current_rows(module, gname)[off : off + n]
            if value is None:
                if strict:
                    missing_keys.append(key)
                value = current
            elif tuple(value.shape) != tuple(current.shape):
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                    f"checkpoint, the shape in current model is {tuple(current.shape)}."
                )
                value = current
            pieces.append(value.detach().to(device=device))
        state_dict[gkey] = torch.cat(pieces)


def _join_and_write(module: nn.Module, prefix: str, gname: str, pieces: dict[str, torch.Tensor]) -> None:
    """A stacked group's write held back by a load (``modules/later_writes.py``): its tables' ``pieces``
    joined as :func:`join_stacked_weights` joins them (a table absent keeps its rows), then written."""
    state: dict[str, Any] = dict(pieces)
    errors: list[str] = []
    join_stacked_weights(module, state, prefix, {}, False, [], [], errors)
    if errors:  # (the load's checks refuse these first)
        raise RuntimeError("; ".join(errors))
    gkey = prefix + f"groups.{gname}.weight"
    write_rows(cast(StackedTables, cast(nn.ModuleDict, module.groups)[gname]), state[gkey], gkey)


def _current_rows(module: nn.Module, gname: str) -> torch.Tensor:
    group = cast(StackedTables, cast(nn.ModuleDict, module.groups)[gname])
    return group.logical_weight()


# Deprecated names, kept importable: models pickled whole before the rename name these hooks and this class.
def stacking_argument(stack_tables: bool | None, fuse_tables: bool | None) -> bool:
    """``EmbeddingCollection``'s ``stack_tables`` (default True), or its deprecated name ``fuse_tables`` (a
    ``DeprecationWarning``); both given is a ``TypeError``."""
    if fuse_tables is not None:
        if stack_tables is not None:
            raise TypeError("Arguments `stack_tables` and `fuse_tables` (its deprecated name) were both "
                            f"given: stack_tables={stack_tables!r}, fuse_tables={fuse_tables!r}. Pass only "
                            "`stack_tables`.")
        warnings.warn("EmbeddingCollection(fuse_tables=...) is deprecated: use stack_tables=...",
                      DeprecationWarning, stacklevel=3)
        check_bool("fuse_tables", fuse_tables)
        stack_tables = fuse_tables
    stack_tables = True if stack_tables is None else stack_tables
    check_bool("stack_tables", stack_tables)
    return stack_tables


# Deprecated names, kept: models pickled whole before the rename name their class and state hooks by them.
FusedTables = StackedTables
split_fused_weights = split_stacked_weights
join_fused_weights = join_stacked_weights
