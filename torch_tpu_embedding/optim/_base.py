"""The one optimizer core: shared behaviour and row bookkeeping for every optimizer.

Each optimizer is a :class:`RowSparseOptimizer` subclass that declares its slot names and a pure
per-row update ``rule(w, g, slots, lr, step, hp) -> (w, slots)``. This class does everything else,
once, for every device:

* tables (parameters of an :class:`~torch_tpu_embedding.EmbeddingCollection`): take the row-sparse
  gradient, sum duplicate ids (static-shape dedup on XLA), gather the touched rows of the weight and
  of every slot, run the pipeline below, scatter the rows back in place. Rows not looked up in a
  step are not changed, nor are their slots.
* dense parameters: the same pipeline on the whole tensor (every row touched); a sparse COO
  ``.grad`` (``nn.Embedding(sparse=True)``) takes the table path.
* pipeline, in Keras's order (tf_spec §5.1) with TF's steps in place (§4.1): loss scale →
  gradient accumulation over calls → ``clipnorm`` / ``global_clipnorm`` / ``clipvalue`` on the
  summed gradient → decoupled weight decay ``w ← w − λ·w`` (``λ = weight_decay_factor``, times lr
  if ``multiply_weight_decay_factor_by_learning_rate``) → ``rule`` → weight clipping to
  ``[clip_weight_min, clip_weight_max]`` → EMA. The Keras extras are in ``_extras.py``.
* learning rates: a float, a 0-d tensor or a zero-argument callable (called once per step); it
  reaches the device as a tensor, so changing it (schedulers, callables) never recompiles on XLA.
* per-table optimizers: a table whose ``TableConfig.optimizer`` is set gets its own parameter group
  with that optimizer's rule and defaults; one object steps all tables and dense parameters.
* ``state_dict`` keys state by table name (``"table:<name>"``) and TF slot name, not by index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from torch_tpu_embedding._fused import merge_member_state, split_member_state
from torch_tpu_embedding._rows import (
    RowGrad,
    coalesce_rows,
    dedup_static,
    drop_sentinel,
    is_static_device,
    table_info,
)
from torch_tpu_embedding._validation import arg_error, check_bool, check_number
from torch_tpu_embedding.optim._extras import (
    EXTRA_DEFAULTS,
    check_extras,
    clip_by_norm,
    ema_catch_up,
    global_norm_scale,
)

__all__ = ["RowContext", "RowSparseOptimizer", "Rule", "SlotSpec", "optimizer_class"]

Tensor = torch.Tensor
Slots = dict[str, Tensor]


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    """One optimizer state tensor of a parameter.

    ``rows``: dim 0 indexes the parameter's rows — gathered and scattered per touched row, given
    trash rows on XLA, and trimmed to the table's logical rows in checkpoints. Otherwise the slot
    belongs to the whole parameter (e.g. Adafactor's column statistic) and is passed whole.
    """

    shape: tuple[int, ...]
    init: float = 0.0
    rows: bool = True
    dtype: torch.dtype | None = None  # None: the parameter's dtype


@dataclasses.dataclass(frozen=True)
class RowContext:
    """What a rule may need beyond its rows: which of them are real, and the table's size.

    ``mask [U]`` is True for touched rows and False for the static-shape padding tail on XLA;
    ``count`` is ``mask.sum()``. Both are ``None`` for a dense update (every row real). Per-row
    rules ignore the context; rules with reductions over rows (Adafactor) use it.
    """

    mask: Tensor | None
    count: Tensor | None
    num_rows: int  # logical rows of the whole parameter


#: ``rule(w [U, D], g [U, D], slots, lr (0-d), step (0-d), hp, ctx) -> (w_new, slots_new)``
Rule = Callable[[Tensor, Tensor, Slots, Tensor, Tensor, Mapping[str, Any], RowContext], tuple[Tensor, Slots]]

_REGISTRY: dict[str, type[RowSparseOptimizer]] = {}

#: Eager row updates run in chunks of this many rows (see ``RowSparseOptimizer._update_rows``), and
#: of ``ROW_CHUNK_PARALLEL`` rows with more than one torch thread: each element-wise op then wakes the
#: thread pool, which costs too much on chunks this small (measured on 2 cores with
#: ``OMP_WAIT_POLICY=PASSIVE``, LazyAdam at 4 × 81,920 rows × 64: 1 thread 256 ms at 2,048 rows vs 322 ms
#: at 16,384; 2 threads 436–499 ms at 2,048 vs 217–256 ms at 16,384).
ROW_CHUNK = 2048
ROW_CHUNK_PARALLEL = 16384

_BUILDING_OVERRIDE = False


def optimizer_class(name: str) -> type[RowSparseOptimizer]:
    """The optimizer class registered under ``name`` (``"sgd"``, ``"adagrad"``, ...)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise arg_error("optimizer", f"must be one of {tuple(sorted(_REGISTRY))}", name) from None


def _check_clipvalue(clipvalue: Any) -> tuple[float | None, float | None] | None:
    if clipvalue is None:
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
    c = check_number("clipvalue", clipvalue, minimum=0.0)
    return (-c, c)


class RowSparseOptimizer(torch.optim.Optimizer):
    """Base class of the optimizers in :mod:`torch_tpu_embedding.optim` (see the module docstring).

    Subclasses set ``algorithm`` (registry name), ``slot_names``, implement :meth:`rule` (a pure
    function of rows), :meth:`slot_initial_values`, and validate their own hyper-parameters in
    :meth:`_validate`.
    """

    algorithm: ClassVar[str] = ""
    slot_names: ClassVar[tuple[str, ...]] = ()
    #: ``rule(w, g) == w + rule(0, g)`` and ``rule(0, ·)`` is linear (SGD). Then, in eager mode and
    #: with no option that needs the summed rows (clipping, decay, EMA, ...), a step adds
    #: ``rule(0, g)`` per looked-up id with one ``index_add_`` — no dedup, gather or scatter. Equal to
    #: summing duplicates first up to float rounding (the sum's order differs).
    additive: ClassVar[bool] = False
    # Read by the global torch.optim guard: this optimizer consumes row-sparse table gradients.
    _tte_reads_row_grads: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.algorithm:
            _REGISTRY[cls.algorithm] = cls

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        extras: Mapping[str, Any] | None = None,
    ) -> None:
        defaults = dict(defaults)
        defaults.setdefault("algorithm", self.algorithm)
        check_extras(defaults, dict(extras or {}))
        self._validate_common(defaults)
        type(self)._validate(defaults)
        self._lr_cache: dict[tuple[int, torch.device, torch.dtype], tuple[float, Tensor]] = {}
        self._clocks: dict[torch.device, Tensor] = {}
        #: calls of ``step()`` so far (Keras ``iterations`` before the ``// k`` of accumulation)
        self._iterations = 0
        self._skipped: Tensor | None = None  # device-side count of calls dropped by skip_nonfinite
        super().__init__(self._with_table_overrides(params, defaults), defaults)

    # ------------------------------------------------------------------ subclass API
    @staticmethod
    def rule(
        w: Tensor, g: Tensor, slots: Slots, lr: Tensor, step: Tensor, hp: Mapping[str, Any], ctx: RowContext
    ) -> tuple[Tensor, Slots]:
        raise NotImplementedError

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

    # ------------------------------------------------------------------ construction
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; options given in the group are validated
        (and normalised) like the constructor's, and a rejected group is not added."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            rule_cls = _REGISTRY.get(group.get("algorithm", ""), type(self))
            extras = {k: group[k] for k in EXTRA_DEFAULTS if k in group}
            check_extras(group, extras)
            self._validate_common(group)
            rule_cls._validate(group)
            _check_fused(group, rule_cls)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    @staticmethod
    def _validate_common(hp: dict[str, Any]) -> None:
        lr = hp.get("lr")
        if isinstance(lr, Tensor):
            if lr.dim() != 0 or not torch.is_floating_point(lr):
                raise arg_error("lr", "must be a float, a 0-d float tensor or a callable", lr)
        elif not callable(lr):
            check_number("lr", lr, minimum=0.0)
        check_bool("use_gradient_accumulation", hp["use_gradient_accumulation"])
        clip = _check_clipvalue(hp.get("clipvalue"))
        if clip is not None and not hp["use_gradient_accumulation"]:
            raise ValueError(
                "When `use_gradient_accumulation` is False, gradient clipping cannot be used and "
                f"`clipvalue` should be left as None. Received value {hp.get('clipvalue')} for "
                "argument `clipvalue`."
            )
        hp["clipvalue"] = clip
        lo, hi = hp.get("clip_weight_min"), hp.get("clip_weight_max")
        for name, v in (("clip_weight_min", lo), ("clip_weight_max", hi)):
            if v is not None:
                check_number(name, v)
        if lo is not None and hi is not None and lo > hi:
            raise arg_error(
                "clip_weight_min", f"must be <= clip_weight_max ({hi})", lo
            )
        wd = hp.get("weight_decay_factor")
        if wd is not None:
            check_number("weight_decay_factor", wd, minimum=0.0)
        mult = hp.get("multiply_weight_decay_factor_by_learning_rate")
        if mult is not None:
            check_bool("multiply_weight_decay_factor_by_learning_rate", mult)
        fn = hp.get("slot_creation_fn")
        if fn is not None and not callable(fn):
            raise arg_error("slot_creation_fn", "must be a callable or None", fn)

    def _with_table_overrides(
        self, params: Iterable[Any], defaults: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Param groups, with tables whose config names an optimizer moved to their own group."""
        items = list(params)
        if not items:
            raise ValueError("optimizer got an empty parameter list")
        groups = items if isinstance(items[0], dict) else [{"params": items}]
        out: list[dict[str, Any]] = []
        for group in groups:
            group = dict(group)
            ps = group["params"]
            ps = [ps] if isinstance(ps, Tensor) else list(ps)
            named = bool(ps) and isinstance(ps[0], tuple)
            keep: list[Any] = []
            for item in ps:
                p = item[1] if named else item
                info = table_info(p)
                if (
                    info is not None
                    and info.optimizer is not None
                    and "algorithm" not in group
                    and not _BUILDING_OVERRIDE
                ):
                    out.append(self._override_group(p, info.name, info.optimizer))
                else:
                    keep.append(item)
            if keep:
                group["params"] = keep
                out.append(group)
        return out

    def _override_group(self, p: Tensor, name: str, spec: Any) -> dict[str, Any]:
        """One parameter group for table ``p`` with the optimizer its TableConfig names."""
        if isinstance(spec, str):
            factory: Any = optimizer_class(spec)
        else:
            factory = spec
        global _BUILDING_OVERRIDE
        _BUILDING_OVERRIDE = True  # the inner optimizer must not look at overrides again
        try:
            inner = factory([p])
        except TypeError as e:
            raise TypeError(
                f"Table '{name}': its TableConfig optimizer {spec!r} must be a name in "
                "OPTIMIZER_NAMES or a factory called as factory(params) that returns a "
                f"torch_tpu_embedding.optim optimizer ({e})."
            ) from e
        finally:
            _BUILDING_OVERRIDE = False
        if not isinstance(inner, RowSparseOptimizer):
            raise TypeError(
                f"Table '{name}': its TableConfig optimizer factory returned "
                f"{type(inner).__name__}; expected a torch_tpu_embedding.optim optimizer."
            )
        group = dict(inner.param_groups[0])
        group["params"] = [p]
        return group

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_lr_cache", {})
        self.__dict__.setdefault("_clocks", {})
        self.__dict__.setdefault("_iterations", 0)
        self.__dict__.setdefault("_skipped", None)
        for group in self.param_groups:
            group.setdefault("algorithm", self.algorithm)
            group.setdefault("slot_creation_fn", None)
            for k, v in EXTRA_DEFAULTS.items():
                group.setdefault(k, v)

    # ------------------------------------------------------------------ per-step helpers
    def _lr_value(self, group: dict[str, Any]) -> float | Tensor:
        lr = group["lr"]
        value: float | Tensor = lr() if callable(lr) and not isinstance(lr, Tensor) else lr
        return value

    def _lr_tensor(self, gi: int, lr: float | Tensor, p: Tensor) -> Tensor:
        """The learning rate as device data (never a traced constant: no recompiles on XLA)."""
        if isinstance(lr, Tensor):
            lr = lr.detach().to(dtype=p.dtype)
            # Through a 1-element shape: a 0-d host tensor would become an XLA constant.
            return lr if lr.device == p.device else lr.reshape(1).to(p.device).reshape(())
        key = (gi, p.device, p.dtype)
        cached = self._lr_cache.get(key)
        if cached is None or cached[0] != lr:
            # A 0-d host tensor moved to XLA is folded into the graph as a constant (one compile
            # per value); a 1-element tensor arrives as device data.
            cached = (float(lr), torch.tensor([float(lr)], dtype=p.dtype).to(p.device))
            self._lr_cache[key] = cached
        # Reshaped on every use: a cached 0-d view would be materialised by the first step's sync
        # and change the next step's graph inputs ([1] -> []), compiling twice.
        return cached[1].reshape(())

    # ------------------------------------------------------------------ state
    @staticmethod
    def _trash_rows(p: Tensor, k: int) -> int:
        """Extra rows for row-indexed slot ``k`` (1-based) of a table on XLA.

        XLA pairs donated buffers with outputs by byte size; equal-sized weight and slots can be
        mis-paired, and then whole tables are copied every step (XLA_NOTES: "donation pitfall").
        Giving slot ``k`` ``k`` extra rows (``k × shards`` when row-sharded, to keep the split even)
        makes every table-sized buffer a distinct size. The extra rows also absorb the sentinel id's
        scatter. They never reach a checkpoint.
        """
        if table_info(p) is None or p.device.type != "xla":
            return 0
        from torch_tpu_embedding.xla.sharding import slot_extra_rows

        return slot_extra_rows(p, k)

    def _group_of(self, p: Tensor) -> dict[str, Any]:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                return group
        raise KeyError("parameter is not in this optimizer")

    @staticmethod
    def _lazy_table(p: Tensor, group: Mapping[str, Any]) -> bool:
        return table_info(p) is not None and optimizer_class(group["algorithm"]).is_lazy(group)

    @staticmethod
    def _rule_slots(p: Tensor, group: Mapping[str, Any]) -> list[str]:
        """Names of the slots the rule reads and returns for ``p``."""
        cls = optimizer_class(group["algorithm"])
        return list(cls.slot_specs(tuple(p.shape), group, table_info(p) is not None))

    def _specs(self, p: Tensor, group: Mapping[str, Any]) -> dict[str, SlotSpec]:
        """Every state tensor of ``p`` except ``step`` and the accumulation buffers of tables."""
        cls = optimizer_class(group["algorithm"])
        specs = dict(cls.slot_specs(tuple(p.shape), group, table_info(p) is not None))
        if group["use_ema"]:
            specs["ema"] = SlotSpec(tuple(p.shape))
            if self._lazy_table(p, group):
                specs["ema_last"] = SlotSpec((p.shape[0],), init=-1.0, dtype=torch.int32)
        if group["gradient_accumulation_steps"] and table_info(p) is None:
            specs["accumulated_gradients"] = SlotSpec(tuple(p.shape))
        return specs

    def _state_for(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        state = self.state[p]
        if state:
            return state  # type: ignore[no-any-return]
        specs = self._specs(p, group)
        fn = group.get("slot_creation_fn")
        made: Mapping[str, Any] = {}
        if fn is not None:
            names = self._rule_slots(p, group)
            made = fn(p, names, {n: specs[n].init for n in names})
            for name in names:
                s = made.get(name) if isinstance(made, Mapping) else None
                if not isinstance(s, Tensor) or tuple(s.shape) != specs[name].shape:
                    raise ValueError(
                        f"slot_creation_fn must return a dict with a tensor of shape "
                        f"{specs[name].shape} for slot '{name}'. Received: {type(s).__name__}"
                        + (f" {tuple(s.shape)}" if isinstance(s, Tensor) else "")
                    )
        k = 0
        for name, spec in specs.items():
            shape = spec.shape
            if spec.rows and shape:
                k += 1
                shape = (shape[0] + self._trash_rows(p, k), *shape[1:])
            if name == "ema":  # Keras's first EMA update copies the weights
                # A new tensor, not a slice assignment from p: on XLA that ties the two as views
                # and the next step traces a different graph.
                if shape == tuple(p.shape):
                    slot = p.detach().clone()
                else:
                    pad = torch.zeros((shape[0] - p.shape[0], *shape[1:]), dtype=p.dtype, device=p.device)
                    slot = torch.cat([p.detach(), pad])
            else:
                slot = torch.full(shape, spec.init, dtype=spec.dtype or p.dtype, device=p.device)
            if name in made:
                slot[: spec.shape[0]] = made[name].detach().to(device=p.device, dtype=slot.dtype)
            if p.device.type == "xla":  # created with the parameter's layout (SPMD)
                from torch_tpu_embedding.xla.sharding import shard_slot

                shard_slot(p, slot, spec.rows)
            state[name] = slot
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return state  # type: ignore[no-any-return]

    def _clock(self, device: torch.device) -> Tensor:
        """The call counter ``iterations`` as device data (0-d int64), uploaded once per step."""
        t = self._clocks.get(device)
        if t is None:
            # Through a 1-element shape: a 0-d host tensor would become an XLA constant.
            t = torch.tensor([self._iterations], dtype=torch.int64).to(device).reshape(())
            self._clocks[device] = t
        return t

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Apply one update to every parameter that has a gradient (tables: touched rows only).

        Order (Keras, tf_spec §5.1): loss scale → gradient accumulation → clipnorm /
        global_clipnorm / clipvalue → weight decay → rule → weight clipping → EMA.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():  # type: ignore[no-untyped-call]
                loss = closure()
        self._clocks = {}
        work: list[_Work] = []
        for gi, group in enumerate(self.param_groups):
            lr_value: float | Tensor | None = None
            for p in group["params"]:
                item = self._prepare(p, group)
                if item is None:
                    continue
                if lr_value is None:
                    lr_value = self._lr_value(group)
                item.lr = self._lr_tensor(gi, lr_value, p)
                work.append(item)
        scale = self._global_clip_scales(work)
        for item in work:
            if item.group["global_clipnorm"]:
                item.g = item.g * scale[item.g.device].to(item.g.dtype)
        self._gate_nonfinite(work)
        for item in work:
            if item.ids is None:
                self._update_dense(item)
            else:
                self._update_rows(item)
        self._ema_dense_and_overwrite()
        self._iterations += 1
        return loss

    def _prepare(self, p: Tensor, group: dict[str, Any]) -> _Work | None:
        """The gradient of ``p`` this call after loss scaling, accumulation, dedup and clipnorm."""
        info = table_info(p)
        k = group["gradient_accumulation_steps"]
        ids: Tensor | None = None
        rows: Tensor | None = None
        g: Tensor | None = None
        cls = optimizer_class(group["algorithm"])
        grad: RowGrad | None = None  # additive, eager, no accumulation: rows multiplied out piecewise
        additive = cls.is_lazy(group) and self._additive(cls, group, p)
        piecewise = info is not None and not k and additive
        if info is not None:
            info.row_grad.keep_factored = piecewise  # how the next backward should hand over its rows
        if info is not None and info.row_grad:
            if piecewise:
                grad = info.row_grad.take()
            else:
                ids, rows = info.row_grad.collect()
                info.row_grad.clear()
        elif p.grad is not None and p.grad.is_sparse:
            if p.dim() != 2:
                raise ValueError(
                    "Sparse gradients are supported for 2-D (embedding) parameters only. "
                    f"Received a sparse gradient for a parameter of shape {tuple(p.shape)}."
                )
            coalesced = p.grad.coalesce()
            ids, rows = coalesced.indices()[0], coalesced.values()
        elif p.grad is not None and info is None:
            g = p.grad
        pending = bool(k) and "acc_ids" in self.state.get(p, {})  # a table mid-accumulation
        if ids is None and g is None and grad is None and not pending:
            return None
        state = self._state_for(p, group)
        s = group["loss_scale_factor"]
        gate: Tensor | None = None
        if g is not None:
            g = g if s is None else g / s
            if k:
                acc = self._accumulate_dense(state, g, k, p.device)
                if acc is None:
                    return None
                g, gate = acc
        else:
            sentinel = p.shape[0]
            lazy = cls.is_lazy(group)
            if grad is not None:
                return self._additive_work(p, group, state, grad, s)
            if rows is not None:
                rows = rows.to(p.dtype) if s is None else rows.to(p.dtype) / s
            if k:
                acc_rows = self._accumulate_rows(state, ids, rows, k, p)
                if acc_rows is None:
                    return None
                ids, rows, gate = acc_rows
            assert ids is not None and rows is not None
            if additive:  # accumulated (or sparse COO) rows: added per id like the piecewise path
                whole = RowGrad()
                whole.add(ids, rows / k if k else rows)
                return self._additive_work(p, group, state, whole, None)
            if group["use_gradient_accumulation"] or not lazy:
                ids, rows = coalesce_rows(ids, rows, sentinel)
            else:
                # No dedup: every contribution updates from the same old rows and the changes are
                # added. Exact for SGD; a cheaper approximation otherwise (docs/optimizers.md).
                ids, rows = drop_sentinel(ids, rows, sentinel)
            if k:
                rows = rows / k
            if lazy:
                g = rows
            else:  # every row updates, with g = 0 where not looked up (O(V·D))
                g = torch.zeros_like(p).index_add_(0, ids, rows)
                ids = None
        if group["clipnorm"]:
            g = clip_by_norm(g, group["clipnorm"])
        return _Work(p=p, group=group, state=state, ids=ids, g=g, gate=gate)

    @staticmethod
    def _additive_work(
        p: Tensor, group: dict[str, Any], state: dict[str, Tensor], grad: RowGrad, divisor: float | None
    ) -> _Work:
        """Work for :attr:`additive` rules: ``grad``'s rows are added per id in pieces (no dedup)."""
        return _Work(p=p, group=group, state=state, ids=torch.empty(0, dtype=torch.int64), g=torch.empty(0),
                     gate=None, pieces=grad, divisor=divisor)

    @staticmethod
    def _additive(cls: type[RowSparseOptimizer], group: Mapping[str, Any], p: Tensor) -> bool:
        """Whether this table's step may add ``rule(0, g)`` per id (see :attr:`additive`)."""
        if not cls.additive or is_static_device(p.device):
            return False
        needs_sum = ("clipvalue", "weight_decay_factor", "clip_weight_min", "clip_weight_max", "use_ema",
                     "clipnorm", "global_clipnorm", "skip_nonfinite")
        return not any(group.get(k) not in (None, False, 0) for k in needs_sum)

    def _gate_nonfinite(self, work: list[_Work]) -> None:
        """``skip_nonfinite``: keep every update of this call only if all gradients are finite."""
        checked = [w for w in work if w.group["skip_nonfinite"]]
        if not checked:
            return
        dev = checked[0].g.device
        finite = torch.ones((), dtype=torch.bool, device=dev)
        for w in checked:
            finite = finite & torch.isfinite(w.g).all().to(dev)
        for w in checked:
            ok = finite.to(w.g.device)
            w.gate = ok if w.gate is None else w.gate & ok
        if self._skipped is None:
            self._skipped = _to_device(torch.zeros((), dtype=torch.int64), dev)
        elif self._skipped.device != dev:
            self._skipped = _to_device(self._skipped, dev)
        self._skipped = self._skipped + (~finite).to(torch.int64)

    @property
    def skipped_steps(self) -> int:
        """Calls whose update ``skip_nonfinite`` dropped (reading it syncs an XLA device)."""
        return 0 if self._skipped is None else int(self._skipped.item())

    def _accumulate_dense(
        self, state: dict[str, Tensor], g: Tensor, k: int, device: torch.device
    ) -> tuple[Tensor, Tensor | None] | None:
        """Keras accumulation for a dense gradient: ``None`` on accumulate-only calls (eager)."""
        acc = state["accumulated_gradients"]
        total = acc + g
        if is_static_device(device):
            # One graph for every call: the update runs always and is kept only on the k-th call.
            it = self._clock(device)
            gate = torch.remainder(it + 1, k) == 0
            acc.copy_(torch.where(gate, torch.zeros_like(total), total))
            return total / k, gate
        if (self._iterations + 1) % k:
            acc.copy_(total)
            return None
        acc.zero_()
        return total / k, None

    def _accumulate_rows(
        self, state: dict[str, Tensor], ids: Tensor | None, rows: Tensor | None, k: int, p: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Keras accumulation for a table: a ``[k, capacity]`` buffer of (ids, rows), one slot per call.

        Call ``i`` writes slot ``i % k`` (a call without lookups writes padding), so every slot is
        rewritten each cycle and the buffer never needs clearing; the k-th call updates from all
        slots. Capacity grows to the largest chunk seen; in a steady loop the shapes are static.
        """
        sentinel, dim = p.shape[0], p.shape[1]
        n = 0 if ids is None else ids.numel()
        buf_ids, buf_rows = state.get("acc_ids"), state.get("acc_rows")
        if buf_ids is None or buf_rows is None or buf_ids.shape[1] < n:
            cap = max(n, 0 if buf_ids is None else buf_ids.shape[1])
            # Built on the host and transferred: device data, not graph constants, on XLA.
            new_ids = torch.full((k, cap), sentinel, dtype=torch.int64)
            new_rows = torch.zeros((k, cap, dim), dtype=p.dtype)
            if buf_ids is not None and buf_rows is not None:
                old = buf_ids.shape[1]
                new_ids, new_rows = new_ids.to(p.device), new_rows.to(p.device)
                new_ids[:, :old] = buf_ids
                new_rows[:, :old] = buf_rows
            buf_ids, buf_rows = new_ids.to(p.device), new_rows.to(p.device)
            if p.device.type == "xla":
                from torch_tpu_embedding.xla.sharding import shard_slot

                shard_slot(p, buf_ids, rows=False)
                shard_slot(p, buf_rows, rows=False)
            state["acc_ids"], state["acc_rows"] = buf_ids, buf_rows
        cap = buf_ids.shape[1]
        chunk_ids = torch.full((cap,), sentinel, dtype=torch.int64, device=p.device)
        chunk_rows = torch.zeros((cap, dim), dtype=p.dtype, device=p.device)
        if ids is not None and rows is not None and n:
            chunk_ids = torch.cat([ids.to(torch.int64), chunk_ids[n:]])
            chunk_rows = torch.cat([rows, chunk_rows[n:]])
        if is_static_device(p.device):
            it = self._clock(p.device)
            at = torch.remainder(it, k).reshape(1)
            buf_ids.index_copy_(0, at, chunk_ids[None])
            buf_rows.index_copy_(0, at, chunk_rows[None])
            gate = torch.remainder(it + 1, k) == 0
            return buf_ids.reshape(-1), buf_rows.reshape(-1, dim), gate
        buf_ids[self._iterations % k] = chunk_ids
        buf_rows[self._iterations % k] = chunk_rows
        if (self._iterations + 1) % k:
            return None
        return buf_ids.reshape(-1), buf_rows.reshape(-1, dim), None

    def _global_clip_scales(self, work: list[_Work]) -> dict[torch.device, Tensor]:
        """Keras ``global_clipnorm``: one norm over every gradient of the groups that set it."""
        clipped = [w for w in work if w.group["global_clipnorm"]]
        if not clipped:
            return {}
        dev = clipped[0].g.device
        sq = torch.zeros((), dtype=torch.float64 if clipped[0].g.dtype == torch.float64 else torch.float32, device=dev)
        for w in clipped:
            part = (w.g * w.g).sum().to(device=dev, dtype=sq.dtype)
            sq = sq + (part if w.gate is None else torch.where(w.gate.to(dev), part, torch.zeros_like(part)))
        c = float(clipped[0].group["global_clipnorm"])
        scale = global_norm_scale(sq, c)
        return {w.g.device: scale.to(w.g.device) for w in clipped}

    def _pipeline(
        self,
        cls: type[RowSparseOptimizer],
        w: Tensor,
        g: Tensor,
        slots: Slots,
        lr: Tensor,
        step: Tensor,
        group: Mapping[str, Any],
        ctx: RowContext,
    ) -> tuple[Tensor, Slots]:
        clip = group["clipvalue"]
        if clip is not None:
            g = g.clamp(min=clip[0], max=clip[1])
        wd = group.get("weight_decay_factor")
        if wd:
            decay = lr * wd if group.get("multiply_weight_decay_factor_by_learning_rate") else wd
            w = w - decay * w
        w, slots = cls.rule(w, g, slots, lr, step, group, ctx)
        lo, hi = group.get("clip_weight_min"), group.get("clip_weight_max")
        if lo is not None or hi is not None:
            w = w.clamp(min=lo, max=hi)
        return w, slots

    @staticmethod
    def _gated(gate: Tensor | None, new: Tensor, old: Tensor) -> Tensor:
        return new if gate is None else torch.where(gate, new, old)

    def _update_dense(self, item: _Work) -> None:
        p, group, state, gate = item.p, item.group, item.state, item.gate
        cls = optimizer_class(group["algorithm"])
        specs = self._specs(p, group)
        n = p.shape[0] if p.dim() else 1
        names = self._rule_slots(p, group)
        # Without the trash rows of a (non-lazy) table's slots.
        slots = {k: _without_trash(state[k], n) if specs[k].rows and p.dim() else state[k] for k in names}
        info = table_info(p)
        ctx = RowContext(mask=None, count=None, num_rows=n if info is None else info.num_embeddings)
        step = state["step"] + 1
        w, new = self._pipeline(cls, p, item.g, slots, item.lr, step, group, ctx)
        for k in names:
            _write_whole(state[k], self._gated(gate, new[k].to(slots[k].dtype), slots[k]))
        state["step"].copy_(self._gated(gate, step, state["step"]))
        p.copy_(self._gated(gate, w, p))

    def _update_rows(self, item: _Work) -> None:
        """Gather the touched rows (and slots), run the pipeline, scatter them back.

        In eager mode, with unique ids and a per-row rule, in chunks of :data:`ROW_CHUNK` rows: the
        rule's ~10 element-wise passes then run over temporaries that stay in cache instead of over
        ``[U, D]`` arrays (Adam's rule ran 3.2× faster at 100k rows × 64; docs/benchmarks.md). XLA
        fuses the passes itself and keeps one static-shape graph, so it gets the whole batch at once.
        """
        ids = item.ids
        assert ids is not None
        group = item.group
        chunk = _row_chunk()
        if item.pieces is not None:  # additive: one index_add_ of rule(0, g) per id, in small pieces
            p, state = item.p, item.state
            step = state["step"] + 1
            ctx = RowContext(mask=None, count=None, num_rows=self._logical_rows(p))
            zero = torch.zeros((), dtype=p.dtype, device=p.device)
            rule = optimizer_class(group["algorithm"]).rule
            for _, part_ids, part in item.pieces.pieces(chunk):
                part = part.to(p.dtype) if item.divisor is None else part.to(p.dtype) / item.divisor
                part_ids, part = drop_sentinel(part_ids, part, p.shape[0])
                delta, _ = rule(zero, part, {}, item.lr, step, group, ctx)
                p.index_add_(0, part_ids, delta.to(p.dtype))
            state["step"].copy_(step)
            return
        separable = all(
            spec.rows for spec in optimizer_class(group["algorithm"]).slot_specs(
                tuple(item.p.shape), group, True).values()
        )
        if is_static_device(ids.device) or not group["use_gradient_accumulation"] or not separable \
                or ids.shape[0] <= chunk:
            self._update_row_chunk(item, ids, item.g)
            return
        for start in range(0, ids.shape[0], chunk):
            self._update_row_chunk(item, ids[start : start + chunk], item.g[start : start + chunk])

    def _update_row_chunk(self, item: _Work, ids: Tensor, g: Tensor) -> None:
        p, group, state, gate = item.p, item.group, item.state, item.gate
        cls = optimizer_class(group["algorithm"])
        specs = self._specs(p, group)
        sentinel = p.shape[0]
        dedup = group["use_gradient_accumulation"]
        # On XLA the sentinel tail is clamped for the gather and dropped by the scatter.
        at = ids.clamp(max=sentinel - 1)
        w0 = p.index_select(0, at)
        names = self._rule_slots(p, group)
        row_slots = [k for k in names if specs[k].rows]
        slots = {k: state[k].index_select(0, at) if k in row_slots else state[k] for k in names}
        mask = ids < sentinel
        info = table_info(p)
        ctx = RowContext(mask=mask, count=mask.sum(), num_rows=sentinel if info is None else info.num_embeddings)
        ema = group["use_ema"]
        ema_ids = ids
        if ema and not dedup:  # ids repeat: the average needs each row once
            ema_ids = unique_ids(ids, sentinel)
            ema_w0 = p.index_select(0, ema_ids.clamp(max=sentinel - 1))
        step = item.step_now if item.step_now is not None else state["step"] + 1
        w, new = self._pipeline(cls, w0, g, slots, item.lr, step, group, ctx)
        w = self._gated(gate, w, w0)
        new = {k: self._gated(gate, new[k].to(slots[k].dtype), slots[k]) for k in names}
        if item.step_now is None:  # the first chunk counts the step; later chunks use the same count
            item.step_now = step
            state["step"].copy_(self._gated(gate, step, state["step"]))
        for k in names:
            if k not in row_slots:
                state[k].copy_(new[k])
            elif dedup:  # ids are unique: write the rows
                state[k].index_copy_(0, ids, new[k])
            else:  # ids repeat: add the changes
                state[k].index_add_(0, ids, new[k] - slots[k])
        if dedup:
            p.index_copy_(0, ids, w)
        else:
            p.index_add_(0, ids, w - w0)
        if ema:
            if dedup:
                self._ema_rows(p, group, state, ids, w0, w)
            else:
                self._ema_rows(p, group, state, ema_ids, ema_w0, p.index_select(0, ema_ids.clamp(max=sentinel - 1)))

    # ------------------------------------------------------------------ EMA
    def _ema_momentum_now(self, group: Mapping[str, Any], device: torch.device, dtype: torch.dtype) -> Tensor:
        """μ' = 0 while Keras's ``iterations`` (calls // k) is 0, else ``ema_momentum``."""
        k = group["gradient_accumulation_steps"] or 1
        it = self._clock(device)
        mu: Tensor = (torch.div(it, k, rounding_mode="floor") != 0).to(dtype) * group["ema_momentum"]
        return mu

    def _ema_rows(
        self, p: Tensor, group: Mapping[str, Any], state: dict[str, Tensor], ids: Tensor, w_old: Tensor, w_new: Tensor
    ) -> None:
        """Catch the touched rows' averages up over their idle calls, then apply this call's EMA."""
        sentinel = p.shape[0]
        at = ids.clamp(max=sentinel - 1)
        it = self._clock(p.device).to(torch.int32)
        avg = state["ema"].index_select(0, at)
        last = state["ema_last"].index_select(0, at)
        caught = ema_catch_up(avg, w_old, it - last - 1, group["ema_momentum"])
        mu = self._ema_momentum_now(group, p.device, p.dtype)
        state["ema"].index_copy_(0, ids, mu * caught + (1 - mu) * w_new)
        # max(last, it) == it, but written as a function of the gathered rows so that XLA orders the
        # gather before the in-place scatter (otherwise it copies the whole [V] slot every step).
        state["ema_last"].index_copy_(0, ids, torch.maximum(last, it))

    def _ema_all_rows(self, p: Tensor, group: Mapping[str, Any], state: dict[str, Tensor], upto: Tensor) -> Tensor:
        """Every row's average as of call ``upto`` (lazy table): ``[rows, D]``, not stored."""
        n = p.shape[0]
        idle = upto.to(torch.int32) - state["ema_last"][:n]
        return ema_catch_up(state["ema"][:n], p, idle, group["ema_momentum"])

    def _ema_dense_and_overwrite(self) -> None:
        """EMA of dense (and non-lazy) parameters every call; Keras's periodic overwrite."""
        for group in self.param_groups:
            if not group["use_ema"]:
                continue
            k = group["gradient_accumulation_steps"] or 1
            f = group["ema_overwrite_frequency"]
            overwrite = bool(f) and ((self._iterations // k) + 1) % f == 0
            for p in group["params"]:
                state = self._state_for(p, group)
                n = p.shape[0] if p.dim() else 1
                avg = _without_trash(state["ema"], n) if p.dim() else state["ema"]
                if self._lazy_table(p, group):
                    if overwrite:  # O(V·D), every f calls, as in Keras
                        it = self._clock(p.device)
                        caught = self._ema_all_rows(p, group, state, it)
                        _write_whole(state["ema"], caught)
                        _write_whole(state["ema_last"], it.to(torch.int32).expand(n))
                        p.copy_(caught)
                    continue
                mu = self._ema_momentum_now(group, p.device, p.dtype)
                avg = mu * avg + (1 - mu) * p
                _write_whole(state["ema"], avg)
                if overwrite:
                    p.copy_(avg)

    def moving_average(self, p: Tensor) -> Tensor:
        """The EMA of ``p`` now (every row caught up), as a new tensor. Needs ``use_ema=True``."""
        group = self._group_of(p)
        if not group["use_ema"]:
            raise ValueError("moving_average() needs an optimizer built with `use_ema=True`.")
        with torch.no_grad():
            state = self._state_for(p, group)
            if self._lazy_table(p, group):
                upto = torch.tensor([self._iterations - 1], dtype=torch.int64).to(p.device).reshape(())
                return self._ema_all_rows(p, group, state, upto)
            n = p.shape[0] if p.dim() else 1
            return (state["ema"][:n] if p.dim() else state["ema"]).clone()

    @torch.no_grad()
    def finalize_variable_values(self) -> None:
        """Copy the moving averages into the parameters (Keras; end of training with ``use_ema``)."""
        for group in self.param_groups:
            if not group["use_ema"]:
                continue
            for p in group["params"]:
                avg = self.moving_average(p)
                p.copy_(avg)
                if self._lazy_table(p, group):
                    state = self.state[p]
                    _write_whole(state["ema"], avg)
                    last = torch.full_like(state["ema_last"][: p.shape[0]], self._iterations - 1)
                    _write_whole(state["ema_last"], last)

    # ------------------------------------------------------------------ lifecycle
    @torch.no_grad()
    def init_state(self) -> None:
        """Create every slot now instead of at the first step.

        Useful on XLA (materialise the slots with one ``torch_xla.sync()`` before the loop, so the
        steady training step is the only graph) and before loading a checkpoint.
        """
        for group in self.param_groups:
            for p in group["params"]:
                self._state_for(p, group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` of dense parameters and pending row gradients of tables."""
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                info = table_info(p)
                if info is not None:
                    info.row_grad.clear()

    # ------------------------------------------------------------------ checkpoints
    def _param_keys(self) -> dict[int, str]:
        """Stable names: ``table:<name>`` for tables, else the given name or ``param:<i>``."""
        keys: dict[int, str] = {}
        i = 0
        for group in self.param_groups:
            names = group.get("param_names")
            for j, p in enumerate(group["params"]):
                info = table_info(p)
                if info is not None:
                    keys[id(p)] = f"table:{info.name}"
                elif names is not None:
                    keys[id(p)] = f"param:{names[j]}"
                else:
                    keys[id(p)] = f"param:{i}"
                i += 1
        return keys

    @staticmethod
    def _logical_rows(p: Tensor) -> int:
        info = table_info(p)
        return info.num_embeddings if info is not None else (p.shape[0] if p.dim() else 1)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": {key: {slot: tensor, "step": tensor}}, "param_groups": [...], "iterations": n}``.

        Keys are ``table:<name>`` (slots named as TF: ``accumulators``, ``momenta``,
        ``velocities``, ``linears``; Keras: ``r``, ``c``, ``v``, ``ema``) and ``param:<name or
        index>``. Row slots are saved with the table's logical rows (no device padding); ids in
        a pending accumulation buffer that are padding are saved as ``-1``. Callables (a callable
        ``lr``, ``slot_creation_fn``) are not saved; the loading optimizer keeps its own.
        """
        keys = self._param_keys()
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        state: dict[str, Any] = {}
        for p, s in self.state.items():
            if id(p) not in keys:
                continue
            specs = self._specs(p, group_of[id(p)])
            n = self._logical_rows(p)
            out: dict[str, Tensor] = {}
            for name, v in s.items():
                if name == "acc_ids":
                    out[name] = torch.where(v >= n, torch.full_like(v, -1), v)
                elif name in specs and specs[name].rows and v.dim():
                    out[name] = v[:n]
                else:
                    out[name] = v
            members = _members(p)
            if members is None:
                state[keys[id(p)]] = out
                continue
            row_slots = [k for k, spec in specs.items() if spec.rows and spec.shape]
            parts = split_member_state(out, members, row_slots)
            state.update({f"table:{name}": part for name, part in parts.items()})
        groups = []
        for group in self.param_groups:
            saved = {
                k: v
                for k, v in group.items()
                if k not in ("params", "slot_creation_fn") and not (callable(v) and not isinstance(v, Tensor))
            }
            saved["params"] = [k for p in group["params"] for k, _ in _logical_keys(p, keys[id(p)], 0)]
            groups.append(saved)
        return {"state": state, "param_groups": groups, "iterations": self._iterations,
                "skipped_steps": self.skipped_steps}

    def physical_state(self) -> tuple[dict[str, Tensor], dict[str, int | None], dict[str, Any]]:
        """The slots as they are on the device, for distributed checkpoints (``tte.checkpoint``).

        Returns ``(tensors, logical_rows, rest)``: ``tensors["<key>/<slot>"]`` is the slot itself
        (sharded, with trash/padding rows), ``logical_rows`` its rows in :meth:`state_dict` (``None``:
        saved whole), and ``rest`` everything else of :meth:`state_dict` (hyper-parameters, the call
        counter, pending accumulation buffers) as small CPU values.
        """
        keys = self._param_keys()
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        tensors: dict[str, Tensor] = {}
        rows: dict[str, int | None] = {}
        acc: dict[str, dict[str, Tensor]] = {}
        for p, s in self.state.items():
            key = keys[id(p)]
            specs = self._specs(p, group_of[id(p)])
            n = self._logical_rows(p)
            for name, v in s.items():
                if name in ("acc_ids", "acc_rows"):
                    small = torch.where(v >= n, torch.full_like(v, -1), v) if name == "acc_ids" else v
                    acc.setdefault(key, {})[name] = small.detach().cpu()
                    continue
                tensors[f"{key}/{name}"] = v
                rows[f"{key}/{name}"] = n if name in specs and specs[name].rows and v.dim() else None
        sd = self.state_dict()
        members = {keys[id(p)]: m for p in self.state if (m := _members(p)) is not None}
        return tensors, rows, {"param_groups": sd["param_groups"], "iterations": sd["iterations"], "acc": acc,
                               "members": members}

    def load_physical_rest(self, rest: Mapping[str, Any]) -> None:
        """Finish a distributed-checkpoint load: the slots were loaded in place (:meth:`physical_state`);
        this restores hyper-parameters, the call counter and pending accumulation buffers."""
        keys = self._param_keys()
        by_key = {keys[id(p)]: p for g in self.param_groups for p in g["params"]}
        saved = rest["param_groups"]
        problems = []
        if len(saved) != len(self.param_groups):
            problems.append(f"{len(saved)} parameter groups saved, {len(self.param_groups)} here")
        for i, (sg, g) in enumerate(zip(saved, self.param_groups, strict=False)):
            if sg.get("algorithm") != g["algorithm"]:
                problems.append(
                    f"group {i}: saved by optimizer '{sg.get('algorithm')}', loading into '{g['algorithm']}'"
                )
        if problems:
            raise ValueError("Optimizer state does not match: " + "; ".join(problems))
        for sg, g in zip(saved, self.param_groups, strict=True):
            for k, v in sg.items():
                if k != "params" and not (callable(g.get(k)) and not isinstance(g.get(k), Tensor)):
                    g[k] = v
        self._iterations = int(rest["iterations"])
        for key, bufs in rest["acc"].items():
            p = by_key[key]
            state = self.state[p]
            ids = bufs["acc_ids"].to(torch.int64)
            state["acc_ids"] = _to_device(torch.where(ids < 0, torch.full_like(ids, p.shape[0]), ids), p.device)
            state["acc_rows"] = _to_device(bufs["acc_rows"].to(p.dtype), p.device)
        self._lr_cache.clear()

    def _merged_state(
        self, saved: Mapping[str, Mapping[str, Tensor]], by_key: Mapping[str, Tensor], keys: Mapping[int, str]
    ) -> dict[str, Mapping[str, Tensor]]:
        """Saved state by physical key: the per-table entries of a fused group's tables stacked."""
        out: dict[str, Mapping[str, Tensor]] = {}
        fused: dict[int, dict[str, Mapping[str, Tensor]]] = {}
        for key, s in saved.items():
            p = by_key[key]
            if _members(p) is None:
                out[key] = s
            else:
                fused.setdefault(id(p), {})[key[len("table:"):]] = s
        params = {id(p): p for p in by_key.values()}
        for pid, parts in fused.items():
            p = params[pid]
            members = _members(p)
            assert members is not None
            group = self._group_of(p)
            state = self._state_for(p, group)
            specs = self._specs(p, group)

            def current(slot: str, off: int, n: int, state: dict[str, Tensor] = state) -> Tensor:
                return state[slot][off : off + n]

            row_slots = [k for k, spec in specs.items() if spec.rows and spec.shape]
            out[keys[pid]] = merge_member_state(parts, members, row_slots, current)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict`, matching parameters by key (table name), not by position."""
        keys = self._param_keys()
        # Logical keys: a fused group answers to each of its tables' keys, with that table's rows.
        by_key: dict[str, Tensor] = {}
        rows_of: dict[str, int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                for key, n in _logical_keys(p, keys[id(p)], self._logical_rows(p)):
                    by_key[key], rows_of[key] = p, n
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        saved_groups = state_dict["param_groups"]
        problems: list[str] = []
        if len(saved_groups) != len(self.param_groups):
            problems.append(
                f"{len(saved_groups)} parameter groups saved, {len(self.param_groups)} here"
            )
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups, strict=False)):
            mine = [k for p in g["params"] for k, _ in _logical_keys(p, keys[id(p)], 0)]
            if sorted(sg["params"]) != sorted(mine):
                missing = sorted(set(mine) - set(sg["params"]))
                extra = sorted(set(sg["params"]) - set(mine))
                problems.append(f"group {i}: missing {missing}, unexpected {extra}")
            if sg.get("algorithm") != g["algorithm"]:
                problems.append(
                    f"group {i}: saved by optimizer '{sg.get('algorithm')}', loading into "
                    f"'{g['algorithm']}'"
                )
        for key, s in state_dict["state"].items():
            p = by_key.get(key)
            if p is None:
                continue  # reported above through the groups
            specs = self._specs(p, {**group_of[id(p)], **_saved_group_of(saved_groups, key)})
            n = rows_of[key]
            for name, v in s.items():
                if name in ("step", "acc_ids", "acc_rows"):
                    continue
                spec = specs.get(name)
                if spec is None:
                    problems.append(f"{key}: unexpected slot '{name}' (expected {sorted(specs)})")
                    continue
                want = (n, *spec.shape[1:]) if spec.rows and spec.shape else spec.shape
                if tuple(v.shape) != tuple(want):
                    problems.append(f"{key}: slot '{name}' has shape {tuple(v.shape)}, expected {tuple(want)}")
        if problems:
            raise ValueError("Optimizer state does not match: " + "; ".join(problems))
        self.state.clear()
        for sg, g in zip(saved_groups, self.param_groups, strict=True):
            for k, v in sg.items():
                if k != "params" and not (callable(g.get(k)) and not isinstance(g.get(k), Tensor)):
                    g[k] = v
        physical = {keys[id(p)]: p for g in self.param_groups for p in g["params"]}
        for key, s in self._merged_state(state_dict["state"], by_key, keys).items():
            p = physical[key]
            state = self._state_for(p, group_of[id(p)])
            specs = self._specs(p, group_of[id(p)])
            for name, v in s.items():
                v = v.detach()
                # Whole-tensor writes into the slots made by _state_for: they keep their layout
                # (SPMD sharding, trash and padding rows); 0-d values arrive as device data.
                if name == "step":
                    state[name].copy_(_to_device(v.to(torch.float32), p.device))
                elif name == "acc_ids":
                    v = v.to(torch.int64)
                    state[name] = _to_device(torch.where(v < 0, torch.full_like(v, p.shape[0]), v), p.device)
                elif name == "acc_rows":
                    state[name] = _to_device(v.to(dtype=p.dtype), p.device)
                elif specs[name].rows and v.dim():
                    _write_whole(state[name], _to_device(v.to(state[name].dtype), p.device))
                else:
                    state[name].copy_(_to_device(v.to(state[name].dtype), p.device))
        self._iterations = int(state_dict.get("iterations", 0))
        skipped = int(state_dict.get("skipped_steps", 0))
        self._skipped = torch.tensor(skipped, dtype=torch.int64) if skipped else None
        self._lr_cache.clear()


def _row_chunk() -> int:
    return ROW_CHUNK if torch.get_num_threads() == 1 else ROW_CHUNK_PARALLEL


def _members(p: Tensor) -> tuple[tuple[str, int, int], ...] | None:
    info = table_info(p)
    return None if info is None else info.members


def _logical_keys(p: Tensor, key: str, rows: int) -> list[tuple[str, int]]:
    """``p``'s keys in :meth:`RowSparseOptimizer.state_dict` with their logical rows (``p``'s
    ``key`` and ``rows``, or one per table of a fused group)."""
    members = _members(p)
    return [(key, rows)] if members is None else [(f"table:{name}", n) for name, _, n in members]


def _check_fused(group: Mapping[str, Any], rule_cls: type[RowSparseOptimizer]) -> None:
    """Reject what a fused group cannot do exactly as its separate tables would (by name)."""
    for p in group["params"]:
        info = table_info(p)
        if info is None or info.members is None:
            continue
        names = [m[0] for m in info.members]
        whole = [k for k, spec in rule_cls.slot_specs(tuple(p.shape), group, True).items() if not spec.rows]
        reason = None
        if whole:
            reason = (f"optimizer '{group['algorithm']}' keeps per-table state {whole} (statistics over all "
                      "of a table's rows)")
        elif group.get("clipnorm"):
            reason = "`clipnorm` clips each table's gradient by its own norm"
        elif group.get("slot_creation_fn") is not None:
            reason = "`slot_creation_fn` creates the slots of one table"
        if reason:
            raise ValueError(
                f"Fused table group '{info.name}' (tables {names}) cannot be trained this way: {reason}. "
                "Build the EmbeddingCollection with fuse_tables=False, or give these tables their own "
                "optimizer with TableConfig.optimizer (tables with different optimizers are not fused)."
            )


def _to_device(v: Tensor, device: torch.device) -> Tensor:
    """``v`` on ``device`` as a new tensor; a 0-d value goes through shape [1] (an XLA constant otherwise)."""
    if v.device == device:
        return v.clone()
    return v.reshape(1).to(device).reshape(()) if v.dim() == 0 else v.to(device)


def _without_trash(slot: Tensor, n: int) -> Tensor:
    """The first ``n`` rows of a slot (the slot itself when it has no trash rows)."""
    return slot if slot.shape[0] == n else slot[:n]


def _write_whole(slot: Tensor, value: Tensor) -> None:
    """Write ``value`` into the leading rows of ``slot`` by one whole-tensor ``copy_``.

    Not through a slice view: an in-place update of a view re-traces the base on XLA, and under
    SPMD the base then loses its sharding annotation (the next step compiles another graph).
    """
    if slot.dim() and value.shape[0] != slot.shape[0]:
        value = torch.cat([value, slot[value.shape[0] :]])
    slot.copy_(value)


def _saved_group_of(saved_groups: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The saved hyper-parameters of the group holding ``key`` (to know which slots it saved)."""
    for sg in saved_groups:
        if key in sg["params"]:
            return {k: v for k, v in sg.items() if k != "params"}
    return {}


def unique_ids(ids: Tensor, sentinel: int) -> Tensor:
    """Distinct ids (static shape with a sentinel tail on XLA; padding dropped elsewhere)."""
    if is_static_device(ids.device):
        return dedup_static(ids, sentinel)[0]
    uniq: Tensor = torch.unique(ids[ids != sentinel])
    return uniq


@dataclasses.dataclass
class _Work:
    """One parameter's prepared gradient for this call."""

    p: Tensor
    group: dict[str, Any]
    state: dict[str, Tensor]
    ids: Tensor | None  # unique touched rows (tables); None: dense update of the whole tensor
    g: Tensor  # [U, D] rows or the full gradient
    gate: Tensor | None  # XLA accumulation: update kept only where True (one graph for all calls)
    lr: Tensor = dataclasses.field(default_factory=lambda: torch.zeros(()))
    step_now: Tensor | None = None  # this call's step count, once the first row chunk has set it
    #: additive rules (RowSparseOptimizer.additive): the row gradient, added per id piece by piece
    pieces: RowGrad | None = None
    divisor: float | None = None  # loss_scale_factor, applied to the pieces


def common_defaults(
    lr: Any,
    use_gradient_accumulation: bool,
    clip_weight_min: float | None,
    clip_weight_max: float | None,
    weight_decay_factor: float | None,
    multiply_weight_decay_factor_by_learning_rate: bool | None,
    clipvalue: Any,
    slot_creation_fn: Any = None,
) -> dict[str, Any]:
    """The hyper-parameters every optimizer shares (tf_spec §4.1), as a defaults dict."""
    return {
        "lr": lr,
        "use_gradient_accumulation": use_gradient_accumulation,
        "clip_weight_min": clip_weight_min,
        "clip_weight_max": clip_weight_max,
        "weight_decay_factor": weight_decay_factor,
        "multiply_weight_decay_factor_by_learning_rate": multiply_weight_decay_factor_by_learning_rate,
        "clipvalue": clipvalue,
        "slot_creation_fn": slot_creation_fn,
    }
