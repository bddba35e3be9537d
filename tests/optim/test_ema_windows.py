"""EMA under gradient accumulation counts the calls of applied windows (issue [hardening4] item 7).

``skip_nonfinite`` drops a whole accumulation window when any of its micro-batches is non-finite (the check
runs on the window's sum, at its last call). On main the EMA counter still counted the window's ``k − 1``
accumulate-only calls and the dense averages had moved in them (Keras averages at every call): the moving
averages ended 0.157 off the run without that window. Now a dropped window is as if it had not happened: weights, slots and every moving
average (lazy tables caught up, dense parameters) equal, bit for bit, the run that never saw it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from optim_registry import OPTIMIZER_INFOS, OptimizerInfo
from test_optim_faults import forward_backward, two_tables

MU = 0.7


def run(info: OptimizerInfo, steps: list[int], nan_at: int | None, k: int) -> tuple[Any, Any, Any]:
    ec, head = two_tables()
    opt = info.cls([*ec.parameters(), *head.parameters()], **info.default, use_ema=True, ema_momentum=MU,
                   skip_nonfinite=True, gradient_accumulation_steps=k)
    for s in steps:
        forward_backward(ec, head, s)
        if s == nan_at:
            head.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    return ec, head, opt


# the third window: after the first, whose momentum is 0, every average equals its weight (nothing to see)
@pytest.mark.parametrize("k,nan_at", [(2, 4), (2, 5), (3, 7), (3, 8)], ids=["k2-first", "k2-last", "k3-middle",
                                                                            "k3-last"])
@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=lambda i: i.name)
def test_a_dropped_window_is_as_if_it_never_happened(info: OptimizerInfo, k: int, nan_at: int) -> None:
    window = range(nan_at - nan_at % k, nan_at - nan_at % k + k)
    steps = list(range(5 * k))
    ec_a, head_a, opt_a = run(info, steps, nan_at, k)
    ec_b, head_b, opt_b = run(info, [s for s in steps if s not in window], None, k)
    assert opt_a.skipped_steps == 1
    for (name, v), w in zip(ec_a.state_dict().items(), ec_b.state_dict().values(), strict=True):
        assert torch.equal(v, w), name
    assert torch.equal(head_a.weight, head_b.weight)
    for p, q in ((ec_a.tables.a.weight, ec_b.tables.a.weight), (ec_a.tables.b.weight, ec_b.tables.b.weight),
                 (head_a.weight, head_b.weight), (head_a.bias, head_b.bias)):
        assert torch.equal(opt_a.moving_average(p), opt_b.moving_average(q))


@pytest.mark.parametrize("k", [2, 3])
def test_a_dense_average_mid_window_is_keras_per_call_average(k: int) -> None:
    """Without a dropped window nothing changes: Keras's per-call EMA of a dense parameter, in float64, after
    every call (accumulate-only calls included)."""
    info = next(i for i in OPTIMIZER_INFOS if i.name == "adam")
    ec, head = two_tables()
    opt = info.cls([*ec.parameters(), *head.parameters()], **info.default, use_ema=True, ema_momentum=MU,
                   gradient_accumulation_steps=k)
    avg = None
    for it in range(4 * k):
        forward_backward(ec, head, it)
        opt.step()
        opt.zero_grad()
        m = 0.0 if it // k == 0 else MU
        w = head.weight.detach().clone()
        avg = w if avg is None else m * avg + (1 - m) * w
        torch.testing.assert_close(opt.moving_average(head.weight), avg, rtol=1e-13, atol=1e-15)
    assert math.isfinite(float(avg.sum()))


@pytest.mark.parametrize("info", [i for i in OPTIMIZER_INFOS if i.name in ("adam", "sgd")], ids=lambda i: i.name)
def test_a_load_forgets_the_window_record_of_the_run_before(info: OptimizerInfo) -> None:
    """An optimizer that recorded its non-lazy averages at a window's first call (call 4 of windows of 2), then loads
    a checkpoint saved mid-window (after call 2 of another run), whose last call is then dropped: it goes on as a fresh
    optimizer loaded with the same checkpoint (which has no record: the window keeps its averages, the documented
    case), not back to the record of its own run before the load (which it took before: another run's averages)."""
    ec, head = two_tables()
    saver = info.cls([*ec.parameters(), *head.parameters()], **info.default, use_ema=True, ema_momentum=MU,
                     skip_nonfinite=True, gradient_accumulation_steps=2)
    for s in range(3):
        forward_backward(ec, head, s)
        saver.step()
        saver.zero_grad()
    ckpt = {"model": copy.deepcopy(ec.state_dict()), "head": copy.deepcopy(head.state_dict()),
            "opt": copy.deepcopy(saver.state_dict())}
    runs = []
    for before in (0, 5):  # a fresh optimizer, and one that trained 5 calls (on other data) first
        ec, head = two_tables()
        opt = info.cls([*ec.parameters(), *head.parameters()], **info.default, use_ema=True, ema_momentum=MU,
                       skip_nonfinite=True, gradient_accumulation_steps=2)
        for s in range(before):
            forward_backward(ec, head, 100 + s)
            opt.step()
            opt.zero_grad()
        ec.load_state_dict(ckpt["model"])
        head.load_state_dict(ckpt["head"])
        opt.load_state_dict(ckpt["opt"])
        forward_backward(ec, head, 3)
        head.weight.grad[0, 0] = float("nan")  # the window of calls 2-3 dropped at its last call
        opt.step()
        opt.zero_grad()
        assert opt.skipped_steps == 1
        runs.append((head, opt))
    (fresh, fresh_opt), (used, used_opt) = runs
    for p, q in ((fresh.weight, used.weight), (fresh.bias, used.bias)):
        assert torch.equal(p, q)
        assert torch.equal(fresh_opt.moving_average(p), used_opt.moving_average(q))
