"""The two interfaces the backends implement, so that nothing below the public face imports a backend.

A table is placed by a backend: :func:`torch_tpu_embedding.xla.shard` (SPMD over a device mesh) or
:func:`torch_tpu_embedding.distributed.shard` (a ``torch.distributed`` process group) records a
:class:`TablePlacement` on the table (``TableInfo.sharding``); a table without one is on one device. The
optimizer core, the lookup, clipping and the checkpoints ask that object, never the backend's modules:

* its shape: :attr:`~TablePlacement.placement`, :attr:`~TablePlacement.num_shards`,
  :attr:`~TablePlacement.row_block`, and how its lookups run (:attr:`~TablePlacement.exchange`: the SPMD
  id exchange, rows updated where they live; :attr:`~TablePlacement.over_process_group`;
  :meth:`~TablePlacement.routed_lookup`);
* reductions over the table's shards (:meth:`~TablePlacement.reduction_group`, and inside an SPMD
  manual-sharding region :meth:`~TablePlacement.on_shards`, :meth:`~TablePlacement.all_reduce`,
  :meth:`~TablePlacement.row_sharded`);
* how its state is saved (:meth:`~TablePlacement.to_logical`, :meth:`~TablePlacement.from_logical`: the
  process group's DTensor form; :meth:`~TablePlacement.move_failed`: a refused load's part in the move;
  :meth:`~TablePlacement.state_checked`: an optimizer's loaded state agreed on before it is written).

What depends on the device a tensor lives on rather than on a placement (an XLA table's optimizer slots
laid out like it, several lazy XLA tensors computed in one graph, DCP's planners for XLA tensors) is a
:class:`DeviceBackend`, registered per device type by the backend's package (:func:`register_device`) and
found with :func:`device_backend`. Data parallel's exchange of row gradients before a step is a hook the
process-group package installs (:func:`install_row_grad_sync`), run by every optimizer step, and so is its
agreement on each training lookup (:func:`install_lookup_agreement`, run by :func:`lookup_starts` and
:func:`lookup_failed`).

The collectives here (:func:`all_reduce_sum`, :func:`all_true`) are ``torch.distributed``'s: a process
group is a value the placement carries, and these need no backend.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torch_tpu_embedding._rows.tables import table_info

__all__ = [
    "DeviceBackend",
    "Sizes",
    "TablePlacement",
    "all_reduce_sum",
    "all_true",
    "device_backend",
    "dtensor_placement",
    "process_group_placement",
    "register_optimizer",
    "registered_optimizers",
    "install_lookup_agreement",
    "install_row_grad_sync",
    "lookup_failed",
    "lookup_starts",
    "is_dtensor",
    "reduction_group",
    "register_device",
    "stored_rows",
    "stored_rows_active",
    "sync_row_grads",
]

Tensor = torch.Tensor


class TablePlacement:
    """How a table's rows are placed over devices or processes: what the layers below the public face may
    ask of it. Each backend subclasses it (``xla.TableSharding``, ``distributed``'s ``GroupSharding``); the
    defaults are those of a table that is whole on every device it is used on.

    Example::

        >>> from torch_tpu_embedding._rows.placement import TablePlacement
        >>> class OnOneDevice(TablePlacement):
        ...     placement = "replicated"
        >>> OnOneDevice().num_shards, OnOneDevice().reduction_group()
        (1, None)
    """

    #: ``"row"``, ``"column"``, ``"replicated"`` or ``"table"`` (the whole table on one process)
    placement: str
    #: trained through the SPMD id exchange: lookups route ids to the shards that own them, the gradient
    #: arrives there and each shard updates its own rows (``TableInfo.owner_local``)
    exchange: bool = False
    #: sharded over a ``torch.distributed`` process group (lookups through :meth:`routed_lookup`)
    over_process_group: bool = False
    #: the table's logical rows (declared here; set by the process-group backend, which stores a shard)
    rows: int

    @property
    def num_shards(self) -> int:
        """Over how many devices or processes the table's rows (or columns) are split."""
        return 1

    @property
    def row_block(self) -> int:
        """Physical rows are a multiple of this."""
        return 1

    #: the table's ``state_dict`` entry and its optimizer's row slots are DTensors of the logical rows
    dtensor_state_dict: bool = False

    def routed_lookup(
        self, table: str, weight: Tensor, configured: int | None, features: list[str], counts: dict[str, Any],
    ) -> Any:
        """The lookup of a table placed this way for one forward call (where ``TableInfo.routed``)."""
        raise NotImplementedError(f"{type(self).__name__} has no routed lookup")

    def lookup_failed(self, device: torch.device) -> None:
        """Called by a forward that failed before its first routed lookup, with this table's (the first one's)
        device: a process group's ranks agree on each step before its first collective, and the failed rank
        takes part in that agreement so that the others raise at the same step. Nothing to do elsewhere."""

    def spec(self, dim: int, rows: bool = True) -> tuple[str | None, ...]:
        """The partition spec of a ``dim``-d tensor laid out like the table (``rows``: dim 0 = rows)."""
        return (None,) * dim

    # Sums over the rows of a table whose rows are split over processes (clipnorm, Adafactor's statistics).
    def reduction_group(self) -> Any:
        """The process group over which the table's rows are split, else ``None``: what the optimizer sums
        over the table's rows is then all-reduced over it."""
        return None

    #: the process group a table placed over one lives on (declared here, set by that backend)
    group: Any

    # The SPMD owner-local path: each shard updates its own rows inside one manual-sharding region.
    def on_shards(self, fn: Callable[..., list[Tensor]], sharded: Mapping[str, Tensor], small: Mapping[str, Tensor],
                  inputs: Sequence[Tensor], replicated: Sequence[Tensor | None]) -> list[Tensor]:
        """Run ``fn`` on every shard's part of ``sharded``/``inputs`` (the SPMD owner-local path)."""
        raise NotImplementedError(f"{type(self).__name__} has no shard-local regions")

    def all_reduce(self, x: Tensor) -> Tensor:
        """Inside :meth:`on_shards`: ``x`` summed over the shards."""
        raise NotImplementedError(f"{type(self).__name__} has no shard-local regions")

    def row_sharded(self, t: Tensor) -> Tensor:
        """``t [n, ...]`` laid out with dim 0 over the table's shards (device-major buffers)."""
        raise NotImplementedError(f"{type(self).__name__} has no shard-local regions")

    # How the state is saved (a process group's DTensor form of the logical rows).
    def to_logical(self, local: Tensor, slot: bool = False) -> Any:
        """This process's stored rows of the table (or of a row slot) as the saved form of the logical rows."""
        raise NotImplementedError(f"{type(self).__name__} saves no DTensors")

    def from_logical(self, value: Any, name: str, base: Tensor | None = None, slot: bool = False) -> Tensor:
        """The saved form of the logical rows as this process's stored rows (``base``: their dtype). A plain
        tensor (not the saved form) is this process's stored rows, given so on every process: returned as it
        is once the processes agree that none was given the saved form instead."""
        raise NotImplementedError(f"{type(self).__name__} loads no DTensors")

    def move_failed(self, device: torch.device) -> None:
        """This process refuses a saved state whose rows it would have moved with :meth:`from_logical`: it takes
        part in the move's agreement as failed (with a tensor on ``device``), so that the other processes raise
        there instead of waiting for it. The caller then raises its own error. Nothing to do elsewhere."""

    def state_checked(self, device: torch.device, failed: bool) -> None:
        """A saved state of an optimizer holding this table, read (its saved form moved, if any) and checked
        on this process, ``failed`` or not, before anything is written: the processes agree on it (with a
        tensor on ``device``), so that where one refuses its state every other raises too, naming it, and
        where one was given the saved form and another plain tensors (nothing to move) they raise at the first
        move. The caller raises its own error when ``failed``. Nothing to do elsewhere."""

    def gather_whole(self, local: Tensor) -> Tensor:
        """This process's stored rows of the table as its whole ``[V, D]`` logical rows, the same on every
        process (a collective: every process calls it, in the same order)."""
        raise NotImplementedError(f"{type(self).__name__} gathers no rows")

    def stored_from_whole(self, value: Tensor, name: str, base: Tensor) -> Tensor:
        """The rows this process stores of the table, from ``value``, its whole ``[V, D]`` logical rows given
        alike on every process (a collective; ``base``: the stored rows now, their dtype and device)."""
        raise NotImplementedError(f"{type(self).__name__} scatters no rows")

    def whole_to_saved(self, value: Tensor) -> Tensor:
        """An optimizer slot of the whole table (not per row) as saved: the same on every process."""
        raise NotImplementedError(f"{type(self).__name__} saves no DTensors")

    def whole_from_saved(self, value: Tensor, live: Tensor | None) -> Tensor:
        """A saved slot of the whole table as this process keeps it (``live``: its slot now)."""
        raise NotImplementedError(f"{type(self).__name__} loads no DTensors")

    def pending_to_logical(self, ids: Tensor | None, rows: Tensor | None, k: int, width: int,
                           dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """A pending accumulation window (``[k, cap]`` ids of the stored rows, their rows) as saved: every
        process's, in logical ids."""
        raise NotImplementedError(f"{type(self).__name__} saves no DTensors")

    def pending_from_logical(self, ids: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The inverse of :meth:`pending_to_logical` for this process."""
        raise NotImplementedError(f"{type(self).__name__} loads no DTensors")


def process_group_placement(p: Tensor) -> TablePlacement | None:
    """The placement of table parameter ``p`` when it is sharded over a process group, else ``None``."""
    info = table_info(p)
    sharding = None if info is None else info.sharding
    return sharding if sharding is not None and sharding.over_process_group else None


def lookup_failed(weights: Iterable[Tensor], training: bool = False) -> None:
    """A forward refused its inputs before any table was looked up: the first routed table among ``weights``
    (in the order the forward looks them up) tells its placement (:meth:`TablePlacement.lookup_failed`). Over a
    process group the other ranks' first collective of the step is that table's, so they raise at this step
    too instead of pairing it with this rank's next. Without a routed table, a ``training`` forward (module in
    training mode, gradients on) takes part in data parallel's agreement instead (:func:`lookup_starts`). The
    caller raises its own error, whatever this meets."""
    weights = list(weights)
    for w in weights:
        info = table_info(w)
        if info is not None and info.sharding is not None and info.routed:
            with contextlib.suppress(Exception):
                info.sharding.lookup_failed(w.device)
            return
    if training:
        for agree in _LOOKUP_AGREEMENTS:
            with contextlib.suppress(Exception):
                agree(lambda: weights, True, lambda: None)


#: a lookup's static sizes: the shapes of its id tensors, ``None`` where some are jagged (counts follow the data)
Sizes = Callable[[], tuple[tuple[int, ...], ...] | None]
_LOOKUP_AGREEMENTS: list[Callable[[Callable[[], list[Tensor]], bool, Sizes], None]] = []


def install_lookup_agreement(agree: Callable[[Callable[[], list[Tensor]], bool, Sizes], None]) -> None:
    """Install data parallel's agreement on each training lookup, ``agree(weights, failed, sizes)`` (``weights()``:
    the forward's tables, ``sizes()``: the shapes of its ids, each asked for only where a process group needs
    them), run by :func:`lookup_starts` and :func:`lookup_failed` (once)."""
    if agree not in _LOOKUP_AGREEMENTS:
        _LOOKUP_AGREEMENTS.append(agree)


def lookup_starts(weights: Callable[[], list[Tensor]], training: bool, sizes: Sizes = lambda: None) -> None:
    """A ``training`` forward accepted its inputs and is about to look ``weights()`` up: the installed agreements
    run (the process-group package's: over a data-parallel group, every rank's training lookup of a step meets
    the others' before the step's first collective, and raises there when another rank's failed, the failed rank
    taking part through :func:`lookup_failed`, or when the ranks' ``sizes()`` differ where the row gradients are
    exchanged at static sizes). Routed tables' lookups agree on each step themselves."""
    if training:
        for agree in _LOOKUP_AGREEMENTS:
            agree(weights, False, sizes)


def reduction_group(p: Tensor) -> Any:
    """The process group over which ``p``'s rows are split, else ``None`` (:meth:`TablePlacement.reduction_group`)."""
    info = table_info(p)
    return None if info is None or info.sharding is None else info.sharding.reduction_group()


def dtensor_placement(p: Tensor) -> TablePlacement | None:
    """The placement of table parameter ``p`` when its table's state goes to torch's helpers as DTensors
    (``dtensor_state_dict``, outside :func:`stored_rows`), else ``None``: what the table's state-dict hooks
    and the optimizer's torch-form state both ask."""
    s = process_group_placement(p)
    return s if s is not None and s.dtensor_state_dict and not stored_rows_active() else None


class DeviceBackend(Protocol):
    """What a device type's backend does for tensors on it (registered with :func:`register_device`)."""

    def materialize(self, tensors: Sequence[Tensor]) -> None:
        """Compute pending ``tensors`` in one graph."""

    def slot_extra_rows(self, table: Tensor, k: int) -> int:
        """Trash rows of a table's row-indexed optimizer slot ``k`` (1-based)."""

    def shard_slot(self, param: Tensor, slot: Tensor, rows: bool) -> None:
        """Give an optimizer slot its parameter's layout (``rows``: dim 0 indexes the parameter's rows)."""

    def dcp_planner(self, kind: str) -> Any:
        """``torch.distributed.checkpoint``'s planner ``kind`` (``"SPMDSavePlanner"``, ...) for these tensors."""


_DEVICES: dict[str, Callable[[], DeviceBackend]] = {}
_LOADED: dict[str, DeviceBackend] = {}


def register_device(device_type: str, load: Callable[[], DeviceBackend]) -> None:
    """Register the backend of ``device_type`` tensors; ``load`` is called on first use (it may import an
    optional dependency then: torch_xla for ``"xla"``)."""
    _DEVICES[device_type] = load
    _LOADED.pop(device_type, None)


def device_backend(device_type: str) -> DeviceBackend:
    """The registered backend of ``device_type`` tensors (loaded on the first call, then kept)."""
    backend = _LOADED.get(device_type)
    if backend is None:
        try:
            load = _DEVICES[device_type]
        except KeyError:
            raise RuntimeError(f"no backend is registered for {device_type!r} tensors") from None
        backend = _LOADED[device_type] = load()
    return backend


_ROW_GRAD_SYNC: list[Callable[[list[dict[str, Any]]], None]] = []


def install_row_grad_sync(sync: Callable[[list[dict[str, Any]]], None]) -> None:
    """Install data parallel's exchange of row gradients, run at the start of every optimizer step (once)."""
    if sync not in _ROW_GRAD_SYNC:
        _ROW_GRAD_SYNC.append(sync)


#: this process's optimizers (:func:`register_optimizer`), in the order they were built
_OPTIMIZERS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_BUILT = itertools.count()


def register_optimizer(optimizer: Any) -> None:
    """Record ``optimizer`` (a :mod:`torch_tpu_embedding.optim` optimizer the user built): the process-group
    package agrees on the optimizers of the tables it exchanges (:func:`registered_optimizers`). Weakly held."""
    _OPTIMIZERS[optimizer] = next(_BUILT)


def registered_optimizers() -> list[Any]:
    """The optimizers :func:`register_optimizer` recorded that are alive, in the order they were built."""
    return sorted(_OPTIMIZERS.keys(), key=lambda o: _OPTIMIZERS.get(o, 0))


def sync_row_grads(param_groups: list[dict[str, Any]]) -> None:
    """Run the installed row-gradient exchanges over ``param_groups`` (none installed: nothing)."""
    for sync in _ROW_GRAD_SYNC:
        sync(param_groups)


def all_reduce_sum(x: Tensor, group: Any) -> Tensor:
    """``x`` summed over ``group`` (a new tensor; ``x`` is left as it is)."""
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_true(flag: Tensor, group: Any) -> Tensor:
    """A 0-d bool ``flag`` and-ed over ``group``."""
    out = flag.to(torch.int32).reshape(1)
    dist.all_reduce(out, op=dist.ReduceOp.MIN, group=group)
    return out.reshape(()) > 0


_LOCAL = threading.local()


@contextlib.contextmanager
def stored_rows() -> Iterator[None]:
    """Inside, ``state_dict`` / ``load_state_dict`` of a sharded table are its rows as stored, never the
    DTensor (no collective): for code that calls them on some ranks only, as
    ``tte.distributed.save_sharded``'s rank 0 does, and that reads and writes the stored rows itself."""
    before = getattr(_LOCAL, "on", False)
    _LOCAL.on = True
    try:
        yield
    finally:
        _LOCAL.on = before


def stored_rows_active() -> bool:
    """True inside :func:`stored_rows`."""
    return bool(getattr(_LOCAL, "on", False))


def is_dtensor(value: Any) -> bool:
    """True for a DTensor (what ``torch.distributed.checkpoint`` loads a sharded entry into)."""
    return isinstance(value, DTensor)
