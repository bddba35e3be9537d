"""``tte.distributed.shard``: a collection's tables laid out over a ``torch.distributed`` process group.

The counterpart of :func:`torch_tpu_embedding.xla.shard` for ``torchrun`` processes (one process per
device: CPU/gloo, GPUs/NCCL, TorchTPU's ``tpu_dist``). Each table's ``TableConfig.placement``:

* ``"row"``: the rows split over the ranks in the interleaved order of the SPMD exchange (physical rows
  padded to a multiple of ``lcm(512, n)``, :class:`~torch_tpu_embedding.routing.RowOwnership`
  ``"interleaved"``): each rank stores ``R / n`` rows and the optimizer slots of those rows only;
* ``"table"``: the whole table on one rank (TorchRec's table-wise), chosen by :func:`assign_tables`;
  the other ranks store none of it;
* ``"replicated"``: every rank holds the table: data parallel (:mod:`torch_tpu_embedding.distributed`),
  row gradients exchanged over the group;
* ``"auto"``: the rule of the SPMD path: replicated below ``replicate_below_bytes``, else ``"row"``;
* ``"column"`` (the embedding dimension split) exists only under torch_xla SPMD and is refused.

Row- and table-sharded tables are looked up through :mod:`torch_tpu_embedding.distributed.routed` (ids to
their owners and rows back by ``all_to_all_single``); their gradients reach the owners, whose
optimizer updates its rows with the same per-row rules. Stacked tables that get sharded are
unstacked first (each is laid out alone); replicated tables stay stacked.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_tpu_embedding._rows.routing import RowOwnership
from torch_tpu_embedding._rows.tables import register_table, stacked_rows, table_info
from torch_tpu_embedding._util.validation import arg_error, check_bool, check_device, check_int
from torch_tpu_embedding.config import DEFAULT_REPLICATE_BELOW_BYTES, TableConfig, auto_placement, table_bytes
from torch_tpu_embedding.distributed.exchange import group_sharding
from torch_tpu_embedding.distributed.grad_sync import mark, spmd_active
from torch_tpu_embedding.distributed.routed import ProcessGroupLayout
from torch_tpu_embedding.distributed.state import check_whole_tables
from torch_tpu_embedding.modules.collection import EmbeddingCollection
from torch_tpu_embedding.modules.stacking import TableView, plan_groups
from torch_tpu_embedding.modules.table import EmbeddingTable

__all__ = [
    "DEFAULT_REPLICATE_BELOW_BYTES",
    "ROW_ALIGNMENT",
    "assign_tables",
    "group_placement",
    "logical_ids",
    "shard",
]

#: Row-sharded tables get physical rows up to a multiple of ``lcm(ROW_ALIGNMENT, n)``, as on the SPMD
#: path (``torch_tpu_embedding.xla.sharding.ROW_ALIGNMENT``): the same interleaved row order.
ROW_ALIGNMENT = 512
#: how long shard() waits for the other ranks without a `timeout`: torch's default for a new group
_DEFAULT_WAIT = "torch's default timeout (30 minutes on gloo)"
#: shard()'s groups over the default group by the `timeout` they wait: (that default group, the ranks' meeting
#: group, the exchange's group), made once (:func:`_meet`)
_GROUPS: dict[datetime.timedelta | None, tuple[Any, Any, Any]] = {}


def group_placement(name: str, config: TableConfig, world: int, replicate_below_bytes: int) -> str:
    """Table ``name``'s placement over a process group of ``world`` ranks (``"auto"`` resolved by size).

    Raises:
        ValueError: ``placement="column"``, which only torch_xla SPMD supports.
    """
    p = config.placement
    if p == "column":
        raise ValueError(
            f"Table `{name}`: placement 'column' (the embedding dimension split over devices) exists only under "
            "torch_xla SPMD (torch_tpu_embedding.xla.shard). Over a process group use 'row', 'table', "
            "'replicated' or 'auto'. Received: placement='column'"
        )
    if p != "auto":
        return p
    return auto_placement(config, world, replicate_below_bytes)


def assign_tables(sizes: dict[str, int], world: int) -> dict[str, int]:
    """The rank of each ``"table"``-placed table (``sizes``: name → bytes): largest first, each onto the
    rank with the fewest bytes so far (ties: the lower rank; equal sizes: in name order). The same on
    every rank (it reads only the configs)."""
    load = [0] * world
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += sizes[name]
    return out


def logical_ids(table: Any) -> torch.Tensor:
    """The logical id of each row this rank stores of a sharded table (an :class:`EmbeddingTable` or its
    weight): ``[rows stored]`` int64, ``>= num_embeddings`` at padding rows. For any other of the library's tables
    (one not sharded over a process group, a stacked table's ``collection.tables[name]``) ``arange(rows)``.

    Raises:
        ValueError: ``table`` is not one of the library's tables (a ``torch.nn.Linear``, a plain tensor).
    """
    if isinstance(table, EmbeddingTable | TableView):
        weight = table.weight
    elif isinstance(table, torch.Tensor) and (table_info(table) is not None or stacked_rows(table) is not None):
        weight = table
    else:
        what = type(table).__name__ + (f" of shape {list(table.shape)}" if isinstance(table, torch.Tensor) else "")
        raise arg_error("table", "must be one of the library's tables: an EmbeddingTable or TableView "
                        "(collection.tables[name]) or its weight", what)
    s = group_sharding(weight)
    return torch.arange(int(weight.shape[0])) if s is None else s.local_logical_ids()


def shard(
    module: nn.Module, group: Any = None, *, replicate_below_bytes: int = DEFAULT_REPLICATE_BELOW_BYTES,
    device: torch.device | str | None = None, dtensor_state_dict: bool = False,
    timeout: datetime.timedelta | None = None,
) -> dict[str, str]:
    """Lay the tables of every :class:`EmbeddingCollection` in ``module`` over the process group ``group``
    (default: the default group) by their placements; returns table name → placement (where collections hold
    tables of one name, such as two towers' default ``table_0``, each of those is keyed by its module path in
    ``module`` instead: ``"user_tower.tables.table_0"``, ``"item_tower.tables.table_0"``).

    Call it on every rank of the group, with the same model (the same seed: each rank keeps its rows of the
    tables it drew; with ``group`` given the exchange runs on that group, so give the DDP wrapper another
    one), after moving the model to its device and before wrapping it in
    :class:`~torch_tpu_embedding.distributed.DistributedDataParallel` and building the optimizer. Each
    rank's sharded tables are then its rows only (``weight`` ``[rows stored, D]``, their logical ids:
    :func:`logical_ids`; ``state_dict`` holds them as stored), and each rank's loss must be the mean
    over its equal share of the global batch, as under DDP.

    A model built on the meta device (``with torch.device("meta"):`` or ``EmbeddingCollection(...,
    device="meta")``) never holds a whole sharded table: each rank draws only its rows of each table
    here, on ``device`` (default: the CPU), one chunk of rows at a time, from the generator state the
    table recorded when it was built — exactly the rows one process draws with the same seed
    (:mod:`torch_tpu_embedding.modules.deferred_init`); replicated tables are drawn whole. ``device`` is used only for
    such tables.

    ``dtensor_state_dict``: a row- or table-sharded table's ``state_dict`` entry is a DTensor ``Shard(0)``
    of its logical rows (each rank a contiguous block, moved there by one ``all_to_all_single``; loading
    one moves the rows back), so ``torch.distributed.checkpoint`` and its ``get_model_state_dict`` /
    ``set_model_state_dict`` save and load each rank's rows (a plain tensor there is taken for a
    replicated one: only one rank's rows would be saved; docs/sharding.md); the optimizer's row slots go
    to ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` the same way. ``state_dict()`` and
    ``load_state_dict`` are then collectives (:func:`~torch_tpu_embedding.distributed.save_sharded` and
    ``load_sharded`` work either way). Off: the entry holds the rank's rows as stored.

    Every rank must shard the same layout: the ranks first meet (each waits at most ``timeout`` for the
    others, default torch's for a new process group, 30 minutes on gloo: a rank that never calls ``shard``
    makes the others raise, naming it, instead of waiting for ever) and agree on it (one
    ``all_gather_object`` of each rank's tables: names, rows, widths, dtypes, resolved placements and the
    tables each replicated one stays stacked with, by ``stack_tables``); where they differ every rank raises,
    naming the tables and each rank's value. The sharded tables are named in
    ``module._ddp_params_and_buffers_to_ignore`` (torch's list of parameters its ``DistributedDataParallel``
    leaves alone: each rank's rows are its own). Over the default group ``shard`` makes two process groups of its
    own (the ranks' meeting, the exchange) once per ``timeout``: every model sharded with it shares them.

    Every argument and table is checked before anything changes: a refused call leaves the model as it was.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised, torch_xla SPMD is on, a table was sharded
            already, or a table was moved to the meta device (its values are gone).
        ValueError: an argument of the wrong type or value (``module`` not a module or holding no collection,
            ``group`` not a process group or one this rank is not in, ``device`` not a device name or ``"meta"``,
            a non-bool ``dtensor_state_dict``), a table's placement is ``"column"``, or ``dtensor_state_dict=True``
            where every table is replicated, or ``timeout`` not a positive ``datetime.timedelta`` or given with
            ``group``.
        RuntimeError: the ranks did not all arrive within ``timeout``, or their layouts differ (on every rank).
    """
    if spmd_active():
        raise RuntimeError("tte.distributed.shard is for process groups; under torch_xla SPMD use "
                           "torch_tpu_embedding.xla.shard.")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tte.distributed.shard needs an initialised process group: call "
                           "torch.distributed.init_process_group(...) first (torchrun sets its environment). "
                           "Received: torch.distributed.is_initialized() is False")
    # Everything checked before anything changes: a refused call leaves the model and the groups as they were.
    collections, where = _check_call(module, group, replicate_below_bytes, device, dtensor_state_dict)
    if timeout is not None and not (isinstance(timeout, datetime.timedelta) and timeout > datetime.timedelta(0)):
        raise arg_error("timeout", "must be None (torch's default for a new process group) or a positive "
                        "datetime.timedelta",
                        timeout if isinstance(timeout, datetime.timedelta) else type(timeout).__name__)
    if timeout is not None and group is not None:  # never ignored silently
        raise arg_error("timeout", "sets the wait of the exchange group shard() creates over the default group; with "
                        "`group` given none is created, and the ranks meet with that group's own timeout (set it "
                        "in torch.distributed.new_group(..., timeout=...)). Pass one or the other", timeout)
    pg = dist.group.WORLD if group is None else group
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    placed = [{n: group_placement(n, c, world, replicate_below_bytes) for n, c in ec.table_configs.items()}
              for ec in collections]
    if dtensor_state_dict and all(p == "replicated" for placements in placed for p in placements.values()):
        every = {n: p for placements in placed for n, p in placements.items()}
        raise ValueError(
            "Argument `dtensor_state_dict` makes the state_dict entries of row- and table-sharded tables DTensors, "
            f"and no table of `module` is sharded over this group of {world}: their placements are {every} "
            "(\"auto\" replicates a table below `replicate_below_bytes`). Pass dtensor_state_dict=False, or set "
            "a table's placement to 'row' or 'table'. Received: dtensor_state_dict=True"
        )
    # The exchange gets a group of its own: its all-to-alls run inside autograd's backward, where a DDP over
    # the same group issues its own all-reduces. new_group needs every process of the default group, which
    # calls shard() only when `group` is the default; a group given is used as it is (give DDP another).
    keys = _table_keys(module, collections)
    meeting, exchange = _meet(pg, group, timeout, rank)
    layouts: list[Any] = [None] * world
    try:
        dist.all_gather_object(layouts, _layout(collections, placed, keys, dtensor_state_dict), group=meeting)
    except RuntimeError as e:  # (gloo's timeout is a plain RuntimeError)
        if group is not None:
            raise
        _GROUPS.pop(timeout, None)  # (a meeting group that timed out is not met in again)
        raise _absent(rank, timeout, e) from e
    _agree_layout(layouts, rank)
    out: dict[str, str] = {}
    for ec, placements in zip(collections, placed, strict=True):
        # Tables built on the meta device: their recorded draws by table, followed through the re-stacking
        draws = {d.name: d for t in ec.physical_tables().values() for _, d in t.deferred}
        ec.restack({n: "replicated" if p == "replicated" else "row" for n, p in placements.items()})
        ec.unstack([g for g, members in ec.stacked_members().items() if placements[members[0][0]] != "replicated"])
        for t in ec.physical_tables().values():
            if t.weight.is_meta:
                members = t.members() or ((t.name, 0, t.config.num_embeddings),)
                t.deferred = tuple((first, draws[n]) for n, first, _ in members if n in draws)
                t.require_draws()  # on every rank, before any draws
        whole = {n: table_bytes(c) for n, c in ec.table_configs.items() if placements[n] == "table"}
        owners = assign_tables(whole, world)
        for name, p in placements.items():
            if p != "replicated":
                _lay_out(ec.tables[name], p, owners.get(name, 0), exchange, world, rank, where, dtensor_state_dict)
        for t in ec.physical_tables().values():
            if t.weight.is_meta:  # replicated, built on the meta device: drawn whole on every rank
                rows = int(t.weight.shape[0])
                t.weight = nn.Parameter(t.fill_rows(torch.empty(rows, t.weight.shape[1], dtype=t.weight.dtype,
                                                                device=where), lambda ids: ids))
                t.deferred = ()
                t._register("it was drawn from the meta device (a new parameter)")
            if group_sharding(t.weight) is None:
                mark(t.weight, group)  # replicated: data parallel over the group
        out.update({key: placements[name] for key, name in zip(keys[id(ec)], placements, strict=True)})
    _ignore_in_torch_ddp(module)
    module.register_load_state_dict_pre_hook(check_whole_tables)  # type: ignore[no-untyped-call]  # (before any load)
    return out


def _table_keys(module: nn.Module, collections: list[EmbeddingCollection]) -> dict[int, list[str]]:
    """Each collection's (by id) keys of :func:`shard`'s result, in the order of its tables: the table's name, or
    where collections hold tables of one name (two towers' default ``table_0``) the table module's path in
    ``module`` (``"user_tower.tables.table_0"``), so that neither takes the other's place."""
    paths = {id(m): p for p, m in module.named_modules()}
    count: dict[str, int] = {}
    for ec in collections:
        for name in ec.table_configs:
            count[name] = count.get(name, 0) + 1
    return {id(ec): [name if count[name] == 1 else ".".join(filter(None, (paths[id(ec)], "tables", name)))
                     for name in ec.table_configs] for ec in collections}


def _meet(pg: Any, group: Any, timeout: datetime.timedelta | None, rank: int) -> tuple[Any, Any]:
    """Every rank of ``pg`` at :func:`shard`, each waiting at most ``timeout``; returns the group the ranks agree on the
    layout in and the exchange's group.

    The exchange gets a group of its own: its all-to-alls run inside autograd's backward, where a DDP over the
    same group issues its own all-reduces. ``new_group`` needs every process of the default group, which calls
    ``shard`` only when ``group`` is the default. Those groups are made once per ``timeout`` (as torch's functional
    collectives find theirs by ranks and tag) and kept in :data:`_GROUPS`: one per call was a gloo group (threads,
    sockets) for every model sharded, never freed. The ranks meet in a group of its own, which nothing but
    ``shard`` uses: the first time in its connection through the store, later in the layout agreement; either waits
    ``timeout`` and never pairs with another collective (a live model's exchange, a DDP all-reduce), so a rank that
    never calls ``shard`` is named rather than waited for. A group given is used as it is (give DDP another; the
    layout agreement then waits its timeout).
    """
    if group is not None:
        return group, group
    made = _GROUPS.get(timeout)
    if made is not None and made[0] is dist.group.WORLD:  # (not the groups of a default group since destroyed)
        return made[1], made[2]
    ranks = dist.get_process_group_ranks(pg)
    try:
        meeting = dist.new_group(ranks, timeout=timeout)
    except dist.DistError as e:
        raise _absent(rank, timeout, e) from e
    _GROUPS[timeout] = (dist.group.WORLD, meeting, dist.new_group(ranks, timeout=timeout))
    return _GROUPS[timeout][1:]


def _absent(rank: int, timeout: datetime.timedelta | None, e: Exception) -> RuntimeError:
    """:func:`shard`'s error where the ranks did not all arrive within ``timeout``."""
    return RuntimeError(
        f"tte.distributed.shard on rank {rank} waited {timeout or _DEFAULT_WAIT} for the other "
        "ranks of the process group, and some never arrived: every rank must call tte.distributed.shard(model) "
        "(with the same model) before its first step. A rank that skipped it, or one that failed or is still "
        "loading before it, leaves the others here; shard(..., timeout=datetime.timedelta(...)) sets the wait. "
        f"Received: {e}"
    )


def _layout(collections: list[EmbeddingCollection], placed: list[dict[str, str]], keys: dict[int, list[str]],
            dtensor_state_dict: bool) -> dict[str, Any]:
    """What every rank must agree on: per table (by name) rows, width, dtype, resolved placement and the tables
    a replicated one is stacked with (its group's row gradients are exchanged as one parameter)."""
    tables = {}
    for ec, placements in zip(collections, placed, strict=True):
        # the groups restack() forms below (stack_tables=True): only replicated tables stay stacked
        planned = plan_groups(ec.table_configs, {n: "replicated" if p == "replicated" else "row"
                                                 for n, p in placements.items()}) if ec._fuse else []
        stacked = {n: list(g) for g in planned if placements[g[0]] == "replicated" for n in g}
        for key, (name, c) in zip(keys[id(ec)], ec.table_configs.items(), strict=True):
            w = ec.tables[name].weight
            tables[key] = {"num_embeddings": c.num_embeddings, "embedding_dim": c.embedding_dim,
                            "dtype": str(w.dtype).replace("torch.", ""), "placement": placements[name],
                            "stacked with": stacked.get(name, "no other table")}
    return {"tables": tables, "dtensor_state_dict": dtensor_state_dict}


def _agree_layout(every: list[Any], rank: int) -> None:
    """Every rank's :func:`_layout` (by one ``all_gather_object``); raises on every rank where they differ.

    Raises:
        RuntimeError: the ranks' tables differ: which tables, which value on which rank.
    """
    problems = []
    names = dict.fromkeys(n for lay in every for n in lay["tables"])
    for name in names:
        per = [lay["tables"].get(name) for lay in every]
        missing = [r for r, t in enumerate(per) if t is None]
        if missing:
            problems.append(f"table `{name}` exists on ranks {[r for r, t in enumerate(per) if t is not None]} "
                            f"but not on ranks {missing}")
            continue
        for key in ("num_embeddings", "embedding_dim", "dtype", "placement", "stacked with"):
            values = [t[key] for t in per]  # type: ignore[index]
            if len(set(map(repr, values))) > 1:
                problems.append(f"table `{name}`: {key} " + ", ".join(f"{v!r} on rank {r}"
                                                                       for r, v in enumerate(values)))
    flags = [lay["dtensor_state_dict"] for lay in every]
    if len(set(flags)) > 1:
        problems.append("dtensor_state_dict " + ", ".join(f"{v} on rank {r}" for r, v in enumerate(flags)))
    if problems:
        raise RuntimeError(
            f"tte.distributed.shard (rank {rank}): the ranks of the process group hold different models, so their "
            "lookups and updates would not pair up; every rank must build the same tables (the same configs, "
            "placements, dtype and stack_tables) and call shard with the same arguments. Nothing was changed. "
            "Received: "
            + "; ".join(problems)
        )


def _ignore_in_torch_ddp(module: nn.Module) -> None:
    """Name the tables sharded over a process group in ``module._ddp_params_and_buffers_to_ignore``: torch's
    own ``DistributedDataParallel(module)`` then neither checks their shapes across the ranks (a table-wise
    table is ``[0, D]`` off its owner) nor reduces them (each rank's rows are its own)."""
    names = [n for n, p in module.named_parameters() if group_sharding(p) is not None]
    names += ["." + n for n in names if "." not in n]  # DDP names a root-level parameter ".weight"
    ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # type: ignore[no-untyped-call]
        module, ignored + [n for n in names if n not in ignored])


def _check_call(module: Any, group: Any, replicate_below_bytes: Any, device: Any, dtensor_state_dict: Any,
                ) -> tuple[list[EmbeddingCollection], torch.device]:
    """:func:`shard`'s arguments, checked before it changes anything: the collections of ``module`` and the
    device to draw tables built on the meta device on.

    Raises:
        ValueError: an argument of the wrong type or value.
        RuntimeError: a table sharded over a process group already, or moved to the meta device.
    """
    if not isinstance(module, nn.Module):
        raise arg_error("module", "must be a torch.nn.Module holding EmbeddingCollections", type(module).__name__)
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on the ranks it leaves out (an int)
        raise arg_error("group", f"must be a process group this rank belongs to: rank {dist.get_rank()} of the default "
                        "group is not one of its ranks (torch.distributed.new_group returns GroupMember."
                        "NON_GROUP_MEMBER on the ranks it leaves out). Call tte.distributed.shard only on the "
                        "group's ranks", group)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise arg_error("group", "must be None (the default group) or a torch.distributed ProcessGroup",
                        type(group).__name__)
    check_int("replicate_below_bytes", replicate_below_bytes, minimum=0)
    check_bool("dtensor_state_dict", dtensor_state_dict)
    where = check_device("device", device) or torch.device("cpu")
    if where.type == "meta":
        raise arg_error("device", "is where tables built on the meta device draw their rows, so it cannot be "
                        "'meta'", device)
    collections = [m for m in module.modules() if isinstance(m, EmbeddingCollection)]
    if not collections:
        raise ValueError(f"Argument `module` holds no EmbeddingCollection to shard. Received: {type(module).__name__}")
    for ec in collections:
        for name, t in ec.physical_tables().items():
            done = group_sharding(t.weight)
            if done is not None:
                raise RuntimeError(f"Table `{name}` is sharded over a process group already; shard a model once. "
                                   f"Received: a model laid out by an earlier tte.distributed.shard ({name!r} placed "
                                   f"{done.placement!r})")
            if t.weight.is_meta and not t.deferred:
                t.require_draws()  # moved to the meta device: its values are gone
    return collections, where


def _lay_out(module: nn.Module, placement: str, owner: int, group: Any, world: int, rank: int,
             device: torch.device, dtensor_state_dict: bool) -> None:
    """Replace table ``module``'s weight by this rank's rows of it and record its layout (a table built on
    the meta device: its rows drawn on ``device``; ``dtensor_state_dict``: :class:`GroupSharding`'s)."""
    assert isinstance(module, EmbeddingTable)
    table = module
    v = table.config.num_embeddings
    if placement == "row":
        block = math.lcm(ROW_ALIGNMENT, world)
        ownership = RowOwnership("interleaved", -(-v // block) * block, world, block)
    else:
        ownership = RowOwnership("range", world * v, world)
    layout = ProcessGroupLayout(placement, group, world, rank, v, ownership, owner, dtensor_state_dict, table.name)
    if table.weight.is_meta:
        out = torch.empty(layout.local_rows, table.config.embedding_dim, dtype=table.weight.dtype, device=device)
        local = table.fill_rows(out, _local_row(layout)) if layout.local_rows else out
        table.deferred = ()
    else:
        local = _rows_of(table, layout)
    table.weight = nn.Parameter(local)  # the whole table goes with its last reference
    table._register("its rows were sharded over a process group (a new parameter)")
    mark(table.weight, None)  # (one the whole table had, carried: its rows go to their owners, never exchanged)
    info = register_table(table.weight, table.name, layout.local_rows, table.config.optimizer)
    info.sharding = layout  # never exchanged as data parallel (grad_sync.exchange_group reads the placement)


def _local_row(layout: ProcessGroupLayout) -> Callable[[torch.Tensor], torch.Tensor]:
    """Logical ids → this rank's row of each (outside ``[0, local_rows)``: another rank's)."""
    if layout.placement == "table":
        return lambda ids: ids  # called on the owner only
    first = layout.rank * layout.ownership.rows_per_shard
    return lambda ids: layout.ownership.physical_row(ids) - first


def _rows_of(table: EmbeddingTable, layout: ProcessGroupLayout) -> torch.Tensor:
    """This rank's rows of a table built whole, by ``layout`` (zero at padding rows)."""
    v = table.config.num_embeddings
    with torch.no_grad():
        whole = table.logical_weight()
        ids = layout.local_logical_ids()
        real = ids < v
        local = torch.zeros(layout.local_rows, whole.shape[1], dtype=whole.dtype, device=whole.device)
        local[real.to(local.device)] = whole.index_select(0, ids[real].to(whole.device))
        del whole
    return local

