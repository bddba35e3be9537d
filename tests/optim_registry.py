"""The optimizer registry of the tests: one ``OptimizerInfo`` per optimizer class, in the spirit of
torch's ``OptimizerInfo`` (``torch/testing/_internal/common_optimizers.py``). Every test that is generic
over optimizers reads it; no test keeps an optimizer table of its own.

ADDING AN OPTIMIZER, TEST SIDE: one ``OptimizerInfo`` appended to ``OPTIMIZER_INFOS`` (below) with
  * ``cls``, ``name`` (its ``algorithm``) and ``default``: the keyword arguments every generic test runs
    where the entry names no configuration of its own (test id: ``name``);
  * ``slot_names`` (a table's slots) and ``np_init(hp, shape)``: each slot's float64 initial value for
    a parameter of ``shape``. The entry chooses the slot shapes (``[V, D]``, ``[V]``, ``[D]``, ``[]``);
    ``whole_slots`` names those not indexed by row;
  * ``np_rule(hp, w, g, s, eta, t, num_rows) -> (w, s)``: the float64 numpy reference of its update of
    the touched rows ``w, g [U, D]`` (slots: their rows, or whole), written from the paper's formulas
    and named after its symbols. The shared steps around it (clipvalue, weight decay, weight clipping)
    are the harness's (tests/optim/test_optim_reference.py). The Keras-pipeline test also runs it on dense
    parameters of shapes (5, 4) and (6,) (``num_rows`` = shape[0]);
  * ``shared_args`` (which shared arguments it takes: ``SHARED_ERRORS`` then run for it) and
    ``error_inputs`` (its own arguments that must be rejected, with the message);
  * the capability flags that differ from their defaults (``per_row_rule``, ``supports_stacked_groups``,
    ``supports_no_dedup``, ``zero_gradient_is_noop``, ...).
Nothing else. The entry then runs in every target of ``TARGETS`` its flags allow: the numpy reference
(f64, f32), the invariants of test_optim_generic.py (untouched rows, lazy == dense, state_dict, lr
schedules, per-table overrides), argument errors, the Keras extras, row chunks, the kernel eager update,
stacked groups, skip non-finite, XLA == CPU, one compilation, 4-device SPMD. tests/optim/test_optim_registry.py fails while an
optimizer of ``tte.optim`` has no entry, or an entry disagrees with its class (slot names, shapes and
initial values, the arguments it takes, the stacked / no-dedup flags).
Optional: ``inputs`` (named configurations, each for the targets it names: option variants worth
testing, or the few Keras-extras combinations it runs on the device targets), ``tf_golden`` /
``keras_golden`` (how golden-file runs map to its arguments), a ``keras_rule`` for a configuration
whose Keras counterpart coincides with it, ``table_only_slots``, ``zero_lr_ok``, ``non_lazy_kwarg``.

Combined options are generated from the entries: a target's ``extras`` are crossed with each entry's
first configuration there (skipped where two clip options would meet), and a target with ``noaccum``
adds the entry's ``default`` with ``use_gradient_accumulation=False`` where ``supports_no_dedup``;
test_optim_extras.py crosses ``KERAS_EXTRAS`` with every entry. On the device targets (seconds per
case) the combinations are the entries' named ``inputs``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from keras_reference import AdafactorRule, AdamRule, FtrlRule, SGDRule

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741
Array = np.ndarray
Slots = dict[str, Array]

# ---------------------------------------------------------------------------------------------- targets
GENERIC = "generic"  # test_optim_reference.py (numpy, f64 + f32) and the invariants of test_optim_generic.py
OVERRIDE = "override"  # test_optim_generic.py: a TableConfig optimizer override == that optimizer alone
KERAS = "keras_pipeline"  # test_keras_pipeline_random.py: extras on dense params vs the numpy Keras pipeline
EXTRAS = "extras"  # test_optim_extras.py: each configuration × every KERAS_EXTRAS combination
CHUNKS = "chunks"  # test_row_chunks.py: chunked eager row updates == one whole-batch pass
KERNEL_PATH = "kernel_path"  # test_kernel_update.py: the compiled eager row update == the reference path
STACKED = "stacked"  # test_stacked_groups.py: stacked table groups == unstacked tables
NONFINITE = "nonfinite"  # test_nonfinite_and_resume.py: skip_nonfinite leaves everything untouched
SYNC_FREE = "sync_free"  # test_sync_free_step.py: the accelerator's static-shape step == the CPU's, and reads nothing
XLA = "xla"  # tests/xla/test_xla_optim.py: XLA == CPU
XLA_COMPILE = "xla_compile"  # tests/xla/_optim_step_script.py: 20 steps, one compilation, no fallback
XLA_STACKED = "xla_stacked"  # tests/xla/test_stacked_xla.py: stacked groups on XLA == unstacked on CPU, one graph
SPMD = "spmd"  # tests/xla_spmd/test_spmd_training.py: every placement on 4 devices == CPU
SPMD_STEP = "spmd_step"  # tests/xla_spmd/_spmd_step_script.py (the HLO tests of test_spmd_hlo.py)
CKPT_MATRIX = "ckpt_matrix"  # tests/xla/_ckpt_script.py: checkpoints across CPU / XLA-1 / SPMD-4 layouts


@dataclasses.dataclass(frozen=True)
class Target:
    """How a test target draws its configurations from the entries."""

    every: bool = True  # every entry runs here (its ``default`` when it names no configuration here)
    requires: str = ""  # a capability flag of OptimizerInfo that an entry needs for this target
    extras: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)  # crossed, see top
    noaccum: bool = False  # also ``default`` + use_gradient_accumulation=False where supported


TARGETS: dict[str, Target] = {
    GENERIC: Target(),
    OVERRIDE: Target(),
    KERAS: Target(requires="keras_extras"),
    EXTRAS: Target(requires="keras_extras"),
    CHUNKS: Target(
        extras={"ema": {"use_ema": True}, "accum-skip": {"gradient_accumulation_steps": 2, "skip_nonfinite": True}},
        noaccum=True,
    ),
    KERNEL_PATH: Target(
        extras={
            # one compiled kernel per configuration: the options together, not one by one
            "options": {"clipvalue": 0.05, "weight_decay_factor": 0.05,
                        "multiply_weight_decay_factor_by_learning_rate": True, "clip_weight_min": -0.3,
                        "clip_weight_max": 0.35, "use_ema": True, "ema_momentum": 0.8, "skip_nonfinite": True,
                        "loss_scale_factor": 4.0},
            "accum-clipnorm": {"gradient_accumulation_steps": 2, "clipnorm": 0.5},
        },
    ),
    STACKED: Target(
        requires="supports_stacked_groups",
        extras={
            "ema-accum-gclip": {"use_ema": True, "ema_momentum": 0.8, "gradient_accumulation_steps": 2,
                                "global_clipnorm": 0.5},
            "accum3-scale-skip": {"gradient_accumulation_steps": 3, "loss_scale_factor": 16.0, "skip_nonfinite": True},
            "clipnorm": {"clipnorm": 0.05},  # per table in a group (each table's own norm)
        },
        noaccum=True,
    ),
    NONFINITE: Target(requires="keras_extras"),
    SYNC_FREE: Target(
        extras={"ema": {"use_ema": True, "ema_momentum": 0.8},
                "accum2-skip": {"gradient_accumulation_steps": 2, "skip_nonfinite": True},
                "clipnorm-scale": {"clipnorm": 0.5, "loss_scale_factor": 4.0},
                "options": {"clipvalue": 0.05, "weight_decay_factor": 0.05, "clip_weight_min": -0.3,
                            "clip_weight_max": 0.35}},
        noaccum=True,
    ),
    XLA: Target(),
    XLA_COMPILE: Target(),
    XLA_STACKED: Target(requires="supports_stacked_groups"),
    SPMD: Target(),
    SPMD_STEP: Target(every=False),  # opt-in: configurations named by the HLO tests
    CKPT_MATRIX: Target(every=False),  # opt-in: one process per layout runs every entry here
}

#: The Keras-extras combinations test_optim_extras.py crosses with every entry (test id ``<config>-<key>``).
KERAS_EXTRAS: dict[str, dict[str, Any]] = {
    "clipnorm": {"clipnorm": 0.5},
    "global_clipnorm": {"global_clipnorm": 0.3},
    "ema": {"use_ema": True, "ema_momentum": 0.8},
    "ema-overwrite": {"use_ema": True, "ema_momentum": 0.8, "ema_overwrite_frequency": 3},
    "loss_scale": {"loss_scale_factor": 4.0},
    "accumulate3": {"gradient_accumulation_steps": 3},
    "accumulate2-ema-clipnorm": {"gradient_accumulation_steps": 2, "use_ema": True, "ema_momentum": 0.7,
                                 "clipnorm": 0.4},
    "accumulate2-gclip-scale": {"gradient_accumulation_steps": 2, "global_clipnorm": 0.2, "loss_scale_factor": 8.0},
}

# ---------------------------------------------------------------------------------------------- arguments
KERAS_ARGS = frozenset(O.KerasExtras.__annotations__)  # clipnorm, use_ema, ..., skip_nonfinite
TPU_ARGS = frozenset({"use_gradient_accumulation", "clip_weight_min", "clip_weight_max", "weight_decay_factor",
                      "multiply_weight_decay_factor_by_learning_rate"})
COMMON_ARGS = frozenset({"lr", "clipvalue"}) | KERAS_ARGS
#: A valid value of every shared argument (tests/optim/test_optim_registry.py probes ``shared_args`` with them).
SHARED_ARG_VALUES: dict[str, Any] = {
    "lr": 0.1, "clipvalue": None, "slot_creation_fn": None, "use_gradient_accumulation": True,
    "clip_weight_min": None, "clip_weight_max": None, "weight_decay_factor": None,
    "multiply_weight_decay_factor_by_learning_rate": None, "clipnorm": None, "global_clipnorm": None,
    "use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None, "loss_scale_factor": None,
    "gradient_accumulation_steps": None, "skip_nonfinite": False,
}


@dataclasses.dataclass(frozen=True)
class ErrorInput:
    """Arguments the constructor must reject with ``error`` and a message matching ``regex``."""

    id: str
    kwargs: Mapping[str, Any]
    error: type[Exception]
    regex: str

    @property
    def args(self) -> frozenset[str]:  # the shared arguments it uses (for SHARED_ERRORS)
        return frozenset(self.kwargs)


def _lit(message: str) -> str:
    return re.escape(message)


#: Errors of shared arguments: each runs for every entry whose ``shared_args`` hold its arguments
#: (test id ``<name>-<id>``).
SHARED_ERRORS = [
    ErrorInput("lr-negative", {"lr": -1}, ValueError, _lit("Argument `lr` must be a finite number and >= 0.0. Received: -1")),
    ErrorInput("lr-nan", {"lr": float("nan")}, ValueError, r"Argument `lr` .* Received: nan"),
    ErrorInput("lr-string", {"lr": "0.1"}, ValueError, r"Argument `lr` .* Received: '0.1'"),
    ErrorInput("lr-2d-tensor", {"lr": torch.ones(2)}, ValueError, r"Argument `lr` must be a float, a 0-d float tensor"),
    ErrorInput("lr-int-tensor", {"lr": torch.tensor(1)}, ValueError, r"Argument `lr` must be a float, a 0-d float"),
    ErrorInput("accum-not-bool", {"use_gradient_accumulation": 1}, ValueError,
               r"Argument `use_gradient_accumulation` must be a boolean. Received: 1"),
    ErrorInput("clipvalue-no-accum", {"clipvalue": 0.0, "use_gradient_accumulation": False}, ValueError,
               r"When `use_gradient_accumulation` is False, gradient clipping cannot be used"),
    ErrorInput("clipvalue-tuple-no-accum", {"clipvalue": (None, 1.0), "use_gradient_accumulation": False},
               ValueError, r"`clipvalue` should be left as None. Received value \(None, 1.0\)"),
    ErrorInput("clipvalue-negative", {"clipvalue": -1.0}, ValueError, r"Argument `clipvalue` .* > 0.0. Received: -1.0"),
    ErrorInput("clipvalue-triple", {"clipvalue": (1, 2, 3)}, ValueError, r"`clipvalue` must be a number or a \(min, max\) pair"),
    ErrorInput("clipvalue-min-gt-max", {"clipvalue": (2.0, 1.0)}, ValueError, r"`clipvalue` must have min <= max"),
    ErrorInput("clip-weight-order", {"clip_weight_min": 1.0, "clip_weight_max": 0.0}, ValueError,
               r"Argument `clip_weight_min` must be <= clip_weight_max \(0.0\). Received: 1.0"),
    ErrorInput("clip-weight-nan", {"clip_weight_max": float("nan")}, ValueError, r"Argument `clip_weight_max`"),
    ErrorInput("weight-decay-negative", {"weight_decay_factor": -0.1}, ValueError,
               r"Argument `weight_decay_factor` .* >= 0.0. Received: -0.1"),
    ErrorInput("multiply-wd-not-bool", {"multiply_weight_decay_factor_by_learning_rate": "yes"}, ValueError,
               r"Argument `multiply_weight_decay_factor_by_learning_rate` must be a boolean"),
    ErrorInput("slot-fn-not-callable", {"slot_creation_fn": 3}, ValueError,
               r"Argument `slot_creation_fn` must be a callable or None. Received: 3"),
    # The Keras extras.
    ErrorInput("clipnorm-and-global", {"clipnorm": 1.0, "global_clipnorm": 1.0}, ValueError,
               _lit("Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: clipnorm=1.0")),
    ErrorInput("clipnorm-and-clipvalue", {"clipnorm": 1.0, "clipvalue": 1.0}, ValueError, _lit("Only one of `clipnorm`")),
    ErrorInput("clipnorm-negative", {"clipnorm": -1.0}, ValueError,
               _lit("Argument `clipnorm` must be a finite number and >= 0.0. Received: -1.0")),
    ErrorInput("global-clipnorm-nan", {"global_clipnorm": float("nan")}, ValueError,
               _lit("Argument `global_clipnorm` must be a finite number")),
    ErrorInput("accumulation-steps-1", {"gradient_accumulation_steps": 1}, ValueError,
               _lit("`gradient_accumulation_steps` must be an integer >= 2. Received: gradient_accumulation_steps=1")),
    ErrorInput("accumulation-steps-float", {"gradient_accumulation_steps": 2.0}, ValueError,
               "must be an integer >= 2. Received: .*=2.0"),
    ErrorInput("accumulation-steps-bool", {"gradient_accumulation_steps": True}, ValueError,
               _lit("must be an integer >= 2")),
    ErrorInput("use-ema-not-bool", {"use_ema": 1}, ValueError, _lit("Argument `use_ema` must be a boolean. Received: 1")),
    ErrorInput("ema-momentum-above-1", {"use_ema": True, "ema_momentum": 1.5}, ValueError,
               _lit("Argument `ema_momentum` must be a finite number and >= 0.0 and <= 1.0. Received: 1.5")),
    ErrorInput("ema-overwrite-zero", {"use_ema": True, "ema_overwrite_frequency": 0}, ValueError,
               _lit("Argument `ema_overwrite_frequency` must be an int and must be >= 1. Received: 0")),
    ErrorInput("ema-overwrite-without-ema", {"ema_overwrite_frequency": 2}, ValueError,
               _lit("Argument `ema_overwrite_frequency` requires `use_ema=True`. Received: 2")),
    ErrorInput("loss-scale-zero", {"loss_scale_factor": 0.0}, ValueError,
               _lit("Argument `loss_scale_factor` must be a finite number and > 0.0")),
    ErrorInput("clipnorm-no-accum", {"clipnorm": 1.0, "use_gradient_accumulation": False}, ValueError,
               _lit("`clipnorm` needs the per-row gradient summed over duplicate ids")),
    ErrorInput("skip-nonfinite-not-bool", {"skip_nonfinite": 1}, ValueError,
               _lit("Argument `skip_nonfinite` must be a boolean. Received: 1")),
]
#: An argument no optimizer takes: rejected by name (the Keras-extras catch-all, or Python's own check).
UNKNOWN_ARGUMENT = ErrorInput("unknown-argument", {"ema_decay": 0.9}, TypeError,
                              r"(?i)unexpected keyword argument.*'ema_decay'")


# ---------------------------------------------------------------------------------------------- entries
@dataclasses.dataclass(frozen=True)
class OptimizerInput:
    """One named configuration (torch's ``OptimizerInput``), for the targets in ``targets``."""

    id: str
    kwargs: Mapping[str, Any]
    targets: frozenset[str]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # target-specific data


def _in(id: str, kwargs: Mapping[str, Any], *targets: str, **meta: Any) -> OptimizerInput:
    return OptimizerInput(id, dict(kwargs), frozenset(targets), meta)


def _full(value: float) -> Callable[[tuple[int, ...]], Array]:
    return lambda shape: np.full(shape, float(value))


@dataclasses.dataclass(frozen=True, eq=False)
class OptimizerInfo:
    """Everything the tests need to know about one optimizer class (see the module docstring)."""

    cls: type
    name: str
    default: Mapping[str, Any]
    slot_names: tuple[str, ...]
    np_init: Callable[[Mapping[str, Any], tuple[int, ...]], Slots]
    np_rule: Callable[..., tuple[Array, Slots]]
    shared_args: frozenset[str]
    error_inputs: tuple[ErrorInput, ...] = ()
    inputs: tuple[OptimizerInput, ...] = ()
    whole_slots: frozenset[str] = frozenset()  # slots of the whole table, not indexed by row
    # --- capability flags
    lazy: bool = True  # updates only the rows a step touched (unless ``non_lazy_kwarg`` is given)
    non_lazy_kwarg: tuple[str, Any] | None = None  # the argument that makes it update every row
    per_row_rule: bool = True  # a row's update reads only that row (False: statistics span rows)
    supports_stacked_groups: bool = True  # trains tables of a stack_tables=True group
    supports_no_dedup: bool = False  # use_gradient_accumulation=False (duplicate ids not summed first)
    zero_gradient_is_noop: bool = False  # g = 0 leaves a row and its slots unchanged: lazy == dense, any batch
    zero_lr_ok: Callable[[Mapping[str, Any]], bool] = lambda kwargs: True  # a step at lr = 0 is finite
    #: a table-only slot, recomputed from the state of the same optimizer on a dense twin parameter
    table_only_slots: Mapping[str, Callable[[Mapping[str, torch.Tensor]], torch.Tensor]] = \
        dataclasses.field(default_factory=dict)
    #: golden_tf.json section C run -> our keyword arguments, or None when the run is not ours
    tf_golden: Callable[[Mapping[str, Any]], dict[str, Any] | None] | None = None
    #: golden_keras.json case -> our keyword arguments where Keras and we coincide, or None
    keras_golden: Callable[[Mapping[str, Any]], dict[str, Any] | None] | None = None

    @property
    def has_slots(self) -> bool:
        return bool(self.slot_names)

    @property
    def keras_extras(self) -> bool:  # takes every Keras base-optimizer extra
        return KERAS_ARGS <= self.shared_args

    @property
    def tpu_args(self) -> bool:  # takes TF's TPU-embedding arguments (accumulation flag, weight clip, decay)
        return TPU_ARGS <= self.shared_args

    def table_slots(self, hp: Mapping[str, Any], shape: tuple[int, ...]) -> Slots:
        slots = self.np_init(hp, shape)
        assert tuple(slots) == self.slot_names, (self.name, tuple(slots))
        return slots

    def __repr__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True, eq=False)
class OptimizerConfig:
    """One configuration of one optimizer, as a test receives it (``str()``: the test id)."""

    info: OptimizerInfo
    id: str
    kwargs: Mapping[str, Any]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def make(self, params: Any, **overrides: Any) -> Any:
        return self.info.cls(params, **{**self.kwargs, **overrides})

    @property
    def lazy(self) -> bool:
        k = self.info.non_lazy_kwarg
        return self.info.lazy and not (k is not None and k[0] in self.kwargs and self.kwargs[k[0]] == k[1])

    def __str__(self) -> str:
        return self.id


# ---------------------------------------------------------------------------------------------- SGD
def np_sgd(hp: Mapping[str, Any], w: Array, g: Array, s: Slots, eta: float, t: int, num_rows: int):
    """w ← w − η·g."""
    return w - eta * g, {}


SGD_INFO = OptimizerInfo(
    cls=O.SGD, name="sgd", default={"lr": 0.1},
    slot_names=(), np_init=lambda hp, shape: {}, np_rule=np_sgd,
    shared_args=COMMON_ARGS | TPU_ARGS,
    supports_no_dedup=True, zero_gradient_is_noop=True,
    inputs=(
        _in("sgd", {"lr": 0.1}, GENERIC, KERAS, SPMD_STEP, keras_rule=lambda shapes, kw: SGDRule(shapes)),
        _in("sgd-clip-decay", {"lr": 0.1, "clipvalue": 0.05, "weight_decay_factor": 0.01,
                               "clip_weight_min": -0.3, "clip_weight_max": 0.3}, GENERIC),
        _in("sgd-decay-clip", {"lr": 0.1, "clipvalue": 0.5, "weight_decay_factor": 0.01,
                               "clip_weight_min": -0.4, "clip_weight_max": 0.4}, CHUNKS),
        _in("sgd", {"lr": 0.1, "clipvalue": 0.5, "weight_decay_factor": 0.01}, STACKED, XLA),
        _in("sgd-noaccum", {"lr": 0.1, "use_gradient_accumulation": False}, XLA, XLA_STACKED),
        _in("sgd-noaccum-ema", {"lr": 0.1, "use_gradient_accumulation": False, "use_ema": True}, XLA),
        _in("sgd", {"lr": 0.1, "clipvalue": 0.5}, SPMD),
        _in("sgd-gclip-scale", {"lr": 0.5, "global_clipnorm": 0.5, "loss_scale_factor": 8.0}, SPMD),
        # the moving average's counter leaves skip_nonfinite's drops out: the same graph before the first count
        _in("sgd-ema-skip", {"lr": 0.1, "use_ema": True, "ema_momentum": 0.8, "skip_nonfinite": True},
            XLA_COMPILE, SPMD),
    ),
    tf_golden=lambda run: dict(run["config"]) if run["optimizer"].startswith("sgd") else None,
    keras_golden=lambda case: {"lr": case["config"]["learning_rate"]} if case["optimizer"] == "SGD" else None,
)


# ---------------------------------------------------------------------------------------------- Adagrad
def np_adagrad(hp: Mapping[str, Any], w: Array, g: Array, s: Slots, eta: float, t: int, num_rows: int):
    """Duchi et al. (TPU: no ε): G ← G + g²; w ← w − η·g/√G."""
    G = s["accumulators"] + g * g
    return w - eta * g / np.sqrt(G), {"accumulators": G}


def _abs_accumulators(p: torch.Tensor, names: list[str], init: Mapping[str, float]) -> dict[str, torch.Tensor]:
    """A slot_creation_fn for slots shaped like the table: ``0.1 + |w|`` (they depend on the rows given)."""
    return {n: 0.1 + p.detach().abs() for n in names}


ADAGRAD_INFO = OptimizerInfo(
    cls=O.Adagrad, name="adagrad", default={"lr": 0.1},
    slot_names=("accumulators",),
    np_init=lambda hp, shape: {"accumulators": _full(hp["initial_accumulator_value"])(shape)},
    np_rule=np_adagrad,
    shared_args=COMMON_ARGS | TPU_ARGS | {"slot_creation_fn"},
    supports_no_dedup=True, zero_gradient_is_noop=True,
    error_inputs=(
        ErrorInput("init-zero", {"initial_accumulator_value": 0.0}, ValueError,
                   r"Argument `initial_accumulator_value` must be a positive float. Received: 0.0"),
        ErrorInput("init-negative", {"initial_accumulator_value": -1}, ValueError,
                   r"`initial_accumulator_value` must be a positive float. Received: -1"),
    ),
    inputs=(
        _in("adagrad", {"lr": 0.1}, GENERIC, KERAS),
        _in("adagrad-init0.5-decaylr", {"lr": 0.2, "initial_accumulator_value": 0.5, "weight_decay_factor": 0.1,
                                        "multiply_weight_decay_factor_by_learning_rate": True}, GENERIC),
        _in("adagrad", {"lr": 0.1, "clip_weight_min": -0.3, "clip_weight_max": 0.3}, STACKED),
        _in("adagrad", {"lr": 0.1, "clip_weight_min": -0.2, "clip_weight_max": 0.2}, XLA),
        # slots made per table from its values, each table clipped by its own norm, inside a group
        _in("adagrad-slotfn-clipnorm", {"lr": 0.1, "clipnorm": 0.05, "slot_creation_fn": _abs_accumulators}, XLA_STACKED),
    ),
    tf_golden=lambda run: (
        {"initial_accumulator_value": run["slot_initial_values"]["accumulators"]}
        if run["optimizer"] == "adagrad" else None),
    keras_golden=lambda case: (
        {"lr": case["config"]["learning_rate"],
         "initial_accumulator_value": case["config"]["initial_accumulator_value"]}
        if case["optimizer"] == "Adagrad" else None),
)


# ---------------------------------------------------------------------------------------------- AdagradMomentum
def np_adagrad_momentum(hp: Mapping[str, Any], w: Array, g: Array, s: Slots, eta: float, t: int, num_rows: int):
    """TF's AdagradMomentum: a ← a + g² (β2 = 1) or β2·a + (1−β2)·g²; u = g·(a + ε)^(−1/p);
    m ← μ·m + u; w ← w − η·(μ·m + u) (Nesterov) or w − η·m."""
    beta2, eps, p, mu = hp["beta2"], hp["epsilon"], hp["exponent"], hp["momentum"]
    a = s["accumulators"] + g * g if beta2 == 1 else beta2 * s["accumulators"] + (1 - beta2) * g * g
    u = g * (a + eps) ** (-1.0 / p)
    m = mu * s["momenta"] + u
    return w - eta * (mu * m + u if hp["use_nesterov"] else m), {"accumulators": a, "momenta": m}


ADAGRAD_MOMENTUM_INFO = OptimizerInfo(
    cls=O.AdagradMomentum, name="adagrad_momentum", default={"lr": 0.1, "momentum": 0.9},
    slot_names=("accumulators", "momenta"),
    np_init=lambda hp, shape: {"accumulators": np.zeros(shape), "momenta": np.zeros(shape)},
    np_rule=np_adagrad_momentum,
    shared_args=COMMON_ARGS | TPU_ARGS | {"slot_creation_fn"},
    supports_no_dedup=True,
    error_inputs=(
        ErrorInput("epsilon-zero", {"epsilon": 0.0}, ValueError, r"Argument `epsilon` .* > 0.0. Received: 0.0"),
        ErrorInput("exponent-zero", {"exponent": 0}, ValueError, r"Argument `exponent` .* > 0.0. Received: 0"),
        ErrorInput("beta2-above-1", {"beta2": 1.5}, ValueError, r"Argument `beta2` .* <= 1.0. Received: 1.5"),
        ErrorInput("momentum-negative", {"momentum": -0.1}, ValueError, r"Argument `momentum` .* Received: -0.1"),
        ErrorInput("nesterov-not-bool", {"use_nesterov": 1}, ValueError,
                   r"Argument `use_nesterov` must be a boolean. Received: 1"),
    ),
    inputs=(
        _in("adagrad_momentum", {"lr": 0.05, "momentum": 0.9}, GENERIC),
        _in("adagrad_momentum-nesterov-beta2", {"lr": 0.05, "momentum": 0.5, "use_nesterov": True, "beta2": 0.9,
                                                "exponent": 3.0}, GENERIC),
        _in("adagrad_momentum", {"lr": 0.1, "momentum": 0.9, "use_nesterov": True}, KERAS, CHUNKS, STACKED, XLA),
        _in("adagrad_momentum", {"lr": 0.05, "momentum": 0.9, "use_nesterov": True}, EXTRAS, SPMD),
    ),
    tf_golden=lambda run: dict(run["config"]) if run["optimizer"] == "adagrad_momentum" else None,
)


# ---------------------------------------------------------------------------------------------- Adam, LazyAdam
def np_adam(hp: Mapping[str, Any], w: Array, g: Array, s: Slots, eta: float, t: int, num_rows: int):
    """Kingma & Ba, TPU form: m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²;
    α_t = η (TPU) or η·√(1−β2^t)/(1−β1^t) (bias correction); w ← w − α_t·m/√(v + ε²) or /(√v + ε)."""
    beta1, beta2 = hp["betas"]
    eps = hp["eps"]
    m = beta1 * s["momenta"] + (1 - beta1) * g
    v = beta2 * s["velocities"] + (1 - beta2) * g * g
    alpha_t = eta * np.sqrt(1 - beta2**t) / (1 - beta1**t) if hp["bias_correction"] else eta
    den = np.sqrt(v + eps**2) if hp["sum_inside_sqrt"] else np.sqrt(v) + eps
    return w - alpha_t * m / den, {"momenta": m, "velocities": v}


ADAM_ERRORS = (
    ErrorInput("beta1-one", {"betas": (1.0, 0.999)}, ValueError, r"Argument `betas\[0\]` .* < 1.0. Received: 1.0"),
    ErrorInput("beta2-prints-beta2", {"betas": (0.9, 1.5)}, ValueError, r"Argument `betas\[1\]` .* Received: 1.5"),
    ErrorInput("beta-negative", {"betas": (-0.1, 0.9)}, ValueError, r"Argument `betas\[0\]` .* Received: -0.1"),
    ErrorInput("betas-not-pair", {"betas": 0.9}, ValueError, r"Argument `betas` must be a pair"),
    ErrorInput("eps-zero", {"eps": 0.0}, ValueError, r"Argument `eps` .* > 0.0. Received: 0.0"),
    ErrorInput("bias-correction-not-bool", {"bias_correction": None}, ValueError,
               r"Argument `bias_correction` must be a boolean. Received: None"),
)
ADAM_SLOTS = {
    "slot_names": ("momenta", "velocities"),
    "np_init": lambda hp, shape: {"momenta": np.zeros(shape), "velocities": np.zeros(shape)},
    "np_rule": np_adam,
    "shared_args": COMMON_ARGS | TPU_ARGS | {"slot_creation_fn"},
    "supports_no_dedup": True,
}
ADAM_INFO = OptimizerInfo(
    cls=O.Adam, name="adam", default={"lr": 0.1}, **ADAM_SLOTS,
    non_lazy_kwarg=("lazy_adam", False),
    error_inputs=(*ADAM_ERRORS, ErrorInput(
        "nonlazy-no-accum", {"lazy_adam": False, "use_gradient_accumulation": False}, ValueError,
        r"When disabling lazy Adam \(`lazy_adam=False`\), gradient accumulation must be used. "
        r"Set `use_gradient_accumulation` to True.")),
    inputs=(
        _in("adam", {"lr": 0.01}, GENERIC),
        _in("adam-eps-outside", {"lr": 0.01, "sum_inside_sqrt": False, "eps": 1e-3}, GENERIC),
        _in("adam-bias-correction", {"lr": 0.01, "bias_correction": True}, GENERIC),
        _in("adam-nonlazy", {"lr": 0.01, "lazy_adam": False}, GENERIC),
        _in("adam", {"lr": 0.05}, EXTRAS, STACKED, XLA, SPMD),
        _in("adam-nonlazy", {"lr": 0.05, "lazy_adam": False}, STACKED, XLA, XLA_STACKED, SPMD, SYNC_FREE),
        _in("adam", {"lr": 0.1}, XLA_COMPILE, SPMD_STEP),
        _in("adam", {"lr": 0.02, "bias_correction": True}, OVERRIDE),
        # Keras Adam == ours with bias correction and ε outside the sqrt; TPU Adam: the numpy rule.
        _in("keras_adam", {"lr": 0.1, "betas": (0.8, 0.95), "eps": 1e-3, "bias_correction": True,
                           "sum_inside_sqrt": False}, KERAS,
            keras_rule=lambda shapes, kw: AdamRule(shapes, beta_1=kw["betas"][0], beta_2=kw["betas"][1],
                                                   epsilon=kw["eps"])),
        _in("tpu_adam", {"lr": 0.1, "betas": (0.8, 0.95), "eps": 1e-3}, KERAS),
        _in("adam-ema-accum-clipnorm", {"lr": 0.05, "use_ema": True, "ema_momentum": 0.8,
                                        "gradient_accumulation_steps": 2, "clipnorm": 0.5}, XLA),
        _in("adam-ema-accum-clipnorm", {"lr": 0.05, "use_ema": True, "ema_momentum": 0.8,
                                        "gradient_accumulation_steps": 2, "clipnorm": 1.0}, SPMD),
        # accumulation calls and update calls must share one graph
        _in("adam-ema-accum", {"lr": 0.1, "use_ema": True, "gradient_accumulation_steps": 4, "clipnorm": 1.0,
                               "loss_scale_factor": 8.0}, XLA_COMPILE),
    ),
    tf_golden=lambda run: (
        {"betas": (run["config"]["beta_1"], run["config"]["beta_2"]), "eps": run["config"]["epsilon"],
         "sum_inside_sqrt": run["config"]["sum_inside_sqrt"], "lazy_adam": run["optimizer"] != "adam_nonlazy"}
        if run["optimizer"].startswith("adam") else None),
    keras_golden=lambda case: (
        {"lr": case["config"]["learning_rate"], "betas": (case["config"]["beta_1"], case["config"]["beta_2"]),
         "eps": case["config"]["epsilon"], "bias_correction": True, "sum_inside_sqrt": False}
        if case["optimizer"] == "Adam" else None),
)
LAZY_ADAM_INFO = OptimizerInfo(
    cls=O.LazyAdam, name="lazy_adam", default={"lr": 0.1}, **ADAM_SLOTS,
    error_inputs=(*ADAM_ERRORS, ErrorInput("lazy-flag", {"lazy_adam": False}, ValueError,
                                           r"Argument `lazy_adam` is not an argument")),
    inputs=(
        # torch.optim.SparseAdam / tfa LazyAdam
        _in("lazy_adam-sparseadam", {"lr": 0.01, "bias_correction": True, "sum_inside_sqrt": False, "eps": 1e-8},
            GENERIC),
        _in("lazy_adam", {"lr": 0.05, "bias_correction": True}, CHUNKS, STACKED, XLA_STACKED),
        _in("lazy_adam", {"lr": 0.05, "bias_correction": True, "sum_inside_sqrt": False}, EXTRAS, SPMD, CKPT_MATRIX),
        _in("lazy_adam-bias", {"lr": 0.05, "bias_correction": True, "sum_inside_sqrt": False}, XLA),
        _in("lazy_adam", {"lr": 0.1, "bias_correction": True}, XLA_COMPILE),
    ),
)


# ---------------------------------------------------------------------------------------------- FTRL
def np_ftrl(hp: Mapping[str, Any], w: Array, g: Array, s: Slots, eta: float, t: int, num_rows: int):
    """McMahan et al. (TF form, p = learning_rate_power): n' = n + g²; Δ = n'^(−p) − n^(−p);
    z ← z + g − Δ·w/η; w = (clip(z, −λ1, λ1) − z) / ((n'^(−p) + β)/η + 2λ2) — or, with
    multiply_linear_by_learning_rate, z ← z + η·g − Δ·w; w = (clip(z, −ηλ1, ηλ1) − z) / (n'^(−p) + 2ηλ2 + β)."""
    p, lambda1, lambda2, beta = (hp["learning_rate_power"], hp["l1_regularization_strength"],
                                 hp["l2_regularization_strength"], hp["beta"])
    n, z = s["accumulators"], s["linears"]
    n2 = n + g * g
    delta = n2 ** (-p) - n ** (-p)
    if hp["multiply_linear_by_learning_rate"]:
        z = z + eta * g - delta * w
        num = np.clip(z, -eta * lambda1, eta * lambda1) - z
        den = n2 ** (-p) + 2 * eta * lambda2 + beta
    else:
        z = z + g - delta * w / eta
        num = np.clip(z, -lambda1, lambda1) - z
        den = (n2 ** (-p) + beta) / eta + 2 * lambda2
    if hp["allow_zero_accumulator"]:  # 0/0 (never a non-zero gradient, β = λ2 = 0) gives 0
        return np.divide(num, den, out=np.zeros_like(num), where=den != 0), {"accumulators": n2, "linears": z}
    return num / den, {"accumulators": n2, "linears": z}


FTRL_INFO = OptimizerInfo(
    cls=O.FTRL, name="ftrl", default={"lr": 0.1},
    slot_names=("accumulators", "linears"),
    np_init=lambda hp, shape: {"accumulators": _full(hp["initial_accumulator_value"])(shape),
                               "linears": np.zeros(shape)},
    np_rule=np_ftrl,
    shared_args=COMMON_ARGS | TPU_ARGS | {"slot_creation_fn"},
    supports_no_dedup=True,
    # TF's FTRL divides by lr (NaN at lr = 0); multiply_linear_by_learning_rate does not
    zero_lr_ok=lambda kwargs: bool(kwargs.get("multiply_linear_by_learning_rate")),
    error_inputs=(
        ErrorInput("power-positive", {"learning_rate_power": 0.5}, ValueError,
                   r"Argument `learning_rate_power` .* <= 0.0. Received: 0.5"),
        ErrorInput("l1-negative", {"l1_regularization_strength": -1.0}, ValueError,
                   r"Argument `l1_regularization_strength` .* Received: -1.0"),
        ErrorInput("l2-negative", {"l2_regularization_strength": -0.5}, ValueError,
                   r"Argument `l2_regularization_strength` .* Received: -0.5"),
        ErrorInput("beta-negative", {"beta": -0.5}, ValueError, r"Argument `beta` .* Received: -0.5"),
        ErrorInput("init-zero", {"initial_accumulator_value": 0.0}, ValueError,
                   r"Argument `initial_accumulator_value` must be a positive float. Received: 0.0"),
        ErrorInput("init-negative-with-zero-allowed", {"initial_accumulator_value": -0.1,
                                                       "allow_zero_accumulator": True}, ValueError,
                   r"Argument `initial_accumulator_value` must be a float >= 0. Received: -0.1"),
        ErrorInput("multiply-not-bool", {"multiply_linear_by_learning_rate": "no"}, ValueError,
                   r"Argument `multiply_linear_by_learning_rate` must be a boolean"),
    ),
    inputs=(
        _in("ftrl", {"lr": 0.1}, GENERIC),
        _in("ftrl-l1l2beta-power", {"lr": 0.1, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02,
                                    "beta": 0.1, "learning_rate_power": -0.7}, GENERIC),
        _in("ftrl-multiply-linear", {"lr": 0.1, "l1_regularization_strength": 0.01,
                                     "multiply_linear_by_learning_rate": True}, GENERIC),
        _in("ftrl", {"lr": 0.3, "l1_regularization_strength": 0.01}, OVERRIDE),
        # Keras Ftrl without l2 shrinkage == TPU FTRL
        _in("ftrl", {"lr": 0.1, "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02, "beta": 0.1,
                     "learning_rate_power": -0.7, "initial_accumulator_value": 0.2}, KERAS,
            keras_rule=lambda shapes, kw: FtrlRule(shapes, **{k: v for k, v in kw.items() if k != "lr"})),
        _in("ftrl", {"lr": 0.1, "l1_regularization_strength": 0.01}, EXTRAS),
        _in("ftrl", {"lr": 0.1, "l1_regularization_strength": 0.001, "beta": 0.1}, STACKED, XLA),
        _in("ftrl-mult", {"lr": 0.1, "multiply_linear_by_learning_rate": True}, XLA),
        _in("ftrl-accum3-scale", {"lr": 0.1, "gradient_accumulation_steps": 3, "loss_scale_factor": 16.0}, XLA),
        _in("ftrl", {"lr": 0.1, "multiply_linear_by_learning_rate": True}, XLA_COMPILE),
        _in("ftrl-ema-accum", {"lr": 0.1, "use_ema": True, "gradient_accumulation_steps": 2}, XLA_STACKED),
        _in("ftrl", {"lr": 0.1, "l1_regularization_strength": 0.001}, SPMD),
        _in("ftrl", {"lr": 0.1, "l1_regularization_strength": 0.001, "multiply_linear_by_learning_rate": True},
            CKPT_MATRIX),
    ),
    tf_golden=lambda run: (
        {"initial_accumulator_value": run["slot_initial_values"]["accumulators"], **run["config"]}
        if run["optimizer"].startswith("ftrl") else None),
    keras_golden=lambda case: (
        {"lr": case["config"]["learning_rate"],
         **{k: case["config"][k] for k in ("learning_rate_power", "l1_regularization_strength",
                                           "l2_regularization_strength", "beta", "initial_accumulator_value")}}
        if case["optimizer"] == "Ftrl" else None),
)


# ---------------------------------------------------------------------------------------------- Adafactor
def np_adafactor(hp: Mapping[str, Any], w: Array, g: Array, s: Slots, eta: float, t: int, num_rows: int):
    """Shazeer & Stern, factored and lazy over the touched rows U of a table (docs/optimizers.md):
    ρ_t = min(η, 1/√t) (relative_step) or η; β̂_t = 1 − t^beta_2_decay; G² = g² + ε1;
    α_t = max(ε2, RMS_U(w))·ρ_t; R_i ← β̂_t·R_i + (1−β̂_t)·mean_j G²_ij (i ∈ U);
    C ← β̂_t·C + (1−β̂_t)·mean_{i∈U} G²_i; ΣR ← ΣR + Σ_{i∈U}(R_i,new − R_i,old);
    V̂_ij = R_i/(ΣR/num_rows)·C_j; U = g/√V̂; w ← w − α_t·U / max(1, RMS_U(U)/d)."""
    rho = min(eta, 1 / math.sqrt(t)) if hp["relative_step"] else eta
    beta2_t = 1 - t ** hp["beta_2_decay"]
    G2 = g * g + hp["epsilon_1"]
    alpha = max(hp["epsilon_2"], math.sqrt(np.mean(w * w))) * rho
    R = beta2_t * s["r"] + (1 - beta2_t) * G2.mean(1)
    C = beta2_t * s["c"] + (1 - beta2_t) * G2.mean(0)
    R_sum = s["r_sum"] + (R - s["r"]).sum()
    V_hat = (R / (R_sum / num_rows))[:, None] * C[None, :]
    U = g / np.sqrt(V_hat)
    U = U / max(1.0, math.sqrt(np.mean(U * U)) / hp["clip_threshold"])
    return w - alpha * U, {"r": R, "c": C, "r_sum": R_sum}


ADAFACTOR_INFO = OptimizerInfo(
    cls=O.Adafactor, name="adafactor", default={"lr": 0.1},
    slot_names=("r", "c", "r_sum"),
    np_init=lambda hp, shape: {"r": np.zeros(shape[:1]), "c": np.zeros(shape[1:]), "r_sum": np.zeros(())},
    np_rule=np_adafactor,
    whole_slots=frozenset({"c", "r_sum"}),
    shared_args=COMMON_ARGS,
    per_row_rule=False,
    table_only_slots={"r_sum": lambda dense_state: dense_state["r"].sum()},
    error_inputs=(
        ErrorInput("beta-2-decay-positive", {"beta_2_decay": 0.5}, ValueError,
                   _lit("Argument `beta_2_decay` must be a finite number and <= 0.0. Received: 0.5")),
        ErrorInput("epsilon-1-negative", {"epsilon_1": -1.0}, ValueError,
                   _lit("Argument `epsilon_1` must be a finite number and > 0.0. Received: -1.0")),
        ErrorInput("epsilon-1-zero", {"epsilon_1": 0.0}, ValueError,
                   _lit("Argument `epsilon_1` must be a finite number and > 0.0. Received: 0.0")),
        ErrorInput("epsilon-2-negative", {"epsilon_2": -1.0}, ValueError,
                   _lit("Argument `epsilon_2` must be a finite number and >= 0.0")),
        ErrorInput("clip-threshold-zero", {"clip_threshold": 0.0}, ValueError,
                   _lit("Argument `clip_threshold` must be a finite number and > 0.0. Received: 0.0")),
        ErrorInput("relative-step-not-bool", {"relative_step": "yes"}, ValueError,
                   _lit("Argument `relative_step` must be a boolean. Received: 'yes'")),
        ErrorInput("weight-decay-negative", {"weight_decay": -0.1}, ValueError,
                   _lit("Argument `weight_decay` must be a finite number and >= 0.0. Received: -0.1")),
        ErrorInput("row-stat-dtype-int", {"row_stat_dtype": torch.int8}, ValueError,
                   _lit("Argument `row_stat_dtype` must be a floating torch.dtype or None")),
        ErrorInput("lr-negative-float", {"lr": -1.0}, ValueError,
                   _lit("Argument `lr` must be a finite number and >= 0.0. Received: -1.0")),
    ),
    inputs=(
        _in("adafactor", {"lr": 0.1, "beta_2_decay": -0.6, "epsilon_2": 1e-2, "clip_threshold": 0.8}, KERAS,
            keras_rule=lambda shapes, kw: AdafactorRule(shapes, beta_2_decay=kw["beta_2_decay"],
                                                        epsilon_2=kw["epsilon_2"], clip_threshold=kw["clip_threshold"]),
            extra_shapes=[(2, 3, 4)]),  # factored over the last two dims of a rank-3 parameter
        _in("adafactor", {"lr": 0.1}, GENERIC, XLA, XLA_COMPILE, CKPT_MATRIX, XLA_STACKED, KERNEL_PATH),
        # per-table statistics and a per-table clip norm inside a group, accumulation's gate on the rows
        _in("adafactor-clipnorm-accum", {"lr": 0.1, "clipnorm": 0.05, "gradient_accumulation_steps": 2}, XLA_STACKED),
        # the update clip binds, ρ = min(η, 1/√t) is off (so η > 1/√t shows), decay, a larger ε2 floor
        _in("adafactor-clip-decay-steps", {"lr": 0.7, "clip_threshold": 0.3, "weight_decay": 0.05,
                                           "relative_step": False, "epsilon_2": 0.5, "beta_2_decay": -0.5}, GENERIC),
        _in("adafactor-bf16-rows", {"lr": 0.1, "row_stat_dtype": torch.bfloat16}, XLA),
        # the compiled update with the options it reads (one kernel): its clip binds, ρ off, decay, the gate, the
        # average (a 16-bit row_stat_dtype keeps the reference path: tests/optim/test_kernel_update.py)
        _in("adafactor-options", {"lr": 0.7, "clip_threshold": 0.3, "weight_decay": 0.05, "relative_step": False,
                                  "clipvalue": 0.05, "use_ema": True, "ema_momentum": 0.8, "skip_nonfinite": True,
                                  "loss_scale_factor": 4.0}, KERNEL_PATH),
        _in("adafactor-ema-overwrite-gclip", {"lr": 0.1, "use_ema": True, "ema_momentum": 0.8,
                                              "ema_overwrite_frequency": 2, "global_clipnorm": 0.5}, XLA),
        _in("adafactor-ema-accum", {"lr": 0.1, "use_ema": True, "ema_momentum": 0.9, "gradient_accumulation_steps": 3,
                                    "global_clipnorm": 0.5}, XLA_COMPILE),
        _in("adafactor-ema-accum", {"lr": 0.1, "use_ema": True, "gradient_accumulation_steps": 2}, SPMD_STEP),
    ),
)

# ---------------------------------------------------------------------------------------------- RowWiseAdagrad
def np_rowwise_adagrad(hp: Mapping[str, Any], w: Array, g: Array, s: Slots, eta: float, t: int, num_rows: int):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: g ← g + λ·w (L2); G ← G + mean_j g² per row (per element below
    rank 2); w ← w − η·g/(√G + ε)."""
    g = g + hp["weight_decay"] * w
    g2 = (g * g).reshape(g.shape[0], -1).mean(axis=1) if w.ndim >= 2 else g * g
    G = s["accumulators"] + g2
    den = np.sqrt(G) + hp["eps"]
    return w - eta * g / (den.reshape(-1, *[1] * (w.ndim - 1)) if w.ndim >= 2 else den), {"accumulators": G}


ROWWISE_ADAGRAD_INFO = OptimizerInfo(
    cls=O.RowWiseAdagrad, name="rowwise_adagrad", default={"lr": 0.1},
    slot_names=("accumulators",),
    np_init=lambda hp, shape: {"accumulators": _full(hp["initial_accumulator_value"])(shape[:1] if len(shape) >= 2
                                                                                      else shape)},
    np_rule=np_rowwise_adagrad,
    shared_args=COMMON_ARGS | TPU_ARGS | {"slot_creation_fn"},
    supports_no_dedup=True, zero_gradient_is_noop=True,
    error_inputs=(
        ErrorInput("eps-zero", {"eps": 0.0}, ValueError, _lit("Argument `eps` must be a finite number and > 0.0. Received: 0.0")),
        ErrorInput("init-negative", {"initial_accumulator_value": -1.0}, ValueError,
                   _lit("Argument `initial_accumulator_value` must be a finite number and >= 0.0. Received: -1.0")),
        ErrorInput("init-inf", {"initial_accumulator_value": float("inf")}, ValueError,
                   r"Argument `initial_accumulator_value` .* Received: inf"),
        ErrorInput("weight-decay-negative", {"weight_decay": -0.5}, ValueError,
                   _lit("Argument `weight_decay` must be a finite number and >= 0.0. Received: -0.5")),
    ),
    inputs=(
        _in("rowwise_adagrad", {"lr": 0.1}, GENERIC, KERAS),
        _in("rowwise_adagrad-init-l2-eps", {"lr": 0.2, "initial_accumulator_value": 0.5, "weight_decay": 0.01,
                                            "eps": 1e-8, "clip_weight_min": -0.5}, GENERIC),
    ),
)


OPTIMIZER_INFOS: list[OptimizerInfo] = [
    SGD_INFO, ADAGRAD_INFO, ADAGRAD_MOMENTUM_INFO, ADAM_INFO, LAZY_ADAM_INFO, FTRL_INFO, ADAFACTOR_INFO,
    ROWWISE_ADAGRAD_INFO,
]
INFO_BY_NAME = {info.name: info for info in OPTIMIZER_INFOS}


# ---------------------------------------------------------------------------------------------- queries
def _clips(kwargs: Mapping[str, Any]) -> bool:
    return any(kwargs.get(k) is not None for k in ("clipnorm", "clipvalue", "global_clipnorm"))


@functools.cache
def cases(target: str) -> list[OptimizerConfig]:
    """The configurations a target runs, in registry order (ids unique within the target)."""
    t = TARGETS[target]
    out: list[OptimizerConfig] = []
    for info in OPTIMIZER_INFOS:
        if t.requires and not getattr(info, t.requires):
            continue
        own = [OptimizerConfig(info, i.id, i.kwargs, i.meta) for i in info.inputs if target in i.targets]
        if not own and t.every:
            own = [OptimizerConfig(info, info.name, info.default)]
        if own:
            first = own[0]
            own += [OptimizerConfig(info, f"{first.id}-{name}", {**first.kwargs, **extra})
                    for name, extra in t.extras.items() if set(extra) <= info.shared_args
                    and not (_clips(extra) and _clips(first.kwargs))]  # one clip option at most
        if own and t.noaccum and info.supports_no_dedup:
            own.append(OptimizerConfig(info, f"{info.name}-noaccum", {**info.default, "use_gradient_accumulation": False}))
        out += own
    ids = [c.id for c in out]
    assert len(set(ids)) == len(ids), f"duplicate ids in target {target!r}: {ids}"
    return out


def case(target: str, id: str) -> OptimizerConfig:
    """One configuration of a target by its id (for the subprocess scripts)."""
    for c in cases(target):
        if c.id == id:
            return c
    raise KeyError(f"no configuration {id!r} in target {target!r}: {[c.id for c in cases(target)]}")


def ids(target: str) -> list[str]:
    return [c.id for c in cases(target)]


def error_cases() -> list[tuple[str, OptimizerInfo, ErrorInput]]:
    """(test id, entry, error input): every entry's own errors and every shared error it takes."""
    out = []
    for info in OPTIMIZER_INFOS:
        out += [(f"{info.name}-{e.id}", info, e) for e in SHARED_ERRORS if e.args <= info.shared_args]
        out += [(f"{info.name}-{e.id}", info, e) for e in info.error_inputs]
        out.append((f"{info.name}-{UNKNOWN_ARGUMENT.id}", info, UNKNOWN_ARGUMENT))
    return out
