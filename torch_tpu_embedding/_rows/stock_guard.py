"""The guards against torch's own machinery touching a table: a ``torch.optim`` optimizer that would step it (a
table's gradient is row-sparse and never in ``.grad``, so such an optimizer would silently leave it untrained;
installed on import of the package), torch's ``DistributedDataParallel`` reducing it (checked by each lookup), and
autograd writing a dense ``.grad`` into it (a loss term on the weight itself, checked by each ``step()``)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_tpu_embedding._rows.tables import table_info

__all__ = [
    "OUTSIDE_A_LOOKUP", "check_no_dense_grad", "check_not_ddp_managed", "ddp_message", "install_stock_optimizer_guard",
]

_GUARD_INSTALLED = False
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def _stock_optimizer_pre_hook(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """Refuse to let an optimizer that cannot read row-sparse gradients step a table.

    A table's gradient lives in its :class:`RowGrad`, never in ``.grad``; an ordinary optimizer
    would find ``.grad is None`` and silently leave the table untrained.
    """
    if getattr(optimizer, "_tte_reads_row_grads", False):
        return
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:  # checked already (re-checked after add_param_group)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            info = table_info(p)
            if info is not None:
                raise TypeError(
                    f"{type(optimizer).__module__}.{type(optimizer).__name__} was given "
                    f"{info.described()}, whose gradient is row-sparse and never stored in "
                    "`.grad`, so it would silently not train. Use an optimizer from "
                    "torch_tpu_embedding.optim for the tables (it also trains dense parameters), "
                    "or split the parameters with torch_tpu_embedding.split_parameters()."
                )
    _CHECKED[optimizer] = count


def install_stock_optimizer_guard() -> None:
    """Register the global ``torch.optim`` step pre-hook (idempotent)."""
    global _GUARD_INSTALLED
    if not _GUARD_INSTALLED:
        register_optimizer_step_pre_hook(_stock_optimizer_pre_hook)
        _GUARD_INSTALLED = True


def check_not_ddp_managed(weight: torch.Tensor) -> None:
    """Raise if a ``DistributedDataParallel`` forward is running that reduces ``weight`` (a table):
    DDP would allocate and all-reduce a ``[V, D]`` gradient and the table would not train right."""
    active = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    if active is not None and any(q is weight for q in getattr(active, "_module_parameters", ())):
        raise RuntimeError(ddp_message(table_info(weight)))


#: a dense ``.grad`` on a table from the user's own loss: what happened and what to do (:func:`check_no_dense_grad`,
#: and under a process group after :func:`ddp_message`)
OUTSIDE_A_LOOKUP = (
    "a loss term used the weight outside a lookup (a penalty over the table, or the table as a tied output layer, "
    "say). A table trains from its lookups' row gradients only, so that gradient would be silently dropped. Look the "
    "rows up through the collection instead (every row: ids torch.arange(num_embeddings)), use the optimizer's "
    "`weight_decay_factor` for a decay, or detach the weight there; then zero_grad()."
)


def ddp_message(info: Any) -> str:
    what = "An embedding table" if info is None else info.described()[0].upper() + info.described()[1:]
    verb = "are" if info is not None and info.members else "is"
    return (
        f"{what} {verb} reduced by DistributedDataParallel, which knows only dense `.grad` "
        "gradients: it would all-reduce an all-zero [V, D] gradient while the table's row-sparse gradient "
        "goes unseen. Wrap the model with tte.distributed.DistributedDataParallel(model, ...) instead, or "
        "call tte.distributed.data_parallel(model) before torch's DistributedDataParallel(model)."
    )


def check_no_dense_grad(params: Iterable[torch.Tensor]) -> None:
    """Raise if a table among ``params`` has a dense ``.grad``: a loss term used its weight outside a lookup (an L2
    penalty over the table, the table as a tied output layer), and autograd accumulated a ``[V, D]`` gradient that
    the optimizers, which read a table's row gradient only, would drop without a word."""
    for p in params:
        grad = p.grad
        if grad is None or grad.is_sparse:
            continue
        info = table_info(p)
        if info is not None:
            raise RuntimeError(
                f"The optimizer was given {info.described()}, whose weight has a dense `.grad` of shape "
                f"{tuple(grad.shape)}: " + OUTSIDE_A_LOOKUP
            )
