"""Hyper-parameters: validation of the options every optimizer shares, and parameter groups.

A table whose ``TableConfig.optimizer`` names another optimizer gets a parameter group of its own
with that optimizer's rule and defaults (:func:`param_groups`), so one optimizer object steps every
table and every dense parameter.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torch_tpu_embedding._rows.tables import refuse_stacked_view, table_info
from torch_tpu_embedding._util.registry import optimizer_class, optimizer_names, resolve_rule, rule_of
from torch_tpu_embedding._util.validation import arg_error, check_bool, check_number
from torch_tpu_embedding.optim._core.extras import EXTRA_DEFAULTS, check_extras, unbounded_pair
from torch_tpu_embedding.optim._core.step_values import check_lr

if TYPE_CHECKING:
    from torch_tpu_embedding.optim._core.base import RowSparseOptimizer

__all__ = [
    "OVERRIDE_GROUP", "SLOT_OPTIONS", "TORCH_GROUP_KEYS", "check_added_group", "check_clipvalue", "check_edited_groups",
    "check_group_options", "check_slot_options", "check_stacked", "mark_exchange", "param_groups", "refuse_complex",
    "user_groups", "validate_common",
]

#: Marks the parameter group a table override's own optimizer is built from: that optimizer must
#: not look for overrides again (the table's config still names the override).
_OVERRIDE_GROUP = OVERRIDE_GROUP = "_tte_table_override"  # (base.py: such an optimizer is not registered)

#: Keys torch.optim itself puts in a parameter group besides an optimizer's options: named
#: parameters (``param_names``) and the LR schedulers' ``initial_lr`` (given in a group to resume one).
TORCH_GROUP_KEYS = frozenset({"params", "param_names", "initial_lr"})


def check_clipvalue(clipvalue: Any) -> tuple[float | None, float | None] | None:
    """``clipvalue`` as a ``(min, max)`` pair (either may be ``None``), or ``None``: no clipping, as TF's
    ``(None, None)`` (no limit on either side) is."""
    if clipvalue is None or unbounded_pair(clipvalue):
        return None
    if isinstance(clipvalue, (tuple, list)):
        if len(clipvalue) != 2:
            raise arg_error("clipvalue", "must be a number or a (min, max) pair", clipvalue)
        lo, hi = clipvalue
        for v in (lo, hi):
            if v is not None:
                check_number("clipvalue", v)
        if lo is not None and hi is not None and lo > hi:
            raise arg_error("clipvalue", "must have min <= max", clipvalue)
        return (None if lo is None else float(lo), None if hi is None else float(hi))
    # 0 would clip every gradient to 0 (``clipnorm=0`` and Keras's ``clipvalue=0`` mean "off"): refused.
    c = check_number("clipvalue", clipvalue, minimum=0.0, min_inclusive=False)
    return (-c, c)


def validate_common(hp: dict[str, Any]) -> None:
    """Check (and normalise in place) the options of :func:`~.contract.common_defaults`."""
    lr = hp.get("lr")
    if isinstance(lr, torch.Tensor):
        if lr.dim() != 0 or not torch.is_floating_point(lr):
            raise arg_error("lr", "must be a float, a 0-d float tensor or a callable", lr)
        check_lr(lr, on_device=True)  # a device tensor is read once, here; CPU ones at every step
    elif not callable(lr):
        check_number("lr", lr, minimum=0.0)
    check_bool("use_gradient_accumulation", hp["use_gradient_accumulation"])
    if hp.get("clipvalue") is not None and not hp["use_gradient_accumulation"]:
        raise ValueError(
            "When `use_gradient_accumulation` is False, gradient clipping cannot be used and "
            f"`clipvalue` should be left as None. Received value {hp.get('clipvalue')} for "
            "argument `clipvalue`."
        )
    hp["clipvalue"] = check_clipvalue(hp.get("clipvalue"))
    lo, hi = hp.get("clip_weight_min"), hp.get("clip_weight_max")
    for name, v in (("clip_weight_min", lo), ("clip_weight_max", hi)):
        if v is not None:
            check_number(name, v)
    if lo is not None and hi is not None and lo > hi:
        raise arg_error("clip_weight_min", f"must be <= clip_weight_max ({hi})", lo)
    wd = hp.get("weight_decay_factor")
    if wd is not None:
        check_number("weight_decay_factor", wd, minimum=0.0)
    mult = hp.get("multiply_weight_decay_factor_by_learning_rate")
    if mult is not None:
        check_bool("multiply_weight_decay_factor_by_learning_rate", mult)
    fn = hp.get("slot_creation_fn")
    if fn is not None and not callable(fn):
        raise arg_error("slot_creation_fn", "must be a callable or None", fn)


def check_stacked(group: Mapping[str, Any], rule_cls: type[RowSparseOptimizer]) -> None:
    """Reject what a stacked group cannot do exactly as its separate tables would (by name).

    Every optimizer and option works in a group (``optim/_core/stacked_members.py``: whole-table statistics,
    ``clipnorm`` and ``slot_creation_fn`` per table) except one combination no optimizer of this
    package has: whole-table state on a non-lazy optimizer (its every-row update keeps no member index).
    """
    for p in group["params"]:
        info = table_info(p)
        if info is None or info.members is None or rule_cls.is_lazy(group):
            continue
        whole = [k for k, spec in rule_cls.slot_specs(tuple(p.shape), group, True).items() if not spec.rows]
        if whole:
            raise ValueError(
                f"Stacked table group '{info.name}' (tables {[m[0] for m in info.members]}) cannot be trained "
                f"this way: non-lazy optimizer '{group['algorithm']}' keeps per-table state {whole}. Build the "
                "EmbeddingCollection with stack_tables=False, or give these tables their own optimizer with "
                "TableConfig.optimizer (tables with different optimizers are not stacked)."
            )


#: The options that shape a parameter's optimizer state: the moving averages' slots, the accumulation buffers (a
#: table's holds one entry per call of a window) and the windows themselves.
SLOT_OPTIONS = ("use_ema", "gradient_accumulation_steps")


def check_slot_options(groups: list[dict[str, Any]], state: Mapping[Any, Any],
                       seen: dict[int, tuple[Any, ...]]) -> None:
    """Raise, before a step takes any gradient, if a group's :data:`SLOT_OPTIONS` changed since the last step (as
    ``seen`` records them, by group position) while its parameters have state made for the old values: that state
    lacks the new slots (``use_ema``) or holds windows of another length (``gradient_accumulation_steps``)."""
    for i, group in enumerate(groups):
        now = tuple(group[k] for k in SLOT_OPTIONS)
        before = seen.get(i, now)
        if before != now and any(state.get(p) for p in group["params"]):
            name, old, new = next((k, a, b) for k, a, b in zip(SLOT_OPTIONS, before, now, strict=True) if a != b)
            raise ValueError(
                f"Parameter group {i}: `{name}` changed from {old!r} to {new!r} after the optimizer state of its "
                f"parameters was made for {old!r} (`{name}` sets up their moving averages or accumulation windows). "
                f"Give `{name}` when building the optimizer, or to parameters added with add_param_group; to change "
                f"it during training, build a new optimizer with it. Nothing was changed by this step."
            )
        seen[i] = now


def check_edited_groups(groups: list[dict[str, Any]], seen: dict[int, dict[str, Any]]) -> None:
    """Raise, before a step takes any gradient, if a group's hyper-parameters were set since the last step
    (``param_groups[i]["eps"] = 0.0``, as torch users edit them; a scheduler's ``betas``) to a value the constructor
    refuses: unchecked, a zero ``eps`` or ``initial_accumulator_value`` turns the rows of a zero gradient NaN. A group
    that passes is normalised as the constructor normalises it; ``seen`` records each group, by position, as last
    checked. (``lr`` is checked at every step, without reading a device tensor: ``step_values.lr_value``.)"""
    for i, group in enumerate(groups):
        before = seen.get(i)
        if before is not None and _unchanged(group, before):
            continue
        checked = {**group, "lr": 0.0}
        try:
            rule_of(group)._options_to_hp(checked)  # (Adafactor's `weight_decay`: its decoupled factor, as built)
            check_extras(checked, {k: checked[k] for k in EXTRA_DEFAULTS if k in checked})
            validate_common(checked)
            rule_of(group)._validate(checked)
        except (TypeError, ValueError) as e:
            kind = TypeError if isinstance(e, TypeError) else ValueError
            raise kind(f"optimizer.param_groups[{i}] was given a value its optimizer refuses: {e}. Nothing was changed "
                       "by this step.") from None
        for k in [k for k in group if k not in checked]:  # (an option stored under another key)
            del group[k]
        for k, v in checked.items():  # (normalised values: a tensor beta's float, clipvalue's pair)
            if k not in ("params", "lr") and v is not group.get(k):
                group[k] = v
        seen[i] = dict(group)


def user_groups(params: Any) -> list[dict[str, Any]]:
    """``params`` as torch.optim reads it: a list of parameter groups (dicts), with torch's errors."""
    if isinstance(params, torch.Tensor):
        # list(tensor) would give its rows (each a non-leaf view): refused as torch.optim does.
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
            + torch.typename(params)
        )
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    return items if isinstance(items[0], dict) else [{"params": items}]


def check_group_options(
    group: Mapping[str, Any], index: int, rule_cls: type[RowSparseOptimizer], defaults: Mapping[str, Any]
) -> None:
    """A parameter group may set what ``rule_cls``'s constructor takes (:meth:`group_options`), with the
    same meaning; any other key raises the constructor's ``TypeError``, naming the key and the group.

    A key of ``defaults`` (the hyper-parameters every group carries, e.g. a copy of
    ``opt.param_groups[0]``) passes when it holds the optimizer's own value.
    """
    allowed = rule_cls.group_options()
    for key, value in group.items():
        if key in allowed or key in TORCH_GROUP_KEYS or key == _OVERRIDE_GROUP:
            continue
        if key in defaults and _same(value, defaults[key]):
            continue
        if not _is_option(key, allowed):
            continue  # the user's own metadata ("name", "lr_scale"): kept, as torch.optim keeps it
        hint = ""
        if key == "weight_decay":
            # torch's weight_decay adds λ·w to the gradient (coupled L2); TF's weight_decay_factor decays
            # the weight after the gradient (decoupled): mapping one onto the other would change the math.
            hint = (" torch's `weight_decay` (λ·w added to the gradient) is not TF's decoupled "
                    "`weight_decay_factor`; set `weight_decay_factor` for decoupled decay (docs/optimizers.md).")
        raise TypeError(
            f"Parameter group {index}: {rule_cls.__name__} takes no option `{key}` (received {value!r}); "
            f"a group may set the constructor's options {sorted(allowed)}.{hint}"
        )


@functools.cache
def _option_names(registered: tuple[str, ...]) -> frozenset[str]:
    """Every option of torch.optim's optimizers and of the ``registered`` ones (read from their
    signatures)."""
    names: set[str] = set()
    for cls in vars(torch.optim).values():
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            names |= set(inspect.signature(cls.__init__).parameters)
    for name in registered:
        names |= optimizer_class(name).group_options()
    return frozenset(names - {"self", "params", "defaults"})


def _is_option(key: str, allowed: frozenset[str]) -> bool:
    """Whether a group key means an optimizer option: one of some optimizer's (torch.optim's or this
    package's), or close enough to one to be a misspelling. Anything else is the user's metadata,
    which torch.optim keeps in the group and frameworks read (Lightning's ``name``, timm's
    ``lr_scale``); an option this optimizer does not take is never silently ignored."""
    options = _option_names(optimizer_names())
    return key in options or bool(difflib.get_close_matches(key, allowed | options, 1, 0.8))


def refuse_complex(group: Mapping[str, Any], index: int, optimizer: str) -> None:
    """Raise ``TypeError`` naming a complex parameter of ``group`` (group ``index``).

    The rules are TF's and Keras's, written for real weights: on a complex tensor their ``g·g``
    and square roots are not torch.optim's ``view_as_real`` update (and Adafactor's statistics fail),
    so a complex parameter is refused rather than trained wrong.
    """
    names = group.get("param_names")
    for i, p in enumerate(group["params"]):
        if isinstance(p, torch.Tensor) and p.is_complex():
            name = repr(names[i]) if names else f"param_groups[{index}]['params'][{i}]"
            raise TypeError(
                f"Parameter {name} (shape {tuple(p.shape)}) is complex ({p.dtype}): {optimizer} does not "
                "train complex parameters. Keep it as a real parameter with a last dim of 2 (the real and "
                "imaginary parts, as torch.view_as_real gives) and use torch.view_as_complex(param) in forward."
            )


def _unchanged(group: Mapping[str, Any], before: Mapping[str, Any]) -> bool:
    """Whether ``group`` holds what ``before`` held, ``lr`` aside (a loop, not a generator: it runs every step)."""
    if len(before) != len(group):
        return False
    for k, v in group.items():
        was = before.get(k, before)  # (``before`` itself: a key it lacks)
        if v is not was and k != "lr" and not _same(v, was):
            return False
    return True


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # a user's key holding an array (no truth value): not the same
        return False


def param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The parameter groups ``groups`` (from :func:`user_groups`), with tables whose config names an
    optimizer moved to their own group (built by that optimizer, with its defaults). Groups that name
    an ``algorithm`` and the group a table override is built from keep their tables."""
    overrides = not any(g.get(_OVERRIDE_GROUP) for g in groups if isinstance(g, dict))
    out: list[dict[str, Any]] = []
    for group in groups:
        group = {k: v for k, v in group.items() if k != _OVERRIDE_GROUP}
        ps = group["params"]
        if isinstance(ps, set):  # refused before list() below hides it, as torch.optim's add_param_group refuses it
            raise TypeError(
                "optimizer parameters need to be organized in ordered collections, but the ordering of tensors in "
                "sets will change between runs. Please use a list instead."
            )
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        keep: list[Any] = []
        for item in ps:
            # Named and unnamed parameters may be mixed here: torch.optim's add_param_group refuses that.
            p = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            if not isinstance(p, torch.Tensor):
                keep.append(item)  # torch.optim's add_param_group names what is not a tensor
                continue
            refuse_stacked_view(p, "params", "optimized", "For per-table optimizer settings use "
                                "TableConfig(optimizer=...) (tables with different settings are stacked apart), or "
                                "build the EmbeddingCollection with stack_tables=False.")
            info = table_info(p)
            if overrides and info is not None and info.optimizer is not None and "algorithm" not in group:
                out.append(_override_group(p, info.name, info.optimizer, item))
            else:
                keep.append(item)
        if keep:
            group["params"] = keep
            out.append(group)
    return out


def _override_group(p: torch.Tensor, name: str, spec: Any, given: Any) -> dict[str, Any]:
    """One parameter group for table ``p`` with the optimizer its TableConfig names; ``given``: ``p`` as the user
    gave it (``(name, p)`` from ``named_parameters()``: torch.optim refuses groups with and without names mixed)."""
    factory: Callable[..., Any] = optimizer_class(spec) if isinstance(spec, str) else spec
    try:
        inner = factory([{"params": [p], _OVERRIDE_GROUP: True}])
    except TypeError as e:
        raise TypeError(
            f"Table '{name}': its TableConfig optimizer {spec!r} must be a name in "
            "OPTIMIZER_NAMES or a factory called as factory(params) that returns a "
            f"torch_tpu_embedding.optim optimizer ({e})."
        ) from e
    # One of this package's optimizers (RowSparseOptimizer, which builds its groups with this module,
    # so it is known here by the mark it sets for torch.optim's guard rather than by class).
    if not (isinstance(inner, torch.optim.Optimizer) and getattr(inner, "_tte_reads_row_grads", False)):
        raise TypeError(
            f"Table '{name}': its TableConfig optimizer factory returned "
            f"{type(inner).__name__}; expected a torch_tpu_embedding.optim optimizer."
        )
    group = dict(inner.param_groups[0])
    group["params"] = [given]
    return group


def mark_exchange(group: Mapping[str, Any]) -> None:
    """Tell the group's tables how data parallel sends their rows (:attr:`RowGrad.raw_exchange`), so that
    whoever exchanges first (``step()``, or ``tte.clip_grad_norm_`` before it) sends what the update needs."""
    for p in group["params"]:
        info = table_info(p)
        if info is not None:
            info.row_grad.raw_exchange = not group["use_gradient_accumulation"]


def check_added_group(group: dict[str, Any], index: int, optimizer: Any, defaults: Mapping[str, Any]) -> None:
    """The checks of ``group``, added as group ``index`` of an ``optimizer`` (its class) by ``add_param_group``
    after torch's own: its rule resolved, its values validated and normalised as the constructor's, its tables'
    stacking and exchange marked. Raises ``TypeError`` / ``ValueError`` (the caller then drops the group)."""
    rule_cls = resolve_rule(group) if group.get("algorithm") else optimizer  # (read by rule_of(group))
    refuse_complex(group, index, optimizer.__name__)
    check_extras(group, {k: group[k] for k in EXTRA_DEFAULTS if k in group})
    validate_common(group)
    try:
        rule_cls._validate(group)
    except KeyError as e:  # only a group of another algorithm lacks one: this one's defaults fill it
        raise TypeError(
            f"Parameter group {index}: its algorithm {group['algorithm']!r} is not "
            f"{optimizer.__name__}'s ({defaults['algorithm']!r}) and the group lacks "
            f"{rule_cls.__name__}'s hyper-parameter {e.args[0]!r}; a group of another algorithm carries all "
            f"of them (a copy of a param_groups[i] of tte.optim.{rule_cls.__name__}). To update some tables "
            f"by another rule, give their TableConfig optimizer={group['algorithm']!r}, or build a "
            f"tte.optim.{rule_cls.__name__} for them."
        ) from e
    check_stacked(group, rule_cls)
    mark_exchange(group)
