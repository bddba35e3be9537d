"""Per-step values as device data: the learning rate and the call counter.

On XLA a Python number or a 0-d host tensor that reaches the graph becomes a constant, and a new
value compiles a new graph. Values that change between steps (a schedule's learning rate, the call
counter that gates gradient accumulation and EMA) therefore travel as 1-element device tensors,
so a steady training loop compiles once.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.transfer import upload
from torch_tpu_embedding._util.validation import check_number

__all__ = ["COUNTERS", "LearningRates", "StepClock", "StepCounters", "check_lr", "lr_value", "step_lrs", "to_device"]

Tensor = torch.Tensor

#: The call counters an optimizer's saved state holds, by their keys in it, in :meth:`StepCounters.restore`'s
#: order (``overflowed_steps``, saved since 2026-12-02, reads as 0 where absent).
COUNTERS = ("iterations", "skipped_steps", "overflowed_steps")


def to_device(v: Tensor, device: torch.device) -> Tensor:
    """``v`` on ``device`` as a new tensor; a 0-d value goes through shape [1] (an XLA constant otherwise)."""
    if v.device == device:
        return v.clone()
    return v.reshape(1).to(device).reshape(()) if v.dim() == 0 else v.to(device)


def check_lr(lr: float | torch.Tensor, on_device: bool = False) -> None:
    """A learning rate's value must be finite and >= 0. A tensor on an accelerator is read only when
    ``on_device`` (a device-to-host transfer): done once when it is set, never per step."""
    if isinstance(lr, torch.Tensor):
        if lr.device.type != "cpu" and not on_device:
            return
        value: Any = float(lr.detach().reshape(()).cpu())
    else:
        value = lr
    check_number("lr", value, minimum=0.0)


def lr_value(group: dict[str, Any]) -> float | Tensor:
    """The group's learning rate for this step (a callable ``lr`` is called), checked finite and >= 0
    on the host (a tensor on an accelerator is not read: that would sync every step)."""
    lr = group["lr"]
    value: float | Tensor = lr() if callable(lr) and not isinstance(lr, Tensor) else lr
    if not isinstance(value, Tensor) and not isinstance(value, numbers.Real):
        raise TypeError(f"The learning rate must be a float or a 0-d tensor. Received: {value!r}")
    if value is not lr and isinstance(value, Tensor) and value.numel() != 1:  # the shape needs no device read
        raise ValueError(
            f"The callable `lr` ({lr!r}) must return one number (a float or a 0-d tensor). It returned a tensor "
            f"of shape {tuple(value.shape)}."
        )
    if isinstance(value, Tensor) and value.numel() != 1:  # set in a group after construction: named, not reshaped
        raise ValueError(f"Argument `lr` (a parameter group's 'lr') must be a float, a 0-d tensor or a callable. "
                         f"Received: a tensor of shape {tuple(value.shape)}")
    check_lr(value)
    return value


def step_lrs(groups: list[dict[str, Any]], pending: list[list[Tensor]]) -> list[float | Tensor | None]:
    """Each group's learning rate for this step (:func:`lr_value`; ``None`` where no gradient is pending). A callable
    ``lr`` held by several groups (the constructor's, which every group without its own inherits) is called once and
    its value shared, as TF evaluates each distinct learning-rate callable once per step for every table holding it:
    a callable that counts its calls (a schedule of its own) would otherwise advance once per group."""
    called: dict[int, float | Tensor] = {}
    out: list[float | Tensor | None] = []
    for group, params in zip(groups, pending, strict=True):
        lr = group["lr"]
        if not params:
            out.append(None)
        elif callable(lr) and not isinstance(lr, Tensor):
            if id(lr) not in called:  # (the groups hold lr for the whole call: its id is not reused meanwhile)
                called[id(lr)] = lr_value(group)
            out.append(called[id(lr)])
        else:
            out.append(lr_value(group))
    return out


class LearningRates:
    """Learning rates as device data, uploaded only when they change."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, torch.device, torch.dtype], tuple[float, Tensor]] = {}

    def clear(self) -> None:
        self._cache.clear()

    def tensor(self, gi: int, lr: float | Tensor, p: Tensor) -> Tensor:
        """Group ``gi``'s learning rate ``lr`` as a 0-d tensor on ``p``'s device, in the dtype of ``p``'s
        update arithmetic (:func:`~torch_tpu_embedding._util.dtypes.math_dtype`)."""
        dtype = math_dtype(p)
        if isinstance(lr, Tensor):
            # 0-d whatever its shape (lr_value: one number): a [1] lr set in a group, as torch.optim takes it, would
            # make a 0-d parameter's update [1]-shaped. Through a 1-element shape: a 0-d host tensor would become an
            # XLA constant.
            lr = lr.detach().to(dtype=dtype)
            return lr.reshape(()) if lr.device == p.device else upload(lr.reshape(1), p.device).reshape(())
        key = (gi, p.device, dtype)
        cached = self._cache.get(key)
        if cached is None or cached[0] != lr:
            # A 0-d host tensor moved to XLA is folded into the graph as a constant (one compile
            # per value); a 1-element tensor arrives as device data. (A schedule sets a new value each step:
            # not a blocking copy, which on CUDA would wait for the device.)
            cached = (float(lr), upload(torch.tensor([float(lr)], dtype=dtype), p.device))
            self._cache[key] = cached
        # Reshaped on every use: a cached 0-d view would be materialised by the first step's sync
        # and change the next step's graph inputs ([1] -> []), compiling twice.
        return cached[1].reshape(())


class StepCounters:
    """What ``step()`` counts, kept out of the optimizer's own attributes: under torch.compile dynamo
    cannot trace an assignment to an attribute of a ``torch.optim.Optimizer`` (its ``OptimizerVariable``
    takes no attribute mutation), while it traces one to this object's."""

    __slots__ = ("checked_retired", "dropped", "ema_window", "groups_checked", "iterations", "last_skipped", "skipped",
                 "slot_options")

    def __init__(self, iterations: int = 0) -> None:
        #: calls of ``step()`` so far (Keras ``iterations`` before the ``// k`` of accumulation)
        self.iterations = iterations
        self.checked_retired = -1  # retired_count() when the parameters were last checked
        self.skipped: Tensor | None = None  # device-side count of calls dropped by skip_nonfinite
        self.dropped: Tensor | None = None  # device-side count of calls dropped by an exchange overflow
        self.last_skipped: Tensor | None = None  # whether the last call was dropped (0-d bool, device)
        #: non-lazy parameters' moving averages as the accumulation window under way began, by id (ema.ema_calls):
        #: a tensor eagerly; on XLA the buffer and whether it holds a record
        self.ema_window: dict[int, Any] = {}
        #: each group's options that shape its state, by position, as the last step saw them (check_slot_options)
        self.slot_options: dict[int, tuple[Any, ...]] = {}
        #: each group's hyper-parameters, by position, as the last step checked them (check_edited_groups)
        self.groups_checked: dict[int, dict[str, Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """What a copy of the optimizer (``copy.deepcopy``, ``pickle``) keeps: the counts, without which it would
        begin again at call 0 (shifting the accumulation windows, the moving average's clock, ``skipped_steps``), as
        a copy of a torch.optim optimizer keeps its ``state``. As after a load (:meth:`restore`), not the record of
        the averages as a window under way began, which is kept by parameter ``id``."""
        return {"iterations": self.iterations, "skipped": self.skipped, "dropped": self.dropped,
                "last_skipped": self.last_skipped, "slot_options": dict(self.slot_options)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        StepCounters.__init__(self, state["iterations"])
        self.skipped, self.dropped, self.last_skipped = state["skipped"], state["dropped"], state["last_skipped"]
        self.slot_options = state.get("slot_options", {})

    def restore(self, iterations: int, skipped_steps: int = 0, overflowed_steps: int = 0) -> None:
        """The counters as a checkpoint saved them (``skipped_steps`` counts both kinds of dropped calls, as
        :attr:`RowSparseOptimizer.skipped_steps` does; ``overflowed_steps`` of them the exchange's). The record of
        the averages as the window under way began (``ema_window``) is this object's run's, which a checkpoint
        does not save: it is forgotten, so a window begun before the load and then dropped keeps its averages, as
        under a fresh optimizer."""
        skipped = skipped_steps - overflowed_steps
        self.iterations = iterations
        self.skipped = torch.tensor([skipped], dtype=torch.int64) if skipped else None
        self.dropped = torch.tensor([overflowed_steps], dtype=torch.int64) if overflowed_steps else None
        self.last_skipped = None  # (no call since the load: a checkpoint does not keep the last call's flag)
        self.ema_window.clear()
        self.slot_options.clear()  # (the loaded state is made for the loaded options)
        self.groups_checked.clear()

    def start(self, clean: Tensor | None, checked: torch.device | None = None) -> None:
        """A call begins; ``clean``: whether its lookups dropped no id (``None``: no table of the call goes
        through the id exchange); ``checked``: the device of a parameter whose group sets ``skip_nonfinite``."""
        if clean is not None and self.dropped is None:  # uploaded: every step then traces the same graph
            self.dropped = torch.zeros(1, dtype=torch.int64).to(clean.device)
        if checked is not None and self.skipped is None:  # the same: the moving average's counter subtracts it
            self.skipped = torch.zeros(1, dtype=torch.int64).to(checked)

    def count(self, finite: Tensor | None, clean: Tensor | None) -> None:
        """Count the call as ``skip_nonfinite`` (``finite``: whether its gradients are; ``None``: not checked)
        and the exchange's overflow (``clean``, as in :meth:`start`) decided it."""
        if finite is not None:
            # A call the overflow drops counts once, there (it is no call at all for the clock).
            dropped = ~finite if clean is None else ~finite & clean.to(finite.device)
            skipped = dropped.to(torch.int64)
            dev = finite.device
            # Kept [1]-shaped: a 0-d counter would enter the first step as an upload and later steps as the
            # previous step's 0-d output, two different graphs.
            base = torch.zeros(1, dtype=torch.int64).to(dev) if self.skipped is None else self.skipped
            self.skipped = (base if base.device == dev else base.to(dev)) + skipped.reshape(1)
        if clean is not None and self.dropped is not None:
            self.dropped = self.dropped.to(clean.device) + (~clean).to(torch.int64).reshape(1)
        kept = clean if finite is None else finite if clean is None else finite & clean.to(finite.device)
        self.last_skipped = None if kept is None else ~kept

    def skipped_count(self) -> int:
        """Calls ``skip_nonfinite`` dropped so far (reading it syncs an XLA device)."""
        return 0 if self.skipped is None else int(self.skipped.item())

    def skipped_now(self) -> Tensor | None:
        """The count of calls ``skip_nonfinite`` dropped, 0-d (``None`` before the first)."""
        return None if self.skipped is None else self.skipped.reshape(())

    def dropped_now(self) -> Tensor | None:
        """The count of calls an exchange overflow dropped, 0-d (``None`` without exchanged tables)."""
        return None if self.dropped is None else self.dropped.reshape(())


class StepClock:
    """The optimizer's call counter (Keras ``iterations``) for one call of ``step()``.

    ``skipped``: calls dropped by ``skip_nonfinite`` before this one (a device tensor, or ``None``
    for none yet); ``finite``: whether this call's checked gradients are finite (set once known).
    ``dropped``: calls dropped before this one because a lookup overflowed the id exchange (a device
    tensor, or ``None``): they are not calls at all, so :meth:`on` leaves them out of the counter (the
    accumulation window and the moving average go on as if they had not happened); ``clean``: whether
    this call's lookups dropped no id (``None``: no table of the call goes through the exchange).
    """

    def __init__(self, iterations: int, skipped: Tensor | None = None, dropped: Tensor | None = None) -> None:
        self.iterations = iterations
        self.skipped = skipped
        self.dropped = dropped
        self.finite: Tensor | None = None
        self.clean: Tensor | None = None
        self._tensors: dict[torch.device, Tensor] = {}

    def ema_on(self, device: torch.device, skip_nonfinite: bool, window: int | None = None) -> Tensor:
        """The moving average's call counter: calls dropped by ``skip_nonfinite`` do not count. ``window``:
        the group's ``gradient_accumulation_steps``; a non-finite window is dropped at its last call, the one call
        ``skipped`` counts, and none of its ``window`` calls counts (the counter counts the calls of applied
        windows). So on XLA too, whose accumulate-only calls are not checked (``step_gates.call_gates``): one
        meaning of ``skipped_steps`` in every layout, so that a checkpoint moved between them continues alike."""
        it = self.on(device)
        if not skip_nonfinite or self.skipped is None:
            return it
        per = window or 1
        return it - self.skipped.to(device) * per

    def keep(self, device: torch.device, skip_nonfinite: bool) -> Tensor | None:
        """This call's gate on ``device``: the non-finite test (groups that set ``skip_nonfinite``) and
        the exchange's (every group); ``None``: nothing to gate."""
        finite = self.finite.to(device) if skip_nonfinite and self.finite is not None else None
        clean = None if self.clean is None else self.clean.to(device)
        if finite is None or clean is None:
            return clean if finite is None else finite
        return finite & clean

    def device_values(self, device: torch.device) -> list[Tensor | None]:
        """``[counter, skipped, finite, clean]`` on ``device`` (``None`` where absent), e.g. to enter a
        manual-sharding region (:meth:`with_device_values` rebuilds the clock from them inside)."""
        skipped = None if self.skipped is None else self.skipped.to(device)
        finite = None if self.finite is None else self.finite.to(device)
        clean = None if self.clean is None else self.clean.to(device)
        return [self.on(device), skipped, finite, clean]

    def with_device_values(self, values: list[Tensor | None]) -> StepClock:
        """This clock with its device values replaced by ``values`` (as :meth:`device_values` gives them)."""
        it, skipped, finite, clean = values
        assert it is not None
        out = StepClock(self.iterations, skipped, self.dropped)
        out.finite, out.clean = finite, clean
        out._tensors = {it.device: it}
        return out

    def on(self, device: torch.device) -> Tensor:
        """The counter as device data (0-d int64), uploaded once per step and device; calls the
        exchange's overflow dropped are left out."""
        t = self._tensors.get(device)
        if t is None:
            # Through a 1-element shape: a 0-d host tensor would become an XLA constant.
            t = upload(torch.tensor([self.iterations], dtype=torch.int64), device).reshape(())
            if self.dropped is not None:
                t = t - self.dropped.to(device).reshape(())
            self._tensors[device] = t
        return t
