"""A table's row-sparse gradient: :class:`RowGrad` (and :class:`BagRows`, its factored rows).

An embedding table never receives a dense ``[V, D]`` gradient. The lookup's backward hands each
table a :class:`RowGrad`: the ids it looked up and one gradient row per id (``[N]`` and ``[N, D]``),
accumulated across features sharing the table and across backward calls until an optimizer
consumes it (or ``zero_grad`` clears it). Which tensors are tables, and their :class:`RowGrad`, is
:mod:`torch_tpu_embedding._rows.tables`'s registry.

Padding positions carry the *sentinel* id ``rows`` (one past the last physical row of the table).
On XLA, gather clamps that index and scatter drops it, so the step keeps static shapes; in eager
mode the sentinel entries are filtered out before the update (``-1`` is never a sentinel: XLA
wraps it to ``V-1``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from torch_tpu_embedding._rows.backward_order import note_backward

__all__ = ["BagRows", "RowGrad", "row_grad_by_handle"]


class BagRows:
    """The per-id gradient rows of a lookup, ``gains[n, l] · grad_out[n]``, not yet multiplied out.

    ``[N·L, D]`` rows at 20 ids per bag are 21 MB per table and step; made whole they cost a pass
    over memory and, with glibc's defaults, page faults every step. SGD's eager step multiplies them
    out in small pieces (:meth:`RowGrad.pieces`) and adds each to the table. The other optimizers
    sum rows per id first; for them the backward multiplies the rows out as before, which measured
    faster (LazyAdam at 20 ids, 4 tables: 250–290 ms against 285–345 ms multiplying out in the step).
    """

    __slots__ = ("constant", "gains", "grad_out", "uniform", "unit")

    def __init__(self, gains: torch.Tensor, grad_out: torch.Tensor, unit: bool = False, uniform: bool = False,
                 constant: float | None = None) -> None:
        self.gains = gains  # [N, L]
        self.grad_out = grad_out  # [N, D]
        self.unit = unit  # every gain is 1 where the id is not padding (sum bags, no per-id weights)
        #: within each bag every gain is the same where the id is not padding, 0 at padding (no per-id weights)
        self.uniform = uniform or unit or constant is not None
        #: every gain of every bag is this number, exactly (the lookup's fill of full mean bags), or ``None``
        self.constant = constant

    def per_bag(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, D]``: each bag's gradient row times its one gain, ``gains[n, l] · grad_out[n]`` for every
        ``l`` not padding, bitwise (the same product); only for :attr:`uniform` bags. Written into ``out``
        if given (else a unit bag's is ``grad_out`` itself)."""
        assert self.uniform
        if self.unit:
            return self.grad_out if out is None else out.copy_(self.grad_out)
        g, grad_out = self.gains, self.grad_out
        if self.constant is not None:
            # One gain for every bag, known: no pass over the gains. The products are those below, each
            # grad_out[n, j] · gain (the number is the gains' value: a scalar operand of their dtype); a
            # gradient that is one row broadcast (row stride 0, as loss = out.sum() gives) has one row of
            # them, kept broadcast (row_sums and the C row loops read it so).
            row = _broadcast_row(grad_out) if out is None else None
            if row is not None:
                return torch.mul(row, self.constant).expand(grad_out.shape)
            return torch.mul(grad_out, self.constant, out=out)
        # amax: the bag's gain (padding holds 0, real ids the gain, which is >= 0 without per-id weights);
        # bags of width 0 have no id to take a row
        gain = g.amax(dim=1, keepdim=True) if g.shape[1] else g.new_zeros(g.shape[0], 1)
        return torch.mul(grad_out, gain, out=out)

    @property
    def width(self) -> int:
        """``L``, the ids per bag (padding included)."""
        return int(self.gains.shape[1])

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows of bags ``[start, stop)`` as ``[(stop - start)·L, D]``."""
        return self.spread(self.grad_out[start:stop], start, stop)

    def spread(self, per_bag: torch.Tensor, start: int = 0, stop: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``gains[n, l] · per_bag[n]`` for bags ``[start, stop)`` as ``[(stop - start)·L, D]``; ``per_bag``
        holds those bags' rows (``grad_out``'s, or a linear function of them); written into ``out`` if given."""
        g = self.gains[start:stop]
        if out is None:
            return (g.unsqueeze(-1) * per_bag.unsqueeze(1)).reshape(-1, per_bag.shape[-1])
        torch.mul(g.unsqueeze(-1), per_bag.unsqueeze(1), out=out.view(g.shape[0], g.shape[1], per_bag.shape[-1]))
        return out


class RowGrad:
    """Accumulated row-sparse gradient of one table: chunks of ``(ids [n], rows [n, D])``.

    Chunks are kept as a list and concatenated when consumed, so a steady training loop (the same
    features, the same number of backward calls per step) always produces the same shapes. A chunk's
    rows may be a :class:`BagRows` (eager lookups), multiplied out when consumed.

    A table trained through the id exchange gets *owner-local* chunks instead (:meth:`add_owned`):
    ``ids [n, M]`` device-major (row ``d``: shard ``d``'s local rows, ``R/n`` = padding) and
    ``rows [n, M, D]``, plus a 0-d flag that is False when the lookup dropped ids (overflow).
    """

    __slots__ = ("__weakref__", "_ids", "_ok", "_rows", "exchanged", "handle", "keep_factored", "raw_exchange",
                 "reached", "variable_rows")

    def __init__(self) -> None:
        self.handle = -1  # not registered: a temporary (take(), local_part()), which no lookup is given
        self._ids: list[torch.Tensor] = []
        self._rows: list[torch.Tensor | BagRows] = []
        self._ok: list[torch.Tensor] = []  # owner-local chunks: whether their lookup dropped no id
        #: set by the optimizer that consumes this gradient piecewise (SGD's eager step): eager
        #: lookups then add :class:`BagRows` instead of multiplied-out rows
        self.keep_factored = False
        #: set by the optimizer whose group has ``use_gradient_accumulation=False``: data parallel sends
        #: every looked-up row as it is (the update applies duplicates one by one), not each rank's sums;
        #: read by whoever exchanges first (the step, or ``tte.clip_grad_norm_`` before it)
        self.raw_exchange = False
        #: data parallel (:mod:`torch_tpu_embedding.distributed`): the leading chunks that already
        #: hold the process group's global gradient
        self.exchanged = 0
        #: names of the tables whose lookups' backward added a chunk (a stacked group's members, which
        #: may have had no id of their own: bags all empty)
        self.reached: set[str] = set()
        #: a pending chunk came from jagged bags (as many rows as the data's ids): data parallel exchanges counts
        self.variable_rows = False

    @classmethod
    def registered(cls) -> RowGrad:  # a table's: a compiled backward names it by an int (_lookup.add_rows)
        out = cls()
        out.handle = next(_HANDLES)
        _BY_HANDLE[out.handle] = out
        return out

    def __setstate__(self, state: tuple[None, dict[str, Any]]) -> None:  # deepcopy, pickle: another table's
        self.raw_exchange = self.variable_rows = False  # pickled before they existed
        for k, v in state[1].items():
            setattr(self, k, v)
        if self.handle >= 0:
            self.handle = next(_HANDLES)
            _BY_HANDLE[self.handle] = self

    def add(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Add ``ids [n]`` with gradient ``rows [n, D]`` (sentinel ids allowed for padding)."""
        note_backward()
        self._ids.append(ids.reshape(-1))
        self._rows.append(rows.reshape(ids.numel(), rows.shape[-1]))  # explicit D: n may be 0

    def add_bags(self, ids: torch.Tensor, gains: torch.Tensor, grad_out: torch.Tensor, unit: bool = False,
                 uniform: bool = False, constant: float | None = None) -> None:
        """Add ``ids [N, L]`` whose gradient rows are ``gains[n, l] · grad_out[n]`` (kept factored; ``unit``:
        every gain is 1 where the id is not padding; ``uniform``: each bag's gains are one value there;
        ``constant``: every gain is this number)."""
        note_backward()
        self._ids.append(ids.reshape(-1))
        self._rows.append(BagRows(gains, grad_out, unit, uniform, constant))

    def add_owned(self, ids: torch.Tensor, rows: torch.Tensor, ok: torch.Tensor) -> None:
        """Add an owner-local chunk: ``ids [n, M]`` (shard-local rows), ``rows [n, M, D]``, ``ok`` (0-d bool)."""
        self._ids.append(ids)
        self._rows.append(rows)
        self._ok.append(ok)

    @property
    def owned(self) -> bool:
        """The pending chunks are owner-local (:meth:`add_owned`)."""
        return bool(self._ok)

    def exchange_ok(self) -> torch.Tensor | None:
        """True (0-d bool, on the device) when no pending owner-local chunk's lookup dropped ids; ``None``
        when there are none. Read without consuming anything."""
        if not self._ok:
            return None
        ok = self._ok[0]
        for o in self._ok[1:]:
            ok = ok & o
        return ok

    def collect_owned(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Owner-local chunks as one ``(ids [n, ΣM], rows [n, ΣM, D], ok)``: concatenated per shard, ``ok``
        True when no chunk dropped ids."""
        if not self._ok or len(self._ok) != len(self._ids):
            raise RuntimeError("RowGrad holds no owner-local chunks (or mixes them with global ones).")
        rows = [r for r in self._rows if isinstance(r, torch.Tensor)]
        ok = self.exchange_ok()
        assert ok is not None
        if len(self._ids) == 1:
            return self._ids[0], rows[0], ok
        return torch.cat(self._ids, dim=1), torch.cat(rows, dim=1), ok

    def __bool__(self) -> bool:
        return len(self._ids) > 0  # (dynamo traces len() of a list, not bool() of one)

    def __len__(self) -> int:
        return len(self._ids)

    def collect(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All chunks as one ``(ids [N], rows [N, D])`` pair (duplicates and sentinels kept)."""
        if not self._ids:
            raise RuntimeError("RowGrad is empty: no backward pass reached this table.")
        if self._ok:
            ids, grad, _ = self.collect_owned()
            return ids, grad
        rows = [r.rows() if isinstance(r, BagRows) else r for r in self._rows]
        if len(self._ids) == 1:
            return self._ids[0], rows[0]
        return torch.cat(self._ids), torch.cat(rows)

    def ids(self) -> torch.Tensor:
        """Every chunk's ids as one ``[N]`` tensor (in :meth:`collect`'s order; no rows made)."""
        return self._ids[0] if len(self._ids) == 1 else torch.cat(self._ids)

    def local_part(self) -> RowGrad:
        """The chunks not yet exchanged across a process group (shared, not copied)."""
        out = RowGrad()
        out._ids, out._rows = self._ids[self.exchanged :], self._rows[self.exchanged :]
        return out

    def set_local(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Replace the chunks not yet exchanged by ``(ids [n], rows [n, D])``, marked exchanged."""
        del self._ids[self.exchanged :], self._rows[self.exchanged :]
        self.add(ids, rows)
        self.exchanged = len(self._ids)

    def pieces(self, max_rows: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(position, ids, rows)`` in order, about ``max_rows`` rows at a time; ``position`` is the
        first row's index in :meth:`collect`'s order."""
        pos = 0
        for ids, rows in zip(self._ids, self._rows, strict=True):
            if isinstance(rows, BagRows):
                width = max(1, rows.width)
                step = max(1, max_rows // width)
                for b in range(0, rows.gains.shape[0], step):
                    part = rows.rows(b, b + step)
                    yield pos + b * width, ids[b * width : b * width + part.shape[0]], part
            else:
                for a in range(0, ids.numel(), max_rows):
                    yield pos + a, ids[a : a + max_rows], rows[a : a + max_rows]
            pos += ids.numel()

    def chunks(self) -> list[tuple[torch.Tensor, torch.Tensor | BagRows]]:
        """The chunks as added: ``(ids [n], rows [n, D] or BagRows)``."""
        return list(zip(self._ids, self._rows, strict=True))

    def scale_(self, coef: torch.Tensor, dtype: torch.dtype) -> None:
        """Multiply every pending row by the 0-d ``coef`` (as ``clip_grad_norm_`` scales a ``.grad``), in
        ``dtype`` (the update's: float32 for a 16-bit table). The chunks keep their ids, order and form
        (no duplicate is summed), so a ``coef`` of 1 leaves the step bitwise as it was."""
        for i, rows in enumerate(self._rows):
            if isinstance(rows, BagRows):
                out = rows.grad_out.to(dtype)
                scaled = _broadcast_row(out)  # (one row broadcast, as loss = out.sum() gives: kept so)
                if scaled is not None:
                    scaled = (scaled * coef.to(device=out.device, dtype=dtype)).expand(out.shape)
                else:
                    scaled = out * coef.to(device=out.device, dtype=dtype)
                self._rows[i] = BagRows(rows.gains, scaled, rows.unit, rows.uniform, rows.constant)
            else:
                self._rows[i] = rows.to(dtype) * coef.to(device=rows.device, dtype=dtype)

    def take(self) -> RowGrad:
        """A new :class:`RowGrad` holding this one's chunks; this one is left empty."""
        out = RowGrad()
        out._ids, out._rows, out._ok = list(self._ids), list(self._rows), list(self._ok)
        out.variable_rows = self.variable_rows
        self.clear()
        return out

    def clear(self) -> None:
        self._ids.clear()
        self._rows.clear()
        self._ok.clear()
        self.exchanged = 0
        self.reached.clear()
        self.variable_rows = False


def _broadcast_row(t: torch.Tensor) -> torch.Tensor | None:
    """``t [N, D]``'s one row ``[1, D]`` where every row is it (row stride 0, N > 0), else ``None``."""
    return t[:1] if t.dim() == 2 and t.shape[0] and t.stride(0) == 0 else None


_HANDLES = itertools.count()
_BY_HANDLE: weakref.WeakValueDictionary[int, RowGrad] = weakref.WeakValueDictionary()
row_grad_by_handle = _BY_HANDLE.__getitem__  # the live RowGrad of a handle
