"""Independent float64 numpy oracle for Keras 3 optimizers (golden data: ``tests/data/golden_keras.json``).

Written from the Keras 3.15.1 sources (``keras/src/optimizers/``) and checked against the golden file,
deliberately *not* from ``torch_tpu_embedding``, so that the package can be tested against it.

Section marks used below:

* §5.1: ``BaseOptimizer.apply(grads, vars)`` (``keras/src/optimizers/base_optimizer.py``), in its order:
  step 1 build (accumulators and EMA averages at zero), step 2 ``g / loss_scale_factor``, step 3 gradient
  accumulation (``gradient_accumulation_steps``), step 4 clipping (one of ``clipnorm``, ``global_clipnorm``,
  ``clipvalue``), step 5 decoupled weight decay, step 6 ``update_step``, step 7 EMA and its overwrite.
* §5.2: Adafactor (``keras/src/optimizers/adafactor.py``).
* §5.3: Adam, Adagrad, Ftrl and SGD (``adam.py``, ``adagrad.py``, ``ftrl.py``, ``sgd.py`` there).

Contents
--------
* :class:`KerasPipeline` -- the per-call pipeline of Keras ``BaseOptimizer.apply()`` (§5.1):
  loss-scale unscaling, gradient accumulation, clipping, decoupled weight decay, ``update_step``,
  EMA with periodic overwrite, and the iteration counter. The per-variable rule is a callback
  ``update_step(var_index, g, W, lr, t) -> W_new`` that owns its own slots, so any rule (the Keras
  ones below or a TPU-style numpy rule) can be wrapped.
* Per-variable Keras rules (§5.2, §5.3) as pure functions over a ``slots`` dict
  (:func:`adafactor_update`, :func:`adam_update`, :func:`adagrad_update`, :func:`ftrl_update`,
  :func:`sgd_update`) and as stateful callables usable as ``update_step``
  (:class:`AdafactorRule`, :class:`AdamRule`, :class:`AdagradRule`, :class:`FtrlRule`,
  :class:`SGDRule`). Slot names are those of the Keras attributes recorded in golden_keras.json
  (``r``/``c``/``v``, ``momentums``/``velocities``, ``accumulators``/``linears``).
* :func:`make_keras_optimizer` -- build ``(pipeline, rule)`` from a Keras class name and its
  constructor / ``get_config()`` arguments.

Conventions
-----------
* ``t`` passed to ``update_step`` is ``iterations + 1`` where ``iterations`` is Keras's *public*
  ``optimizer.iterations``, i.e. ``_iterations // k`` under gradient accumulation (§5.1 step 3).
* ``lr`` passed to ``update_step`` (and used by weight decay) is the learning rate evaluated at the
  *raw* ``_iterations`` (§5.1 steps 3 and 5). A callable ``learning_rate`` plays the role of a Keras
  ``LearningRateSchedule`` and is called with the raw iteration count.
* Every array is float64; slots are replaced (never mutated in place) so snapshots stay valid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = [
    "Array",
    "UpdateStep",
    "KerasRule",
    "KerasPipeline",
    "rms",
    "clip_by_norm",
    "clip_by_global_norm",
    "adafactor_slots",
    "adafactor_update",
    "adam_slots",
    "adam_update",
    "adagrad_slots",
    "adagrad_update",
    "ftrl_slots",
    "ftrl_update",
    "sgd_update",
    "AdafactorRule",
    "AdamRule",
    "AdagradRule",
    "FtrlRule",
    "SGDRule",
    "BASE_ARGS",
    "make_keras_optimizer",
]

Array = NDArray[np.float64]
Slots = dict[str, Array]
UpdateStep = Callable[[int, Array, Array, float, int], ArrayLike]
"""``update_step(var_index, g, W, lr, t) -> W_new`` (see the module docstring for ``lr`` and ``t``)."""

LearningRate = float | Callable[[int], float]


def _f64(x: ArrayLike) -> Array:
    """Return ``x`` as a fresh float64 array (never a view of the caller's data)."""
    return np.array(x, dtype=np.float64, copy=True)


# ----------------------------------------------------------------------------------------------
# Clipping helpers (§5.1 step 4) and RMS (§5.2)
# ----------------------------------------------------------------------------------------------
def rms(x: ArrayLike) -> float:
    """Root mean square over ALL elements of ``x`` (§5.2: RMS(W) is over the whole tensor)."""
    a = np.asarray(x, dtype=np.float64)
    return float(np.sqrt(np.mean(np.square(a))))


def clip_by_norm(g: Array, clipnorm: float) -> Array:
    """§5.1 step 4, ``clipnorm c``: ``g * c / max(||g||_2, c)`` for one variable.

    A zero gradient has norm 0 and is returned unchanged (``max(0, c) = c``).
    """
    norm = float(np.sqrt(np.sum(np.square(g))))
    return g * clipnorm / max(norm, clipnorm)


def clip_by_global_norm(grads: Sequence[Array], clipnorm: float) -> list[Array]:
    """§5.1 step 4, ``global_clipnorm c``: scale every gradient by ``c * min(1/||G||, 1/c)``.

    ``||G||`` is the L2 norm over all gradients jointly. As in Keras, ``scale + (n - n)`` turns the
    scale into NaN when the norm is inf/NaN, and a zero norm gives ``1/0 = inf`` so the scale is 1.
    """
    norm = np.sqrt(np.float64(sum(float(np.sum(np.square(g))) for g in grads)))
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.float64(1.0) / norm
        scale = clipnorm * np.minimum(inv, 1.0 / clipnorm) + (norm - norm)
    return [g * scale for g in grads]


# ----------------------------------------------------------------------------------------------
# KerasPipeline: BaseOptimizer.apply() (§5.1)
# ----------------------------------------------------------------------------------------------
class KerasPipeline:
    """Keras 3 ``BaseOptimizer.apply(grads, vars)`` in float64 numpy (§5.1).

    Args:
        variables: initial values of the trainable variables (copied to float64).
        update_step: per-variable rule ``update_step(var_index, g, W, lr, t) -> W_new``; it owns its
            slots. ``t = iterations + 1`` with ``iterations = _iterations // k`` under accumulation;
            ``lr`` is the learning rate at the raw ``_iterations``.
        learning_rate: a float, or a callable of the raw iteration count (a Keras
            ``LearningRateSchedule``; schedules see the raw ``_iterations``, §5.1 step 3).
        weight_decay: decoupled decay ``W <- W - W*wd*lr`` before ``update_step`` (§5.1 step 5).
        clipnorm / global_clipnorm / clipvalue: at most one may be non-``None`` (ValueError otherwise);
            ``0`` disables (§5.1 step 4).
        use_ema / ema_momentum / ema_overwrite_frequency: EMA of the variables (§5.1 step 7).
        loss_scale_factor: gradients are divided by it first (§5.1 step 2).
        gradient_accumulation_steps: ``k >= 2`` or ``None`` (§5.1 step 3).

    State exposed after every :meth:`apply` (all float64 copies owned by the pipeline):
        ``variables``, ``averages`` (EMA, ``None`` unless ``use_ema``), ``accumulated_gradients``
        (``None`` unless accumulating), ``raw_iterations`` (Keras ``_iterations``, the recorded
        ``iterations_var``), ``iterations`` (public Keras ``iterations``), ``learning_rate``.
    """

    def __init__(
        self,
        variables: Sequence[ArrayLike],
        update_step: UpdateStep,
        *,
        learning_rate: LearningRate = 0.001,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        global_clipnorm: float | None = None,
        clipvalue: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        # Constructor validation, same conditions as Keras (§5.1 steps 3, 4, 7).
        if gradient_accumulation_steps and not gradient_accumulation_steps >= 2:
            raise ValueError(
                "`gradient_accumulation_steps` must be an integer >= 2. "
                f"Received: gradient_accumulation_steps={gradient_accumulation_steps}"
            )
        if use_ema:
            if ema_momentum > 1 or ema_momentum < 0:
                raise ValueError(f"`ema_momentum` must be in the range [0, 1]. Received: ema_momentum={ema_momentum}")
            if ema_overwrite_frequency and (
                not isinstance(ema_overwrite_frequency, int) or ema_overwrite_frequency < 1
            ):
                raise ValueError(
                    "`ema_overwrite_frequency` must be an integer >= 1 or None. "
                    f"Received: ema_overwrite_frequency={ema_overwrite_frequency}"
                )
        if sum(a is not None for a in (clipnorm, clipvalue, global_clipnorm)) > 1:
            raise ValueError(
                "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. "
                f"Received: clipnorm={clipnorm}, clipvalue={clipvalue}, global_clipnorm={global_clipnorm}"
            )
        if not variables:
            raise ValueError("KerasPipeline needs at least one variable.")

        self.update_step = update_step
        self._learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.clipnorm = clipnorm
        self.global_clipnorm = global_clipnorm
        self.clipvalue = clipvalue
        self.use_ema = use_ema
        self.ema_momentum = ema_momentum
        self.ema_overwrite_frequency = ema_overwrite_frequency
        self.loss_scale_factor = loss_scale_factor
        self.gradient_accumulation_steps = gradient_accumulation_steps

        # §5.1 step 1 (build): EMA averages and gradient accumulators start at zero.
        self.variables: list[Array] = [_f64(v) for v in variables]
        self.averages: list[Array] | None = [np.zeros_like(v) for v in self.variables] if use_ema else None
        self.accumulated_gradients: list[Array] | None = (
            [np.zeros_like(v) for v in self.variables] if gradient_accumulation_steps else None
        )
        self.raw_iterations = 0

    # -- counters ------------------------------------------------------------------------------
    @property
    def iterations(self) -> int:
        """Keras's public ``iterations``: ``_iterations // k`` under accumulation (§5.1 step 3)."""
        k = self.gradient_accumulation_steps
        return self.raw_iterations // k if k else self.raw_iterations

    @property
    def learning_rate(self) -> float:
        """Current learning rate: the schedule is evaluated at the RAW ``_iterations`` (§5.1 step 3)."""
        lr = self._learning_rate
        return float(lr(self.raw_iterations)) if callable(lr) else float(lr)

    # -- the steps -----------------------------------------------------------------------------
    def _clip(self, grads: list[Array]) -> list[Array]:
        """§5.1 step 4: the first enabled (truthy and > 0) of clipnorm, global_clipnorm, clipvalue."""
        if self.clipnorm and self.clipnorm > 0:
            return [clip_by_norm(g, self.clipnorm) for g in grads]
        if self.global_clipnorm and self.global_clipnorm > 0:
            return clip_by_global_norm(grads, self.global_clipnorm)
        if self.clipvalue and self.clipvalue > 0:
            return [np.clip(g, -self.clipvalue, self.clipvalue) for g in grads]
        return grads

    def _apply_weight_decay(self, idx: Sequence[int]) -> None:
        """§5.1 step 5: ``W <- W - W*wd*lr`` with the raw-iteration lr, before ``update_step``."""
        if self.weight_decay is None:
            return
        lr = self.learning_rate
        for i in idx:
            w = self.variables[i]
            self.variables[i] = w - w * self.weight_decay * lr

    def _update(self, idx: Sequence[int], grads: list[Array]) -> None:
        """§5.1 steps 4-6 on the variables ``idx``: clip jointly, decay, then ``update_step`` each."""
        grads = self._clip(grads)
        self._apply_weight_decay(idx)
        lr = self.learning_rate
        t = self.iterations + 1
        for i, g in zip(idx, grads, strict=True):
            w_new = _f64(self.update_step(i, g, self.variables[i].copy(), lr, t))
            if w_new.shape != self.variables[i].shape:
                raise ValueError(f"update_step returned shape {w_new.shape}, expected {self.variables[i].shape}")
            self.variables[i] = w_new

    def _ema(self) -> None:
        """§5.1 step 7 on ALL variables, on every apply call (accumulation-only calls included).

        ``avg <- mu'*avg + (1-mu')*W`` with ``mu' = 0`` while the public (floored) ``iterations`` is 0,
        then ``W <- avg`` when ``(iterations + 1) % F == 0``. Under accumulation the floored counter
        means: mu' = 0 on each of the first k calls, and the overwrite fires on all k calls of a block.
        """
        if not self.use_ema:
            return
        assert self.averages is not None
        it = self.iterations
        mu = 0.0 if it == 0 else float(self.ema_momentum)
        self.averages = [mu * a + (1.0 - mu) * w for a, w in zip(self.averages, self.variables, strict=True)]
        freq = self.ema_overwrite_frequency
        if freq and (it + 1) % freq == 0:
            self.variables = [a.copy() for a in self.averages]

    def apply(self, grads: Sequence[ArrayLike | None]) -> list[Array]:
        """One Keras ``optimizer.apply(grads, vars)`` call, in the exact §5.1 order.

        1. Drop ``None`` gradients (all ``None`` -> ValueError); those variables get no accumulation,
           decay or update, but still take part in the EMA (Keras runs EMA on all its variables).
        2. ``g <- g / loss_scale_factor``.
        3. With accumulation ``k``: if ``(_iterations + 1) % k != 0`` add ``g`` to the accumulator and
           stop; else ``g <- (g + acc) / k``, run steps 4-6, and reset ALL accumulators to zero.
        4-6. Clip, decoupled weight decay, ``update_step`` (see :meth:`_update`).
        7. EMA and overwrite (see :meth:`_ema`).
        8. ``_iterations += 1``.

        Returns copies of the variables after the call.
        """
        if len(grads) != len(self.variables):
            raise ValueError(f"Expected {len(self.variables)} gradients, got {len(grads)}.")
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            raise ValueError("No gradients provided for any variable.")
        gs: list[Array] = []
        for i in idx:
            g = _f64(grads[i])  # type: ignore[arg-type]
            if g.shape != self.variables[i].shape:
                raise ValueError(f"Gradient {i} has shape {g.shape}, variable has {self.variables[i].shape}.")
            gs.append(g)

        # Step 2: unscale.
        if self.loss_scale_factor is not None:
            gs = [g / self.loss_scale_factor for g in gs]

        # Step 3: accumulation (or straight to steps 4-6).
        k = self.gradient_accumulation_steps
        if k:
            acc = self.accumulated_gradients
            assert acc is not None
            if (self.raw_iterations + 1) % k == 0:
                self._update(idx, [(g + acc[i]) / k for i, g in zip(idx, gs, strict=True)])
                self.accumulated_gradients = [np.zeros_like(a) for a in acc]
            else:
                for i, g in zip(idx, gs, strict=True):
                    acc[i] = g + acc[i]
        else:
            self._update(idx, gs)

        # Step 7: EMA, then step 8: the counter.
        self._ema()
        self.raw_iterations += 1
        return [w.copy() for w in self.variables]

    def finalize_variable_values(self) -> list[Array]:
        """§5.1 step 7: with EMA, copy the averages into the variables; returns the variables."""
        if self.use_ema:
            assert self.averages is not None
            self.variables = [a.copy() for a in self.averages]
        return [w.copy() for w in self.variables]


# ----------------------------------------------------------------------------------------------
# Per-variable Keras rules (§5.2, §5.3). Each *_update mutates its ``slots`` dict (by rebinding
# the entries) and returns the new variable value. ``t = iterations + 1`` (floored iterations).
# ----------------------------------------------------------------------------------------------
def adafactor_slots(shape: Sequence[int]) -> Slots:
    """§5.2 slots: rank >= 2: ``r`` of ``shape[:-1]``, ``c`` of ``shape[:-2] + shape[-1:]``, full ``v``;
    rank < 2: ``r`` and ``c`` are dummy scalar zeros and ``v`` is full-size."""
    shape = tuple(shape)
    if len(shape) >= 2:
        return {"r": np.zeros(shape[:-1]), "c": np.zeros(shape[:-2] + shape[-1:]), "v": np.zeros(shape)}
    return {"r": np.zeros(()), "c": np.zeros(()), "v": np.zeros(shape)}


def adafactor_update(
    g: ArrayLike,
    w: ArrayLike,
    slots: Slots,
    lr: float,
    t: int | float,
    *,
    beta_2_decay: float = -0.8,
    epsilon_1: float = 1e-30,
    epsilon_2: float = 1e-3,
    clip_threshold: float = 1.0,
    relative_step: bool = True,
    lr_is_schedule: bool = False,
) -> Array:
    """Keras 3 ``Adafactor.update_step`` (§5.2) for a variable of any rank.

    Steps: (1) if ``relative_step`` and lr is not a schedule, ``lr <- min(lr, 1/sqrt(t))``;
    (2) ``rho = min(lr, 1/sqrt(t))`` applied AGAIN unconditionally -- so ``relative_step`` (and
    ``lr_is_schedule``) have no effect at all (§5.2 findings); (3) ``alpha = max(eps2, RMS(W)) * rho``
    with the RMS over all elements of the pre-update W; (4) ``G2 = g^2 + eps1``,
    ``beta2_t = 1 - t^beta_2_decay``; (5) rank >= 2: factored ``r`` (mean over the last axis),
    ``c`` (mean over the second-last axis), ``v = (r / mean(r, -1))[..., None] * c[..., None, :]``;
    rank < 2: ``v <- beta2_t*v + (1-beta2_t)*G2``; (6) ``u = g/sqrt(v)``,
    ``u_hat = u / max(1, RMS(u)/clip_threshold)``; (7) ``W <- W - alpha*u_hat``.
    """
    g = np.asarray(g, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    t = float(t)
    inv_sqrt_t = 1.0 / np.sqrt(t)
    if relative_step and not lr_is_schedule:
        lr = min(lr, inv_sqrt_t)
    rho = min(lr, inv_sqrt_t)
    alpha = max(epsilon_2, rms(w)) * rho
    g2 = np.square(g) + epsilon_1
    beta2 = 1.0 - t**beta_2_decay
    if w.ndim >= 2:
        r = beta2 * slots["r"] + (1.0 - beta2) * np.mean(g2, axis=-1)
        c = beta2 * slots["c"] + (1.0 - beta2) * np.mean(g2, axis=-2)
        v = np.expand_dims(r / np.mean(r, axis=-1, keepdims=True), -1) * np.expand_dims(c, -2)
        slots["r"], slots["c"] = r, c
    else:
        v = beta2 * slots["v"] + (1.0 - beta2) * g2
    slots["v"] = v
    u = g / np.sqrt(v)
    u_hat = u / max(1.0, rms(u) / clip_threshold)
    return w - alpha * u_hat


def adam_slots(shape: Sequence[int]) -> Slots:
    """§5.3 Adam slots: ``momentums`` and ``velocities``, zeros."""
    return {"momentums": np.zeros(tuple(shape)), "velocities": np.zeros(tuple(shape))}


def adam_update(
    g: ArrayLike,
    w: ArrayLike,
    slots: Slots,
    lr: float,
    t: int | float,
    *,
    beta_1: float = 0.9,
    beta_2: float = 0.999,
    epsilon: float = 1e-7,
) -> Array:
    """Keras Adam (§5.3, amsgrad=False): ``alpha = lr*sqrt(1-b2^t)/(1-b1^t)``, ``m += (g-m)(1-b1)``,
    ``v += (g^2-v)(1-b2)``, ``W -= alpha*m/(sqrt(v)+eps)`` (eps outside, "epsilon-hat")."""
    g = np.asarray(g, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    t = float(t)
    alpha = lr * np.sqrt(1.0 - beta_2**t) / (1.0 - beta_1**t)
    m = slots["momentums"] + (g - slots["momentums"]) * (1.0 - beta_1)
    v = slots["velocities"] + (np.square(g) - slots["velocities"]) * (1.0 - beta_2)
    slots["momentums"], slots["velocities"] = m, v
    return w - alpha * m / (np.sqrt(v) + epsilon)


def adagrad_slots(shape: Sequence[int], initial_accumulator_value: float = 0.1) -> Slots:
    """§5.3 Adagrad slot: ``accumulators`` filled with ``initial_accumulator_value``."""
    return {"accumulators": np.full(tuple(shape), float(initial_accumulator_value))}


def adagrad_update(g: ArrayLike, w: ArrayLike, slots: Slots, lr: float, *, epsilon: float = 1e-7) -> Array:
    """Keras Adagrad (§5.3): ``a += g^2``, ``W -= lr*g/sqrt(a+eps)`` (eps INSIDE the sqrt)."""
    g = np.asarray(g, dtype=np.float64)
    a = slots["accumulators"] + np.square(g)
    slots["accumulators"] = a
    return np.asarray(w, dtype=np.float64) - lr * g / np.sqrt(a + epsilon)


def ftrl_slots(shape: Sequence[int], initial_accumulator_value: float = 0.1) -> Slots:
    """§5.3 Ftrl slots: ``accumulators`` (n, filled with the initial value) and ``linears`` (z, zeros)."""
    return {"accumulators": np.full(tuple(shape), float(initial_accumulator_value)), "linears": np.zeros(tuple(shape))}


def ftrl_update(
    g: ArrayLike,
    w: ArrayLike,
    slots: Slots,
    lr: float,
    *,
    learning_rate_power: float = -0.5,
    l1_regularization_strength: float = 0.0,
    l2_regularization_strength: float = 0.0,
    l2_shrinkage_regularization_strength: float = 0.0,
    beta: float = 0.0,
) -> Array:
    """Keras Ftrl (§5.3): ``l2' = l2 + beta/(2lr)``, ``g_s = g + 2*l2s*W``, ``n' = n + g^2`` (raw g),
    ``z += g_s - (n'^-p - n^-p)/lr * W``, ``W = (clip(z,-l1,l1) - z)/(n'^-p/lr + 2*l2')``, ``n = n'``."""
    g = np.asarray(g, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    p = learning_rate_power
    n, z = slots["accumulators"], slots["linears"]
    l2 = l2_regularization_strength + beta / (2.0 * lr)
    g_s = g + 2.0 * l2_shrinkage_regularization_strength * w
    n_new = n + np.square(g)
    z = z + g_s - (np.power(n_new, -p) - np.power(n, -p)) / lr * w
    quad = np.power(n_new, -p) / lr + 2.0 * l2
    l1 = l1_regularization_strength
    slots["accumulators"], slots["linears"] = n_new, z
    return (np.clip(z, -l1, l1) - z) / quad


def sgd_update(g: ArrayLike, w: ArrayLike, lr: float) -> Array:
    """Keras SGD with momentum 0 (§5.3): ``W -= lr*g``."""
    return np.asarray(w, dtype=np.float64) - lr * np.asarray(g, dtype=np.float64)


# ----------------------------------------------------------------------------------------------
# Stateful rules usable as KerasPipeline.update_step
# ----------------------------------------------------------------------------------------------
class KerasRule(Protocol):
    """A per-variable rule with per-variable ``slots`` that can be passed as ``update_step``."""

    slots: list[Slots]

    def __call__(self, i: int, g: Array, w: Array, lr: float, t: int) -> Array: ...


class AdafactorRule:
    """:func:`adafactor_update` with one :func:`adafactor_slots` dict per variable (§5.2)."""

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        *,
        beta_2_decay: float = -0.8,
        epsilon_1: float = 1e-30,
        epsilon_2: float = 1e-3,
        clip_threshold: float = 1.0,
        relative_step: bool = True,
        lr_is_schedule: bool = False,
    ) -> None:
        self.slots: list[Slots] = [adafactor_slots(s) for s in shapes]
        self.hparams: dict[str, Any] = dict(
            beta_2_decay=beta_2_decay,
            epsilon_1=epsilon_1,
            epsilon_2=epsilon_2,
            clip_threshold=clip_threshold,
            relative_step=relative_step,
            lr_is_schedule=lr_is_schedule,
        )

    def __call__(self, i: int, g: Array, w: Array, lr: float, t: int) -> Array:
        return adafactor_update(g, w, self.slots[i], lr, t, **self.hparams)


class AdamRule:
    """:func:`adam_update` with per-variable ``momentums``/``velocities`` (§5.3)."""

    def __init__(
        self, shapes: Sequence[Sequence[int]], *, beta_1: float = 0.9, beta_2: float = 0.999, epsilon: float = 1e-7
    ) -> None:
        self.slots: list[Slots] = [adam_slots(s) for s in shapes]
        self.hparams: dict[str, Any] = dict(beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)

    def __call__(self, i: int, g: Array, w: Array, lr: float, t: int) -> Array:
        return adam_update(g, w, self.slots[i], lr, t, **self.hparams)


class AdagradRule:
    """:func:`adagrad_update` with per-variable ``accumulators`` (§5.3)."""

    def __init__(
        self, shapes: Sequence[Sequence[int]], *, initial_accumulator_value: float = 0.1, epsilon: float = 1e-7
    ) -> None:
        self.slots: list[Slots] = [adagrad_slots(s, initial_accumulator_value) for s in shapes]
        self.epsilon = epsilon

    def __call__(self, i: int, g: Array, w: Array, lr: float, t: int) -> Array:
        return adagrad_update(g, w, self.slots[i], lr, epsilon=self.epsilon)


class FtrlRule:
    """:func:`ftrl_update` with per-variable ``accumulators``/``linears`` (§5.3), with Keras's validation."""

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        *,
        learning_rate_power: float = -0.5,
        initial_accumulator_value: float = 0.1,
        l1_regularization_strength: float = 0.0,
        l2_regularization_strength: float = 0.0,
        l2_shrinkage_regularization_strength: float = 0.0,
        beta: float = 0.0,
    ) -> None:
        checks = {
            "initial_accumulator_value": initial_accumulator_value < 0.0,
            "learning_rate_power": learning_rate_power > 0.0,
            "l1_regularization_strength": l1_regularization_strength < 0.0,
            "l2_regularization_strength": l2_regularization_strength < 0.0,
            "l2_shrinkage_regularization_strength": l2_shrinkage_regularization_strength < 0.0,
        }
        for name, bad in checks.items():
            if bad:
                raise ValueError(f"Invalid Ftrl argument {name}.")
        self.slots: list[Slots] = [ftrl_slots(s, initial_accumulator_value) for s in shapes]
        self.hparams: dict[str, Any] = dict(
            learning_rate_power=learning_rate_power,
            l1_regularization_strength=l1_regularization_strength,
            l2_regularization_strength=l2_regularization_strength,
            l2_shrinkage_regularization_strength=l2_shrinkage_regularization_strength,
            beta=beta,
        )

    def __call__(self, i: int, g: Array, w: Array, lr: float, t: int) -> Array:
        return ftrl_update(g, w, self.slots[i], lr, **self.hparams)


class SGDRule:
    """:func:`sgd_update` (momentum 0, no slots) (§5.3)."""

    def __init__(self, shapes: Sequence[Sequence[int]]) -> None:
        self.slots: list[Slots] = [{} for _ in shapes]

    def __call__(self, i: int, g: Array, w: Array, lr: float, t: int) -> Array:
        return sgd_update(g, w, lr)


# ----------------------------------------------------------------------------------------------
# Factory from Keras constructor / get_config() arguments
# ----------------------------------------------------------------------------------------------
BASE_ARGS = (
    "learning_rate",
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)
"""Keyword arguments of the Keras base optimizer (§5.1) that go to :class:`KerasPipeline`."""

_DEFAULT_LR = {"Adafactor": 0.001, "Adam": 0.001, "Adagrad": 0.001, "Ftrl": 0.001, "SGD": 0.01}


def make_keras_optimizer(
    optimizer: str, variables: Sequence[ArrayLike], config: Mapping[str, Any] | None = None, **kwargs: Any
) -> tuple[KerasPipeline, KerasRule]:
    """Build the numpy twin of ``keras.optimizers.<optimizer>(**config, **kwargs)`` on ``variables``.

    ``optimizer`` is one of ``Adafactor``, ``Adam``, ``Adagrad``, ``Ftrl``, ``SGD``. ``config`` may be a
    Keras ``get_config()`` dict (``name`` is ignored). The base arguments of §5.1 go to the pipeline, the
    rest to the rule; unknown keys raise ``TypeError``, and Keras features outside §5
    (``amsgrad=True``, SGD momentum) raise ``NotImplementedError``.
    Returns ``(pipeline, rule)``; the rule's ``slots[i]`` are the Keras slot variables of variable ``i``.
    """
    args = {**(dict(config) if config else {}), **kwargs}
    args.pop("name", None)
    base = {k: args.pop(k) for k in BASE_ARGS if k in args}
    if optimizer not in _DEFAULT_LR:
        raise ValueError(f"Unknown Keras optimizer {optimizer!r}.")
    base.setdefault("learning_rate", _DEFAULT_LR[optimizer])
    lr_is_schedule = callable(base["learning_rate"])
    shapes = [np.shape(v) for v in variables]
    rule: KerasRule
    if optimizer == "Adafactor":
        rule = AdafactorRule(shapes, lr_is_schedule=lr_is_schedule, **args)
    elif optimizer == "Adam":
        if args.pop("amsgrad", False):
            raise NotImplementedError("amsgrad is not modelled by this oracle (§5.3)")
        rule = AdamRule(shapes, **args)
    elif optimizer == "Adagrad":
        rule = AdagradRule(shapes, **args)
    elif optimizer == "Ftrl":
        rule = FtrlRule(shapes, **args)
    else:
        if args.pop("momentum", 0.0) or args.pop("nesterov", False):
            raise NotImplementedError("SGD momentum is not modelled by this oracle (§5.3)")
        rule = SGDRule(shapes, **args)
    return KerasPipeline(variables, rule, **base), rule
