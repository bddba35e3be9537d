"""Row bookkeeping, written once: which parameters are embedding tables, and what is known of each.

A table parameter carries a :class:`TableInfo` (its name, rows, placement, stored row order and its
:class:`~torch_tpu_embedding._rows.row_grad.RowGrad`, the row-sparse gradient its lookups add to), set by
:func:`register_table` and read by :func:`table_info`; a stacked table's ``weight`` carries its
:class:`StackedRows` (:func:`register_view`, :func:`stacked_rows`), and where ``tte.distributed`` marked it, the
process group its row gradients are exchanged over (:func:`exchange_mark`). A table whose weight was replaced is
retired (:func:`retire_table`) and named by :func:`check_live_tables`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.row_order import RowLayout

if TYPE_CHECKING:
    from torch_tpu_embedding._rows.placement import TablePlacement

__all__ = [
    "GROUP_NOT_PICKLED",
    "CarriedMark",
    "StackedRows",
    "TableInfo",
    "check_live_tables",
    "exchange_mark",
    "register_table",
    "refuse_stacked_view",
    "register_view",
    "retire_table",
    "retired_count", "set_exchange_mark", "stacked_rows",
    "table_info",
]


@dataclasses.dataclass
class TableInfo:
    """What the library knows about a table parameter."""

    name: str
    num_embeddings: int
    #: the table's per-table optimizer override (``TableConfig.optimizer``), if any
    optimizer: Any = None
    row_grad: RowGrad = dataclasses.field(default_factory=RowGrad.registered)
    #: how the table is placed over devices or processes (set by :func:`torch_tpu_embedding.xla.shard` or
    #: :func:`torch_tpu_embedding.distributed.shard`); ``None``: on one device
    sharding: TablePlacement | None = None
    #: a stacked group's tables as ``(name, first row, rows)`` in row order; ``None`` for one table
    members: tuple[tuple[str, int, int], ...] | None = None
    #: the stored row order (``None``: logical order); set with the id exchange's interleaved layout
    #: by :func:`torch_tpu_embedding.xla.shard`
    layout: RowLayout | None = None
    #: why this tensor is no longer the table's weight (:func:`retire_table`); ``None`` while it is
    retired: str | None = None
    #: a stacked group with frozen member tables: ``[rows]`` bool in stored row order, True at the rows of
    #: a frozen member (no gradient recorded, never updated); ``None`` when every member trains
    frozen_rows: torch.Tensor | None = None
    #: the names of those frozen members
    frozen_tables: frozenset[str] = frozenset()

    @property
    def tables(self) -> list[str]:
        """The user's tables in this parameter: its own name, or a stacked group's members."""
        return [m[0] for m in self.members] if self.members else [self.name]

    def described(self) -> str:
        """The user's names for this parameter in messages: ``embedding table 't'``, or for a stacked group
        ``embedding tables 't', 'u' (stacked in group 'fused_0')`` (the group's name is internal)."""
        if not self.members:
            return f"embedding table '{self.name}'"
        names = ", ".join(f"'{m[0]}'" for m in self.members)
        return f"embedding tables {names} (stacked in group '{self.name}')"

    @property
    def num_shards(self) -> int:
        """Over how many devices or processes the table is split (1 without a placement)."""
        return 1 if self.sharding is None else self.sharding.num_shards

    @property
    def owner_local(self) -> bool:
        """Trained through the id exchange (:func:`torch_tpu_embedding.xla.shard`): lookups route ids to
        the shards that own them and the gradient arrives there (``RowGrad.add_owned``)."""
        return self.sharding is not None and self.sharding.exchange

    @property
    def routed(self) -> bool:
        """Looked up through its layout's ``routed_lookup``: the SPMD id exchange (:attr:`owner_local`), or
        rows sharded over a process group (``tte.distributed.shard``)."""
        return self.sharding is not None and (self.sharding.exchange or self.sharding.over_process_group)


# A registered tensor's entry is an attribute of the tensor (its _Tag), which names the tensor it was made for:
# a lookup is an attribute read and a weak reference's call (a step makes some 15; a WeakIdKeyDictionary's
# lookup cost 1-2 µs each), and torch.compile reads an attribute of a tensor as a guarded constant, so a
# compiled step stays one graph (dynamo skips ``WeakIdKeyDictionary.get``: one graph break per lookup).
_INFO_ATTR = "_tte_table_info"
_ROWS_ATTR = "_tte_stacked_rows"
_MARK_ATTR = "_tte_exchange_mark"


class _Tag:
    """The value of such an attribute, and the tensor it belongs to. A copy or an unpickled tensor is not
    registered: a deep copy or pickle of the tag gives no tag, and a shallow copy's tag is its original's."""

    __slots__ = ("owner", "value")

    def __init__(self, value: Any, owner: torch.Tensor) -> None:
        self.value, self.owner = value, weakref.ref(owner)

    def __deepcopy__(self, memo: Any) -> None:
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (set, ())  # an empty set: no tag, and a global torch.load(weights_only=True) allows


def _tag(t: torch.Tensor, attr: str) -> Any:
    return tag.value if isinstance(tag := getattr(t, attr, None), _Tag) else None


def _registered(t: torch.Tensor, attr: str) -> Any:
    """The value registered for ``t`` itself (not for the tensor a copy was made from), or ``None``."""
    tag = t.__dict__.get(attr)
    return tag.value if isinstance(tag, _Tag) and tag.owner() is t else None


def register_table(
    param: torch.Tensor,
    name: str,
    num_embeddings: int,
    optimizer: Any = None,
    members: tuple[tuple[str, int, int], ...] | None = None,
    layout: RowLayout | None = None,
) -> TableInfo:
    """Mark ``param`` as an embedding table whose gradient arrives row-sparse."""
    info = TableInfo(name=name, num_embeddings=num_embeddings, optimizer=optimizer, members=members, layout=layout)
    param.__dict__[_INFO_ATTR] = _Tag(info, param)
    return info


_RETIRED = [0]  # tables retired so far, process-wide: optimizers re-check their parameters when it moves


def retire_table(param: torch.Tensor, why: str) -> None:
    """Mark ``param`` as replaced by a new weight of its table (an optimizer built on it would
    update a tensor nothing looks up any more); :func:`check_live_tables` then names it."""
    info = table_info(param)
    if info is not None and info.retired is None:
        info.retired = why
        _RETIRED[0] += 1


def retired_count() -> int:
    """How many table weights have been retired in this process (cheap to compare between steps)."""
    return _RETIRED[0]


def check_live_tables(params: Iterable[torch.Tensor]) -> None:
    """Raise if a table among ``params`` was retired (its table has a new weight)."""
    for p in params:
        info = table_info(p)
        if info is not None and info.retired is not None:
            tables = ", ".join(f"`{m[0]}`" for m in info.members) if info.members else f"`{info.name}`"
            what = (f"tables {tables} (stacked together) that is no longer theirs" if info.members
                    else f"table {tables} that is no longer the table's")
            raise RuntimeError(
                f"The optimizer holds a weight of {what}: {info.retired}. It "
                "would update a tensor that nothing looks up. Build the optimizer after the call that laid the "
                "tables out (tte.distributed.shard(model) over a process group, tte.xla.shard(...) under SPMD) "
                "and after any other call that replaces table weights, from model.parameters()."
            )


def table_info(param: torch.Tensor) -> TableInfo | None:
    """The :class:`TableInfo` of ``param``, or ``None`` for an ordinary (dense) parameter."""
    if torch.compiler.is_compiling():  # an attribute dynamo traces (the dictionary it cannot)
        return _tag(param, _INFO_ATTR)  # type: ignore[no-any-return]
    return _registered(param, _INFO_ATTR)  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class StackedRows:
    """What ``ec.tables.<name>.weight`` of a stacked table is: rows ``[offset, offset + rows)`` of the
    logical rows of its group's parameter ``weight`` (``logical`` maps the stored rows of a tensor
    shaped like ``weight`` to logical order)."""

    table: str
    group: str
    offset: int
    rows: int
    weight: torch.Tensor
    logical: Callable[[torch.Tensor], torch.Tensor]

    def of(self, whole: torch.Tensor) -> torch.Tensor:
        """This table's rows of ``whole``, a tensor stored like the group's weight."""
        return self.logical(whole)[self.offset : self.offset + self.rows]


def register_view(view: torch.Tensor, rows: StackedRows) -> torch.Tensor:
    """Mark ``view`` as a stacked table's rows (see :func:`stacked_rows`); returns ``view``."""
    view.__dict__[_ROWS_ATTR] = _Tag(rows, view)
    return view


def refuse_stacked_view(p: Any, argument: str, use: str, remedy: str) -> None:
    r"""Raise if ``p`` is a stacked table's ``weight`` (a view of its group's rows), which cannot be
    ``use``\ d on its own; ``remedy`` says what to do instead."""
    rows = stacked_rows(p) if isinstance(p, torch.Tensor) else None
    if rows is not None:
        raise ValueError(
            f"Argument `{argument}` holds the weight of table `{rows.table}`, which is stacked with other tables in "
            f"group `{rows.group}`: it is a view of the group's parameter and cannot be {use} on its own. Pass the "
            "module's parameters (e.g. ec.parameters() or split_parameters(model)), which hold the group's "
            f"parameter (ec.groups.{rows.group}.weight). {remedy}"
        )


def stacked_rows(t: torch.Tensor) -> StackedRows | None:
    """For the weight of a table stacked in a group (``ec.tables.<name>.weight``), where its rows are."""
    if torch.compiler.is_compiling():  # an attribute dynamo traces (the dictionary it cannot)
        return _tag(t, _ROWS_ATTR)  # type: ignore[no-any-return]
    return _registered(t, _ROWS_ATTR)  # type: ignore[no-any-return]


def exchange_mark(t: torch.Tensor) -> Any:
    """What ``tte.distributed`` marked table ``t`` with (a process group its row gradients are exchanged over,
    or a string: never exchanged, or :data:`GROUP_NOT_PICKLED`), or ``None`` (the default)."""
    if torch.compiler.is_compiling():  # an attribute dynamo traces (the dictionary it cannot: a compiled step under
        return _tag(t, _MARK_ATTR)  # an initialised process group read it in every step)
    return _registered(t, _MARK_ATTR)


def set_exchange_mark(t: torch.Tensor, value: Any) -> None:
    """Mark table ``t`` (``None``: lift the mark)."""
    if value is None:
        t.__dict__.pop(_MARK_ATTR, None)
    else:
        t.__dict__[_MARK_ATTR] = _Tag(value, t)


#: the mark of a table unpickled from one exchanged over a process group other than the default one, which a
#: pickle cannot hold: the table's exchange refuses until it is marked again
GROUP_NOT_PICKLED = "group not pickled"


class CarriedMark:
    """A table's :func:`exchange_mark` as a copy of its module carries it to the copy's new weight (the mark
    belongs to the model's table, as its registration does)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    @classmethod
    def of(cls, t: torch.Tensor) -> CarriedMark:
        return cls(exchange_mark(t))

    def put_on(self, t: torch.Tensor) -> None:
        set_exchange_mark(t, self.value)

    @staticmethod
    def move(old: torch.Tensor | None, new: torch.Tensor) -> None:
        """A table's new weight gets the mark of the ``old`` one it replaces (``load_state_dict(assign=True)``, a
        conversion that makes new parameters), unless it was marked itself: the mark is the table's."""
        if old is not None and old is not new and exchange_mark(new) is None:
            set_exchange_mark(new, exchange_mark(old))

    def __deepcopy__(self, memo: Any) -> CarriedMark:
        # A process group is a handle on the running processes, not data: a copy is exchanged over the same one.
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        value = self.value
        if not isinstance(value, str) and value is not None:
            # The default group is what an unmarked table is exchanged over; any other cannot be pickled, and
            # dropping it would exchange the unpickled table over the default group: different numbers, or a
            # wait where only some ranks make the copy.
            value = None if value is dist.group.WORLD else GROUP_NOT_PICKLED
        return (CarriedMark, (value,))
