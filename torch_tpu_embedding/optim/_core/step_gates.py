"""The gates of one ``step()`` over every item of work: ``clipnorm`` of the tables split over a process group,
``global_clipnorm``'s one norm, the id exchange's overflow (which drops the whole call) and ``skip_nonfinite``.
Each is decided on the device (no ``.item()``): a 0-d flag every item's update is gated on, so a dropped call
changes nothing.

Over a process group every rank holds a part of each norm and of the check; :func:`call_gates` sums all of them
with one ``all_reduce`` per group (and dtype). The check is then taken on the gradients before a norm scales
them, which is the same check: a factor in ``[0, 1]`` keeps a finite gradient finite, and the factor is NaN
exactly where it would make one not finite (``global_norm_scale``: a norm that is not finite; ``clipnorm``: a
NaN norm), so a checked item that a NaN factor reaches ("exposed") fails the check.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu_embedding._rows.placement import all_reduce_sum, process_group_placement, reduction_group
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding.optim._core.extras import global_norm_scale
from torch_tpu_embedding.optim._core.grad_intake import Work

__all__ = ["call_gates", "exchange_clean", "gate_clean"]

Tensor = torch.Tensor


class _GroupSums:
    """0-d values to sum over process groups, one ``all_reduce`` per (group, dtype) for all of them, issued in the
    order their keys were first met (the same on every rank: the same items in the same order)."""

    def __init__(self) -> None:
        self.parts: dict[tuple[int, torch.dtype], tuple[Any, list[Tensor]]] = {}
        self.summed: dict[tuple[int, torch.dtype], Tensor] = {}

    def add(self, group: Any, x: Tensor) -> tuple[tuple[int, torch.dtype], int]:
        key = (id(group), x.dtype)
        values = self.parts.setdefault(key, (group, []))[1]
        values.append(x)
        return key, len(values) - 1

    def run(self) -> None:
        for key, (group, values) in self.parts.items():
            dev = values[0].device
            self.summed[key] = all_reduce_sum(torch.stack([v.to(dev) for v in values]), group)

    def __getitem__(self, at: tuple[tuple[int, torch.dtype], int]) -> Tensor:
        return self.summed[at[0]][at[1]]


def call_gates(work: list[Work], clean: Tensor | None) -> Tensor | None:
    """The gates of the call, in Keras's order: ``clipnorm`` of the tables split over a process group (each by its
    own norm, ``Work.norm_part`` summed over the group); ``global_clipnorm`` (one norm over every gradient of the
    groups that set it) scales their gradients; the exchange's overflow ``clean`` is folded into every item's gate
    (:func:`gate_clean`); ``skip_nonfinite`` keeps every update of the call only if all checked gradients (as
    clipped and scaled) are finite, folded into each checked item's gate. Returns the call's ``finite`` flag
    (``None`` when no group checks). What the tables split over a process group hold of the norms and of the check
    is summed in one ``all_reduce`` per group."""
    sums = _GroupSums()
    norms = [(w, sums.add(reduction_group(w.p), w.norm_part)) for w in work if w.norm_part is not None]
    clipped = [w for w in work if w.group["global_clipnorm"]]
    checked = [w for w in work if w.group["skip_nonfinite"]]
    sq = spread = None
    if clipped:  # (the gates before clean's: the norm is taken before the overflow drops the call)
        dev = clipped[0].g.device
        sq = torch.zeros((), dtype=torch.float64 if clipped[0].g.dtype == torch.float64 else torch.float32,
                         device=dev)
        spread = torch.zeros_like(sq)  # tables sharded over a process group: each rank holds a part of the norm
        for w in clipped:
            part = (w.g * w.g).sum().to(device=dev, dtype=sq.dtype)
            part = part if w.gate is None else torch.where(w.gate.to(dev), part, torch.zeros_like(part))
            if process_group_placement(w.p) is not None:
                spread = spread + part
            else:
                sq = sq + part
        clip_group = _group_of(clipped)
        spread_at = None if clip_group is None else sums.add(clip_group, spread)
    gate_clean(work, clean)
    check: list[tuple[tuple[int, torch.dtype], int] | Tensor] = []
    if checked:
        # An update its gate drops is not checked, as eagerly, where an accumulate-only call has no update to
        # check: on XLA that call runs one over the window so far and the last window's stale slots, and
        # counting it (once per call that sees a non-finite row, not once per window) set the moving
        # average's counter (and skipped_steps, saved) apart from the CPU's. (A call the exchange's overflow
        # drops is not counted as a skip anyway: StepCounters.count.)
        cdev = checked[0].g.device
        kind = sq.dtype if sq is not None else norms[0][0].g.dtype if norms else torch.float32
        bad = torch.zeros((), dtype=kind, device=cdev)  # checked items whose gradient is not finite
        exposed = torch.zeros_like(bad)  # checked items global_clipnorm's factor reaches
        exposed_to = {id(w): torch.zeros_like(bad) for w, _ in norms}  # checked items reached by their clipnorm
        for w in checked:
            on = torch.ones((), dtype=torch.bool, device=cdev) if w.gate is None else w.gate.to(cdev)
            bad = bad + (on & ~torch.isfinite(w.g).all().to(cdev)).to(kind)
            if w.g.numel() and w.group["global_clipnorm"]:
                exposed = exposed + on.to(kind)
            if w.g.numel() and id(w) in exposed_to:
                exposed_to[id(w)] = on.to(kind)
        values = [bad, exposed, *exposed_to.values()]
        check_group = _group_of(checked)
        check = list(values) if check_group is None else [sums.add(check_group, v) for v in values]
    sums.run()
    for w, at in norms:
        norm = torch.sqrt(sums[at])
        w.g = w.g * (float(w.group["clipnorm"]) / torch.clamp(norm, min=float(w.group["clipnorm"]))).to(w.g.device)
    scale: Tensor | None = None
    if spread is not None and sq is not None:
        scale = global_norm_scale(sq + (spread if spread_at is None else sums[spread_at]),
                                  float(clipped[0].group["global_clipnorm"]))
        for w in clipped:
            w.g = w.g * scale.to(w.g.device).to(w.g.dtype)
    if not check:
        return None
    bad, exposed, *exposed_each = (v if isinstance(v, Tensor) else sums[v] for v in check)
    finite = bad == 0
    if scale is not None:
        finite = finite & ((exposed == 0) | torch.isfinite(scale).to(finite.device))
    for (_, at), hit in zip(norms, exposed_each, strict=True):
        finite = finite & ((hit == 0) | ~torch.isnan(sums[at]).to(finite.device))
    for w in checked:
        ok = finite.to(w.g.device)
        w.gate = ok if w.gate is None else w.gate & ok
    return finite


def _group_of(items: list[Work]) -> Any:
    """The process group of the first of ``items``' tables sharded over one, else ``None``."""
    return next((s.group for s in (process_group_placement(w.p) for w in items) if s is not None), None)


def exchange_clean(params: list[Tensor]) -> Tensor | None:
    """Whether no lookup of this call's pending tables overflowed the id exchange (0-d bool on the device;
    ``None``: no table of ``params`` went through the exchange). Consumes nothing."""
    clean: Tensor | None = None
    for p in params:
        info = table_info(p)
        ok = None if info is None else info.row_grad.exchange_ok()
        if ok is not None:
            clean = ok if clean is None else clean & ok.to(clean.device)
    return clean


def gate_clean(work: list[Work], clean: Tensor | None) -> None:
    """The exchange's overflow drops the whole call: fold ``clean`` into every item's gate (every group,
    as ``skip_nonfinite`` does for the groups that set it)."""
    if clean is None:
        return
    for w in work:
        ok = clean.to(w.g.device) if w.g.device != clean.device else clean
        w.gate = ok if w.gate is None else w.gate & ok
