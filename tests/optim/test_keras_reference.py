"""Checks of the independent Keras oracle ``tests/keras_reference.py`` (its §5.1-§5.3; tests/data/golden_keras.json).

1. Every case of ``tests/data/golden_keras.json`` (real Keras 3.15.1, float32, TF back end) is replayed
   through the float64 reference; the variable, every recorded slot (r, c, v, momentums, velocities,
   accumulators, linears, EMA averages, accumulated gradients) and ``iterations_var`` must match at
   every step to 1e-6 (§9.1 reports <= 1.6e-7 for the spec's own numpy port).
2. Spec anchors (§9.1), the ``relative_step`` no-op (§5.2) and the pipeline's ordering rules (§5.1) are
   checked on small hand-derived examples, so the oracle is pinned even without Keras installed.
3. If ``keras`` is installed, live Keras 3 (float64 variables, floatx float64, CPU, in a subprocess
   so the backend choice cannot leak) is compared with the reference on three random float64 cases
   mixing clipnorm/global_clipnorm/clipvalue, EMA with overwrite, gradient accumulation, weight decay,
   loss_scale_factor, a None gradient and a staircase ExponentialDecay schedule, for each of Adafactor,
   Adam, Adagrad, Ftrl and SGD, on the ``torch`` back end and (where ``tensorflow`` is importable) on
   the ``tensorflow`` back end. Tolerance 1e-9, except on torch for runs that go through
   ``ops.minimum``/``ops.maximum``, which Keras evaluates in float32 there (see :func:`_demoted`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from keras_reference import (
    AdafactorRule,
    KerasPipeline,
    SGDRule,
    adafactor_slots,
    adafactor_update,
    clip_by_global_norm,
    clip_by_norm,
    make_keras_optimizer,
)

GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "golden_keras.json").read_text())
CASES = {c["name"]: c for c in GOLDEN["cases"]}
GOLDEN_TOL = 1e-6
LIVE_TOL = 1e-9
DEMOTED_TOL = 1e-6  # see _demoted()
RULE_SLOTS = {"r", "c", "v", "momentums", "velocities", "accumulators", "linears"}


def _max_abs(a: Any, b: Any) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def replay_golden_case(case: dict[str, Any]) -> dict[str, float]:
    """Replay one golden case (§9.1) and return the max |Keras - reference| per recorded quantity.

    Raises AssertionError on a recorded quantity the reference does not model, a slot of the
    reference that Keras did not record, or an iteration-count mismatch.
    """
    pipe, rule = make_keras_optimizer(case["optimizer"], [case["initial_variable"]], case["config"])
    diffs: dict[str, float] = {"variable": 0.0}
    for step, (g, rec) in enumerate(zip(case["gradients"], case["steps"], strict=True)):
        pipe.apply([g])
        diffs["variable"] = max(diffs["variable"], _max_abs(pipe.variables[0], rec["variable"]))
        slots = dict(rec["slots"])
        assert slots.pop("iterations_var") == pipe.raw_iterations == step + 1
        assert set(rule.slots[0]) <= set(slots), f"unrecorded reference slots {set(rule.slots[0]) - set(slots)}"
        for name, want in slots.items():
            if name in RULE_SLOTS:
                got = rule.slots[0][name]
            elif name == "model_variables_moving_average":
                assert pipe.averages is not None
                got = pipe.averages[0]
            elif name == "accumulated_gradients":
                assert pipe.accumulated_gradients is not None
                got = pipe.accumulated_gradients[0]
            else:
                raise AssertionError(f"golden slot {name!r} is not modelled by the reference")
            diffs[name] = max(diffs.get(name, 0.0), _max_abs(got, want))
    return diffs


# ----------------------------------------------------------------------------------------------
# 1. The golden file
# ----------------------------------------------------------------------------------------------
def test_golden_file_has_the_20_cases_of_the_spec() -> None:
    assert GOLDEN["meta"]["keras_version"] == "3.15.1"
    assert len(CASES) == 20
    assert {c["optimizer"] for c in CASES.values()} == {"Adafactor", "Ftrl", "Adam", "Adagrad", "SGD"}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_golden_keras(name: str) -> None:
    diffs = replay_golden_case(CASES[name])
    worst = max(diffs.values())
    assert worst <= GOLDEN_TOL, diffs


# ----------------------------------------------------------------------------------------------
# 2. Anchors and hand-derived pipeline semantics
# ----------------------------------------------------------------------------------------------
def test_spec_anchors_9_1() -> None:
    """The numbers quoted in §9.1 "Anchors"."""
    case = CASES["adafactor_2d_defaults"]
    pipe, rule = make_keras_optimizer("Adafactor", [case["initial_variable"]], case["config"])
    pipe.apply([case["gradients"][0]])
    np.testing.assert_allclose(pipe.variables[0][0], [0.0990956, -0.1992289, 0.2995956], atol=1e-7)
    np.testing.assert_allclose(rule.slots[0]["r"], [0.1266667, 0.0566667, 0.0175, 0], atol=1e-7)
    np.testing.assert_allclose(rule.slots[0]["c"], [0.065625, 0.0325, 0.0525], atol=1e-7)

    case = CASES["ftrl_2d_lr0.1_defaults"]
    pipe, _ = make_keras_optimizer("Ftrl", [case["initial_variable"]], case["config"])
    pipe.apply([case["gradients"][0]])
    np.testing.assert_allclose(pipe.variables[0][0], [-0.0379677, 0.01392, -0.0069985], atol=1e-7)
    np.testing.assert_array_equal(pipe.variables[0][3], 0.0)

    case = CASES["adam_2d_defaults"]
    pipe, _ = make_keras_optimizer("Adam", [case["initial_variable"]], case["config"])
    pipe.apply([case["gradients"][0]])
    w0, g0 = np.array(case["initial_variable"]), np.array(case["gradients"][0])
    np.testing.assert_allclose(pipe.variables[0] - w0, -0.001 * np.sign(g0), atol=1e-7)  # ~ because of eps
    np.testing.assert_array_equal(pipe.variables[0][g0 == 0], w0[g0 == 0])


@pytest.mark.parametrize("shape", [(4,), (4, 3), (2, 3, 2)])
def test_adafactor_relative_step_is_a_no_op(shape: tuple[int, ...]) -> None:
    """§5.2: rho = min(lr, 1/sqrt(t)) is applied regardless of relative_step or a schedule."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=shape)
    grads = [rng.normal(size=shape) for _ in range(4)]
    outs = []
    for kw in ({"relative_step": True}, {"relative_step": False}, {"lr_is_schedule": True}):
        slots, x = adafactor_slots(shape), w.copy()
        for t, g in enumerate(grads, start=1):
            x = adafactor_update(g, x, slots, 1.0, t, **kw)
        outs.append(x)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_adafactor_first_step_closed_form_rank1() -> None:
    """t=1: beta2_t = 0 so v = g^2 + eps1, u = g/|g| = sign(g); W -= max(eps2, RMS(W))*min(lr,1)*u_hat."""
    w, g = np.array([0.3, -0.4, 0.0, 1.2]), np.array([0.5, -2.0, 0.1, 0.0])
    slots = adafactor_slots(w.shape)
    out = adafactor_update(g, w, slots, 0.1, 1)
    u = g / np.sqrt(g * g + 1e-30)
    u_hat = u / max(1.0, np.sqrt(np.mean(u * u)))
    np.testing.assert_allclose(out, w - np.sqrt(np.mean(w * w)) * 0.1 * u_hat, rtol=0, atol=1e-15)
    assert slots["r"].shape == () and slots["c"].shape == ()


def test_clipping_helpers() -> None:
    g = np.array([3.0, 4.0])
    np.testing.assert_allclose(clip_by_norm(g, 1.0), [0.6, 0.8])
    np.testing.assert_allclose(clip_by_norm(g, 10.0), g)
    np.testing.assert_array_equal(clip_by_norm(np.zeros(2), 1.0), np.zeros(2))
    out = clip_by_global_norm([g, np.array([0.0, 12.0])], 6.5)  # ||G|| = 13
    np.testing.assert_allclose(out[0], g / 2)
    np.testing.assert_allclose(out[1], [0.0, 6.0])
    np.testing.assert_array_equal(clip_by_global_norm([np.zeros(3)], 1.0)[0], np.zeros(3))
    assert np.isnan(clip_by_global_norm([np.array([np.inf, 1.0])], 1.0)[0]).all()


def test_pipeline_validation() -> None:
    def step(i: int, g: np.ndarray, w: np.ndarray, lr: float, t: int) -> np.ndarray:
        return w

    with pytest.raises(ValueError, match="Only one of"):
        KerasPipeline([np.zeros(2)], step, clipnorm=1.0, clipvalue=0.0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        KerasPipeline([np.zeros(2)], step, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="ema_momentum"):
        KerasPipeline([np.zeros(2)], step, use_ema=True, ema_momentum=1.5)
    with pytest.raises(ValueError, match="ema_overwrite_frequency"):
        KerasPipeline([np.zeros(2)], step, use_ema=True, ema_overwrite_frequency=0.5)  # type: ignore[arg-type]
    pipe = KerasPipeline([np.zeros(2)], step)
    with pytest.raises(ValueError, match="No gradients"):
        pipe.apply([None])
    with pytest.raises(ValueError, match="Ftrl"):
        make_keras_optimizer("Ftrl", [np.zeros(2)], learning_rate_power=0.5)


def test_callback_sees_floored_t_and_raw_iteration_schedule() -> None:
    """§5.1 step 3: update_step's t uses _iterations // k; the schedule (and weight decay) see the raw count."""
    calls: list[tuple[int, float, int]] = []

    def step(i: int, g: np.ndarray, w: np.ndarray, lr: float, t: int) -> np.ndarray:
        calls.append((i, lr, t))
        return w - lr * g

    pipe = KerasPipeline(
        [np.ones(2), np.ones(3)], step, learning_rate=lambda it: 1.0 / (it + 1), gradient_accumulation_steps=3,
        weight_decay=0.5,
    )
    for _ in range(6):
        pipe.apply([np.ones(2), np.full(3, 2.0)])
    # Real updates on raw calls 2 and 5 -> lr = 1/3 and 1/6; floored iterations 0 and 1 -> t = 1 and 2.
    assert calls == [(0, 1 / 3, 1), (1, 1 / 3, 1), (0, 1 / 6, 2), (1, 1 / 6, 2)]
    assert pipe.raw_iterations == 6 and pipe.iterations == 2
    w = 1.0
    for lr in (1 / 3, 1 / 6):
        w = w * (1 - 0.5 * lr) - lr * 1.0  # decay with the raw-iteration lr, then the mean gradient (1.0)
    np.testing.assert_allclose(pipe.variables[0], [w, w], rtol=1e-15)


def test_ema_with_accumulation_uses_floored_iterations() -> None:
    """§5.1 step 7 + step 3: EMA runs on every call; mu' = 0 and the overwrite test use iterations // k.

    SGD lr=1 on a scalar, k=2, mu=0.5, F=2. Raw call n has iterations n // 2:
      n=0: accumulate 1;          it=0: avg = W = 10 (mu' = 0)
      n=1: W = 10 - (1+1)/2 = 9;  it=0: avg = W = 9 (mu' = 0 again!)
      n=2: accumulate;            it=1: avg = .5*9 + .5*9 = 9; (1+1)%2 == 0 -> W = avg (accumulation-only call)
      n=3: W = 9 - (1+3)/2 = 7;   it=1: avg = .5*9 + .5*7 = 8; overwrite again -> W = 8
      n=4: accumulate;            it=2: avg = 8, no overwrite
      n=5: W = 8 - (1+1)/2 = 7;   it=2: avg = .5*8 + .5*7 = 7.5, W stays 7
    """
    pipe = KerasPipeline(
        [np.array([10.0])], SGDRule([(1,)]), learning_rate=1.0, gradient_accumulation_steps=2,
        use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2,
    )
    seen = []
    for g in (1.0, 1.0, 1.0, 3.0, 1.0, 1.0):
        pipe.apply([np.array([g])])
        assert pipe.averages is not None and pipe.accumulated_gradients is not None
        seen.append((pipe.variables[0][0], pipe.averages[0][0], pipe.accumulated_gradients[0][0]))
    assert seen == [(10, 10, 1), (9, 9, 0), (9, 9, 1), (8, 8, 0), (8, 8, 1), (7, 7.5, 0)]
    assert pipe.finalize_variable_values()[0][0] == 7.5


def test_none_gradient_skips_update_but_not_ema_and_reset() -> None:
    """§5.1 step 1: a None gradient drops that variable from accumulation and update, but the EMA covers
    all variables and the accumulator reset at an update step zeroes every accumulator."""
    pipe = KerasPipeline(
        [np.array([1.0]), np.array([2.0])], SGDRule([(1,), (1,)]), learning_rate=0.5,
        gradient_accumulation_steps=2, use_ema=True, ema_momentum=0.5,
    )
    pipe.apply([np.array([1.0]), np.array([4.0])])
    pipe.apply([np.array([1.0]), None])
    assert pipe.accumulated_gradients is not None and pipe.averages is not None
    np.testing.assert_array_equal(pipe.variables[0], [0.5])  # 1 - .5 * (1+1)/2
    np.testing.assert_array_equal(pipe.variables[1], [2.0])  # untouched
    np.testing.assert_array_equal(pipe.accumulated_gradients[1], [0.0])  # reset anyway
    np.testing.assert_array_equal(pipe.averages[1], [2.0])


def test_make_keras_optimizer_rejects_unknown() -> None:
    with pytest.raises(NotImplementedError):
        make_keras_optimizer("SGD", [np.zeros(2)], momentum=0.9)
    with pytest.raises(TypeError):
        make_keras_optimizer("Adam", [np.zeros(2)], bogus=1)
    pipe, rule = make_keras_optimizer("Adafactor", [np.zeros((2, 3))], learning_rate=lambda it: 0.1)
    assert isinstance(rule, AdafactorRule) and rule.hparams["lr_is_schedule"]
    assert pipe.learning_rate == 0.1


# ----------------------------------------------------------------------------------------------
# 3. Live Keras 3 (torch back end) vs the reference
# ----------------------------------------------------------------------------------------------
_KERAS_WORKER = textwrap.dedent(
    """
    import json, sys  # KERAS_BACKEND is set by the parent process
    import numpy as np
    import keras
    from keras import ops
    keras.config.set_floatx("float64")
    SLOT_ATTRS = {"Adafactor": ["_r", "_c", "_v"], "Adam": ["_momentums", "_velocities"],
                  "Adagrad": ["_accumulators"], "Ftrl": ["_accumulators", "_linears"], "SGD": []}

    def np64(x):
        return np.asarray(ops.convert_to_numpy(x), dtype=np.float64).tolist()

    out = {"keras_version": keras.__version__, "backend": keras.backend.backend(), "runs": []}
    for run in json.load(sys.stdin):
        kw = dict(run["kwargs"])
        sched = kw.pop("schedule", None)
        if sched is not None:
            kw["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(**sched)
        opt = getattr(keras.optimizers, run["optimizer"])(**kw)
        vs = [keras.Variable(np.array(v, dtype=np.float64), dtype="float64", name=f"w{i}")
              for i, v in enumerate(run["variables"])]
        steps = []
        for grads in run["grads"]:
            opt.apply([None if g is None else ops.convert_to_tensor(np.array(g, dtype=np.float64)) for g in grads],
                      vs)
            rec = {"variables": [np64(v) for v in vs], "iterations": int(np64(opt._iterations)),
                   "public_iterations": int(np64(opt.iterations)), "slots": []}
            for v in vs:
                i = opt._get_variable_index(v)
                rec["slots"].append({a.lstrip("_"): np64(getattr(opt, a)[i]) for a in SLOT_ATTRS[run["optimizer"]]})
            if opt.use_ema:
                rec["averages"] = [np64(a) for a in opt._model_variables_moving_average]
            if opt.gradient_accumulation_steps:
                rec["accumulated"] = [np64(a) for a in opt._accumulated_gradients]
            steps.append(rec)
        opt.finalize_variable_values(vs)
        out["runs"].append({"steps": steps, "final": [np64(v) for v in vs]})
    json.dump(out, sys.stdout)
    """
)

# Every hyperparameter is a dyadic rational: Keras's TF back end casts Python-float hyperparameters
# (betas, epsilon, initial accumulator, weight decay, EMA momentum, schedule arithmetic) to float32
# before casting them to the variable dtype, so only float32-exact values keep the run exactly float64.
LIVE_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "Adafactor": {"clip_threshold": 0.75, "epsilon_2": 2.0**-7, "beta_2_decay": -0.75},
    "Adam": {"beta_1": 0.75, "beta_2": 0.9375, "epsilon": 2.0**-10},
    "Adagrad": {"initial_accumulator_value": 0.25},
    "Ftrl": {"l1_regularization_strength": 2.0**-7, "l2_regularization_strength": 2.0**-6, "beta": 0.125,
             "l2_shrinkage_regularization_strength": 2.0**-5, "learning_rate_power": -0.625,
             "initial_accumulator_value": 0.125},
    "SGD": {},
}


def _live_cases() -> list[dict[str, Any]]:
    """Three random float64 cases: a [5, 4] and a 1-D variable, gradients with a zero row / element.

    The staircase ExponentialDecay halves the lr every 2 RAW calls, so with k = 3 it differs from a
    schedule driven by the floored iteration count (§5.1 step 3).
    """
    cases = []
    specs: list[tuple[str, dict[str, Any], int, float, bool]] = [
        # name, base kwargs, calls, gradient multiplier, a None gradient for the 1-D var on call 5 (an update call)
        ("clipnorm+ema_overwrite2+accum2",
         {"learning_rate": 0.25, "clipnorm": 0.5, "use_ema": True, "ema_momentum": 0.75,
          "ema_overwrite_frequency": 2, "gradient_accumulation_steps": 2}, 7, 1.0, False),
        ("global_clipnorm+weight_decay+loss_scale+schedule",
         {"schedule": {"initial_learning_rate": 0.25, "decay_steps": 2, "decay_rate": 0.5, "staircase": True},
          "global_clipnorm": 0.75, "weight_decay": 0.0625, "loss_scale_factor": 64.0}, 5, 64.0, False),
        ("clipvalue+ema_overwrite3+accum3+weight_decay+schedule+None_grad",
         {"schedule": {"initial_learning_rate": 0.25, "decay_steps": 2, "decay_rate": 0.5, "staircase": True},
          "clipvalue": 0.375, "use_ema": True, "ema_momentum": 0.875, "ema_overwrite_frequency": 3,
          "gradient_accumulation_steps": 3, "weight_decay": 0.125}, 8, 1.0, True),
    ]
    for seed, (name, base, calls, mult, with_none) in enumerate(specs):
        rng = np.random.default_rng(1234 + seed)
        w2, w1 = rng.normal(size=(5, 4)), rng.normal(size=(6,))
        grads = []
        for n in range(calls):
            g2, g1 = rng.normal(scale=0.5, size=(5, 4)) * mult, rng.normal(scale=0.5, size=(6,)) * mult
            g2[2] = 0.0  # an untouched embedding row
            g1[n % 6] = 0.0
            grads.append([g2.tolist(), None if (with_none and n == 5) else g1.tolist()])
        for opt, hp in LIVE_OPTIMIZERS.items():
            cases.append({"name": f"{opt}:{name}", "optimizer": opt, "kwargs": {**base, **hp},
                          "variables": [w2.tolist(), w1.tolist()], "grads": grads})
    return cases


def _reference_run(run: dict[str, Any]) -> tuple[list[dict[str, Any]], list[np.ndarray], KerasPipeline]:
    kw = dict(run["kwargs"])
    sched = kw.pop("schedule", None)
    if sched is not None:
        lr0, ds, rate = sched["initial_learning_rate"], sched["decay_steps"], sched["decay_rate"]
        staircase = sched.get("staircase", False)
        kw["learning_rate"] = lambda it: lr0 * rate ** (it // ds if staircase else it / ds)  # ExponentialDecay
    pipe, rule = make_keras_optimizer(run["optimizer"], [np.array(v) for v in run["variables"]], **kw)
    steps = []
    for grads in run["grads"]:
        pipe.apply([None if g is None else np.array(g) for g in grads])
        steps.append({
            "variables": [w.copy() for w in pipe.variables],
            "iterations": pipe.raw_iterations,
            "public_iterations": pipe.iterations,
            "slots": [{k: v.copy() for k, v in s.items()} for s in rule.slots],
            "averages": None if pipe.averages is None else [a.copy() for a in pipe.averages],
            "accumulated": None if pipe.accumulated_gradients is None else [a.copy() for a in pipe.accumulated_gradients],
        })
    return steps, pipe.finalize_variable_values(), pipe


def _demoted(run: dict[str, Any]) -> bool:
    """True when Keras's torch back end rounds an intermediate of this run to float32.

    Keras 3's ``result_type`` maps float64 to float32 on every back end except TensorFlow ("aligned
    with JAX's default"), so ``ops.minimum``/``ops.maximum`` return float32 even for two float64
    inputs. They appear in ``clipnorm`` (``max(||g||, c)``), ``global_clipnorm`` (``min(1/n, 1/c)``)
    and Adafactor (``rho``, ``alpha``, ``max(1, RMS(u)/d)``); everything else stays float64.
    """
    kw = run["kwargs"]
    return run["optimizer"] == "Adafactor" or bool(kw.get("clipnorm")) or bool(kw.get("global_clipnorm"))


@pytest.fixture(scope="module", params=["torch", "tensorflow"])
def live_keras(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Run every live case through real Keras 3 on one back end, in a subprocess."""
    backend = request.param
    if importlib.util.find_spec("keras") is None or importlib.util.find_spec(backend) is None:
        pytest.skip(f"keras (3.x) and {backend} are needed for the live comparison on the {backend} back end")
    cases = _live_cases()
    env = {**os.environ, "KERAS_BACKEND": backend, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"}
    with tempfile.TemporaryDirectory() as home:
        env["KERAS_HOME"] = home
        proc = subprocess.run(
            [sys.executable, "-c", _KERAS_WORKER], input=json.dumps(cases), env=env,
            capture_output=True, text=True, timeout=600,
        )
    if proc.returncode != 0 and "No module named 'keras'" in proc.stderr:
        pytest.skip(f"keras not importable: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    if not out["keras_version"].startswith("3."):
        pytest.skip(f"needs Keras 3, found {out['keras_version']}")
    assert out["backend"] == backend
    return {"cases": cases, **out}


LIVE_NAMES = [c["name"] for c in _live_cases()]


@pytest.mark.parametrize("index", range(len(LIVE_NAMES)), ids=LIVE_NAMES)
def test_reference_matches_live_keras(live_keras: dict[str, Any], index: int) -> None:
    """Every variable, slot, EMA average, accumulator and both iteration counters after every call, plus
    ``finalize_variable_values()``: 1e-9 (TF back end, or torch where Keras stays in float64), else 1e-6."""
    run, got = live_keras["cases"][index], live_keras["runs"][index]
    tol = DEMOTED_TOL if live_keras["backend"] != "tensorflow" and _demoted(run) else LIVE_TOL
    steps, final, _ = _reference_run(run)
    worst = 0.0
    for n, (want, ref) in enumerate(zip(got["steps"], steps, strict=True)):
        assert want["iterations"] == ref["iterations"] == n + 1
        assert want["public_iterations"] == ref["public_iterations"]
        for a, b in zip(want["variables"], ref["variables"], strict=True):
            worst = max(worst, _max_abs(a, b))
        for ks, rs in zip(want["slots"], ref["slots"], strict=True):
            assert set(ks) == set(rs)
            for k in ks:
                worst = max(worst, _max_abs(ks[k], rs[k]))
        for key in ("averages", "accumulated"):
            assert (key in want) == (ref[key] is not None)
            for a, b in zip(want.get(key, []), ref[key] or [], strict=True):
                worst = max(worst, _max_abs(a, b))
    for a, b in zip(got["final"], final, strict=True):
        worst = max(worst, _max_abs(a, b))
    assert worst <= tol, f"{live_keras['backend']} {run['name']}: max |keras - reference| = {worst:.3e} > {tol:.0e}"
