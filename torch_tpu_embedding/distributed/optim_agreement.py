"""Every rank's optimizer for the tables it shares with the others is the same: checked at each training lookup,
inside the agreement it makes already.

Data parallel (replicated tables) and tables sharded over a process group train as one process only if every rank
updates its rows with the same rule and hyper-parameters: a rank with ``lr=0.2`` where the others have ``0.1``
(another ``eps``, another optimizer class) would apply other updates to its replica, or its shard, silently.
:func:`fingerprint` is a number every rank computes on the host from the parameter groups of its
:mod:`torch_tpu_embedding.optim` optimizers (each one registers when it is built or copied,
:func:`~torch_tpu_embedding._rows.placement.register_optimizer`) that hold a table of the lookup exchanged over a
process group: each group's optimizer, tables and hyper-parameters. It rides in the agreement of each training lookup
(:func:`~torch_tpu_embedding.distributed.exchange.agree_capacity`: two more int64 in its one ``all_reduce``, read
back with it), so the check adds no collective and no host read to a step, and a learning-rate scheduler that
changes ``lr`` alike on every rank at every step costs nothing: ``lr`` is part of the number. Only where the
numbers differ do the ranks gather their configurations (one ``all_gather_object``, every rank alike: each saw the
same reduced numbers) and every rank raises a ``ValueError`` naming the hyper-parameter, each rank's value and the
tables. A change made between a lookup and its step is checked at the next training lookup (the one after that
step). Values that would need a read of the device (a tensor ``lr``) are compared by their kind only.
"""

from __future__ import annotations

import hashlib
import numbers
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_tpu_embedding._rows.placement import registered_optimizers
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding.distributed.exchange import group_sharding
from torch_tpu_embedding.distributed.grad_sync import MARKED, exchange_group

__all__ = ["configurations", "explain", "fingerprint"]

#: group keys that are not hyper-parameters (torch's, and the tensors themselves)
_SKIP = frozenset({"params", "param_names", "initial_lr"})
#: optimizer → (its groups' parameter lists, as ids and lengths; each group's shared tables; the ids of the
#: parameters holding them)
_TABLES: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], list[list[str]], frozenset[int]]] = (
    weakref.WeakKeyDictionary())


def _value(v: Any) -> Any:
    """``v`` as every process writes it alike: numbers, strings and their tuples as they are (a numpy scalar, which
    the optimizers accept for a number, as the Python number of its value); a tensor, a function or another object
    by its kind (a tensor is not read: that would wait for its device; a repr would hold its address)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, (tuple, list)):
        return tuple(_value(x) for x in v)
    if isinstance(v, torch.Tensor):
        return f"a {tuple(v.shape)} tensor"
    if isinstance(v, type) or callable(v):
        return getattr(v, "__qualname__", type(v).__qualname__)
    return type(v).__qualname__


def _shared_tables(opt: Any) -> tuple[list[list[str]], frozenset[int]]:
    """Each parameter group's tables exchanged over a process group, by name, and the ``id`` of each parameter that
    holds one; looked up again only when a group's list of parameters changes, or a table's exchange is marked
    (``data_parallel``, ``local_tables``: a table each rank trains on its own since is no longer compared); each
    training lookup asks, and a walk over every dense parameter would cost more."""
    key = (MARKED[0], *((id(g["params"]), len(g["params"])) for g in opt.param_groups))
    cached = _TABLES.get(opt)
    if cached is None or cached[0] != key:
        shared = [[p for p in g["params"] if _is_shared(p)] for g in opt.param_groups]
        cached = _TABLES[opt] = (key, [sorted(n for p in ps for n in _names(p)) for ps in shared],
                                 frozenset(id(p) for ps in shared for p in ps))
    return cached[1], cached[2]


def _is_shared(p: Any) -> bool:
    return table_info(p) is not None and (group_sharding(p) is not None or exchange_group(p) is not None)


def _names(p: Any) -> list[str]:
    info = table_info(p)
    return [] if info is None else list(info.tables)


def configurations(weights: Sequence[torch.Tensor]) -> dict[str, dict[str, Any]]:
    """This rank's optimizers of the tables exchanged over a process group: each parameter group's tables (as
    ``"`a`, `b`"``) → its optimizer and hyper-parameters, of the optimizers that hold one of ``weights``
    (the tables of the lookup that agrees): a copy of a model and its optimizer (``copy.deepcopy``) has
    tables of the same names as the original's, and whichever of the two a rank keeps aside (a snapshot, a model
    to evaluate) is no difference between the ranks while the other one trains. A table that several of them hold
    counts for the newest only: an optimizer rebuilt mid-training leaves the old one alive wherever something still
    refers to it (a rank's own checkpoint or logging helper, an exception's traceback), which is no difference
    between the ranks while the new one steps the table."""
    wanted = {id(w) for w in weights}
    out: dict[str, dict[str, Any]] = {}
    claimed: set[str] = set()
    for opt in reversed(registered_optimizers()):  # the newest first
        shared, held = _shared_tables(opt)
        if held.isdisjoint(wanted):
            continue
        for group, tables in zip(opt.param_groups, shared, strict=True):
            mine = [n for n in tables if n not in claimed]
            if not mine:
                continue
            claimed.update(mine)
            config = {"optimizer": _value(group.get("_rule", type(opt)))}
            config.update((k, _value(v)) for k, v in sorted(group.items()) if k not in _SKIP and not k.startswith("_"))
            out[", ".join(f"`{n}`" for n in mine)] = config
    return out


def fingerprint(weights: Sequence[torch.Tensor]) -> int:
    """A number for :func:`configurations` of ``weights`` (62 bits: it and its negation fit an int64)."""
    mine = configurations(weights)
    if not mine:
        return 0
    return int.from_bytes(hashlib.blake2b(repr(sorted(mine.items())).encode(), digest_size=8).digest()) >> 2


def explain(group: Any, weights: Sequence[torch.Tensor]) -> None:
    """The agreement of a lookup of ``weights`` found the ranks' optimizers different: gather every rank's
    :func:`configurations` of them over ``group`` (a collective: every rank of the group calls it at the same
    agreement) and raise.

    Raises:
        ValueError: naming each hyper-parameter that differs, each rank's value, and the tables.
    """
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, configurations(weights), group=group)
    problems = []
    for tables in dict.fromkeys(k for configs in every for k in configs):
        keys = dict.fromkeys(k for configs in every for k in configs.get(tables, {}))
        for key in keys:
            values = [configs[tables].get(key, "absent") if tables in configs else "no optimizer" for configs in every]
            if len(set(map(repr, values))) > 1:
                per_rank = ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))
                what = "optimizer" if key == "optimizer" else f"`{key}`"
                problems.append(f"{what} of tables {tables}: {per_rank}")
                if key == "optimizer" or any(tables not in c for c in every):
                    break  # (another rule, or none: its hyper-parameters differ as a matter of course)
    if not problems:  # (two configurations alike but for their order, or a hash collision: nothing to name)
        problems.append("their hyper-parameters, in another order")
    raise ValueError(
        "The ranks of the process group update their shared tables (data parallel, or sharded over the group) with "
        "different optimizers, so their replicas or shards would train apart: " + "; ".join(problems) + ". Every "
        "rank must build the same optimizer with the same hyper-parameters for these tables (a learning-rate "
        "scheduler changing `lr` alike on every rank is fine). Raised on every rank at a training lookup, before "
        "its step (a change made between a lookup and its step is found at the next lookup). Received: each "
        "rank's optimizers of tables exchanged over the process group"
    )
