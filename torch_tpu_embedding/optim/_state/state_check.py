"""Value checks of a saved optimizer state, run before :func:`.state_load.write_checked` writes anything.

``state_load.state_problems`` checks the structure (groups, keys, slot names and shapes); the rules
here check each value it would write: a tensor with data (not on the ``meta`` device, not sparse or
nested), of the slot's kind of dtype, a ``step`` that is one real number (a Python number loads, as
in torch), call counters that are integers, and pending accumulation buffers whose ids lie in their
(stacked member) table. A damaged or crafted file would otherwise fail half-way through the load,
with some slots already replaced, or load ids that update a neighbouring table's rows.

:class:`CheckedState` is a state those checks passed, handed from the check to the write, so that one load
checks its state once (the checks walk every slot: they are not free on a large optimizer).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import dtype_kind, math_dtype
from torch_tpu_embedding.optim._core.contract import SlotSpec
from torch_tpu_embedding.optim._core.slots import ACCUMULATION
from torch_tpu_embedding.optim._core.step_values import COUNTERS

__all__ = ["CheckedState", "accumulation_problems", "counter_problems", "entry_problems", "refuse", "saved_count",
           "step_problem", "step_value", "tensor_problem"]


@dataclasses.dataclass(frozen=True)
class CheckedState:
    """A state dict in our layout that ``state_load.state_problems`` found nothing in, for the optimizer ``owner``
    refers to (``state_load.checked``, or ``tte.checkpoint``'s check of a file): handed on, so that
    ``staged_load`` and ``state_load.write_checked`` write it without checking it again. Another optimizer
    checks it as any state dict (a weak reference: not an ``id``, which a later optimizer may reuse)."""

    state: dict[str, Any]
    owner: weakref.ref[Any]

    @classmethod
    def of(cls, state: dict[str, Any], optimizer: Any) -> CheckedState:
        return cls(state, weakref.ref(optimizer))

    def checked_for(self, optimizer: Any) -> bool:
        """Whether the check this state passed was ``optimizer``'s."""
        return self.owner() is optimizer


def refuse(problems: list[str]) -> None:
    """Raise the error of every optimizer load for what its checks found (one message, wherever it is checked);
    nothing found: return."""
    if problems:
        raise ValueError("Optimizer state does not match: " + "; ".join(problems))


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        layout = "" if v.layout == torch.strided else f", layout {v.layout}"
        return f"a {v.dtype} tensor of shape {tuple(v.shape)} on {v.device}{layout}"
    return f"{type(v).__name__} {v!r}"[:120]


def tensor_problem(where: str, v: Any, dtype: torch.dtype | None = None) -> str | None:
    """Why ``v`` (saved at ``where``) cannot be written into a tensor of ``dtype``'s kind; ``None``: it can."""
    if not isinstance(v, torch.Tensor):
        return f"{where} must be a tensor. Received {_describe(v)}"
    if v.device.type == "meta":
        return f"{where} must hold data (a meta-device tensor has none). Received {_describe(v)}"
    if v.layout != torch.strided or v.is_nested:
        return f"{where} must be a dense (strided) tensor. Received {_describe(v)}"
    if dtype is not None and dtype_kind(v.dtype) != dtype_kind(dtype):
        return f"{where} must hold {dtype_kind(dtype)} values ({dtype} here). Received {_describe(v)}"
    return None


def step_value(v: Any) -> torch.Tensor:
    """A saved ``step`` as the 0-d float32 tensor the state holds (a Python number converts, as in torch)."""
    if isinstance(v, torch.Tensor):
        return v.detach().to(torch.float32).reshape(())
    return torch.tensor(float(v), dtype=torch.float32)


def step_problem(where: str, v: Any) -> str | None:
    """Why a saved ``step`` is refused: it must be one finite real number >= 0 (a tensor or a Python number)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        ok = math.isfinite(v) and v >= 0
        return None if ok else f"{where} must be a finite number >= 0. Received {v!r}"
    problem = tensor_problem(where, v)
    if problem is not None:
        return problem
    assert isinstance(v, torch.Tensor)
    if v.numel() != 1 or dtype_kind(v.dtype) not in ("integer", "floating point"):
        return f"{where} must be one real number (a 0-d tensor or a Python number). Received {_describe(v)}"
    x = float(v.detach().cpu().reshape(()).item())  # a device step: one small transfer, no compile
    return None if math.isfinite(x) and x >= 0 else f"{where} must be a finite number >= 0. Received {x!r}"


def accumulation_problems(key: str, s: Mapping[str, Any], rows: int, dim: int, calls: Any = None) -> list[str]:
    """Problems of ``key``'s saved pending accumulation buffers: ``acc_ids`` ``[k, cap]`` integers, each
    ``-1`` (padding) or a row of this table (``[0, rows)``: for a stacked member its own rows, not the
    group's), and ``acc_rows`` ``[k, cap, dim]`` floating point; ``k`` = ``calls`` (the loaded group's
    ``gradient_accumulation_steps``) where given: a buffer of more calls would add its stale calls to every window,
    one of fewer would be written past its end."""
    if "acc_ids" not in s and "acc_rows" not in s:
        return []
    if "acc_ids" not in s or "acc_rows" not in s:
        only = sorted(set(s) & {"acc_ids", "acc_rows"})
        return [f"{key}: 'acc_ids' and 'acc_rows' are saved together. Received only {only}"]
    ids, acc = s["acc_ids"], s["acc_rows"]
    problems = [p for p in (tensor_problem(f"{key}: slot 'acc_ids'", ids, torch.int64),
                            tensor_problem(f"{key}: slot 'acc_rows'", acc, torch.float32)) if p]
    if problems:
        return problems
    if ids.dim() != 2 or tuple(acc.shape) != (*ids.shape, dim):
        return [f"{key}: pending accumulation buffers must be 'acc_ids' [k, cap] and 'acc_rows' [k, cap, {dim}]. "
                f"Received {tuple(ids.shape)} and {tuple(acc.shape)}"]
    if calls and ids.shape[0] != calls:
        return [f"{key}: pending accumulation buffers hold {ids.shape[0]} calls, but the group's "
                f"`gradient_accumulation_steps` is {calls}"]
    ids = ids.detach().cpu()  # a device buffer: checked on the host (a boolean mask is no XLA shape)
    bad = ids[(ids < -1) | (ids >= rows)]
    if bad.numel():
        return [f"{key}: slot 'acc_ids' must hold -1 (padding) or rows of this table, in [0, {rows}). "
                f"Received {bad[:5].tolist()}"]
    return []


def saved_count(v: Any) -> int | None:
    """A saved call counter's value: an integer >= 0, or a 0-d / 1-element integer tensor holding one; None
    for anything else."""
    if isinstance(v, torch.Tensor) and tensor_problem("counter", v) is None and v.numel() == 1 \
            and dtype_kind(v.dtype) == "integer":
        v = int(v.item())
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def counter_problems(sd: Mapping[str, Any]) -> list[str]:
    """The call counters (``COUNTERS``) present in ``sd`` must be integers >= 0 (0-d integer tensors
    accepted, :func:`saved_count`), ``overflowed_steps`` at most ``skipped_steps`` (it counts some of them)."""
    problems, values = [], {}
    for name in COUNTERS:
        if name not in sd:
            continue
        v = saved_count(sd[name])
        if v is None:
            problems.append(f"'{name}' must be an integer >= 0. Received {_describe(sd[name])}")
        else:
            values[name] = v
    if values.get("overflowed_steps", 0) > values.get("skipped_steps", 0):
        problems.append(f"'overflowed_steps' counts some of 'skipped_steps', so it must be at most it. Received "
                        f"{values['overflowed_steps']} and {values.get('skipped_steps', 0)}")
    return problems


def entry_problems(key: str, s: Mapping[str, Any], p: torch.Tensor, all_specs: Mapping[str, SlotSpec],
                   rows: int, calls: Any = None) -> list[str]:
    """Problems of one saved state entry ``s`` (``key``: a table's or a dense parameter's) for ``p``, whose
    slots are ``all_specs`` (``rows``: the entry's logical rows; a stacked member's own; ``calls``: the loaded
    group's ``gradient_accumulation_steps``)."""
    info = table_info(p)
    problems = accumulation_problems(key, s, rows, p.shape[-1], calls) if info is not None else []
    for name, v in s.items():
        if name == "step":
            problems += [m for m in [step_problem(f"{key}: slot 'step'", v)] if m]
            continue
        if name in ACCUMULATION and info is not None:
            continue  # checked above
        spec = all_specs.get(name)
        if spec is None:
            problems.append(f"{key}: unexpected slot '{name}' (expected {sorted(all_specs)})")
            continue
        bad = tensor_problem(f"{key}: slot '{name}'", v, spec.dtype or math_dtype(p))
        if bad:
            problems.append(bad)
            continue
        want = (rows, *spec.shape[1:]) if spec.rows and spec.shape else spec.shape
        if not spec.rows and info is not None and info.members is not None:  # a stacked group's whole-table slot
            want = spec.shape[1:]  # per table
        if tuple(v.shape) != tuple(want):
            problems.append(f"{key}: slot '{name}' has shape {tuple(v.shape)}, expected {tuple(want)}")
    return problems
