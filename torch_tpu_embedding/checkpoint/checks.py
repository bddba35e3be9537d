"""Checks that run before a checkpoint writes anything: a load either loads everything or changes nothing.

``torch.nn.Module.load_state_dict`` copies each module's tensors as it walks the model and reports a
wrong shape or a missing key only at the end, so a failed load leaves some tables overwritten. The
checks here read only names, shapes and dtypes (never a table's values: a row-permuted table would
otherwise be gathered to the host just to be checked).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import dtype_kind
from torch_tpu_embedding.checkpoint.rollback import extra_states, load_in_order
from torch_tpu_embedding.optim._core.base import RowSparseOptimizer
from torch_tpu_embedding.optim._state import state_load
from torch_tpu_embedding.optim._state.state_check import CheckedState, tensor_problem

__all__ = [
    "CheckpointMismatchError", "aliases", "apply_payload", "check_payload", "expected_model_state", "is_row_sparse",
    "meta_problems", "model_problems", "named_keys", "optimizer_problems", "slots_for_a_load", "write_payload",
]


class CheckpointMismatchError(ValueError, RuntimeError):
    """A checkpoint that does not fit the model or optimizer it is loaded into; nothing was loaded.

    A ``ValueError`` (what the optimizers raise) and a ``RuntimeError`` (what
    ``Module.load_state_dict`` raises), so existing handlers of either keep working.
    """


def expected_model_state(model: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.dtype] | None]:
    """The keys ``model.load_state_dict`` expects, with the logical shape and dtype of each tensor (``None``: an extra
    state).

    Tables answer with ``[num_embeddings, D]`` (no padding rows); a stacked group answers to each of its
    tables' ``tables.<name>.weight`` keys, as the collection's ``state_dict`` hook writes them.
    """
    out: dict[str, tuple[torch.Size, torch.dtype] | None] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is None:
                continue
            info = table_info(p)
            if info is not None and info.members is not None:  # a stacked group: per-table keys
                owner = (dot + name)[: -len(f"groups.{info.name}.weight")]  # the collection's prefix
                for tname, _, n in info.members:
                    out[f"{owner}tables.{tname}.weight"] = (torch.Size((n, *p.shape[1:])), p.dtype)
                continue
            rows = info.num_embeddings if info is not None else None
            shape = torch.Size((rows, *p.shape[1:])) if rows is not None else p.shape
            out[dot + name] = (shape, p.dtype)
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[dot + name] = (b.shape, b.dtype)
    out.update(dict.fromkeys(extra_states(model, loaded=True)))
    return out


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """The keys of ``model.state_dict()`` that name what another key names, each mapped to that key (the first in
    ``state_dict()``'s order): the keys under every path but the first of a module reached by several paths, and a
    tensor (not a table) held by several modules. A save that stores each tensor once records these, and a load
    through the host gives the value under every key, as ``load_state_dict`` (strict) expects."""
    keys = [*expected_model_state(model), *extra_states(model)]
    known, out = set(keys), {}
    paths: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), []).append(f"{name}." if name else "")
    for first, *others in (p for p in paths.values() if len(p) > 1):
        for k in keys:
            if k.startswith(first):
                out.update({p + k[len(first):]: k for p in others if p + k[len(first):] in known})
    by_tensor: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in known and table_info(t) is None:
            first = by_tensor.setdefault(id(t), name)
            if first != name and name not in out:
                out[name] = out.get(first, first)
    return {k: v for k, v in out.items() if k != v}


def model_problems(model: torch.nn.Module, state: Mapping[str, Any], strict: bool) -> list[str]:
    """What ``model.load_state_dict(state, strict=strict)`` would refuse, in torch's words; writes nothing."""
    if not isinstance(state, Mapping):
        return [f"not a state_dict (a mapping of names to tensors): found {type(state).__name__}"]
    expected = expected_model_state(model)
    problems = meta_problems(model, state)
    if strict:
        missing = [k for k in expected if k not in state]
        unexpected = [k for k in state if k not in expected]
        if missing:
            problems.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing))
        if unexpected:
            problems.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected))
    groups = _group_keys(model)
    for gkey, (shape, dtype, tables) in groups.items():
        if gkey not in state:
            continue
        # Our files hold a stacked group's tables (``tables.<name>.weight``); a group's own weight
        # (a key that ``load_state_dict`` accepts too) is checked like them, and never mixed with them.
        both = [k for k in tables if k in state]
        if both:
            problems.append(f"{gkey}: the stacked group's weight and its tables' keys {both} are both in the "
                            "state_dict; keep one or the other")
        expected = {**expected, gkey: (shape, dtype)}
    for key, want in expected.items():
        value = state.get(key)
        if want is None or key not in state:
            continue
        shape, dtype = want
        bad = tensor_problem(key, value)
        if bad is not None:
            problems.append(bad)
            continue
        assert isinstance(value, torch.Tensor)  # tensor_problem refuses anything else
        if value.shape != shape:
            problems.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                            f"the shape in current model is {shape}")
        elif dtype_kind(value.dtype) != dtype_kind(dtype):
            problems.append(f"{key}: the checkpoint holds {dtype_kind(value.dtype)} values ({value.dtype}), "
                            f"the model a {dtype_kind(dtype)} tensor ({dtype})")
    return problems


def meta_problems(model: torch.nn.Module, state: Mapping[str, Any] | None = None) -> list[str]:
    """``model``'s tensors on the meta device that a load of ``state`` (``None``: every key) would write: a copy into
    one writes nothing (torch only warns), so a load into a model built there and not drawn yet is refused."""
    out, seen = [], set()
    kept = [(f"{prefix}.{n}" if prefix else n, t) for prefix, m in model.named_modules()
            for n, t in [*m._parameters.items(), *m._buffers.items()] if n not in m._non_persistent_buffers_set]
    for name, t in kept:
        if t is None or not t.is_meta or id(t) in seen:
            continue
        seen.add(id(t))
        info = table_info(t)
        if info is None:
            if state is None or name in state:
                out.append(f"`{name}` is on the meta device (it holds no values for a load to write): call "
                           "module.to_empty(device=...) for it first")
            continue
        owner = name[: -len(f"{info.name}.weight")].removesuffix("groups.").removesuffix("tables.")
        names = [m[0] for m in info.members] if info.members is not None else [info.name]
        if state is None or any(f"{owner}tables.{n}.weight" in state for n in names) or name in state:
            out += [f"table `{n}` is on the meta device (built with device=\"meta\": it holds no values for a load to "
                    "write): call model.to_empty(device=...) or tte.distributed.shard(model, device=...) first"
                    for n in names]
    return out


def named_keys(keys: list[str], members: Mapping[str, Any]) -> list[str]:
    """Keys of a distributed checkpoint (``model/<state_dict key>``, ``optim/table:<name>/<slot>``) as a message names
    them: a stacked group's with its tables (``members``: each group's ``(table, first row, rows)``), whose own name
    (``fused_0``) the user never gave."""
    out = []
    for key in keys:
        where, _, rest = key.partition("/")
        name, _, slot = rest.partition("/") if where == "optim" else (rest, "", "")
        group = members.get(f"{where}/{name}")
        tables = f" (stacked tables {', '.join(f'`{m[0]}`' for m in group)})" if group else ""
        out.append(f"optimizer slot '{slot}' of {name}{tables}" if slot else f"{name}{tables}")
    return out


def _group_keys(model: torch.nn.Module) -> dict[str, tuple[torch.Size, torch.dtype, list[str]]]:
    """Each stacked group's own weight key: its logical shape and dtype and its tables' keys."""
    out = {}
    for name, p in model.named_parameters():
        info = table_info(p)
        if info is not None and info.members is not None:
            owner = name[: -len(f"groups.{info.name}.weight")]
            rows = sum(n for _, _, n in info.members)
            out[name] = (torch.Size((rows, *p.shape[1:])), p.dtype,
                         [f"{owner}tables.{t}.weight" for t, _, _ in info.members])
    return out


def is_row_sparse(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ``tte.optim`` optimizer."""
    return isinstance(optimizer, RowSparseOptimizer)


@contextlib.contextmanager
def slots_for_a_load(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """``optimizer.init_state()`` (every slot made, for a load to check the checkpoint against and write into),
    undone if the load fails: the slots it made go again, so a later first step makes them as it would have
    (an EMA slot is made as a copy of the weights as they are then)."""
    if optimizer is None or not hasattr(optimizer, "init_state"):
        yield
        return
    had = {id(p) for p, s in optimizer.state.items() if s}
    optimizer.init_state()
    try:
        yield
    except BaseException:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in had:
                    optimizer.state.pop(p, None)
        raise


def optimizer_problems(optimizer: torch.optim.Optimizer, state: Any) -> list[str]:
    """A ``tte.optim`` optimizer's refusals of ``state`` (``optim/_state/state_load.py``), without writing; other
    optimizers answer ``[]`` (torch's optimizers check their state before writing it)."""
    if not is_row_sparse(optimizer):
        return []
    return state_load.state_problems(optimizer, state)  # type: ignore[arg-type]


def apply_payload(
    payload: dict[str, Any], target: str, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
    strict: bool,
) -> dict[str, Any] | None:
    """Check a ``tte.checkpoint.save`` payload against ``model`` / ``optimizer``, then load it; returns ``extra``."""
    return write_payload(check_payload(payload, target, model, optimizer, strict), model, optimizer, strict)


def check_payload(
    payload: dict[str, Any], target: str, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
    strict: bool,
) -> dict[str, Any]:
    """Raise unless :func:`write_payload` of ``payload`` (read from ``target``) fits ``model`` / ``optimizer``;
    writes nothing. Returns the payload to write: a ``tte.optim`` optimizer's state in it marked checked
    (:class:`~torch_tpu_embedding.optim._state.state_check.CheckedState`), which its load does not check again."""
    # (an entry missing from a file of another writer is named as one saved as None, not a KeyError)
    if model is not None and payload.get("model") is None:
        raise ValueError(f"{target} holds no model state.")
    if optimizer is not None and payload.get("optimizer") is None:
        raise ValueError(f"{target} holds no optimizer state.")
    # Everything is checked before anything is written: a load that fails changes nothing.
    problems = []
    if model is not None:
        problems += [f"model: {p}" for p in model_problems(model, payload["model"], strict)]
    if optimizer is not None:
        refused = optimizer_problems(optimizer, payload["optimizer"])
        if refused and not strict:  # (the user asked for leniency: say where it stops)
            refused[-1] += (" (strict=False applies to the model's keys only: an optimizer's state loads whole. Load "
                            "the model alone, without `optimizer`, for its slots to start fresh)")
        problems += [f"optimizer: {p}" for p in refused]
    if problems:
        raise CheckpointMismatchError(f"{target} does not match (nothing was loaded): " + "; ".join(problems))
    if optimizer is None or not is_row_sparse(optimizer):
        return payload
    return {**payload, "optimizer": CheckedState.of(payload["optimizer"], optimizer)}


def write_payload(
    payload: dict[str, Any], model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None, strict: bool,
) -> dict[str, Any] | None:
    """Load ``payload`` as :func:`check_payload` returned it into ``model`` / ``optimizer``; returns ``extra``."""
    # The user's load code (hooks, set_extra_state) runs before the tables are written: checkpoint/rollback.py
    load_in_order(model, payload.get("model"), optimizer, payload.get("optimizer"), strict)
    extra: dict[str, Any] | None = payload.get("extra")
    return extra
