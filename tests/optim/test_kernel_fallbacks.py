"""When the kernel row update (``Path.KERNEL``, ``optim/_kernels/row_update.py``) cannot run: a compile that fails,
no C++ compiler, a step under a ``TorchDispatchMode``, a recompile limit hit later. Each falls back to the reference
path with one warning at most and the reference path's numbers (tests/optim/test_kernel_update.py compares the kernel
itself with that path)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import test_kernel_update
import torch
from optim_registry import KERNEL_PATH, cases
from test_kernel_update import CASES, _tensors, assert_same, model, needs_compiler, step

from torch_tpu_embedding.optim._core.update_paths import Path
from torch_tpu_embedding.optim._kernels import kernel_policy, row_update

# test_kernel_update's fixtures, which pytest finds here by these names: kernel_from_the_first_step (autouse) and
# kernel_on
kernel_from_the_first_step = test_kernel_update.kernel_from_the_first_step
kernel_on = test_kernel_update.kernel_on


@pytest.mark.parametrize("built_before", [False, True], ids=["first-build", "after-a-build"])
def test_a_failed_compile_warns_once_and_runs_the_reference_path(built_before: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that does not build: one warning, the reference path, the same results. If it was the
    process's first build (a broken toolchain, say) the path is off for every later step; after a
    successful build, only that configuration runs the reference path."""
    cfg = next(c for c in cases(KERNEL_PATH) if c.id == "adagrad")

    def broken(fn: Any, **kwargs: Any) -> Any:
        def fail(*args: Any) -> None:
            raise RuntimeError("LoweringException: something inductor cannot lower")
        return fail

    monkeypatch.setattr(row_update, "_KERNELS", {("built before",): lambda: None} if built_before else {})
    monkeypatch.setattr(kernel_policy, "_WARNED", False)
    monkeypatch.setattr(kernel_policy, "_NO_COMPILER", False)
    monkeypatch.setattr(torch, "compile", broken)
    ref, got = model(cfg, torch.float32), model(cfg, torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            ran = step(*got, s, 1.0, kernel=True)
            assert Path.KERNEL not in ran and Path.ROW_CHUNKS in ran
            step(*ref, s, 1.0, kernel=False)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "could not be compiled" in msgs[0] and "something inductor cannot lower" in msgs[0]
    assert kernel_policy._NO_COMPILER is not built_before
    for (a, sa), (b, sb) in zip(_tensors(*got), _tensors(*ref), strict=True):
        assert torch.equal(a, b) and all(torch.equal(sa[n], sb[n]) for n in sa)


@needs_compiler
def test_a_step_under_a_dispatch_mode_updates_its_rows_once_on_the_reference_path(kernel_on: None,
                                                                                   monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    """A step under a TorchDispatchMode (torch's FLOP counter, as a user measuring a step has it): its rows are
    updated once, on the reference path, bitwise as there; the steps after it compile and run the kernel. The
    mode over the process's first compile and over a step after it. (torch 2.13 runs no compiled code under a
    mode: it ran the kernel's Python eagerly, which wrote the rows, then raised: a caught first compile wrote the
    rows twice and turned the kernel path off for the process; a later step raised half applied.)"""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = next(c for c in cases(KERNEL_PATH) if c.id == "adagrad")
    monkeypatch.setattr(row_update, "_KERNELS", {})
    monkeypatch.setattr(kernel_policy, "_NO_COMPILER", False)
    got, ref = model(cfg, torch.float32), model(cfg, torch.float32)
    for s in range(4):
        under = s in (0, 2)
        if under:
            with FlopCounterMode(display=False):
                ran = step(*got, s, 1.0, kernel=True)
            assert Path.KERNEL not in ran and Path.ROW_CHUNKS in ran, (s, ran)
        else:
            ran = step(*got, s, 1.0, kernel=True)
            assert Path.KERNEL in ran, (s, ran)
        step(*ref, s, 1.0, kernel=False)
        pairs = list(zip(_tensors(*got), _tensors(*ref), strict=True))
        if under:  # the same path from the same state
            assert all(torch.equal(a, b) and all(torch.equal(sa[n], sb[n]) for n in sa) for (a, sa), (b, sb) in pairs)
        assert_same(got, ref, f"call {s}")
        with torch.no_grad():  # (each call from the same state, as run_lockstep)
            for (a, sa), (b, sb) in pairs:
                a.copy_(b)
                for n in sa:
                    sa[n].copy_(sb[n])
    assert not kernel_policy._NO_COMPILER and row_update.compiled_kernels() >= 1


def test_without_a_cxx_compiler_one_warning_and_the_reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """inductor's compiler set to one that does not exist (as on a machine without g++): the first
    step warns once and every optimizer runs the reference path, no compile attempted; results are
    bitwise those of the reference path."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/g++"))
    monkeypatch.setattr(row_update, "_KERNELS", {})
    monkeypatch.setattr(kernel_policy, "_WARNED", False)
    monkeypatch.setattr(kernel_policy, "_NO_COMPILER", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("adagrad", "lazy_adam"):
            cfg = next(c for c in cases(KERNEL_PATH) if c.id == name)
            ref, got = model(cfg, torch.float32), model(cfg, torch.float32)
            for s in range(3):
                ran = step(*got, s, 1.0, kernel=True)
                assert Path.KERNEL not in ran and Path.ROW_CHUNKS in ran
                step(*ref, s, 1.0, kernel=False)
            for (a, sa), (b, sb) in zip(_tensors(*got), _tensors(*ref), strict=True):
                assert torch.equal(a, b) and all(torch.equal(sa[n], sb[n]) for n in sa)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "could not be compiled" in msgs[0] and "/nonexistent/g++" in msgs[0], msgs
    assert kernel_policy._NO_COMPILER and row_update.compiled_kernels() == 0


@needs_compiler
def test_a_recompile_limit_hit_later_sends_that_table_to_the_reference_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a kernel run out of torch.compile's recompiles (a shape it had to specialise, say), the
    guards raise before the kernel runs, and that table's update (this step and later ones) takes the
    reference path, with the reference path's numbers."""
    cfg = next(c for c in CASES if c.id == "adagrad")
    ours, ref = model(cfg, torch.float32), model(cfg, torch.float32)
    assert step(*ours, 0, 1.0, kernel=True)[0] is Path.KERNEL  # the table: compiled and run once
    real = row_update.call
    calls = []

    def limit_hit(fn: Any, args: Any) -> None:
        calls.append(1)
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")

    monkeypatch.setattr(row_update, "call", limit_hit)
    step(*ours, 1, 1.0, kernel=True)
    step(*ours, 2, 1.0, kernel=True)
    assert len(calls) == 1  # the second step did not try the kernel again
    monkeypatch.setattr(row_update, "call", real)
    for s in range(3):
        step(*ref, s, 1.0, kernel=s == 0)
    assert_same(ours, ref, "after the fallback")
