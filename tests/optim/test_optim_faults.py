"""Optimizer-core faults found by adversarial testing ([hardening] items 5, 9, 10, 11, 14): each test
shows the clear error or the correct result, and for errors that weights, slots and pending row
gradients are unchanged."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741


def two_tables(dtype: torch.dtype = torch.float64) -> tuple[tte.EmbeddingCollection, torch.nn.Linear]:
    torch.manual_seed(0)
    a = tte.TableConfig(12, 3, name="a", dtype=dtype)
    b = tte.TableConfig(9, 3, name="b", dtype=dtype)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(a, max_ids_per_bag=2), "b": tte.FeatureConfig(b)})
    return ec, torch.nn.Linear(6, 1).to(dtype)


def forward_backward(ec: tte.EmbeddingCollection, head: torch.nn.Linear, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    out = ec({"a": tte.Jagged(torch.randint(0, 12, (5,), generator=g), lengths=torch.tensor([2, 1, 2])),
              "b": torch.randint(0, 9, (3,), generator=g)})
    head(torch.cat([out["a"], out["b"]], 1)).square().sum().backward()


# ------------------------------------------------------------------ item 11: a failing lr callable
def test_failing_lr_callable_consumes_no_gradient() -> None:
    ec, head = two_tables()
    ref_ec, ref_head = copy.deepcopy(ec), copy.deepcopy(head)
    calls = {"n": 0}

    def lr() -> float:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("schedule not ready")
        return 0.1

    opt = O.Adagrad([*ec.parameters(), *head.parameters()], lr=lr)
    ref = O.Adagrad([*ref_ec.parameters(), *ref_head.parameters()], lr=0.1)
    forward_backward(ec, head, 0)
    forward_backward(ref_ec, ref_head, 0)
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    with pytest.raises(RuntimeError, match="schedule not ready"):
        opt.step()
    assert sorted(ec.row_grads()) == ["a", "b"]  # nothing consumed
    assert head.weight.grad is not None
    assert all(torch.equal(v, ec.state_dict()[k]) for k, v in before.items())
    assert len(opt.state) == 0
    opt.step()  # the retry trains every table, as a run that never failed
    ref.step()
    for (k, v), w in zip(ec.state_dict().items(), ref_ec.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    assert torch.equal(head.weight, ref_head.weight)


def collect(opt: Any) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


# ------------------------------------------------------------------ item 14: stacked <-> unstacked with dense params
@pytest.mark.parametrize("stacked_first", [False, True], ids=["unstacked-to-stacked", "stacked-to-unstacked"])
def test_state_moves_between_stacked_and_unstacked_with_dense_parameters(stacked_first: bool) -> None:
    def build(stack: bool) -> tuple[tte.EmbeddingCollection, torch.nn.Linear, Any]:
        torch.manual_seed(0)
        a = tte.TableConfig(12, 3, name="a", dtype=torch.float64)
        b = tte.TableConfig(9, 3, name="b", dtype=torch.float64)
        ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(a, max_ids_per_bag=2), "b": tte.FeatureConfig(b)},
                                     stack_tables=stack)
        head = torch.nn.Linear(6, 1).double()
        return ec, head, O.Adam([*ec.parameters(), *head.parameters()], lr=0.05)  # the documented pattern

    ec, head, opt = build(stacked_first)
    for s in range(3):
        forward_backward(ec, head, s)
        opt.step()
        opt.zero_grad()
    ec2, head2, opt2 = build(not stacked_first)
    ec2.load_state_dict(ec.state_dict())
    head2.load_state_dict(head.state_dict())
    opt2.load_state_dict(opt.state_dict())
    assert sorted(opt2.state_dict()["state"]) == sorted(opt.state_dict()["state"]) == [
        "param:2", "param:3", "table:a", "table:b"]
    for s in range(3, 6):
        for e, h, o in ((ec, head, opt), (ec2, head2, opt2)):
            forward_backward(e, h, s)
            o.step()
            o.zero_grad()
    for (k, v), w in zip(ec.state_dict().items(), ec2.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    assert torch.equal(head.weight, head2.weight)


# ------------------------------------------------------------------ item 10: values that must be refused
BAD_VALUES = [
    ("tensor-lr-nan", O.SGD, {"lr": torch.tensor(float("nan"))}, r"Argument `lr` must be a finite number and >= 0.0. Received: nan"),
    ("tensor-lr-negative", O.Adam, {"lr": torch.tensor(-0.5)}, r"Argument `lr` .* >= 0.0. Received: -0.5"),
    ("tensor-lr-inf", O.Adagrad, {"lr": torch.tensor(float("inf"))}, r"Argument `lr` .* Received: inf"),
    ("adagrad-init-inf", O.Adagrad, {"initial_accumulator_value": float("inf")},
     r"Argument `initial_accumulator_value` must be a positive float. Received: inf"),
    ("ftrl-init-inf", O.FTRL, {"initial_accumulator_value": float("inf")},
     r"Argument `initial_accumulator_value` must be a positive float. Received: inf"),
    ("adam-eps-square-underflows", O.Adam, {"eps": 1e-30},
     r"Argument `eps` must have a square that is > 0 in float32 .* Received: 1e-30"),
    ("adafactor-epsilon1-zero", O.Adafactor, {"epsilon_1": 0.0}, r"Argument `epsilon_1` .* > 0.0. Received: 0.0"),
    ("clipvalue-zero", O.SGD, {"clipvalue": 0.0}, r"Argument `clipvalue` must be a finite number and > 0.0. Received: 0.0"),
]


@pytest.mark.parametrize("cls, kwargs, pattern", [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES])
def test_bad_values_are_refused_at_construction(cls: Any, kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        cls([torch.nn.Parameter(torch.zeros(3, 2))], **kwargs)


def test_adam_eps_square_underflow_is_fine_outside_the_sqrt() -> None:
    O.Adam([torch.nn.Parameter(torch.zeros(3, 2))], eps=1e-30, sum_inside_sqrt=False)


def test_numpy_scalar_learning_rates_are_accepted() -> None:
    import numpy as np

    for lr in (np.float32(0.1), np.float64(0.1), np.int64(1)):
        p = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        opt = O.SGD([p], lr=lr)
        p.grad = torch.ones(2, dtype=torch.float64)
        opt.step()
        assert torch.allclose(p.detach(), torch.full((2,), 1 - float(lr), dtype=torch.float64))


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")], ids=["nan", "negative", "inf"])
@pytest.mark.parametrize("how", ["callable", "tensor-set-later", "scheduler-like"])
def test_bad_learning_rate_at_step_changes_nothing(bad: float, how: str) -> None:
    ec, head = two_tables()
    lr_t = torch.tensor(0.1, dtype=torch.float64)
    calls = iter([0.1, bad])
    lr: Any = {"callable": lambda: next(calls), "tensor-set-later": lr_t, "scheduler-like": 0.1}[how]
    opt = O.Adagrad([*ec.parameters(), *head.parameters()], lr=lr)
    forward_backward(ec, head, 0)
    opt.step()
    opt.zero_grad()
    if how == "tensor-set-later":
        lr_t.fill_(bad)
    elif how == "scheduler-like":
        for g in opt.param_groups:
            g["lr"] = bad
    forward_backward(ec, head, 1)
    weights = {k: v.clone() for k, v in ec.state_dict().items()}
    slots = collect(opt)
    with pytest.raises(ValueError, match=r"Argument `lr` must be a finite number and >= 0.0"):
        opt.step()
    assert all(torch.equal(v, ec.state_dict()[k]) for k, v in weights.items())
    after = opt.state_dict()
    for key, s in slots["state"].items():
        for name, v in s.items():
            assert torch.equal(v, after["state"][key][name]), (key, name)
    assert sorted(ec.row_grads()) == ["a", "b"]  # still pending


def test_state_dict_with_invalid_hyper_parameters_is_refused_and_nothing_changes() -> None:
    ec, head = two_tables()
    opt = O.Adagrad([*ec.parameters(), *head.parameters()], lr=0.1)
    forward_backward(ec, head, 0)
    opt.step()
    sd = opt.state_dict()
    before = collect(opt)
    for key, value, pattern in (("lr", -5, r"group 0: Argument `lr` .* Received: -5"),
                                ("initial_accumulator_value", float("nan"), r"group 0: .*`initial_accumulator_value`"),
                                ("clipvalue", (2.0, 1.0), r"group 0: .*`clipvalue` must have min <= max")):
        bad = copy.deepcopy(sd)
        bad["param_groups"][0][key] = value
        with pytest.raises(ValueError, match=r"Optimizer state does not match: " + pattern):
            opt.load_state_dict(bad)
        after = opt.state_dict()
        assert after["param_groups"] == before["param_groups"]
        for k, s in before["state"].items():
            for name, v in s.items():
                assert torch.equal(v, after["state"][k][name])


# ------------------------------------------------------------------ item 5: skip_nonfinite with EMA
def ema_run(steps: list[int], nan_at: int | None, **extra: Any) -> tuple[Any, Any, Any]:
    ec, head = two_tables()
    opt = O.Adam([*ec.parameters(), *head.parameters()], lr=0.05, use_ema=True, ema_momentum=0.7,
                 skip_nonfinite=True, **extra)
    for s in steps:
        forward_backward(ec, head, s)
        if s == nan_at:
            head.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    return ec, head, opt


def everything(ec: Any, head: Any, opt: Any) -> dict[str, torch.Tensor]:
    out = {f"w/{k}": v.clone() for k, v in ec.state_dict().items()}
    out.update({f"w/head.{k}": v.clone() for k, v in head.state_dict().items()})
    for key, s in opt.state_dict()["state"].items():
        out.update({f"s/{key}/{k}": v.clone() for k, v in s.items()})
    return out


@pytest.mark.parametrize("overwrite", [None, 3], ids=["no-overwrite", "skipped-call-is-an-overwrite-call"])
def test_skipped_call_changes_no_average_and_no_weight(overwrite: int | None) -> None:
    ec, head, opt = ema_run([0, 1], None, ema_overwrite_frequency=overwrite)
    before = everything(ec, head, opt)
    forward_backward(ec, head, 2)
    head.weight.grad[0, 0] = float("nan")
    opt.step()  # the third call: an overwrite call when overwrite == 3
    assert opt.skipped_steps == 1
    after = everything(ec, head, opt)
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k


def test_a_skipped_call_is_as_if_it_never_happened() -> None:
    """Weights, slots and every moving average (tables caught up) equal a run without that call."""
    a = ema_run([0, 1, 2, 3, 4, 5], nan_at=2)
    b = ema_run([0, 1, 3, 4, 5], nan_at=None)
    (ec_a, head_a, opt_a), (ec_b, head_b, opt_b) = a, b
    for (k, v), w in zip(ec_a.state_dict().items(), ec_b.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    for p, q in ((ec_a.tables.a.weight, ec_b.tables.a.weight), (ec_a.tables.b.weight, ec_b.tables.b.weight),
                 (head_a.weight, head_b.weight)):
        assert torch.equal(opt_a.moving_average(p), opt_b.moving_average(q))
    opt_a.finalize_variable_values()
    opt_b.finalize_variable_values()
    assert torch.equal(ec_a.tables.a.weight, ec_b.tables.a.weight)


# ------------------------------------------------------------------ item 9: 16-bit tables update in float32
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_16bit_tables_keep_float32_slots_and_do_not_overflow(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    t = tte.TableConfig(6, 4, name="t", dtype=dtype, combiner="sum")
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
    start = ec.tables.t.weight.detach().float().clone()
    opt = O.Adagrad(ec.parameters(), lr=0.5)
    for _ in range(3):  # gradient 300 per coordinate: g² = 90,000 > float16's largest finite 65,504
        (ec({"f": torch.tensor([1, 2])})["f"].sum() * 300).backward()
        opt.step()
        opt.zero_grad()
    acc = opt.state[ec.tables.t.weight]["accumulators"]
    assert acc.dtype == torch.float32 and torch.isfinite(acc).all()
    torch.testing.assert_close(acc[1], torch.full((4,), 0.1 + 3 * 300.0**2))
    w = ec.tables.t.weight.detach().float()
    # Every step moves the row by lr·300/√a, in float32, then rounds it to 16 bits: it keeps moving.
    moved = sum(0.5 * 300 / (0.1 + k * 300.0**2) ** 0.5 for k in (1, 2, 3))
    tol = 8 * torch.finfo(dtype).eps
    torch.testing.assert_close(start[1] - w[1], torch.full((4,), moved), rtol=tol, atol=tol)
    assert torch.equal(start[0], w[0])  # untouched


def test_16bit_adam_zero_gradient_row_stays_finite() -> None:
    p = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float16))
    opt = O.Adam([p], lr=0.01)  # default eps 1e-7: eps² underflows in float16, not in float32
    p.grad = torch.zeros(3, 2, dtype=torch.float16)
    opt.step()
    assert torch.isfinite(p).all() and torch.equal(p.detach(), torch.ones(3, 2, dtype=torch.float16))


@pytest.mark.parametrize("cls, kwargs", [(O.SGD, {"lr": 0.1}), (O.Adam, {"lr": 0.01}), (O.FTRL, {"lr": 0.1}),
                                         (O.Adafactor, {"lr": 0.05}), (O.Adam, {"lr": 0.01, "lazy_adam": False})],
                         ids=["sgd", "adam", "ftrl", "adafactor", "adam-nonlazy"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_16bit_tables_track_float32(cls: Any, kwargs: dict[str, Any], dtype: torch.dtype) -> None:
    """The 16-bit table equals a float32 table rounded to 16 bits after each step (to a few ulps). Non-lazy Adam
    updates every row from a dense gradient made of the rows (in float32: it once failed at step() with
    ``index_add_(): self (BFloat16) and source (Float) must have the same scalar type``)."""
    runs = {}
    start = torch.randn(20, 4, generator=torch.Generator().manual_seed(0)).to(dtype)
    for dt in (dtype, torch.float32):
        t = tte.TableConfig(20, 4, name="t", dtype=dt, combiner="mean", initializer=start.to(dt))
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=3)})
        opt = cls(ec.parameters(), **kwargs)
        for s in range(4):
            g = torch.Generator().manual_seed(s)
            out = ec({"f": tte.Jagged(torch.randint(0, 20, (7,), generator=g), lengths=torch.tensor([3, 2, 2]))})["f"]
            (out.float() * torch.arange(12.0).reshape(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if dt == torch.float32:
                with torch.no_grad():  # what the 16-bit table stores
                    ec.tables.t.weight.copy_(ec.tables.t.weight.to(dtype).float())
        runs[dt] = ec.tables.t.weight.detach().float()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(runs[dtype], runs[torch.float32], rtol=4 * eps, atol=4 * eps)
