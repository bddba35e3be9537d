"""Data parallel's agreement on each training lookup: a rank whose forward fails makes every rank raise.

Under data parallel (:mod:`torch_tpu_embedding.distributed.grad_sync`) a forward makes no collective of its
own: the step's first is DDP's all-reduce of the dense gradients in the backward, or the exchange of the
tables' row gradients at ``step()``. A rank whose forward refused its inputs (an out-of-range id, a missing
feature) skips both, so the others' would pair with its next step's (training on mismatched gradients) or
wait for it. So a training forward of data-parallel tables (the module in training mode, gradients on) meets
the other ranks' before it looks up: the lookup agreement of tables sharded over a process group
(:func:`~torch_tpu_embedding.distributed.exchange.agree_capacity`: one ``all_reduce(MAX)`` of eight int64 and
one host read), its failed rank taking part with ``failed=True``. Every other rank then raises at that step
(``Rank 1 of the process group failed this step before its exchange ...``), before its backward, and ranks
that all catch it and move on stay in step. A forward with a table sharded over the group needs none: its
routed lookups agree already.

Installed by :mod:`torch_tpu_embedding.distributed` into the layer below
(:func:`~torch_tpu_embedding._rows.placement.install_lookup_agreement`), which the collection's forward calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torch_tpu_embedding._rows.placement import Sizes
from torch_tpu_embedding._rows.tables import TableInfo, table_info
from torch_tpu_embedding.distributed.exchange import agree_capacity
from torch_tpu_embedding.distributed.grad_sync import (
    agreement_device,
    count_forward,
    exchange_group,
    static_route,
)
from torch_tpu_embedding.distributed.optim_agreement import explain, fingerprint

__all__ = ["agree_lookup", "agreement_device"]


def agree_lookup(weights: Callable[[], list[torch.Tensor]], failed: bool, sizes: Sizes) -> None:
    """A training forward of ``weights()`` (a collection's tables, in lookup order) meets the other ranks of the
    data-parallel group of its tables whose row gradients are exchanged (none: nothing to do), and agrees on which
    of them are frozen (``requires_grad=False``: a table frozen on some ranks only would leave the others waiting
    in the exchange of its rows); ``failed``: this rank's forward refused its inputs (its own error is raised by
    the caller). Where the row
    gradients are exchanged at static sizes (an accelerator, :func:`~.grad_sync.static_route`), ``sizes()`` (the
    shapes of the lookup's ids) is part of what the ranks agree on: ranks whose batch sizes or padded widths
    differ raise here, every one at this step, rather than reach the exchange with buffers of other sizes (before,
    each rank checked its sizes only at a shape it had not seen, so a rank whose shape repeated made no check
    while the other did: one collective on one rank, a hang on NCCL).

    Raises:
        RuntimeError: (on every rank but a failed one) another rank failed this step, is at another exchange, or
            looks up ids of other shapes where they must be equal.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    exchanged: list[tuple[torch.Tensor, TableInfo, Any]] = []  # (weight, its table info, its exchange group)
    for w in weights():
        info = table_info(w)
        if info is not None and info.routed:
            return  # its lookup agrees on the step (TablePlacement.lookup_failed)
        group = exchange_group(w)
        if info is not None and group is not None and all(w is not x for x, _, _ in exchanged):  # (a group: once)
            exchanged.append((w, info, group))
    if not exchanged:
        return
    # Frozen tables too (requires_grad=False: no row gradient, no exchange at step()): a table frozen on some
    # ranks only would leave the others waiting in the exchange, so which are frozen is part of the agreement;
    # so are a stacked group's members frozen on their own (ids padding in the backward: a member frozen on
    # some ranks only would be updated on the others alone).
    first, info, group = next((e for e in exchanged if e[0].requires_grad), exchanged[0])
    where = agreement_device(dist.get_backend_config(group), first.device)
    tables = ", ".join(f"`{n}`" for n in info.tables)
    frozen = [n for w, i, _ in exchanged for n in (i.tables if not w.requires_grad else sorted(i.frozen_tables))]
    if frozen:
        tables += f" (frozen: {', '.join(f'`{n}`' for n in frozen)})"
    shapes = None if failed or not static_route(first.device) else sizes()
    if shapes is not None:  # (the failed rank's tag is not compared: the others raise naming its failure)
        tables = _with_shapes(tables, shapes)
    # (the ranks' optimizers: distributed/optim_agreement.py; the forwards per step: grad_sync.count_forward)
    held = [w for w, _, _ in exchanged]
    agree_capacity(torch.zeros((), dtype=torch.int64, device=where), group, what="data_parallel",
                   table=tables, grad=True, failed=failed, config=0 if failed else fingerprint(held),
                   disagree=lambda: explain(group, held), forwards=count_forward(group))


@functools.lru_cache(maxsize=64)
def _with_shapes(tables: str, shapes: tuple[tuple[int, ...], ...]) -> str:
    """The agreement's text for ``tables`` looked up with ids of ``shapes``: spelled out once per distinct input
    structure (a steady loop repeats one), not on every forward of it."""
    return f"{tables} with ids of shapes {', '.join(str(list(s)) for s in shapes)}"
