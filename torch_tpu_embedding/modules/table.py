"""``EmbeddingTable``: one table's weight, its config, and the row padding used for sharding."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from torch_tpu_embedding._rows.dedup import is_static_device
from torch_tpu_embedding._rows.placement import dtensor_placement, process_group_placement
from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding._rows.row_order import RowLayout, from_logical, owned_logical_ids, to_logical
from torch_tpu_embedding._rows.stacked_state import member_entries
from torch_tpu_embedding._rows.tables import CarriedMark, TableInfo, register_table, retire_table, table_info
from torch_tpu_embedding._util.huge_pages import empty
from torch_tpu_embedding._util.in_place import apply_in_place, load_in_place, swapping
from torch_tpu_embedding.config import TableConfig, default_initializer
from torch_tpu_embedding.modules.deferred_init import DeferredDraw, defer, fill
from torch_tpu_embedding.modules.later_writes import later_writes

__all__ = ["EmbeddingTable", "host_empty", "write_rows"]


def host_empty(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: str | None = None) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on the host, on huge pages where large (``_util.huge_pages``: rows are
    read and written all over a table); an allocation failure names the table and its size. ``device``
    ``None``: the default device (meta under ``torch.device("meta")``, an XLA device under its context)."""
    try:
        return empty(shape, dtype, device)
    except (RuntimeError, MemoryError) as e:  # torch's CPU allocator raises RuntimeError
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raise MemoryError(
            f"Table `{name}`: cannot allocate its weight {list(shape)} {dtype} ({size / 2**30:.2f} GiB) in host "
            f"memory (tables are drawn on the host before they move to a device). Shrink num_embeddings or "
            f"embedding_dim, or free host memory. ({e})"
        ) from e


class EmbeddingTable(nn.Module):
    """One table: ``weight`` ``[num_embeddings, embedding_dim]`` plus its config.

    The weight is an ordinary ``nn.Parameter`` whose gradient arrives row-sparse in a
    :class:`~torch_tpu_embedding._rows.row_grad.RowGrad` (never in ``.grad``). It holds the rows in their
    stored order: logical order plus padding rows, or, for a row-sharded table trained through the id
    exchange, the interleaved order of ``row_layout`` (read logical rows with :meth:`logical_weight`
    or ``state_dict``).
    """

    def __init__(self, config: TableConfig, name: str, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.name = name
        #: the stored row order (``None``: logical); set by :meth:`permute_rows`
        self.row_layout: RowLayout | None = None
        #: built on the meta device: ``(first row, draw)`` of each table whose rows it holds, drawn later
        #: (:meth:`fill_rows`, ``tte.distributed.shard``); empty once drawn or when built with values
        self.deferred: tuple[tuple[int, DeferredDraw], ...] = ()
        if weight is None:
            self.weight = nn.Parameter(host_empty(name, (config.num_embeddings, config.embedding_dim), config.dtype))
            self.reset_parameters()
        else:  # initial values given (a stacked group stacks its tables' drawn weights)
            self.weight = nn.Parameter(weight)
        self._register()
        # Padding rows (added for even sharding) never reach a checkpoint.
        self._register_state_dict_hook(_trim_padding_rows)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_restore_padding_rows)  # type: ignore[no-untyped-call]

    @property
    def padding_rows(self) -> int:
        """Rows past ``num_embeddings`` that exist only so the rows split evenly over devices."""
        info = table_info(self.weight)
        if info is not None and info.sharding is not None and info.sharding.over_process_group:
            return 0  # one rank's shard of the table (tte.distributed.shard): its rows are saved as stored
        return int(self.weight.shape[0]) - self.config.num_embeddings

    def pad_rows(self, multiple: int) -> None:
        """Round the physical rows up to a multiple of ``multiple`` with zero rows (never looked up). Replaces
        ``weight`` with a new parameter: call before building the optimizer."""
        n = self.config.num_embeddings
        rows = -(-n // multiple) * multiple
        if rows == self.weight.shape[0]:
            return
        with torch.no_grad():
            w = self.weight
            pad = torch.zeros(rows - n, w.shape[1], dtype=w.dtype, device=w.device)
            self.weight = nn.Parameter(torch.cat([w[:n], pad]))
        self._register(f"its rows were padded to a multiple of {multiple} (a new parameter)")

    def permute_rows(self, layout: RowLayout) -> None:
        """Store the rows (padding included) in ``layout``'s order instead of the logical order.

        Replaces ``weight`` with a new parameter (call before building the optimizer); ``state_dict``
        and :meth:`logical_weight` still read logical rows.
        """
        if self.row_layout is not None:
            raise RuntimeError(f"Table `{self.name}` is already stored in a permuted row order.")
        with torch.no_grad():
            w = self.weight
            logical_of = layout.ownership(int(w.shape[0])).logical_id(torch.arange(w.shape[0]))
            self.weight = nn.Parameter(w.index_select(0, logical_of.to(w.device)))
        self.row_layout = layout
        self._register("its rows were stored in the id exchange's order (a new parameter)")

    def logical_weight(self) -> torch.Tensor:
        """The ``[num_embeddings, D]`` logical rows: a view of ``weight`` in logical order, else a copy
        gathered on the host."""
        return self.logical_rows(self.weight.detach())

    def logical_rows(self, stored: torch.Tensor) -> torch.Tensor:
        """``stored`` (rows in ``weight``'s stored order, e.g. an optimizer slot or moving average) in
        logical order, ``[num_embeddings, ...]``: a view, or a host copy for a permuted layout."""
        if self.row_layout is None:
            return stored[: self.config.num_embeddings]
        return to_logical(stored.cpu(), self.config.num_embeddings, self.row_layout)

    def members(self) -> tuple[tuple[str, int, int], ...] | None:
        """``(table name, first row, rows)`` of each table stacked in this one (``None``: just itself)."""
        return None

    def pending_row_grads(self, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This physical table's pending row gradient by user table (``name`` when nothing is stacked in
        it): ``(ids [N], rows [N, D])``, the contract of ``EmbeddingCollection.row_grads``."""
        if not self.row_grad:
            return {}
        members = self.members()
        ids, rows = self.row_grad.collect()
        if self.row_grad.owned:  # shard-local rows [n, M] -> the table's (or group's) logical ids, [n·M]
            assert self.row_layout is not None  # owner-local chunks exist only on tables so laid out
            ids = owned_logical_ids(ids, self.row_layout, int(self.weight.shape[0]), int(self.weight.shape[0]))
            ids, rows = ids.reshape(-1), rows.reshape(-1, rows.shape[-1])
        if members is None:
            # Padding: the sentinel weight.shape[0] is past the rows a sharded table pads to split evenly.
            return {name: (ids.clamp(max=self.config.num_embeddings), rows)}
        pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for tname, off, n in members:
            if is_static_device(ids.device):  # the group's entries, the other tables' as padding
                pending[tname] = member_entries(ids, rows, off, n, n)
                continue
            mine = (ids >= off) & (ids < off + n)
            if tname in self.row_grad.reached or bool(mine.any()):  # reached: bags all empty, as unstacked
                pending[tname] = (ids[mine] - off, rows[mine])
        return pending

    def _register(self, replaced: str = "the table's weight parameter was replaced by a new one (a move to "
                  "another device, load_state_dict(assign=True))") -> TableInfo:
        """Register ``weight`` as this table's; the weight registered before, if another tensor, is
        retired with the reason ``replaced`` (an optimizer still holding it must not train it silently)."""
        ref = self.__dict__.get("_registered_weight")
        old = None if ref is None else ref()
        if old is not None and old is not self.weight:
            retire_table(old, replaced)
        self.__dict__["_registered_weight"] = weakref.ref(self.weight)
        CarriedMark.move(old, self.weight)  # (a conversion that made new parameters: torch's overwrite_module_params)
        spread = None if old is None else process_group_placement(old)
        if old is not self.weight and spread is not None:
            # One rank's rows of a table sharded over a process group (tte.distributed.shard), moved or cast:
            # still those rows, with that layout (else its lookups would read the shard as a whole table).
            info = register_table(self.weight, self.name, int(self.weight.shape[0]), self.config.optimizer)
            info.sharding = spread
            return info
        return register_table(
            self.weight, self.name, self.config.num_embeddings, self.config.optimizer, self.members(),
            self.row_layout,
        )

    def reset_parameters(self) -> None:
        """Fill the weight from the config's initializer: in place for a CPU table (no second buffer
        of its size); drawn on the CPU and then copied for a device table. A table on the meta device
        records its draw instead (:mod:`torch_tpu_embedding.modules.deferred_init`) and is drawn by
        :meth:`fill_rows`."""
        init = self.config.initializer
        with torch.no_grad():
            w = self.weight.detach()
            if w.is_meta:  # built under torch.device("meta"): recorded now, each rank draws its rows later
                self.deferred = ((0, defer(self.name, self.config)),)
                return
            in_place = w.device.type == "cpu" and w.is_contiguous()
            # On the CPU whatever the default device (under `with torch.device(xla):` too): one seed, one table
            host = w if in_place else host_empty(self.name, tuple(w.shape), w.dtype, "cpu")
            if init is None:
                default_initializer(host)
            elif isinstance(init, torch.Tensor):
                host.copy_(init)
            else:
                _call_initializer(self.name, init, host)
            if not in_place:
                w.copy_(host)

    def fill_rows(self, out: torch.Tensor, local_row: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Draw into ``out`` ``[rows, D]`` (zeroed first) the rows of this table built on the meta device
        that ``local_row`` places (logical ids ``[k]`` → rows of ``out``; a row outside ``out``: not
        written): exactly the values one process draws with the same seed, one chunk at a time. Returns
        ``out``.

        Raises:
            RuntimeError: the table recorded no draw (it was not built on the meta device: moved there,
                its values are gone).
        """
        self.require_draws()
        with torch.no_grad():
            out.zero_()  # padding rows
            for first, draw in self.deferred:
                fill(draw, out, functools.partial(_shifted, local_row, first))
        return out

    def require_draws(self) -> None:
        """Raise ``RuntimeError`` unless this table, on the meta device, recorded its draw."""
        if not self.deferred:
            raise RuntimeError(
                f"Table `{self.name}` is on the meta device without a recorded draw: it was moved there "
                "(its values are gone), not built there. Build the model under `with torch.device('meta'):` "
                "(or EmbeddingCollection(..., device='meta')), or build it with its values."
            )

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get("_parameters", {}).get("weight") if name == "weight" else None
        if name == "weight" and isinstance(value, nn.Parameter):
            # A weight set as the module's (load_state_dict(assign=True), `table.weight = ...`) becomes the table's
            # at its first use; one put in place for a call (torch.func.functional_call writes `_parameters`) is not.
            self.__dict__["_assigned_weight"] = id(value)
            CarriedMark.move(old, value)  # tte.distributed's mark: the old weight may be gone by the first use
        super().__setattr__(name, value)
        if old is not None and old is not value and process_group_placement(old) is not None:
            self._register()  # one rank's rows (tte.distributed.shard): their layout carried while `old` lives

    @property
    def row_grad(self) -> RowGrad:
        info = table_info(self.weight)
        if info is None and self.__dict__.get("_assigned_weight") != id(self.weight):
            info = self._substituted()
        elif info is None:  # the Parameter object was replaced (load_state_dict with assign=True)
            info = self._register()
        return info.row_grad

    def _substituted(self) -> TableInfo:
        """The info of a tensor in place of the weight for one call (``torch.func.functional_call``), not
        registered: looked up as the table, whose own weight stays registered (an optimizer still trains it). A
        gradient for it is refused: a table's gradient is row-sparse and reaches only the table's own parameter."""
        # (torch.export traces with fake parameters in place of the weights, under grad: nothing to refuse there)
        if self.weight.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            members = self.members()  # (the user's tables: a stacked group's name is not theirs)
            tables = f"Tables {', '.join(f'`{m[0]}`' for m in members)} (stacked together)" if members \
                else f"Table `{self.name}`"
            raise RuntimeError(
                f"{tables}: a tensor substituted for the weight (torch.func.functional_call, "
                "torch.nn.utils.stateless) cannot get a gradient: a table's gradient is row-sparse and reaches "
                "only the table's own parameter, for the optimizer. Look up under torch.no_grad() (or with "
                "tensors that do not require grad) to read with other values; to train them, load them into "
                "the table (load_state_dict)."
            )
        # Not registered: the tensor is the caller's, and it stays theirs (the next call is checked again)
        return TableInfo(self.name, self.config.num_embeddings, self.config.optimizer, members=self.members(),
                         layout=self.row_layout)

    def __getstate__(self) -> dict[str, Any]:
        # What the library knows about the weight lives beside it, keyed by the tensor (_rows): a copy or an unpickled
        # module gets new tensors, registered again in __setstate__ (with the layout and tte.distributed's mark).
        state = dict(self.__dict__)
        state.pop("_registered_weight", None)  # a weak reference: neither copied nor pickled
        info = table_info(self.weight)
        state["_tte_sharding"] = None if info is None else info.sharding
        state["_tte_exchange"] = CarriedMark.of(self.weight)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        sharding = state.pop("_tte_sharding", None)
        carried = state.pop("_tte_exchange", CarriedMark(None))  # (absent: pickled before marks were carried)
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._register().sharding = sharding
        carried.put_on(self.weight)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> EmbeddingTable:
        old = self.weight
        try:
            if swapping():  # (torch's swap of tensors refuses the weight: written in place, _util/in_place.py)
                apply_in_place(self, fn)
            else:
                super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        except NotImplementedError as e:
            if not old.is_meta:
                raise
            raise RuntimeError(  # torch's "Cannot copy out of meta tensor", with the table's name and the ways out
                f"Table `{self.name}` is on the meta device and holds no values: .to() / .cuda() / .float() "
                "cannot copy it. Use model.to_empty(device=...) (the table drawn whole, as one process draws it) "
                f"or tte.distributed.shard(model, device=...) (each rank draws its rows). Received: {e}"
            ) from None
        if old.is_meta and not self.weight.is_meta and self.deferred:
            # to_empty() of a table built on the meta device: the whole table, as one process draws it
            self.fill_rows(self.weight.detach(), lambda ids: ids)
            self.deferred = ()
        if self.weight is not old or table_info(self.weight) is None:
            self._register()
        return self

    def _load_from_state_dict(self, *args: Any) -> None:
        load = functools.partial(super()._load_from_state_dict, *args)
        if swapping():  # (torch's swap of tensors refuses the weight: written in place, _util/in_place.py)
            load_in_place(self, "weight", load, *args)
        else:
            load()

    def extra_repr(self) -> str:
        c = self.config
        pad = f", padding_rows={self.padding_rows}" if self.padding_rows else ""
        return (
            f"name={self.name!r}, num_embeddings={c.num_embeddings}, "
            f"embedding_dim={c.embedding_dim}, combiner={c.combiner!r}, dtype={c.dtype}{pad}"
        )


def _call_initializer(name: str, init: Callable[[torch.Tensor], Any], host: torch.Tensor) -> None:
    """Fill ``host`` (table ``name``'s ``[V, D]`` weight on the host, uninitialised) with ``init``: in place
    (torch.nn.init style), or from the ``[V, D]`` tensor it returns (TF style, the values returned).

    An initializer that does neither would leave uninitialised memory in the table. The first and last
    elements are set to NaN before the call: both still NaN after it (and no values returned) means it wrote
    nothing there (``lambda t: None``, ``lambda t: t``) or only scaled what was there (``t.mul_(0.1)``), and
    is refused. Two elements read, no pass over the table; writes through ``.data`` or ``.numpy()`` count.
    """
    host[0, 0] = host[-1, -1] = float("nan")
    label = getattr(init, "__name__", init)
    try:
        result = init(host)
    except TypeError as e:
        # TF calls initializer(shape, dtype=...); such a function called here fails inside itself or in
        # torch, with an error that names neither the table nor the contract.
        raise TypeError(
            f"Table `{name}`: its initializer {label!r} failed when called as initializer(weight) with the "
            f"{list(host.shape)} weight tensor to fill in place ({e}). TF's initializer(shape, dtype) form is not "
            "taken: write it as a function of the tensor (torch.nn.init style), or pass a "
            "[num_embeddings, embedding_dim] tensor of values."
        ) from e
    shape = tuple(host.shape)
    if result is not None and not isinstance(result, torch.Tensor):
        raise TypeError(
            f"Table `{name}`: its initializer {label!r} returned a {type(result).__name__}, which is neither the "
            f"values (a {shape} torch.Tensor) nor None. Fill the tensor it is given in place (returning it or "
            f"None), or return a torch.Tensor of shape {shape} (e.g. torch.as_tensor(values))."
        )
    if result is not None and not _same_memory(result, host):
        if tuple(result.shape) != shape:
            raise ValueError(
                f"Table `{name}`: the initializer returned shape {tuple(result.shape)}, expected {shape}."
            )
        if result.is_meta or result.layout != torch.strided or result.is_complex():
            raise ValueError(
                f"Table `{name}`: its initializer {label!r} returned a {result.dtype} {result.layout} tensor "
                f"on {result.device}; the values must be a dense real tensor off the meta device."
            )
        host.copy_(result)
        return
    if bool(host[0, 0].isnan() & host[-1, -1].isnan()):
        what = "None" if result is None else "the tensor it was given"
        raise ValueError(
            f"Table `{name}`: its initializer {label!r} neither filled the {list(shape)} weight tensor it was "
            f"given in place nor returned a tensor of values (it returned {what}; the tensor's first and last "
            "elements still hold the NaN put there to see whether it writes), so the table would hold uninitialised "
            "memory. Fill the tensor in place (torch.nn.init style, e.g. functools.partial(torch.nn.init.normal_, "
            f"std=0.01)), return a tensor of shape {shape}, or pass the values as initializer=<tensor>."
        )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b``, or a tensor on its very memory (``b.data``, a full view): nothing to copy."""
    return a is b or (
        a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def _shifted(local_row: Callable[[torch.Tensor], torch.Tensor], first: int, ids: torch.Tensor) -> torch.Tensor:
    """``local_row`` of a stacked table's ids, ``first`` rows into its group."""
    return local_row(ids + first)


def _dtensor_sharding(table: EmbeddingTable) -> Any:
    """The process-group layout of a table whose ``state_dict`` is a DTensor (``shard(..., dtensor_state_dict=
    True)``), else ``None``: the one flag on its layout, which the optimizer reads too."""
    return dtensor_placement(table.weight)


def _trim_padding_rows(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    table = cast(EmbeddingTable, module)
    key = prefix + "weight"
    spread = _dtensor_sharding(table)
    if key in state_dict and spread is not None:  # a collective: every rank's state_dict() together
        state_dict[key] = spread.to_logical(state_dict[key])
    elif key in state_dict and table.row_layout is not None:  # permuted: logical rows gathered on the host
        state_dict[key] = table.logical_weight()
    elif key in state_dict and table.padding_rows:
        state_dict[key] = state_dict[key][: table.config.num_embeddings]


def _restore_padding_rows(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
    missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    table = cast(EmbeddingTable, module)
    key = prefix + "weight"
    value = state_dict.get(key)
    later = later_writes()
    if later is not None and later.is_stand_in(value):  # a stacked group's weight, written later
        return
    spread = _dtensor_sharding(table)
    if spread is not None and isinstance(value, torch.Tensor):  # a collective, as state_dict(): a DTensor moved;
        # a plain tensor (the stored rows) agreed on, so that one given on some ranks only raises on every rank
        state_dict[key] = spread.from_logical(value, table.name)
        return
    logical = (table.config.num_embeddings, table.config.embedding_dim)
    if table.padding_rows and table.members() is None and isinstance(value, torch.Tensor) \
            and tuple(value.shape) != logical:
        # A table padded for the mesh (tte.xla.shard) holds [num_embeddings, D] as the CPU does; compared with
        # the padded weight, a tensor of the padded row count would load (its rows taken as stored: permuted).
        error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                          f"checkpoint, the shape in current model is {logical}.")
        state_dict[key] = table.weight.detach()  # (nothing written)
        return
    if later is not None and spread is None and isinstance(value, torch.Tensor):
        # tte.checkpoint.load: written once the user's load code has run (modules/later_writes.py)
        state_dict[key] = later.stand_in(table.weight)
        later.later(functools.partial(write_rows, table, value, key))
        return
    stored = _stored_rows(table, value)
    if stored is not value:
        state_dict[key] = stored


def _stored_rows(table: EmbeddingTable, value: Any) -> Any:
    """``value`` as ``table.weight`` stores it: logical rows get the padding rows (zero) and the row order."""
    n = table.config.num_embeddings
    if table.padding_rows and isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[0] == n:
        pad = torch.zeros(table.padding_rows + n, value.shape[1], dtype=value.dtype, device=value.device)
        return from_logical(value, pad, table.row_layout)  # padding rows are zero
    return value


def write_rows(table: EmbeddingTable, value: torch.Tensor, key: str) -> None:
    """Write ``value`` (the table's logical rows, or its rows as stored) into ``table.weight`` as
    ``load_state_dict`` writes it (``key``: its name there, for the error)."""
    stored = _stored_rows(table, value)
    if tuple(stored.shape) != tuple(table.weight.shape):
        raise RuntimeError(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                           f"checkpoint, the shape in current model is {tuple(table.weight.shape)}.")
    with torch.no_grad():
        table.weight.copy_(stored)
