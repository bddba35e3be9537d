"""Keras's exponential moving average of the parameters (``use_ema``), exact on lazy tables.

``avg ← μ'·avg + (1−μ')·w`` after every call, with ``μ' = 0`` while Keras's ``iterations // k`` is 0
(the first average is the weights). A lazy table's row does not change between the calls that touch
it, so its average is brought up to date only when the row is next touched — after ``n`` idle calls
``avg = w + μⁿ (avg − w)`` (``ema_catch_up``) — using ``ema_last``, the call at which each row was
last brought up to date. The whole table is caught up only at an ``ema_overwrite_frequency`` call
(``w ← avg``, O(V·D) as in Keras) or by :meth:`~RowSparseOptimizer.finalize_variable_values`.

A call that ``skip_nonfinite`` drops changes no average and no weight, and does not count as a call
of the average (:meth:`StepClock.ema_on`), so lazy rows and dense parameters agree; nor does a call an
exchange overflow drops (:meth:`StepClock.on`).

With gradient accumulation (``k`` calls a window; on XLA too, whose accumulate-only calls go unchecked:
``step_gates.call_gates``) the check sees a window's sum at its last call,
so a non-finite micro-batch drops the whole window: none of its ``k`` calls counts (the counter counts the
calls of applied windows), a lazy row's catch-up never sees them, and a non-lazy parameter's average, which
Keras moves at every call, goes back to what it was when the window began (:func:`ema_calls`' record of it).
A window dropped is then as if it had not happened, on XLA too (the record there is rewritten at every call, in
the one graph every call traces).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torch_tpu_embedding._rows.dedup import is_static_device, sink_rows, sinks_sentinel
from torch_tpu_embedding._rows.placement import device_backend
from torch_tpu_embedding.optim._core.extras import ema_catch_up
from torch_tpu_embedding.optim._core.rule_pipeline import gated
from torch_tpu_embedding.optim._core.slots import RowSpace, lazy_table
from torch_tpu_embedding.optim._core.step_values import StepClock

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.grad_intake import Work

__all__ = [
    "ema_all_rows", "ema_calls", "ema_row_update", "ema_rows", "last_call", "momentum_now", "moving_average",
    "overwrite_due", "window_averages",
]

Tensor = torch.Tensor


def momentum_now(group: Mapping[str, Any], clock: StepClock, device: torch.device, dtype: torch.dtype) -> Tensor:
    """μ' = 0 while Keras's ``iterations`` (calls // k) is 0, else ``ema_momentum``."""
    k = group["gradient_accumulation_steps"] or 1
    it = clock.ema_on(device, group["skip_nonfinite"], k)
    mu: Tensor = (torch.div(it, k, rounding_mode="floor") != 0).to(dtype) * group["ema_momentum"]
    return mu


def ema_rows(item: Work, space: RowSpace, ids: Tensor, w_old: Tensor, w_new: Tensor) -> None:
    """Catch the touched rows' averages up over their idle calls, then apply this call's EMA.

    ``ids [U]`` unique touched rows of ``space`` (sentinel tail allowed), ``w_old``/``w_new`` their
    weights before/after this call's update.
    """
    p, group, state, where = space.p, item.group, space.state, space.where
    it = item.clock.ema_on(p.device, group["skip_nonfinite"], group["gradient_accumulation_steps"]).to(torch.int32)
    # The item's gate, not only the call's (clock.keep): on XLA it also holds the accumulation window's, and an
    # accumulate-only call, which runs the update there (one graph) over the window's buffer (stale slots of the
    # last window included), must bring no row's average up to date, as eagerly, where it updates nothing: else
    # ema_last (and the raw ema) name another call than the CPU's, for rows the call did not even touch.
    keep = item.gate
    avg0 = space.gather("ema", ids)
    last0 = space.gather("ema_last", ids)
    mu = momentum_now(group, item.clock, p.device, w_new.dtype)
    avg, last = ema_row_update(avg0, last0, w_old, w_new, it, keep, mu, group["ema_momentum"])
    at = ids
    if sinks_sentinel(p.device):  # the sentinel tail into the sink row
        at, avg = sink_rows(ids, avg, avg0, p.shape[0])
        last = sink_rows(ids, last, last0, p.shape[0])[1]
    state["ema"].index_copy_(0, where.at("ema", at), avg)
    state["ema_last"].index_copy_(0, where.at("ema_last", at), last)


def ema_row_update(
    avg: Tensor, last: Tensor, w_old: Tensor, w_new: Tensor, it: Tensor, keep: Tensor | None, mu: Tensor,
    momentum: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """The touched rows' new ``(ema, ema_last)``: caught up over their idle calls, then this call's
    average (``it``: this call's counter, int32; ``keep``: the non-finite gate; ``mu``: μ' now)."""
    caught = ema_catch_up(avg, w_old, it - last - 1, momentum)
    # max(last, it) == it, but written as a function of the gathered rows so that XLA orders the
    # gather before the in-place scatter (otherwise it copies the whole [V] slot every step).
    return gated(keep, mu * caught + (1 - mu) * w_new, avg), gated(keep, torch.maximum(last, it), last)


def ema_all_rows(space: RowSpace, group: Mapping[str, Any], upto: Tensor) -> Tensor:
    """Every row's average as of call ``upto`` (lazy table): ``[rows, D]`` in the table's row order,
    not stored."""
    idle = upto.to(torch.int32) - space.table_order("ema_last")
    avg = space.table_order("ema")
    return ema_catch_up(avg, space.p.to(avg.dtype), idle, group["ema_momentum"])


def overwrite_due(group: Mapping[str, Any], iterations: int) -> bool:
    """Whether this call (``iterations`` calls before it) copies the averages into the weights."""
    k = group["gradient_accumulation_steps"] or 1
    f = group["ema_overwrite_frequency"]
    return bool(f) and ((iterations // k) + 1) % f == 0


def ema_calls(
    groups: list[dict[str, Any]],
    state_for: Callable[[Tensor, dict[str, Any]], dict[str, Tensor]],
    clock: StepClock,
    window_start: dict[int, Any] | None = None,
) -> None:
    """After the updates of a call: EMA of dense (and non-lazy) parameters, and the periodic overwrite.

    ``window_start`` (eager gradient accumulation with ``skip_nonfinite``): each non-lazy parameter's average
    as its window began, by ``id``, kept by the optimizer between calls (:func:`window_averages`)."""
    for group in groups:
        if not group["use_ema"]:
            continue
        overwrite = overwrite_due(group, clock.iterations)
        starts = window_averages(group, clock.iterations, window_start)
        for p in group["params"]:
            space = RowSpace.of(p, group, state_for(p, group))
            keep = clock.keep(p.device, group["skip_nonfinite"])
            avg = space.table_order("ema")
            if starts is not None and not lazy_table(p, group):
                avg = _restore_dropped(starts, p, avg, keep, group, clock)
            if lazy_table(p, group):
                if overwrite:  # O(V·D), every f calls, as in Keras
                    it = clock.ema_on(p.device, group["skip_nonfinite"], group["gradient_accumulation_steps"])
                    caught = ema_all_rows(space, group, it)
                    space.write("ema", gated(keep, caught, avg))
                    last = space.table_order("ema_last")
                    space.write("ema_last", gated(keep, it.to(torch.int32).expand(p.shape[0]), last))
                    p.copy_(gated(keep, caught, p))
                continue
            mu = momentum_now(group, clock, p.device, avg.dtype)
            avg = gated(keep, mu * avg + (1 - mu) * p, avg)
            space.write("ema", avg)
            if overwrite:
                p.copy_(gated(keep, avg, p))


def window_averages(group: Mapping[str, Any], iterations: int,
                    window_start: dict[int, Any] | None) -> dict[int, Any] | None:
    """The store of the group's averages at its window's start, or ``None`` where none is kept: only with gradient
    accumulation and ``skip_nonfinite``, where a window's accumulate-only calls average (Keras's per-call EMA)
    before the check at its last call can drop the window."""
    if window_start is None or not group["gradient_accumulation_steps"] or not group["skip_nonfinite"]:
        return None
    return window_start


def _restore_dropped(starts: dict[int, Any], p: Tensor, avg: Tensor, keep: Tensor | None,
                     group: Mapping[str, Any], clock: StepClock) -> Tensor:
    """Non-lazy ``p``'s average before this call's: at a window's first call it is recorded (a copy, the size
    of the parameter, once a window); at its last call, when the call is dropped (``keep`` False), the window's
    accumulate-only calls are undone (the average it began with), so the dropped window counts no call."""
    k = group["gradient_accumulation_steps"]
    if is_static_device(p.device):
        return _restore_dropped_static(starts, p, avg, keep, k, clock)
    if clock.iterations % k == 0:
        starts[id(p)] = avg.clone()
    if (clock.iterations + 1) % k == 0 and keep is not None and id(p) in starts:
        avg = gated(keep, avg, starts.pop(id(p)))
    return avg


def _restore_dropped_static(starts: dict[int, Any], p: Tensor, avg: Tensor, keep: Tensor | None, k: int,
                            clock: StepClock) -> Tensor:
    """:func:`_restore_dropped` in one graph for every call (XLA): the record is a buffer the size of the average,
    rewritten at a window's first call (``where``, on the device's call counter, as the accumulation's window runs),
    with a flag saying it holds one (as eagerly, a window begun before the record existed, under another optimizer
    object or before a load, keeps its averages). Made as device data (uploaded, not a constant of the graph), so the
    first call traces the graph every call traces."""
    record = starts.get(id(p))
    if record is None:
        buffer = torch.zeros(avg.shape, dtype=avg.dtype).to(avg.device)
        if avg.device.type == "xla" and avg.shape == p.shape:  # (the parameter's layout on a mesh, not a replica)
            device_backend("xla").shard_slot(p, buffer, rows=True)
        # (the flag kept [1]-shaped: a 0-d one would enter the first call as an upload and later ones as the call
        # before's 0-d output, two graphs; StepCounters keeps its counters so)
        record = (buffer, torch.zeros(1, dtype=torch.bool).to(avg.device))
    start, held = record
    it = clock.on(avg.device)
    first = torch.remainder(it, k) == 0
    start, held = torch.where(first, avg, start), held | first.reshape(1)
    starts[id(p)] = (start, held)
    if keep is None:
        return avg
    last = torch.remainder(it + 1, k) == 0
    return torch.where(last & held.reshape(()) & ~keep.to(avg.device), start, avg)


def last_call(
    group: Mapping[str, Any], device: torch.device, iterations: int, skipped: Tensor | None,
    dropped: Tensor | None = None,
) -> Tensor:
    """The average's counter at the last of ``iterations`` calls (``skipped`` of them dropped by
    ``skip_nonfinite``, ``dropped`` by an exchange overflow)."""
    clock = StepClock(iterations - 1, skipped, dropped)
    return clock.ema_on(device, group["skip_nonfinite"], group["gradient_accumulation_steps"])


def moving_average(
    p: Tensor, group: Mapping[str, Any], state: dict[str, Tensor], iterations: int, skipped: Tensor | None,
    dropped: Tensor | None = None,
) -> Tensor:
    """The EMA of ``p`` after ``iterations`` calls (every row caught up), as a new tensor in ``p``'s
    row order."""
    space = RowSpace.of(p, group, state)
    if lazy_table(p, group):
        return ema_all_rows(space, group, last_call(group, p.device, iterations, skipped, dropped))
    return space.table_order("ema").clone()
