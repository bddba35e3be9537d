"""Optimizer state in: a load's check (:func:`checked`, :func:`state_problems`) and write (:func:`write_checked`)
of a ``state_dict``, and the distributed-checkpoint form's small remainder (:func:`load_physical_rest`).

A state saved by :mod:`.state_save` (logical: keyed by table, row slots cut to the table's rows, a stacked
group's state split per table) is checked whole before anything is written, then written into the slots
``_state_for`` makes, which keep their layout. Both loads check the saved groups the same way
(:func:`_check_groups`) and write hyper-parameters and pending buffers the same way.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torch_tpu_embedding._rows.placement import device_backend
from torch_tpu_embedding._rows.row_order import from_logical, logical_to_owned
from torch_tpu_embedding._rows.stacked_state import merge_member_state
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding._util.registry import resolve_rule, rule_of
from torch_tpu_embedding.optim._core.extras import EXTRA_DEFAULTS, check_extras
from torch_tpu_embedding.optim._core.hyperparams import mark_exchange, validate_common
from torch_tpu_embedding.optim._core.slots import (
    ACCUMULATION,
    from_saved_ids,
    logical_rows,
    slot_rows,
    specs,
    write_whole,
)
from torch_tpu_embedding.optim._core.step_values import COUNTERS, to_device
from torch_tpu_embedding.optim._state.state_check import (
    CheckedState,
    accumulation_problems,
    counter_problems,
    entry_problems,
    refuse,
    saved_count,
    step_value,
)
from torch_tpu_embedding.optim._state.state_save import groups_by_param, logical_keys, members_of, param_keys

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.base import RowSparseOptimizer

__all__ = ["checked", "load_physical_rest", "rest_problems", "state_problems", "write_checked"]

Tensor = torch.Tensor


def _renumbered(opt: RowSparseOptimizer, sd: dict[str, Any], keys: Mapping[int, str]) -> dict[str, Any]:
    """``sd`` with dense parameters keyed as :func:`param_keys` numbers them today, if it was saved with
    the older numbering (a stacked group counted once); otherwise ``sd`` itself."""
    old = param_keys(opt, group_as_one=True)
    rename = {old[pid]: new for pid, new in keys.items() if old[pid] != new}
    saved = {k for g in sd["param_groups"] for k in g["params"]}
    if not rename or not set(rename) <= saved or saved & (set(rename.values()) - set(rename)):
        return sd
    groups = [{**g, "params": [rename.get(k, k) for k in g["params"]]} for g in sd["param_groups"]]
    return {**sd, "state": {rename.get(k, k): v for k, v in sd["state"].items()}, "param_groups": groups}


def _write_logical_slot(p: Tensor, slot: Tensor, value: Tensor, k: int) -> None:
    """Write logical rows ``value`` into row slot ``k`` of ``p`` (one whole-tensor copy; trash kept)."""
    info = table_info(p)
    layout = None if info is None else info.layout
    if layout is None:
        write_whole(slot, to_device(value.to(slot.dtype), p.device))
        return
    # From the host tensor itself: the sharded slot keeps its layout (a replicated device copy would not).
    slot.copy_(from_logical(value.to(slot.dtype).cpu(), slot.detach().cpu(), layout, k))


def _check_groups(opt: RowSparseOptimizer, saved: list[dict[str, Any]], keys: Mapping[int, str] | None) -> list[str]:
    """Problems between saved parameter groups and ours: count, optimizer, and (given ``keys``) params."""
    problems: list[str] = []
    if len(saved) != len(opt.param_groups):
        problems.append(f"{len(saved)} parameter groups saved, {len(opt.param_groups)} here")
    ours = [sorted(k for p in g["params"] for k, _ in logical_keys(p, keys[id(p)], 0)) for g in opt.param_groups] \
        if keys is not None else []
    if ours and sorted(map(sorted, (sg["params"] for sg in saved))) == sorted(ours) \
            and [sorted(sg["params"]) for sg in saved] != ours:
        # The same groups in another order: each group's settings would be compared with (and loaded from) another
        # group's, which names other tables.
        moved = [f"{mine} in group {i} here, group {[sorted(sg['params']) for sg in saved].index(mine)} saved"
                 for i, mine in enumerate(ours) if sorted(saved[i]["params"]) != mine]
        return [f"the parameter groups hold the tables they were saved with, in another order ({'; '.join(moved)}). "
                "A load matches groups by position, as torch.optim's: build the groups in the saved order"]
    for i, (sg, g) in enumerate(zip(saved, opt.param_groups, strict=False)):
        if ours and sorted(sg["params"]) != ours[i]:
            missing = sorted(set(ours[i]) - set(sg["params"]))
            extra = sorted(set(sg["params"]) - set(ours[i]))
            problems.append(f"group {i}: missing {missing}, unexpected {extra}")
            continue  # (its saved settings are other tables': not compared with this group's)
        if sg.get("algorithm") != g["algorithm"]:
            problems.append(f"group {i}: saved by optimizer '{sg.get('algorithm')}', loading into '{g['algorithm']}'")
            continue
        merged = {**g, **{k: v for k, v in sg.items() if k != "params" and not _callable(g.get(k))}}
        try:  # the saved hyper-parameters must pass the constructor's checks
            check_extras(merged, {k: merged[k] for k in EXTRA_DEFAULTS if k in merged})
            validate_common(merged)
            rule_of(g)._validate(merged)
        except (TypeError, ValueError) as e:
            problems.append(f"group {i}: {e}")
    return problems


def _callable(v: Any) -> bool:
    return callable(v) and not isinstance(v, Tensor)


def _apply_groups(opt: RowSparseOptimizer, saved: list[dict[str, Any]]) -> None:
    """Saved hyper-parameters into our groups (our callables — a callable ``lr`` — are kept). Copies, as torch.optim
    copies them: a tensor ``lr`` of the saved dict is the saving optimizer's own (``state_dict`` gives the live
    value), which its scheduler goes on changing in place."""
    for sg, g in zip(saved, opt.param_groups, strict=True):
        for k, v in sg.items():
            if k != "params" and not _callable(g.get(k)):
                g[k] = copy.deepcopy(v)
        resolve_rule(g)  # the loaded group's rule, resolved again from its (checked) algorithm
        rule_of(g)._validate(g)  # normalised as the constructor normalises (a tensor beta: its float); checked above
        mark_exchange(g)  # a loaded use_gradient_accumulation: how data parallel (and the clip) send its rows


def _restore_accumulation(state: dict[str, Tensor], bufs: Mapping[str, Tensor], p: Tensor) -> None:
    """Pending accumulation buffers (saved form) into ``p``'s state (per shard for the owner-local path)."""
    if "acc_ids" not in bufs:
        return
    info = table_info(p)
    ids, rows = bufs["acc_ids"].detach(), bufs["acc_rows"].detach().to(dtype=math_dtype(p))
    if info is not None and info.owner_local and info.layout is not None:
        n = info.num_shards
        ids, rows = logical_to_owned(ids.cpu(), rows.cpu(), info.layout, p.shape[0], n)
        state["acc_ids"], state["acc_rows"] = ids.to(p.device), rows.to(p.device)
        device_backend("xla").shard_slot(p, state["acc_ids"], rows=True)
        device_backend("xla").shard_slot(p, state["acc_rows"], rows=True)
        return
    state["acc_ids"] = to_device(from_saved_ids(ids, p.shape[0]), p.device)
    state["acc_rows"] = to_device(rows, p.device)
    if p.device.type == "xla":
        # The layout the step gives the buffers it makes: left unannotated, XLA may choose another for the first
        # step's outputs (a column-sharded group's: split along the entries), and the second step compiles again.
        device_backend("xla").shard_slot(p, state["acc_ids"], rows=False)
        device_backend("xla").shard_slot(p, state["acc_rows"], rows=False)


def _saved_group_of(saved_groups: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The saved hyper-parameters of the group holding ``key`` (to know which slots it saved)."""
    for sg in saved_groups:
        if key in sg["params"]:
            return {k: v for k, v in sg.items() if k != "params"}
    return {}


def _merged_state(
    opt: RowSparseOptimizer, saved: Mapping[str, Mapping[str, Tensor]], by_key: Mapping[str, Tensor],
    keys: Mapping[int, str],
) -> dict[str, Mapping[str, Tensor]]:
    """Saved state by physical key: the per-table entries of a stacked group's tables stacked."""
    out: dict[str, Mapping[str, Tensor]] = {}
    stacked: dict[int, dict[str, Mapping[str, Tensor]]] = {}
    for key, s in saved.items():
        p = by_key[key]
        if members_of(p) is None:
            out[key] = s
        else:
            stacked.setdefault(id(p), {})[key[len("table:"):]] = s
    params = {id(p): p for p in by_key.values()}
    for pid, parts in stacked.items():
        p = params[pid]
        members = members_of(p)
        assert members is not None
        group = opt._group_of(p)
        state = opt._state_for(p, group)
        all_specs = specs(p, group)

        def current(slot: str, off: int, n: int, state: dict[str, Tensor] = state) -> Tensor:
            return state[slot][off : off + n]

        row_slots = [k for k, spec in all_specs.items() if spec.rows and spec.shape]
        out[keys[pid]] = merge_member_state(parts, members, row_slots, current)
    return out


def _logical_targets(opt: RowSparseOptimizer, keys: Mapping[int, str]) -> tuple[dict[str, Tensor], dict[str, int]]:
    """Logical keys: a stacked group answers to each of its tables' keys, with that table's rows."""
    by_key: dict[str, Tensor] = {}
    rows_of: dict[str, int] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            for key, n in logical_keys(p, keys[id(p)], logical_rows(p)):
                by_key[key], rows_of[key] = p, n
    return by_key, rows_of


def state_problems(opt: RowSparseOptimizer, sd: Any) -> list[str]:
    """Everything in ``sd`` that a load refuses (empty: it loads); writes nothing."""
    if not isinstance(sd, Mapping) or not isinstance(sd.get("state"), Mapping) \
            or not isinstance(sd.get("param_groups"), list):
        return ["not an optimizer state_dict (needs 'state' and 'param_groups')"]
    bad = [f"param_groups[{i}] is a {type(g).__name__}, not a mapping with a 'params' list"
           for i, g in enumerate(sd["param_groups"])
           if not isinstance(g, Mapping) or not isinstance(g.get("params"), list)]
    bad += [f"state[{k!r}] is a {type(v).__name__}, not a mapping of slot names to tensors"
            for k, v in sd["state"].items() if not isinstance(v, Mapping)]
    if bad:
        return bad
    keys = param_keys(opt)
    sd = _renumbered(opt, dict(sd), keys)
    by_key, rows_of = _logical_targets(opt, keys)
    group_of = groups_by_param(opt)
    saved_groups = sd["param_groups"]
    problems = _check_groups(opt, saved_groups, keys) + counter_problems(sd)
    pending: dict[int, set[int]] = {}  # a stacked group's tables' pending call counts (merged side by side)
    for key, s in sd["state"].items():
        p = by_key.get(key)
        if p is None:
            continue  # reported above through the groups
        group = {**group_of[id(p)], **_saved_group_of(saved_groups, key)}
        found = entry_problems(key, s, p, specs(p, group), rows_of[key], group.get("gradient_accumulation_steps"))
        problems += found
        if "acc_ids" in s and not found:
            pending.setdefault(id(p), set()).add(s["acc_ids"].shape[0])
    problems += [f"the stacked tables of one group hold pending accumulation buffers of different call counts "
                 f"{sorted(counts)}" for counts in pending.values() if len(counts) > 1]
    return problems


def checked(opt: RowSparseOptimizer, sd: Any) -> CheckedState:
    """``sd`` marked checked for ``opt`` if :func:`state_problems` finds nothing, else every load's ``ValueError``."""
    refuse(state_problems(opt, sd))
    return CheckedState.of(sd, opt)


def write_checked(opt: RowSparseOptimizer, done: CheckedState) -> None:
    """Write a state :func:`checked` for ``opt`` (``done.owner``), not checking it again: one check per load."""
    assert done.checked_for(opt), "write_checked: a state checked for another optimizer"
    keys = param_keys(opt)
    sd = _renumbered(opt, done.state, keys)
    # A step saved as a Python number (torch's optimizers accept one) as the 0-d tensor the state holds.
    steps = {k: {**s, "step": step_value(s["step"])} for k, s in sd["state"].items() if "step" in s}
    sd = {**sd, "state": {**sd["state"], **steps}}
    by_key, _ = _logical_targets(opt, keys)
    group_of = groups_by_param(opt)
    saved_groups = sd["param_groups"]
    opt.state.clear()
    _apply_groups(opt, saved_groups)
    physical = {keys[id(p)]: p for g in opt.param_groups for p in g["params"]}
    for key, s in _merged_state(opt, sd["state"], by_key, keys).items():
        p = physical[key]
        state = opt._state_for(p, group_of[id(p)])
        _restore_accumulation(state, {k: v for k, v in s.items() if k in ACCUMULATION}, p)
        numbers = slot_rows(p, group_of[id(p)]).numbers
        for name, v in s.items():
            v = v.detach()
            # Whole-tensor writes into the slots made by _state_for: they keep their layout
            # (SPMD sharding, trash and padding rows, row order); 0-d values arrive as device data.
            if name == "step":
                state[name].copy_(to_device(v, p.device))
            elif name in ACCUMULATION:
                continue
            elif name in numbers:
                _write_logical_slot(p, state[name], v, numbers[name])
            else:
                state[name].copy_(to_device(v.to(state[name].dtype), p.device))
    _restore_counters(opt, sd)
    opt._lrs.clear()


def _restore_counters(opt: RowSparseOptimizer, saved: Mapping[str, Any]) -> None:
    """The call counters as saved (checked by ``counter_problems``; a checkpoint written before they were
    saved, none: 0)."""
    counts = []
    for name in COUNTERS:
        count = saved_count(saved.get(name, 0))
        assert count is not None, f"{name!r} reached the load unchecked (counter_problems refuses it first)"
        counts.append(count)
    opt._run.restore(*counts)


def rest_problems(opt: RowSparseOptimizer, rest: Mapping[str, Any]) -> list[str]:
    """What :func:`load_physical_rest` would refuse in ``rest`` (empty: it loads); writes nothing."""
    if not isinstance(rest, Mapping) or not isinstance(rest.get("param_groups"), list) \
            or not isinstance(rest.get("acc"), Mapping) or "iterations" not in rest:
        return ["the optimizer entry of tte_meta.pt is not a mapping with 'param_groups', 'iterations' and 'acc'"]
    saved = rest["param_groups"]
    problems = _check_groups(opt, saved, None) + counter_problems(rest)
    keys = param_keys(opt)
    by_key = {keys[id(p)]: p for g in opt.param_groups for p in g["params"]}
    # The window length the load gives each parameter: its group's as saved (groups match by position; a stacked
    # group's buffers are saved under its physical key, which no saved group's logical 'params' names).
    calls = {id(p): {**g, **(saved[i] if i < len(saved) and isinstance(saved[i], Mapping) else {})}.get(
        "gradient_accumulation_steps") for i, g in enumerate(opt.param_groups) for p in g["params"]}
    for key, bufs in rest["acc"].items():
        p = by_key.get(key)
        if p is None or table_info(p) is None or not isinstance(bufs, Mapping):
            problems.append(f"pending accumulation buffers saved for {key!r}, which is no table here")
            continue
        # A stacked group's buffers are saved under the group's own key: named by the user's tables instead.
        named = ", ".join(k for k, _ in logical_keys(p, key, 0))
        named += " (stacked together)" if members_of(p) is not None else ""
        problems += accumulation_problems(named, bufs, logical_rows(p), p.shape[-1], calls[id(p)])
    return problems


def load_physical_rest(opt: RowSparseOptimizer, rest: Mapping[str, Any]) -> None:
    """See :meth:`RowSparseOptimizer.load_physical_rest`."""
    refuse(rest_problems(opt, rest))
    keys = param_keys(opt)
    by_key = {keys[id(p)]: p for g in opt.param_groups for p in g["params"]}
    saved = rest["param_groups"]
    _apply_groups(opt, saved)
    _restore_counters(opt, rest)
    for key, bufs in rest["acc"].items():
        p = by_key[key]
        _restore_accumulation(opt.state[p], bufs, p)
    opt._lrs.clear()
