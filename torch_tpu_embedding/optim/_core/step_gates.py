"""The gates of one ``step()`` over every item of work: ``global_clipnorm``'s one norm, the id exchange's
overflow (which drops the whole call) and ``skip_nonfinite``. Each is decided on the device (no
``.item()``): a 0-d flag every item's update is gated on, so a dropped call changes nothing.
"""

from __future__ import annotations

import torch

from torch_tpu_embedding._rows.placement import all_reduce_sum, all_true, process_group_placement
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding.optim._core.extras import global_norm_scale
from torch_tpu_embedding.optim._core.grad_intake import Work

__all__ = ["exchange_clean", "gate_clean", "gate_nonfinite", "global_clip_scales"]

Tensor = torch.Tensor


def global_clip_scales(work: list[Work]) -> dict[torch.device, Tensor]:
    """Keras ``global_clipnorm``: one norm over every gradient of the groups that set it."""
    clipped = [w for w in work if w.group["global_clipnorm"]]
    if not clipped:
        return {}
    dev = clipped[0].g.device
    sq = torch.zeros((), dtype=torch.float64 if clipped[0].g.dtype == torch.float64 else torch.float32, device=dev)
    spread = torch.zeros_like(sq)  # tables sharded over a process group: each rank holds a part of the norm
    groups = [s.group for s in (process_group_placement(w.p) for w in clipped) if s is not None]
    for w in clipped:
        part = (w.g * w.g).sum().to(device=dev, dtype=sq.dtype)
        part = part if w.gate is None else torch.where(w.gate.to(dev), part, torch.zeros_like(part))
        if process_group_placement(w.p) is not None:
            spread = spread + part
        else:
            sq = sq + part
    if groups:
        sq = sq + all_reduce_sum(spread, groups[0])
    c = float(clipped[0].group["global_clipnorm"])
    scale = global_norm_scale(sq, c)
    return {w.g.device: scale.to(w.g.device) for w in clipped}


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


def gate_nonfinite(work: list[Work]) -> Tensor | None:
    """``skip_nonfinite``: keep every update of this call only if all checked gradients are finite.

    Folds the test into each checked item's gate; returns the call's ``finite`` flag (``None`` when no
    group checks).
    """
    checked = [w for w in work if w.group["skip_nonfinite"]]
    if not checked:
        return None
    dev = checked[0].g.device
    finite = torch.ones((), dtype=torch.bool, device=dev)
    for w in checked:
        ok = torch.isfinite(w.g).all()
        if w.gate is not None:
            # An update its gate drops is not checked, as eagerly, where an accumulate-only call has no update to
            # check: on XLA that call runs one over the window so far and the last window's stale slots, and
            # counting it (once per call that sees a non-finite row, not once per window) set the moving
            # average's counter (and skipped_steps, saved) apart from the CPU's. (A call the exchange's overflow
            # drops is not counted as a skip anyway: StepCounters.count.)
            ok = ok | ~w.gate
        finite = finite & ok.to(dev)
    groups = [s.group for s in (process_group_placement(w.p) for w in checked) if s is not None]
    if groups:  # tables sharded over a process group: every rank skips when any rank's part is not finite
        finite = all_true(finite, groups[0])
    for w in checked:
        ok = finite.to(w.g.device)
        w.gate = ok if w.gate is None else w.gate & ok
    return finite
