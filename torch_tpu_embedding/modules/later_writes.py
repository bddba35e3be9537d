"""Table writes of a ``load_state_dict`` held back until the user's load code has run (``tte.checkpoint.load``).

``Module.load_state_dict`` runs the user's code as it walks the model (load pre- and post-hooks,
``set_extra_state``, ``_load_from_state_dict`` overrides) and copies each tensor when it reaches it, so a
hook that raises leaves the tables before it written. A copy of the tables to undo that would double the
host memory of a load; instead, inside :func:`tables_written_later`, the tables' own load hooks
(``EmbeddingTable``'s, the collection's for stacked groups) keep each table's value for later and leave a
stand-in in the state dict: a tensor on the ``meta`` device with the table's physical shape, which passes
torch's shape check and whose copy into the table is dropped. :meth:`LaterWrites.run` then writes the
tables (padding rows, row order and stacking as the hooks make them) once every user hook has run.

User code that runs after a table's hook sees the stand-in, not the values (a load pre-hook registered on
the collection after it was built, for a stacked group's ``groups.<g>.weight``); load post-hooks run
before the tables are written and see their previous values.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["LaterWrites", "later_writes", "tables_written_later"]


class LaterWrites:
    """The table writes held back by one load, with the stand-ins left in their place."""

    def __init__(self) -> None:
        self._writes: list[Callable[[], None]] = []
        self._stand_ins: dict[int, torch.Tensor] = {}  # kept alive: their ids stay theirs

    def stand_in(self, table: torch.Tensor) -> torch.Tensor:
        """A ``meta`` tensor shaped like ``table`` (the parameter as stored): torch's walk checks its shape
        and its copy into ``table`` is dropped."""
        t = torch.empty(table.shape, dtype=table.dtype, device="meta")
        self._stand_ins[id(t)] = t
        return t

    def is_stand_in(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and self._stand_ins.get(id(value)) is value

    def later(self, write: Callable[[], None]) -> None:
        """Run ``write`` (one table's write) in :meth:`run`, in the order the walk reached the tables."""
        self._writes.append(write)

    def run(self) -> None:
        """Write the tables held back (each write is the table hooks' own code: no user code runs)."""
        writes, self._writes = self._writes, []
        for write in writes:
            write()

    def __len__(self) -> int:
        return len(self._writes)


class _DropStandInCopies(TorchFunctionMode):
    """``param.copy_(stand_in)`` (torch's walk writing a table) does nothing; every other call runs as is."""

    def __init__(self, writes: LaterWrites) -> None:
        super().__init__()
        self._writes = writes

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and len(args) > 1 and self._writes.is_stand_in(args[1]):
            return args[0]
        return func(*args, **(kwargs or {}))


_ACTIVE: contextvars.ContextVar[LaterWrites | None] = contextvars.ContextVar("tte_later_writes", default=None)


def later_writes() -> LaterWrites | None:
    """The writes being held back by the load running in this thread, else ``None`` (write now)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def tables_written_later() -> Iterator[LaterWrites]:
    """Inside, a ``load_state_dict`` writes no table (every other tensor as usual); the writes wait in the
    :class:`LaterWrites` it yields, for :meth:`LaterWrites.run`.

    Under ``torch.__future__.set_swap_module_params_on_conversion(True)`` torch swaps the tensors instead
    of copying into them: nothing is held back then (the load writes the tables as it walks, as torch's).
    """
    writes = LaterWrites()
    if torch.__future__.get_swap_module_params_on_conversion():
        yield writes
        return
    token = _ACTIVE.set(writes)
    try:
        with _DropStandInCopies(writes):
            yield writes
    finally:
        _ACTIVE.reset(token)
