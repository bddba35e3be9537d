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
* pipeline, in TF's order (tf_spec §4.1): ``clipvalue`` on the summed gradient → decoupled weight
  decay ``w ← w − λ·w`` (``λ = weight_decay_factor``, times lr if
  ``multiply_weight_decay_factor_by_learning_rate``) → ``rule`` → weight clipping to
  ``[clip_weight_min, clip_weight_max]``.
* learning rates: a float, a 0-d tensor or a zero-argument callable (called once per step); it
  reaches the device as a tensor, so changing it (schedulers, callables) never recompiles on XLA.
* per-table optimizers: a table whose ``TableConfig.optimizer`` is set gets its own parameter group
  with that optimizer's rule and defaults; one object steps all tables and dense parameters.
* ``state_dict`` keys state by table name (``"table:<name>"``) and TF slot name, not by index.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from torch_tpu_embedding._rows import coalesce_rows, drop_sentinel, table_info
from torch_tpu_embedding._validation import arg_error, check_bool, check_number

__all__ = ["RowSparseOptimizer", "Rule", "optimizer_class"]

Tensor = torch.Tensor
Slots = dict[str, Tensor]
#: ``rule(w [U, D], g [U, D], slots, lr (0-d), step (0-d), hp) -> (w_new, slots_new)``
Rule = Callable[[Tensor, Tensor, Slots, Tensor, Tensor, Mapping[str, Any]], tuple[Tensor, Slots]]

_REGISTRY: dict[str, type[RowSparseOptimizer]] = {}
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
    ) -> None:
        defaults = dict(defaults)
        defaults.setdefault("algorithm", self.algorithm)
        self._validate_common(defaults)
        type(self)._validate(defaults)
        self._lr_cache: dict[tuple[int, torch.device, torch.dtype], tuple[float, Tensor]] = {}
        super().__init__(self._with_table_overrides(params, defaults), defaults)

    # ------------------------------------------------------------------ subclass API
    @staticmethod
    def rule(
        w: Tensor, g: Tensor, slots: Slots, lr: Tensor, step: Tensor, hp: Mapping[str, Any]
    ) -> tuple[Tensor, Slots]:
        raise NotImplementedError

    @classmethod
    def slot_initial_values(cls, hp: Mapping[str, Any]) -> dict[str, float]:
        return {name: 0.0 for name in cls.slot_names}

    @classmethod
    def _validate(cls, hp: dict[str, Any]) -> None:
        """Check (and normalise in place) the subclass's own hyper-parameters."""

    @classmethod
    def is_lazy(cls, hp: Mapping[str, Any]) -> bool:
        """False for optimizers that update every row of a table each step (non-lazy Adam)."""
        return True

    # ------------------------------------------------------------------ construction
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
        for group in self.param_groups:
            group.setdefault("algorithm", self.algorithm)
            group.setdefault("slot_creation_fn", None)

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
        if cached is not None and cached[0] == lr:
            return cached[1]
        # A 0-d host tensor moved to XLA is folded into the graph as a constant (one compile per
        # value); a 1-element tensor arrives as device data.
        t = torch.tensor([float(lr)], dtype=p.dtype).to(p.device).reshape(())
        self._lr_cache[key] = (float(lr), t)
        return t

    @staticmethod
    def _trash_rows(p: Tensor, k: int) -> int:
        """Extra rows for slot ``k`` (1-based) of a table on XLA.

        XLA pairs donated buffers with outputs by byte size; equal-sized weight and slots can be
        mis-paired, and then whole tables are copied every step (XLA_NOTES: "donation pitfall").
        Giving slot ``k`` ``k`` extra rows makes every table-sized buffer a distinct size. The
        extra rows also absorb the sentinel id's scatter. They never reach a checkpoint.
        """
        return k if table_info(p) is not None and p.device.type == "xla" else 0

    def _state_for(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        state = self.state[p]
        if not state:
            cls = optimizer_class(group["algorithm"])
            init = cls.slot_initial_values(group)
            fn = group.get("slot_creation_fn")
            made: Mapping[str, Any] = {}
            if fn is not None:
                made = fn(p, list(cls.slot_names), dict(init))
                for name in cls.slot_names:
                    s = made.get(name) if isinstance(made, Mapping) else None
                    if not isinstance(s, Tensor) or s.shape != p.shape:
                        raise ValueError(
                            f"slot_creation_fn must return a dict with a tensor of shape "
                            f"{tuple(p.shape)} for slot '{name}'. Received: {type(s).__name__}"
                            + (f" {tuple(s.shape)}" if isinstance(s, Tensor) else "")
                        )
            for k, name in enumerate(cls.slot_names, start=1):
                shape = (p.shape[0] + self._trash_rows(p, k), *p.shape[1:])
                slot = torch.full(shape, init[name], dtype=p.dtype, device=p.device)
                if fn is not None:
                    slot[: p.shape[0]] = made[name].detach().to(device=p.device, dtype=p.dtype)
                state[name] = slot
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return state  # type: ignore[no-any-return]

    def _pipeline(
        self,
        cls: type[RowSparseOptimizer],
        w: Tensor,
        g: Tensor,
        slots: Slots,
        lr: Tensor,
        step: Tensor,
        group: Mapping[str, Any],
    ) -> tuple[Tensor, Slots]:
        clip = group["clipvalue"]
        if clip is not None:
            g = g.clamp(min=clip[0], max=clip[1])
        wd = group.get("weight_decay_factor")
        if wd:
            decay = lr * wd if group.get("multiply_weight_decay_factor_by_learning_rate") else wd
            w = w - decay * w
        w, slots = cls.rule(w, g, slots, lr, step, group)
        lo, hi = group.get("clip_weight_min"), group.get("clip_weight_max")
        if lo is not None or hi is not None:
            w = w.clamp(min=lo, max=hi)
        return w, slots

    # ------------------------------------------------------------------ updates
    def _update_dense(self, p: Tensor, g: Tensor, group: dict[str, Any], lr: Tensor) -> None:
        cls = optimizer_class(group["algorithm"])
        state = self._state_for(p, group)
        state["step"].add_(1)
        n = p.shape[0] if p.dim() else 1
        slots = {k: state[k][:n] if p.dim() else state[k] for k in cls.slot_names}
        w, new = self._pipeline(cls, p, g, slots, lr, state["step"], group)
        for k in cls.slot_names:
            slots[k].copy_(new[k])  # a view of the slot without its trash rows
        p.copy_(w)

    def _update_rows(
        self, p: Tensor, ids: Tensor, rows: Tensor, group: dict[str, Any], lr: Tensor
    ) -> None:
        cls = optimizer_class(group["algorithm"])
        sentinel = p.shape[0]
        rows = rows.to(p.dtype)
        if not cls.is_lazy(group):
            uniq, g = coalesce_rows(ids, rows, sentinel)
            full = torch.zeros_like(p).index_add_(0, uniq, g)  # g = 0 for rows not looked up
            self._update_dense(p, full, group, lr)
            return
        state = self._state_for(p, group)
        state["step"].add_(1)
        if group["use_gradient_accumulation"]:
            ids, rows = coalesce_rows(ids, rows, sentinel)
        else:
            # No dedup: every contribution updates from the same old rows and the changes are
            # added. Exact for SGD; a cheaper approximation otherwise (docs/optimizers.md).
            ids, rows = drop_sentinel(ids, rows, sentinel)
        # On XLA the sentinel tail is clamped for the gather and dropped by the scatter.
        at = ids.clamp(max=sentinel - 1)
        w0 = p.index_select(0, at)
        slots = {k: state[k].index_select(0, at) for k in cls.slot_names}
        w, new = self._pipeline(cls, w0, rows, slots, lr, state["step"], group)
        if group["use_gradient_accumulation"]:  # ids are unique: write the rows
            for k in cls.slot_names:
                state[k].index_copy_(0, ids, new[k])
            p.index_copy_(0, ids, w)
        else:  # ids repeat: add the changes
            for k in cls.slot_names:
                state[k].index_add_(0, ids, new[k] - slots[k])
            p.index_add_(0, ids, w - w0)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Apply one update to every parameter that has a gradient (rows: only touched rows)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():  # type: ignore[no-untyped-call]
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            lr_value: float | Tensor | None = None
            for p in group["params"]:
                info = table_info(p)
                if info is not None and info.row_grad:
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
                elif p.grad is not None:
                    ids, rows = None, None
                else:
                    continue
                if lr_value is None:
                    lr_value = self._lr_value(group)
                lr = self._lr_tensor(gi, lr_value, p)
                if ids is None or rows is None:
                    self._update_dense(p, p.grad, group, lr)  # type: ignore[arg-type]
                else:
                    self._update_rows(p, ids, rows, group, lr)
        return loss

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

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": {key: {slot: tensor, "step": tensor}}, "param_groups": [...]}``.

        Keys are ``table:<name>`` (slots named as TF: ``accumulators``, ``momenta``,
        ``velocities``, ``linears``) and ``param:<name or index>``. Callables (a callable ``lr``,
        ``slot_creation_fn``) are not saved; the loading optimizer keeps its own.
        """
        keys = self._param_keys()
        state = {
            keys[id(p)]: {
                name: v if name == "step" else v[: p.shape[0]] for name, v in s.items()
            }
            for p, s in self.state.items()
            if id(p) in keys
        }
        groups = []
        for group in self.param_groups:
            saved = {
                k: v
                for k, v in group.items()
                if k not in ("params", "slot_creation_fn") and not (callable(v) and not isinstance(v, Tensor))
            }
            saved["params"] = [keys[id(p)] for p in group["params"]]
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a :meth:`state_dict`, matching parameters by key (table name), not by position."""
        keys = self._param_keys()
        by_key = {keys[id(p)]: p for g in self.param_groups for p in g["params"]}
        saved_groups = state_dict["param_groups"]
        problems: list[str] = []
        if len(saved_groups) != len(self.param_groups):
            problems.append(
                f"{len(saved_groups)} parameter groups saved, {len(self.param_groups)} here"
            )
        for i, (sg, g) in enumerate(zip(saved_groups, self.param_groups, strict=False)):
            mine = [keys[id(p)] for p in g["params"]]
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
            for name, v in s.items():
                if name != "step" and tuple(v.shape) != tuple(p.shape):
                    problems.append(
                        f"{key}: slot '{name}' has shape {tuple(v.shape)}, expected {tuple(p.shape)}"
                    )
        if problems:
            raise ValueError("Optimizer state does not match: " + "; ".join(problems))
        self.state.clear()
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for sg, g in zip(saved_groups, self.param_groups, strict=True):
            g["algorithm"] = sg.get("algorithm", g["algorithm"])
        for key, s in state_dict["state"].items():
            p = by_key[key]
            state = self._state_for(p, group_of[id(p)])
            for name, v in s.items():
                v = v.detach().to(device=p.device)
                if name == "step":
                    state[name] = v.to(torch.float32).clone()
                else:
                    state[name][: p.shape[0]] = v.to(p.dtype)
        for sg, g in zip(saved_groups, self.param_groups, strict=True):
            for k, v in sg.items():
                if k != "params" and not (callable(g.get(k)) and not isinstance(g.get(k), Tensor)):
                    g[k] = v
        self._lr_cache.clear()


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

