"""torch.optim's ``state_dict`` layout, for ``torch.distributed.checkpoint.state_dict``'s helpers.

Our ``state_dict()`` keys state by table (``table:<name>``, ``param:<...>``: optim/_state/state_save.py), so
that it moves between stacked and unstacked collections. torch's helpers
(``get_optimizer_state_dict`` / ``get_state_dict``, TorchTitan's checkpointing) need torch.optim's
layout instead: ``state`` keyed by each parameter's position in ``param_groups`` (they rename
positions to the parameter's module path), ``params`` lists of positions, nothing beside ``state``
and ``param_groups``.

:func:`state_dict` gives them that layout with no opt-in: when the caller of ``opt.state_dict()`` is
torch's helper (:func:`called_by_torch_helpers`), every slot is created (the helpers need an entry per
parameter) and the state is turned to torch's layout (:func:`to_torch_layout`); every other caller
(``tte.checkpoint``, a user) gets ours. :func:`use_torch_layout` makes ``state_dict()`` torch's layout
for every caller. ``load_state_dict`` reads either layout (:func:`from_torch_layout`, called by
``RowSparseOptimizer.load_state_dict``). One entry per parameter: a stacked group's entry holds its
tables' state joined in their logical rows (``[Σ num_embeddings, ...]``). Each saved group keeps,
under ``tte_params``, every parameter's tables and rows (and a group's row slots), so a group's entry
is split per table again and loads into a collection stacked otherwise; and, under ``iterations`` /
``skipped_steps`` / ``overflowed_steps``, the optimizer's call counters (torch's helpers keep only ``state`` and
``param_groups``; ``overflowed_steps``, saved since 2026-12-02, reads as 0 where absent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torch_tpu_embedding._rows.placement import (
    TablePlacement,
    dtensor_placement,
    is_dtensor,
    process_group_placement,
)
from torch_tpu_embedding._rows.stacked_state import merge_member_state, split_member_state
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding._util.dtypes import math_dtype
from torch_tpu_embedding.optim._core.slots import logical_rows, specs
from torch_tpu_embedding.optim._core.step_values import COUNTERS
from torch_tpu_embedding.optim._state import state_load, state_save
from torch_tpu_embedding.optim._state.state_check import CheckedState, refuse
from torch_tpu_embedding.optim._state.state_save import param_keys

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.base import RowSparseOptimizer

__all__ = ["called_by_torch_helpers", "from_torch_layout", "state_dict", "to_torch_layout", "use_torch_layout"]

_TTE = "tte_params"  # a saved group's key: per parameter, {"keys", "rows", "row_slots"}
_REQUIRED_COUNTERS = ("iterations", "skipped_steps")  # of COUNTERS, those a saved group must have
_PENDING = "tte_pending"  # a table's pending accumulation window: (acc_ids, acc_rows) or () (_pack_pending)
_UNSAVED = "tte_unsaved"  # a saved group's key: the keys saved as None placeholders (see to_torch_layout)
# Where torch's helpers call ``optim.state_dict()`` (torch 2.9 to 2.13: ``_get_optim_state_dict``, which
# ``get_optimizer_state_dict``, ``get_state_dict`` and a full-state-dict ``set_*`` go through).
_HELPERS_MODULE = "torch.distributed.checkpoint.state_dict"
_HELPERS_CALLER = "_get_optim_state_dict"


def called_by_torch_helpers() -> bool:
    """Whether the ``state_dict()`` running now was called by ``torch.distributed.checkpoint.
    state_dict``'s helpers: the first frame above the ``state_dict`` methods (ours, and a subclass's
    override calling ``super()``) is torch's ``_get_optim_state_dict``.

    The helpers call ``optim.state_dict()`` and rename its integer keys, so they cannot read our
    layout; they give the optimizer no other way to learn who asks (no argument, no flag).
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name == "state_dict":
        frame = frame.f_back  # type: ignore[assignment]
    return frame is not None and frame.f_code.co_name == _HELPERS_CALLER \
        and frame.f_globals.get("__name__") == _HELPERS_MODULE


def state_dict(optimizer: RowSparseOptimizer) -> dict[str, Any]:
    """``optimizer``'s state in our layout, or, when torch's helpers ask (:func:`called_by_torch_helpers`),
    in torch.optim's, every slot created first (a fresh optimizer's template has an entry per parameter)."""
    if not called_by_torch_helpers() or getattr(optimizer, "_tte_torch_layout", False):
        return state_save.state_dict(optimizer)  # (use_torch_layout's hooks turn it, user hooks between)
    optimizer.init_state()
    return to_torch_layout(optimizer, state_save.state_dict(optimizer))


def use_torch_layout(optimizer: RowSparseOptimizer) -> RowSparseOptimizer:
    """Make ``optimizer.state_dict()`` torch.optim's layout for every caller; returns ``optimizer``.

    Not needed for ``torch.distributed.checkpoint.state_dict``'s helpers (since 2026-11-26 they get
    torch's layout without it: :func:`state_dict`); kept for code that calls it, and for reading torch's
    layout from ``state_dict()`` itself. Registers a ``state_dict`` pre-hook (every slot created, as
    :meth:`~RowSparseOptimizer.init_state`) and post-hook (:func:`to_torch_layout`). Loading needs
    nothing: ``load_state_dict`` takes either layout. Calling it again changes nothing.
    """
    if getattr(optimizer, "_tte_torch_layout", False):
        return optimizer
    optimizer.register_state_dict_pre_hook(_create_state)
    optimizer.register_state_dict_post_hook(to_torch_layout)
    optimizer._tte_torch_layout = True  # type: ignore[attr-defined]
    return optimizer


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    optimizer.init_state()  # type: ignore[attr-defined]


def _describe(p: torch.Tensor, group: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``p``'s tables as saved: logical keys, their rows, and (a stacked group) its row slots."""
    info = table_info(p)
    members = None if info is None else info.members
    if members is None:
        return {"keys": [key], "rows": [logical_rows(p)], "row_slots": []}
    slots = sorted(k for k, spec in specs(p, group).items() if spec.rows and spec.shape)
    return {"keys": [f"table:{n}" for n, _, _ in members], "rows": [n for _, _, n in members], "row_slots": slots}


def _members(desc: Mapping[str, Any]) -> tuple[tuple[str, int, int], ...]:
    out, off = [], 0
    for key, n in zip(desc["keys"], desc["rows"], strict=True):
        out.append((key, off, int(n)))
        off += int(n)
    return tuple(out)


def to_torch_layout(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` post-hook: our layout ``sd`` → torch.optim's (positions; see the module); ``sd``
    itself when it is torch's already (torch's helpers asked: :func:`state_dict` turned it)."""
    if not _is_ours(sd):
        return sd
    keys = param_keys(opt)  # type: ignore[arg-type]
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    pid = 0
    for group, saved in zip(opt.param_groups, sd["param_groups"], strict=True):
        out = {k: v for k, v in saved.items() if k != "params"}
        out["params"], out[_TTE] = [], []
        for p in group["params"]:
            desc = _describe(p, group, keys[id(p)])
            parts = {k: sd["state"][k] for k in desc["keys"] if k in sd["state"]}
            if len(desc["keys"]) == 1:
                entry = parts.get(desc["keys"][0])
            elif parts:
                members = _members(desc)
                entry = merge_member_state(parts, members, desc["row_slots"], _no_current(desc["keys"]))
            else:
                entry = None
            if entry is None and group["gradient_accumulation_steps"] and table_info(p) is not None:
                entry = {}  # a table of a group that accumulates always has an entry: its window's (_pack_pending)
            if entry is not None:
                state[pid] = _pack_pending(p, group, _as_dtensors(p, group, dict(entry)))
            out["params"].append(pid)
            out[_TTE].append(desc)
            pid += 1
        for k in COUNTERS:
            out[k] = int(sd.get(k, 0))
        # What is not saved (callables: `slot_creation_fn`, a callable `lr`) as None: torch's helpers
        # look every key of the live groups up; loading keeps the live value (as for our layout).
        out[_UNSAVED] = [k for k in group if k not in out]
        out.update({k: None for k in out[_UNSAVED]})
        groups.append(out)
    return {"state": state, "param_groups": groups}


def _as_dtensors(p: torch.Tensor, group: Mapping[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """A table sharded over a process group with ``dtensor_state_dict=True``: its row slots as DTensors
    ``Shard(0)`` of their logical rows, as its weight is in the model's state_dict (a collective: every
    rank's helper call converts the same slots in the same order). Other parameters: ``entry`` as is."""
    spread = dtensor_placement(p)
    if spread is None:
        return entry
    slots = sorted(specs(p, group).items())
    rows = [k for k, spec in slots if spec.rows and k in entry]
    whole = [k for k, spec in slots if not spec.rows and isinstance(entry.get(k), torch.Tensor)]
    return {**entry, **{k: spread.to_logical(entry[k], slot=True) for k in rows},
            **{k: spread.whole_to_saved(entry[k]) for k in whole}}


def _pack_pending(p: torch.Tensor, group: Mapping[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """A table's pending accumulation window (``acc_ids [k, cap]``, ``acc_rows [k, cap, D]``) as one entry,
    ``tte_pending``: a tuple ``(ids, rows)``, or ``()`` with none. A tuple is one object to DCP (saved and
    loaded whole, whatever its shapes), and every table of a group that accumulates has the entry, so a fresh
    optimizer's template (which has no window yet) loads a saved window too. A table sharded over a process
    group with ``dtensor_state_dict=True`` saves every rank's window in logical ids (a collective)."""
    k = group["gradient_accumulation_steps"]
    if not k or table_info(p) is None:
        return entry
    ids, rows = entry.pop("acc_ids", None), entry.pop("acc_rows", None)
    spread = dtensor_placement(p)
    if spread is not None:
        ids, rows = spread.pending_to_logical(ids, rows, k, p.shape[1], math_dtype(p))
    entry[_PENDING] = () if ids is None or rows is None else (ids, rows)
    return entry


def _unpack_pending(entry: Mapping[str, Any], p: torch.Tensor | None) -> Mapping[str, Any]:
    """The inverse of :func:`_pack_pending` on a loaded entry (``p``: the live table, ``None`` for a stacked
    group's entry, split per table after this)."""
    if _PENDING not in entry:
        return entry
    out = {k: v for k, v in entry.items() if k != _PENDING}
    pending = entry[_PENDING]
    if not isinstance(pending, tuple) or len(pending) not in (0, 2) or \
            not all(isinstance(t, torch.Tensor) for t in pending):
        raise ValueError(f"Optimizer state does not match: '{_PENDING}' must be () or (acc_ids, acc_rows), the "
                         f"pending accumulation window. Received: {type(pending).__name__}")
    if not pending:
        return out
    ids, rows = pending
    spread = None if p is None else dtensor_placement(p)
    out["acc_ids"], out["acc_rows"] = (ids, rows) if spread is None else spread.pending_from_logical(ids, rows)
    return out


def _check_dtensors(entry: Any, key: str, live: Mapping[str, torch.Tensor], group: Mapping[str, Any]) -> bool:
    """Whether the loaded entry of table ``key`` holds DTensors to move back to the stored rows (by
    :func:`_from_dtensors`, after every entry is checked). An entry without DTensors is loaded as is (the
    stored rows, as a plain entry of the model's ``state_dict``).

    Raises (no collective: the checks read global shapes only):
        ValueError: DTensors for a table not sharded with ``dtensor_state_dict=True`` here, for a slot that
            is not one of the table's row slots, or of a global shape other than the slot's logical rows.
    """
    if not isinstance(entry, Mapping) or not any(is_dtensor(v) for v in entry.values()):
        return False
    p = live.get(key)
    spread = None if p is None else dtensor_placement(p)
    name = key.split(":", 1)[-1]
    if p is None or spread is None:
        how = "not sharded over a process group" if p is None or process_group_placement(p) is None else \
            "sharded without dtensor_state_dict"
        raise ValueError(f"Optimizer state of `{name}` holds DTensors: load it into a model whose table `{name}` is "
                         "sharded over a process group with tte.distributed.shard(..., dtensor_state_dict=True). "
                         f"Received: DTensor slots {sorted(k for k, v in entry.items() if is_dtensor(v))} for a "
                         f"table {how} here")
    rows = {k: (spread.rows, *spec.shape[1:]) for k, spec in specs(p, group).items() if spec.rows and spec.shape}
    for k, v in sorted(entry.items()):
        if is_dtensor(v) and tuple(v.shape) != rows.get(k):
            rule = (f"a DTensor of slot '{k}' must be a Shard(0) of shape {rows[k]}: the table's {spread.rows} logical "
                    "rows") if k in rows else f"only its row slots ({sorted(rows)}) can be DTensors"
            raise ValueError(f"Optimizer state of `{name}` does not match: {rule}. Received: slot '{k}', a DTensor "
                             f"of shape {tuple(v.shape)}")
    return True


def _from_dtensors(opt: torch.optim.Optimizer, entry: Mapping[str, Any], key: str, live: Mapping[str, torch.Tensor],
                   group: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_as_dtensors` on the loaded entry of table ``key``, checked by
    :func:`_check_dtensors`: each DTensor slot back to this rank's stored rows of the live parameter (a
    collective, in the order :func:`_as_dtensors` used)."""
    p = live[key]
    spread = dtensor_placement(p)
    assert spread is not None  # (checked)
    name = key.split(":", 1)[-1]
    live_slots = opt.state[p]
    whole = {k for k, spec in specs(p, group).items() if not spec.rows}
    return {k: spread.from_logical(v, name, live_slots.get(k), slot=True) if is_dtensor(v)
            else spread.whole_from_saved(v, live_slots.get(k)) if k in whole and isinstance(v, torch.Tensor) else v
            for k, v in sorted(entry.items())}


def _no_current(keys: list[str]) -> Any:
    def current(slot: str, off: int, n: int) -> torch.Tensor:
        raise ValueError(f"Optimizer state of a stacked group ({keys}) lacks slot '{slot}' for one of its tables.")
    return current


def _is_ours(sd: Mapping[str, Any]) -> bool:
    groups = sd.get("param_groups")
    if not isinstance(groups, list):
        return True  # not a state_dict at all: our loader names the problem
    return all(
        not isinstance(g, Mapping) or not isinstance(g.get("params"), list)
        or all(isinstance(k, str) and k.startswith(("table:", "param:")) for k in g["params"])
        for g in groups
    )


def from_torch_layout(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> CheckedState | None:
    """For ``load_state_dict``: torch.optim's layout (positions, or module paths as torch's
    helpers give it) → ours, checked as the load checks it (the load's one check: the caller writes it as is);
    ``None`` (``sd`` is to be checked and loaded as is) when ``sd`` is in our layout already.

    A saved group's ``tte_params`` names each parameter's tables (without them, parameters are matched
    by position, as torch.optim does). Its ``iterations`` and ``skipped_steps`` are required: a dict
    without them (``flatten_optimizer_state_dict=True`` drops them) is refused, not loaded with the
    counters reset; so is an empty entry (what that option gives for an optimizer with no slots).

    Every entry is read and checked before the first DTensor slot is moved (a collective). For an optimizer
    holding a table sharded over a process group with ``dtensor_state_dict=True``, every rank then checks the
    state it would write (:func:`~torch_tpu_embedding.optim._state.state_load.state_problems`: hyper-parameters,
    every slot, the moved ones included) and the ranks agree on it before anything is written
    (:meth:`~torch_tpu_embedding._rows.placement.TablePlacement.state_checked`: one ``all_reduce`` of eight int64
    per load, whether it moved DTensors or read plain tensors, each rank's stored rows). A rank that refuses its
    state takes part in the first move, or in that agreement, as failed: over a process group every rank then
    raises, this one its ``ValueError``, the others a ``RuntimeError`` naming it, none waiting for another and
    none loading alone; a rank given plain tensors where another was given DTensors meets the other's first
    move with that agreement, and every rank raises (the ranks are at different exchanges).
    """
    if _is_ours(sd) or not isinstance(sd.get("state"), Mapping) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in sd["param_groups"]):
        return None  # ours, or not a state_dict at all: our loader names the problem
    keys = param_keys(opt)  # type: ignore[arg-type]
    live = {keys[id(p)]: p for g in opt.param_groups for p in g["params"]}
    shared = _first_dtensor_table(opt)
    try:
        state, groups, counters, moves = _read_torch_layout(opt, sd, keys, live)
    except Exception:
        _refuse_moves(shared)
        raise
    for key, group in moves:  # every entry checked: the slots' moves (collectives), the same on every rank
        state[key] = _from_dtensors(opt, state[key], key, live, group)
    out = {"state": state, "param_groups": groups, **counters}
    if shared is None:
        return state_load.checked(opt, out)  # type: ignore[arg-type]
    # What the load would refuse after the moves (a hyper-parameter, a slot's dtype), found on one rank only,
    # must not leave the others loading alone: every rank checks, then they agree, nothing written yet. This
    # is the load's one check: the caller writes the state it returns without checking it again.
    problems = state_load.state_problems(opt, out)  # type: ignore[arg-type]
    shared.state_checked(failed=bool(problems))
    refuse(problems)
    return CheckedState.of(out, opt)


@dataclasses.dataclass(frozen=True)
class _Shared:
    """The first table of an optimizer sharded over a process group with ``dtensor_state_dict=True``: its
    placement (over whose group a torch-layout load agrees) and its device."""

    placement: TablePlacement
    device: torch.device

    def state_checked(self, failed: bool) -> None:
        self.placement.state_checked(self.device, failed)


def _first_dtensor_table(opt: torch.optim.Optimizer) -> _Shared | None:
    for g in opt.param_groups:
        for p in g["params"]:
            spread = dtensor_placement(p)
            if spread is not None:
                return _Shared(spread, p.device)
    return None


def _refuse_moves(shared: _Shared | None) -> None:
    """This rank refuses a torch-layout state before its first move: over the group of the optimizer's first
    table sharded with ``dtensor_state_dict=True``, it takes part in the first move as failed
    (:meth:`~torch_tpu_embedding._rows.placement.TablePlacement.move_failed`), so that the other ranks, at
    that move or at the agreement after their checks (no DTensor to move: plain tensors), raise there instead
    of waiting for it. An optimizer without such a table makes no collective here, nor on the other ranks."""
    if shared is not None:
        with contextlib.suppress(Exception):  # the caller raises its own error, whatever this meets
            shared.placement.move_failed(shared.device)


def _read_torch_layout(opt: torch.optim.Optimizer, sd: Mapping[str, Any], keys: Mapping[int, str],
                       live: Mapping[str, torch.Tensor],
                       ) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, int], list[tuple[str, Any]]]:
    """:func:`from_torch_layout`'s reading and checks, no collective: ``(state, param_groups, counters, moves)``,
    ``moves`` the ``(table key, param group)`` of each entry whose DTensor slots are to be moved."""
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"Optimizer state does not match: {len(saved_groups)} parameter groups saved, {len(opt.param_groups)} here"
        )
    moves: list[tuple[str, Any]] = []
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    counters: dict[str, int] = {}
    for gi, (saved, group) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        descs = saved.get(_TTE)
        if descs is None:
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"Optimizer state does not match: group {gi} saved {len(saved['params'])} parameters, "
                    f"{len(group['params'])} here"
                )
            descs = [_describe(p, group, keys[id(p)]) for p in group["params"]]
        _check_descs(gi, saved["params"], descs)
        if "algorithm" not in saved:  # every group of ours has it, in either layout (and flattened, as live groups do)
            slots = sorted({n for e in sd["state"].values() if isinstance(e, Mapping) for n in e})
            raise ValueError(
                f"Optimizer state does not match: param_groups[{gi}] has no 'algorithm': this is the state_dict of "
                f"another kind of optimizer (a torch.optim one, for example), with slots {slots}, not of a "
                f"torch_tpu_embedding.optim optimizer. {type(opt).__name__} cannot take those slots: start it from a "
                f"fresh state, or load a state_dict that a tte.optim.{type(opt).__name__} saved."
            )
        for k in _REQUIRED_COUNTERS:
            if k not in saved:
                raise ValueError(
                    f"Optimizer state does not match: group {gi} has no '{k}' (an optimizer counter). torch's "
                    "flatten_optimizer_state_dict=True keeps only keys the live groups have, and drops it: "
                    "save without it (use_torch_layout's state_dict keeps it in each group)."
                )
        for k in COUNTERS:
            counters[k] = max(counters.get(k, 0), int(saved.get(k, 0)))
        out = {k: v for k, v in saved.items() if k not in ("params", _TTE, _UNSAVED, *COUNTERS,
                                                     *saved.get(_UNSAVED, []))}
        out["params"] = []
        for k, desc in zip(saved["params"], descs, strict=True):
            out["params"].extend(desc["keys"])
            entry = sd["state"].get(k)
            if entry is None:
                continue
            if not isinstance(entry, Mapping):
                raise ValueError(f"Optimizer state does not match: state[{k!r}] is a {type(entry).__name__}, "
                                 "not a mapping of slot names to tensors")
            if not entry:  # what torch's unflattening gives for an optimizer with no slots yet
                raise ValueError(f"Optimizer state does not match: the saved state of {desc['keys']} is empty.")
            entry = _unpack_pending(entry, live.get(desc["keys"][0]) if len(desc["keys"]) == 1 else None)
            if len(desc["keys"]) == 1:
                state[desc["keys"][0]] = entry
                if _check_dtensors(entry, desc["keys"][0], live, group):
                    moves.append((desc["keys"][0], group))
            else:
                members = _members(desc)
                parts = split_member_state(entry, members, desc["row_slots"])
                state.update(parts)
        groups.append(out)
    return state, groups, counters, moves


def _check_descs(gi: int, params: list[Any], descs: Any) -> None:
    """A saved group's ``tte_params``: one ``{"keys", "rows", "row_slots"}`` per parameter, as
    :func:`to_torch_layout` writes them (checked before anything is written)."""
    ok = isinstance(descs, list) and len(descs) == len(params) and all(
        isinstance(d, Mapping) and isinstance(d.get("keys"), list) and isinstance(d.get("rows"), list)
        and isinstance(d.get("row_slots"), list) and len(d["keys"]) == len(d["rows"]) >= 1
        and all(isinstance(k, str) for k in d["keys"]) and all(isinstance(n, int) and n >= 0 for n in d["rows"])
        for d in descs)
    if not ok:
        raise ValueError(f"Optimizer state does not match: param_groups[{gi}]['{_TTE}'] is not one "
                         f"{{'keys', 'rows', 'row_slots'}} per parameter ({len(params)}). Received: {descs!r}")
