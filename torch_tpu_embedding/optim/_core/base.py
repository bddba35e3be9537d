"""``RowSparseOptimizer``: the one optimizer core, shared by every optimizer of the package.

Each optimizer is a subclass that declares its slots and a pure per-row ``rule`` (``_core.contract``);
this class runs everything else, once, on every device. A call of :meth:`step`:

1. gradient intake (``_core.grad_intake``): for each parameter with something to apply, its update path
   (:func:`.update_paths.choose_path`), then its gradient — a table's row-sparse gradient (duplicate ids
   summed with a static-shape dedup on XLA) or a dense ``.grad`` — after loss scaling, gradient
   accumulation and ``clipnorm``;
2. ``global_clipnorm`` over every gradient of the call, then the ``skip_nonfinite`` gate;
3. the update (``_core.update_paths``): gather the touched rows of the weight and of every slot, run
   clipvalue → decoupled weight decay → ``rule`` → weight clipping, scatter the rows back in place.
   Rows not looked up in a step are not changed, nor are their slots;
4. EMA (:mod:`~torch_tpu_embedding.optim._core.ema`).

Learning rates may be floats, 0-d tensors or zero-argument callables (called once per step); they
reach the device as data, so changing one never recompiles on XLA (``_core.step_values``). A table whose
``TableConfig.optimizer`` is set gets its own parameter group with that optimizer's rule
(``_core.hyperparams``). ``state_dict`` keys state by table name and slot name (``_state.state_save``); slots
are created with trash rows and their table's layout on XLA (:mod:`~torch_tpu_embedding.optim._core.slots`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from torch_tpu_embedding._rows.placement import register_optimizer, sync_row_grads
from torch_tpu_embedding._rows.stock_guard import check_no_dense_grad
from torch_tpu_embedding._rows.tables import check_live_tables, retired_count, stacked_rows, table_info
from torch_tpu_embedding._util.registry import RULE_KEY, optimizer_class, register, resolve_rule
from torch_tpu_embedding.optim._core import ema, grad_intake, step_gates
from torch_tpu_embedding.optim._core.contract import RowContext, Slots, SlotSpec
from torch_tpu_embedding.optim._core.extras import EXTRA_DEFAULTS, EXTRA_NAMES, check_extras
from torch_tpu_embedding.optim._core.hyperparams import (
    OVERRIDE_GROUP,
    check_added_group,
    check_edited_groups,
    check_group_options,
    check_slot_options,
    param_groups,
    user_groups,
    validate_common,
)
from torch_tpu_embedding.optim._core.keywords import fill_doc
from torch_tpu_embedding.optim._core.slots import RowSpace, lazy_table, make_state
from torch_tpu_embedding.optim._core.state_mapping import StateMapping
from torch_tpu_embedding.optim._core.step_values import LearningRates, StepClock, StepCounters, step_lrs
from torch_tpu_embedding.optim._core.update_paths import choose_path, update
from torch_tpu_embedding.optim._state import state_load, state_save, torch_form
from torch_tpu_embedding.optim._state.state_check import CheckedState

__all__ = ["RowSparseOptimizer"]

Tensor = torch.Tensor


class RowSparseOptimizer(torch.optim.Optimizer):
    """Base class of the optimizers in :mod:`torch_tpu_embedding.optim` (see the module docstring).

    Subclasses set ``algorithm`` (their registry name), ``slot_names``, the pure :meth:`rule`,
    :meth:`slot_initial_values` (or :meth:`slot_specs` for slots not shaped like the parameter),
    and validate their own hyper-parameters in :meth:`_validate`.
    """

    algorithm: ClassVar[str] = ""
    slot_names: ClassVar[tuple[str, ...]] = ()
    #: ``rule(w, g) == w + increment(g, lr)`` and ``increment`` is linear in ``g`` (SGD): an eager step may add
    #: ``increment`` per looked-up id with no dedup, gather or scatter (``Path.ADDITIVE``). Equal to
    #: summing duplicates first up to float rounding (the sum's order differs).
    additive: ClassVar[bool] = False
    # Read by the global torch.optim guard: this optimizer consumes row-sparse table gradients.
    _tte_reads_row_grads: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "algorithm" in cls.__dict__ and cls.algorithm:
            register(cls)
        if "__doc__" in cls.__dict__:
            cls.__doc__ = fill_doc(cls.__doc__)  # the shared keyword documentation (optim/_core/keywords.py)

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        extras: Mapping[str, Any] | None = None,
    ) -> None:
        defaults = dict(defaults)
        defaults.setdefault("algorithm", self.algorithm)
        check_extras(defaults, dict(extras or {}))
        validate_common(defaults)
        type(self)._validate(defaults)
        self._lrs = LearningRates()
        self._run = StepCounters()  # the call counter, the skip / drop counts (see StepCounters)
        groups = user_groups(params)
        for i, group in enumerate(groups):
            if isinstance(group, dict):  # (torch.optim names anything else)
                check_group_options(group, i, type(self), defaults)
                type(self)._options_to_hp(group)
        # Checked above with the indices the user wrote (table overrides add groups before theirs).
        self._groups_checked = True
        super().__init__(param_groups(groups), defaults)
        self._groups_checked = False
        if not any(isinstance(g, dict) and g.get(OVERRIDE_GROUP) for g in groups):  # (not a table override's own)
            register_optimizer(self)  # its configuration agreed over a process group (distributed/optim_agreement.py)
        self.state = StateMapping(dict, self.state)

    # ------------------------------------------------------------------ subclass API
    @staticmethod
    def rule(
        w: Tensor, g: Tensor, slots: Slots, lr: Tensor, step: Tensor, hp: Mapping[str, Any], ctx: RowContext
    ) -> tuple[Tensor, Slots]:
        raise NotImplementedError

    @staticmethod
    def increment(g: Tensor, lr: Tensor, out: Tensor | None = None) -> Tensor:
        """An ``additive`` rule's ``rule(w, g) − w``, to the bit (tested): what ``Path.ADDITIVE`` adds per id,
        without the rule's pass over a zero ``w``; written into ``out`` if given."""
        raise NotImplementedError

    @staticmethod
    def increment_factor(lr: Tensor) -> Tensor | None:  # ``f``, ``increment(g, lr) == f · g`` to the bit (SGD: ``−lr``)
        return None  # for Path.ADDITIVE's C add (optim/_kernels/c_add.py); None: the eager add runs

    @classmethod
    def slot_initial_values(cls, hp: Mapping[str, Any]) -> dict[str, float]:
        return {name: 0.0 for name in cls.slot_names}

    @classmethod
    def slot_specs(cls, shape: tuple[int, ...], hp: Mapping[str, Any], table: bool) -> dict[str, SlotSpec]:
        """The rule's slots for a parameter of ``shape`` (default: each like the parameter)."""
        init = cls.slot_initial_values(hp)
        return {name: SlotSpec(shape, init[name]) for name in cls.slot_names}

    @classmethod
    def _validate(cls, hp: dict[str, Any]) -> None:
        """Check (and normalise in place) the subclass's own hyper-parameters."""

    @classmethod
    def is_lazy(cls, hp: Mapping[str, Any]) -> bool:
        """False for optimizers that update every row of a table each step (non-lazy Adam)."""
        return True

    #: Constructor arguments a subclass refuses although a base class's constructor takes them
    #: (LazyAdam: ``lazy_adam``).
    _refused_options: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def group_options(cls) -> frozenset[str]:
        """The options a parameter group may set: the constructor's keyword arguments (every Keras
        extra included), each with the constructor's meaning (:meth:`_options_to_hp`)."""
        names: set[str] = set(EXTRA_NAMES)
        for klass in cls.__mro__:
            if klass is RowSparseOptimizer:
                break
            init = klass.__dict__.get("__init__")
            if init is not None:
                kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
                names |= {n for n, a in inspect.signature(init).parameters.items() if a.kind in kinds}
        return frozenset(names - {"self", "params", *cls._refused_options})

    @classmethod
    def _options_to_hp(cls, group: dict[str, Any]) -> None:
        """Rewrite, in place, a group's constructor options the groups store under other keys
        (Adafactor's ``weight_decay``); the default stores every option under its own name."""

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; options given in the group are validated (and normalised)
        like the constructor's, and a rejected group is not added. A key the constructor does not take raises
        ``TypeError`` naming it and the group's index. A table whose ``TableConfig.optimizer`` is set gets a group of
        its own with that optimizer, as in the constructor."""
        groups, size = [param_group], len(self.param_groups)
        if not self.__dict__.get("_groups_checked") and isinstance(param_group, dict):
            rule_cls = optimizer_class(param_group["algorithm"]) if param_group.get("algorithm") else type(self)
            check_group_options(param_group, len(self.param_groups), rule_cls, self.defaults)
            rule_cls._options_to_hp(param_group)
            groups = param_groups([param_group]) or [param_group]  # (split as the constructor splits its groups)
        try:
            for group in groups:
                super().add_param_group(group)
                check_added_group(self.param_groups[-1], len(self.param_groups) - 1, type(self), self.defaults)
        except (TypeError, ValueError):
            del self.param_groups[size:]
            raise
        self._run.checked_retired = -1  # the new group's tables are checked at the next step

    def __repr__(self) -> str:  # torch.optim's format, less the rule class the core keeps in each group (not saved)
        return f"{type(self).__name__} (" + "".join(f"\nParameter Group {i}\n" + "".join(
            f"    {k}: {g[k]}\n" for k in sorted(g) if k not in ("params", RULE_KEY))
            for i, g in enumerate(self.param_groups)) + ")"

    def __getstate__(self) -> dict[str, Any]:  # torch.optim's three entries and the call counters (a copy counts on)
        return {**super().__getstate__(), "_run": self._run}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A copy (copy.deepcopy, pickle) steps tables as the original does: its configuration is agreed over a
        # process group as the original's (its own tables'), not left out of the check
        register_optimizer(self)
        if not isinstance(self.state, StateMapping):
            self.state = StateMapping(dict, self.state)
        self.__dict__.setdefault("_lrs", LearningRates())
        if "_run" not in self.__dict__:  # pickled before the counters moved into StepCounters
            run = self._run = StepCounters(self.__dict__.pop("_iterations", 0))
            for k in ("skipped", "dropped", "last_skipped"):
                setattr(run, k, self.__dict__.pop(f"_{k}", None))
            self.__dict__.pop("_checked_retired", None)
        for group in self.param_groups:
            group.setdefault("algorithm", self.algorithm)
            group.setdefault("slot_creation_fn", None)
            for k, v in EXTRA_DEFAULTS.items():
                group.setdefault(k, v)
            resolve_rule(group)

    # ------------------------------------------------------------------ state
    def _group_of(self, p: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise KeyError("parameter is not in this optimizer")

    def _state_for(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """``p``'s state, created (every slot at its initial value) on first use."""
        state: dict[str, Tensor] = self.state[p]
        if not state:
            state.update(make_state(p, group))
        return state

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Apply one update to every parameter that has a gradient (tables: touched rows only).

        Order (Keras): loss scale → gradient accumulation → clipnorm / global_clipnorm / clipvalue →
        weight decay → rule → weight clipping → EMA.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():  # type: ignore[no-untyped-call]
                loss = closure()
        self._check_live_tables()
        check_slot_options(self.param_groups, self.state, self._run.slot_options)  # before any gradient is sent
        if not torch.compiler.is_compiling():  # (its checks read numbers on the host: a graph break)
            check_edited_groups(self.param_groups, self._run.groups_checked)
        # Data parallel (torch_tpu_embedding.distributed): the tables' row gradients made global first. (A table's
        # dense .grad is refused by it before anything is sent under a process group, as torch's DDP's; by
        # check_no_dense_grad without one.)
        sync_row_grads(self.param_groups)
        check_no_dense_grad(p for g in self.param_groups for p in g["params"])
        pending = [[p for p in g["params"] if grad_intake.has_gradient(p, g, self.state.get(p))]
                   for g in self.param_groups]
        # A lookup over the id exchange's capacity drops the whole call, accumulation too: skip_nonfinite's gate.
        clean = step_gates.exchange_clean([p for ps in pending for p in ps])
        checked = None if self._run.skipped is not None else next(  # (looked for until the count exists)
            (ps[0].device for g, ps in zip(self.param_groups, pending, strict=True) if ps and g["skip_nonfinite"]),
            None)
        self._run.start(clean, checked)
        clock = StepClock(self._run.iterations, self._run.skipped_now(), self._run.dropped_now())
        clock.clean = clean
        # Every learning rate first: a callable that raises must find every gradient still pending.
        lrs = step_lrs(self.param_groups, pending)
        work: list[grad_intake.Work] = []
        for gi, (group, params) in enumerate(zip(self.param_groups, pending, strict=True)):
            for p in params:
                path = choose_path(p, group, row_grad=grad_intake.arrives_as_rows(p))
                taken = grad_intake.take(p, group, path)
                item = grad_intake.prepare(p, group, self._state_for(p, group), taken, path, clock)
                if item is None:
                    continue
                lr = lrs[gi]
                assert lr is not None
                item.lr = self._lrs.tensor(gi, lr, p)
                work.append(item)
        # global_clipnorm's scale, then the overflow's and skip_nonfinite's gates (a dropped call updates nothing,
        # whatever its norm): over a process group, one all_reduce for the norm and the check together
        finite = clock.finite = step_gates.call_gates(work, clean)
        self._run.count(finite, clean)
        for item in work:
            update(item)
        ema.ema_calls(self.param_groups, self._state_for, clock, getattr(self._run, "ema_window", None))
        self._run.iterations += 1
        return loss

    @property
    def skipped_steps(self) -> int:
        """Calls that changed nothing: dropped by ``skip_nonfinite``, or because a lookup overflowed the id
        exchange (reading it syncs an XLA device)."""
        return self._run.skipped_count() + self.overflowed_steps

    @property
    def overflowed_steps(self) -> int:
        """Of :attr:`skipped_steps`, the calls dropped because a lookup of a row-sharded table overflowed
        the id exchange's capacity (``EmbeddingCollection.check_ids()`` names the features)."""
        return 0 if self._run.dropped is None else int(self._run.dropped.item())

    @property
    def last_step_skipped(self) -> Tensor:
        """Whether the last :meth:`step` changed nothing (``skip_nonfinite``, or an exchange overflow): a
        0-d bool tensor on the device, read without a sync, e.g. to gate another optimizer's update
        (``torch.where(flag, old, new)``). ``False`` (on the CPU) before a step that could skip, and after a load
        until the next step (a checkpoint does not keep it)."""
        if self._run.last_skipped is None:
            return torch.zeros((), dtype=torch.bool)
        return self._run.last_skipped

    # ------------------------------------------------------------------ EMA
    def moving_average(self, p: Tensor) -> Tensor:
        """The EMA of ``p`` now (every row caught up), as a new tensor. Needs ``use_ema=True``. ``p`` may be a
        stacked table's weight (``ec.tables.<name>.weight``): its rows of its group's EMA."""
        rows = stacked_rows(p)
        if rows is not None:
            return rows.of(self.moving_average(rows.weight))
        group = self._group_of(p)
        if not group["use_ema"]:
            raise ValueError("moving_average() needs an optimizer built with `use_ema=True`.")
        with torch.no_grad():
            return ema.moving_average(p, group, self._state_for(p, group), self._run.iterations,
                                       self._run.skipped_now(), self._run.dropped_now())

    @torch.no_grad()
    def finalize_variable_values(self) -> None:
        """Copy the moving averages into the parameters (Keras; end of training with ``use_ema``)."""
        for group in self.param_groups:
            if not group["use_ema"]:
                continue
            for p in group["params"]:
                avg = self.moving_average(p)
                p.copy_(avg)
                if lazy_table(p, group):
                    space = RowSpace.of(p, group, self.state[p])
                    space.write("ema", avg)
                    upto = ema.last_call(group, p.device, self._run.iterations, self._run.skipped_now(),
                                          self._run.dropped_now())
                    space.write("ema_last", upto.to(torch.int32).expand(p.shape[0]))

    # ------------------------------------------------------------------ lifecycle
    @torch.no_grad()
    def init_state(self) -> None:
        """Create every slot now instead of at the first step. Useful on XLA (materialise the slots with one
        ``torch_xla.sync()`` before the loop, so the steady training step is the only graph) and before loading
        a checkpoint."""
        self._check_live_tables()
        for group in self.param_groups:
            for p in group["params"]:
                self._state_for(p, group)

    def _check_live_tables(self) -> None:
        """Raise if a table weight this optimizer holds was replaced since it was built (checked
        again only when some table weight in the process was, so a steady loop pays one compare)."""
        count = retired_count()
        if count != self._run.checked_retired:
            check_live_tables(p for g in self.param_groups for p in g["params"])
            self._run.checked_retired = count

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` of dense parameters and pending row gradients of tables."""
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                info = table_info(p)
                if info is not None:
                    info.row_grad.clear()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": {key: {slot: tensor, "step": tensor}}, "param_groups": [...], "iterations": n}``.

        Keys are ``table:<name>`` (slots named as TF: ``accumulators``, ``momenta``,
        ``velocities``, ``linears``; Keras: ``r``, ``c``, ``v``, ``ema``) and ``param:<name or
        index>``. Row slots are saved with the table's logical rows (no device padding); ids in
        a pending accumulation buffer that are padding are saved as ``-1``. Callables (a callable
        ``lr``, ``slot_creation_fn``) are not saved; the loading optimizer keeps its own.

        Hooks as in torch.optim: ``register_state_dict_pre_hook``'s ``hook(optimizer)`` first, then
        ``register_state_dict_post_hook``'s ``hook(optimizer, state_dict)``, whose non-``None`` result
        replaces the state dict. Called by ``torch.distributed.checkpoint.state_dict``'s helpers, it
        gives torch.optim's layout (optim/torch_form.py); ``use_torch_layout`` gives it to every caller.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        out = torch_form.state_dict(self)  # (torch.optim's layout when torch's DCP helpers ask)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict`, matching parameters by key (table name), not by position.

        Hooks as in torch.optim: ``register_load_state_dict_pre_hook``'s ``hook(optimizer, state_dict)``
        gets a shallow copy of ``state_dict`` (a non-``None`` result is loaded instead), and
        ``register_load_state_dict_post_hook``'s ``hook(optimizer)`` runs after the load.

        torch.optim's layout (:func:`~torch_tpu_embedding.optim.use_torch_layout`'s, or parameters
        by position or module path as ``torch.distributed.checkpoint.state_dict`` gives it) loads too.
        """
        self.staged_load(state_dict)()

    def staged_load(self, state_dict: dict[str, Any] | CheckedState) -> Callable[[], None]:
        """:meth:`load_state_dict` in two parts: now the load pre-hooks and every check, writing nothing
        (an error here leaves the optimizer as it was); the function returned writes the state and runs
        the load post-hooks. ``tte.checkpoint.load`` writes the model's tables in between.

        The state is checked once: the function returned writes what the check passed. A
        :class:`~torch_tpu_embedding.optim._state.state_check.CheckedState` of this optimizer (``tte.checkpoint``
        checked the file) is not checked again, unless a load pre-hook, which may change it, ran."""
        given = state_dict
        state_dict = (given.state if isinstance(given, CheckedState) else given).copy()  # shallow, as torch.optim
        hooked = bool(self._optimizer_load_state_dict_pre_hooks)  # (a hook may add or drop keys)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        # torch.optim's layout (torch.distributed.checkpoint.state_dict's helpers give it): into ours, checked.
        converted = torch_form.from_torch_layout(self, state_dict)
        if converted is not None:
            done = converted
        elif isinstance(given, CheckedState) and given.checked_for(self) and not hooked:
            done = CheckedState.of(state_dict, self)  # the entries checked, in a shallow copy
        else:
            done = state_load.checked(self, state_dict)

        def write() -> None:
            state_load.write_checked(self, done)
            for post_hook in self._optimizer_load_state_dict_post_hooks.values():
                post_hook(self)

        return write

    def physical_state(self) -> state_save.PhysicalState:
        """The slots as they are on the device, for distributed checkpoints (``tte.checkpoint``):
        sharded, with trash and padding rows, plus the small rest (:class:`~.state_save.PhysicalState`)."""
        return state_save.physical_state(self)

    def load_physical_rest(self, rest: Mapping[str, Any]) -> None:
        """Finish a distributed-checkpoint load: the slots were loaded in place (:meth:`physical_state`);
        this restores hyper-parameters, the call counter and pending accumulation buffers."""
        state_load.load_physical_rest(self, rest)



_State = StateMapping  # the name pickles of earlier optimizers give their ``state``
