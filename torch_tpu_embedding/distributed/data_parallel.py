"""Data parallel outside SPMD: replicated tables under ``torch.distributed`` (torchrun, DDP); and
:func:`shard`, tables sharded over the process group by placement (``torch_tpu_embedding/distributed/sharding.py``).

Every process holds every table and trains on its share of the global batch. A table's gradient
lives in its :class:`~torch_tpu_embedding._rows.row_grad.RowGrad`, never in ``.grad``, so torch's
data-parallel machinery (``DistributedDataParallel``, ``all_reduce`` of ``.grad``) does not see it.
Here each process's ``(ids [n], rows [n, D])`` of a table are gathered across the process group,
concatenated in rank order and averaged as DDP averages (each rank's rows divided by the world size
before the sum). The optimizer's dedup then makes a row touched by several ranks one update, so
every replica applies the same update: one process on the global batch, when each rank's loss is
the mean over its equal share of the batch (as DDP assumes).

When: the first consumer of a step's table gradients — a :mod:`torch_tpu_embedding.optim`
optimizer's ``step()`` or :func:`torch_tpu_embedding.clip_grad_norm_` — calls
:func:`sync_row_grads`, which exchanges what is not yet exchanged (so clipping and then stepping
exchanges once). How it moves the rows: :mod:`torch_tpu_embedding.distributed.grad_sync`.

Which group: the one given to :func:`data_parallel` (or :class:`DistributedDataParallel`), else the
default group when ``torch.distributed`` is initialised with more than one process; never under
torch_xla SPMD, where the partitioner already makes gradients global (multi-host SPMD runs call
``init_process_group`` for checkpoint coordination; exchanging there would count every gradient
once per host). :func:`local_tables` opts a model's tables out.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding.distributed.exchange import group_sharding
from torch_tpu_embedding.distributed.grad_sync import (
    LOCAL,
    check_not_ddp_managed,
    exchange_group,
    mark,
    should_exchange,
    spmd_active,
    sync_row_grads,
)
from torch_tpu_embedding.distributed.sharded_checkpoint import load_sharded
from torch_tpu_embedding.distributed.sharded_save import save_sharded
from torch_tpu_embedding.distributed.sharding import (
    DEFAULT_REPLICATE_BELOW_BYTES,
    assign_tables,
    group_placement,
    logical_ids,
    shard,
)

__all__ = [
    "DEFAULT_REPLICATE_BELOW_BYTES",
    "DistributedDataParallel",
    "assign_tables",
    "group_placement",
    "load_sharded",
    "logical_ids",
    "save_sharded",
    "shard",
    "check_not_ddp_managed",
    "data_parallel",
    "exchange_group",
    "local_tables",
    "should_exchange",
    "spmd_active",
    "sync_row_grads",
]

Tensor = torch.Tensor


def _tables(module: torch.nn.Module) -> list[tuple[str, Tensor]]:
    return [(name, p) for name, p in module.named_parameters() if table_info(p) is not None]


def local_tables(module: torch.nn.Module) -> torch.nn.Module:
    """Never exchange the row gradients of ``module``'s tables: each process trains its own (model
    parallel by hand, or independent runs sharing a process group). Returns ``module``."""
    for _, p in _tables(module):
        mark(p, LOCAL)
    return module


def data_parallel(
    module: torch.nn.Module, process_group: Any = None, *, broadcast: bool = True
) -> torch.nn.Module:
    """Prepare ``module``'s tables for data parallel training; returns ``module``.

    * the tables' row gradients are exchanged over ``process_group`` (default: the default group,
      which is also used without this call);
    * ``torch.nn.parallel.DistributedDataParallel(module)`` built afterwards leaves the tables alone:
      their names are set in ``module._ddp_params_and_buffers_to_ignore``, torch's list of
      parameters DDP must not reduce (no ``[V, D]`` gradient is made or all-reduced for a table);
    * with ``broadcast`` the tables are copied from the group's first process (DDP does this for
      what it manages), so the replicas start equal.

    Call it after moving ``module`` to its device (``.to()`` makes new table parameters) and before
    wrapping it in DDP; :class:`DistributedDataParallel` does both in one line.

    With ``broadcast`` (a collective) the ranks first agree on their tables (one ``all_gather_object`` of
    each table's shape and dtype, and the tables stacked together): where they differ every rank raises,
    naming the tables and each rank's value, and nothing is changed.

    Raises:
        RuntimeError: under torch_xla SPMD (gradients there are global already), when
            ``torch.distributed`` is not initialised, or (on every rank) the ranks' tables differ.
    """
    if spmd_active():
        raise RuntimeError(
            "tte.distributed.data_parallel is not for torch_xla SPMD: there the partitioner already makes "
            "gradients global (replicate or shard the tables with torch_tpu_embedding.xla.shard instead)."
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "tte.distributed.data_parallel needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets its environment)."
        )
    tables = _tables(module)
    group: Any = dist.group.WORLD if process_group is None else process_group
    # Tables sharded over a process group (shard()) are each rank's own rows: never exchanged or broadcast.
    replicated = [p for _, p in tables if group_sharding(p) is None]
    broadcast = broadcast and dist.get_world_size(group) > 1
    if broadcast:  # (a collective already: the ranks' tables agreed first, before anything changes)
        _agree_tables(replicated, group)
    names = [n for n, _ in tables]
    # DDP builds a root-level parameter's name as f"{module_name}.{param_name}", i.e. ".weight".
    names += ["." + n for n in names if "." not in n]
    ignored = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # type: ignore[no-untyped-call]
        module, ignored + [n for n in names if n not in ignored]
    )
    for p in replicated:
        mark(p, process_group)
    if broadcast:
        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for p in replicated:
                dist.broadcast(p.detach(), src=src, group=group)
    return module


def _agree_tables(replicated: list[Tensor], group: Any) -> None:
    """Every rank of ``group`` holds the same replicated tables (each parameter's tables, shape and dtype, in
    order): one ``all_gather_object``, so that a rank whose tables differ makes every rank raise here instead of
    one rank aborting in the broadcast or in the first step's exchange of row gradients.

    Raises:
        RuntimeError: (on every rank) the ranks' tables differ: which tables, which value on which rank.
    """
    mine = {}
    for p in replicated:
        info = table_info(p)
        assert info is not None
        names = info.tables
        what = f"table `{names[0]}`" if len(names) == 1 else "tables " + ", ".join(f"`{n}`" for n in names) + \
            " (stacked)"
        mine[what] = f"{list(p.shape)} {str(p.dtype).replace('torch.', '')}"
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    problems = []
    for what in dict.fromkeys(k for tables in every for k in tables):
        values = [tables.get(what, "absent") for tables in every]
        if len(set(values)) > 1:
            problems.append(f"{what}: " + ", ".join(f"{v} on rank {r}" for r, v in enumerate(values)))
    if problems:
        raise RuntimeError(
            f"tte.distributed.data_parallel (rank {dist.get_rank(group)}): the ranks of the process group hold "
            "different tables, so the tables broadcast from its first rank and their row gradients exchanged at "
            "each step would not pair up; every rank must build the same tables (the same configs, dtype and "
            "stack_tables). Nothing was changed. Received: " + "; ".join(problems)
        )


_DDP_SIGNATURE = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__)


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` for a model that holds embedding tables.

    The same arguments and behaviour as torch's; before torch's constructor runs, the tables are
    prepared with :func:`data_parallel` (DDP ignores them, they are broadcast from the group's first
    process when ``init_sync`` is on, and their row gradients are exchanged over DDP's
    ``process_group`` or ``device_mesh``). Dense parameters are DDP's as usual.

    Example::

        >>> model = tte.distributed.DistributedDataParallel(MyModel(...).to(device))
        >>> opt = tte.optim.Adagrad(model.parameters(), lr=0.1)   # loop as usual

    Raises:
        ValueError: ``module`` has no dense parameter that needs a gradient (DDP then has nothing to
            do: call :func:`data_parallel` alone).
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        bound = _DDP_SIGNATURE.bind(self, module, *args, **kwargs).arguments
        group, mesh = bound.get("process_group"), bound.get("device_mesh")
        if group is None and mesh is not None:
            group = mesh.get_group(mesh_dim=0)
        tables = {id(p) for _, p in _tables(module)}
        if tables and not any(p.requires_grad and id(p) not in tables for p in module.parameters()):
            raise ValueError(
                "The module has no dense parameter that needs a gradient, so DistributedDataParallel has "
                "nothing to reduce: call tte.distributed.data_parallel(module) instead (it broadcasts the "
                "tables, and their row gradients are exchanged at each step)."
            )
        data_parallel(module, group, broadcast=bool(bound.get("init_sync", True)))
        super().__init__(module, *args, **kwargs)
