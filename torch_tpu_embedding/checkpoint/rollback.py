"""The order of a checkpoint load, so that the user's own load code raising changes nothing.

A load runs the user's code: the model's load pre- and post-hooks, ``set_extra_state`` and
``_load_from_state_dict`` overrides as ``load_state_dict`` walks the model, and the optimizer's load hooks.
Undoing the writes of a failed load with a copy of everything would double the host memory of the tables,
so everything the user's code can see or stop runs first, while what it changed is small enough to copy:

1. the checks (``checks.py``), which read names, shapes and dtypes;
2. ``model.load_state_dict`` with the tables' writes held back (``modules/later_writes.py``): every other
   parameter, buffer and extra state is written and every user hook runs; a copy of those, made before,
   puts them back if anything raises;
3. the optimizer up to its writes: a ``tte.optim`` optimizer's load pre-hooks and, where 1. did not check its
   state or the model's load changed the optimizer's groups (a hook may), its checks
   (:meth:`~torch_tpu_embedding.optim.RowSparseOptimizer.staged_load`); another optimizer's whole
   ``load_state_dict``, undone if it raises by putting back its ``state`` and ``param_groups`` (torch's
   ``Optimizer.load_state_dict`` replaces both, never writing the tensors they hold);
4. the tables (our code, checked in 1.), then the ``tte.optim`` optimizer's state and its load post-hooks,
   which run after the whole load, as torch's: one that raises leaves the load complete.

What a module's own load code changes besides its parameters, buffers and extra state is not undone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding.modules.later_writes import tables_written_later
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._state.state_check import CheckedState

__all__ = ["EXTRA_STATE", "extra_states", "load_in_order", "put_extra_states"]

#: a module's extra state in ``state_dict()``: ``<module path>.`` + this (torch's key)
EXTRA_STATE = "_extra_state"


def extra_states(model: torch.nn.Module, *, loaded: bool = False) -> dict[str, torch.nn.Module]:
    """The modules of ``model`` with an extra state, by its key in ``state_dict()`` (a module reached by two paths,
    under each, as torch has it). torch has a rule for each direction: ``state_dict()`` saves one where the module's
    class overrides ``get_extra_state``, ``load_state_dict`` sets one (``loaded=True``) where it overrides
    ``set_extra_state`` (a key that no module sets is unexpected)."""
    method = "set_extra_state" if loaded else "get_extra_state"
    base = getattr(torch.nn.Module, method)
    return {f"{name}.{EXTRA_STATE}" if name else EXTRA_STATE: m
            for name, m in model.named_modules(remove_duplicate=False) if getattr(type(m), method) is not base}


def put_extra_states(model: torch.nn.Module, saved: dict[str, Any]) -> Callable[[BaseException], None]:
    """Each module's ``set_extra_state`` with its value in ``saved`` (keys as ``extra_states(model, loaded=True)``
    gives them, checked against them). Returns what puts the values before back (each module's
    ``get_extra_state`` gives them), given the error that undoes the load: it names there what it could not put
    back. The user's code: run before anything else of a load is written, and where one raises, those already
    set are put back before the error goes on."""
    modules = extra_states(model, loaded=True)
    done: list[tuple[str, torch.nn.Module, Any]] = []

    def undo(error: BaseException) -> None:
        for key, module, state in reversed(done):
            try:
                module.set_extra_state(state)
            except Exception as e:  # the load's own error is the one raised
                error.add_note(f"The extra state '{key}' could not be put back: set_extra_state raised "
                               f"{type(e).__name__}: {e}")

    try:
        for key, value in saved.items():
            module = modules[key]
            before = copy.deepcopy(module.get_extra_state())
            module.set_extra_state(value)
            done.append((key, module, before))
    except BaseException as e:
        undo(e)
        raise
    return undo


def _small_state(model: torch.nn.Module) -> Callable[[BaseException], None]:
    """A copy of everything of ``model`` a load writes but its tables (parameters, persistent buffers, extra
    state); the function returned puts it back (a tensor a hook replaced included) and names on the
    error what it could not."""
    tensors: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
    for module in model.modules():
        for where, held in (("p", module._parameters), ("b", module._buffers)):
            for key, t in held.items():
                if t is None or table_info(t) is not None or (
                        where == "b" and key in module._non_persistent_buffers_set):
                    continue
                tensors.append((held, key, t, t.detach().clone()))
    loaded = extra_states(model, loaded=True)  # (those a load sets that can say what they held: both methods)
    extras = [(key, module, copy.deepcopy(module.get_extra_state())) for key, module in extra_states(model).items()
              if key in loaded]

    def restore(error: BaseException) -> None:
        with torch.no_grad():
            for held, key, t, saved in tensors:
                held[key] = t  # (a hook may have put another tensor there)
                t.copy_(saved)
        for key, module, state in extras:
            try:
                module.set_extra_state(state)
            except Exception as e:  # the load's own error is the one raised
                error.add_note(f"The extra state '{key}' could not be put back: set_extra_state raised "
                               f"{type(e).__name__}: {e}")

    return restore


def _optimizer_up_to_writes(optimizer: torch.optim.Optimizer, state: Any) -> Callable[[], None]:
    """Step 3 of the load (see the module); returns step 4's part of the optimizer."""
    if isinstance(optimizer, RowSparseOptimizer):
        return optimizer.staged_load(state)
    before = (optimizer.state, optimizer.param_groups)
    try:
        optimizer.load_state_dict(state)
    except BaseException:
        optimizer.state, optimizer.param_groups = before
        raise
    return lambda: None


def _groups(optimizer: torch.optim.Optimizer) -> list[tuple[tuple[int, ...], str]]:
    """What the check of an optimizer's state read of its groups: their parameters and options."""
    return [(tuple(id(p) for p in g["params"]), repr(sorted((k, v) for k, v in g.items() if k != "params")))
            for g in optimizer.param_groups]


def load_in_order(
    model: torch.nn.Module | None, model_state: Any, optimizer: torch.optim.Optimizer | None, optimizer_state: Any,
    strict: bool,
) -> None:
    """Load checked states into ``model`` and ``optimizer`` in the order of this module: any error before
    the tables are written (the user's hooks included) leaves both as they were."""
    undo = _small_state(model) if model is not None else None
    groups = _groups(optimizer) if optimizer is not None else None
    try:
        with tables_written_later() as tables:
            if model is not None:
                model.load_state_dict(model_state, strict=strict)
        if optimizer is not None and isinstance(optimizer_state, CheckedState) and _groups(optimizer) != groups:
            optimizer_state = optimizer_state.state  # checked against groups the model's load changed: again
        finish = _optimizer_up_to_writes(optimizer, optimizer_state) if optimizer is not None else None
    except BaseException as e:
        if undo is not None:
            undo(e)
        raise
    tables.run()
    if finish is not None:
        finish()
