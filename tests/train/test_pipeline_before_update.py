"""``tte.TrainPipeline(before_update=...)``: a gradient clip between the backward and the optimizers' ``step()``
equals the plain loop that clips there (bitwise, prefetch on and off) and TF's one-step-stale schedule written out by
hand with the same clip (float64); one that raises leaves the pipeline as a loss that raises does."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from suite_helpers import pipeline_batches, train_by_hand
from test_pipeline import _equal
from test_pipeline_lifecycle import _model, _opts, _step, _threads

import torch_tpu_embedding as tte

MAX_NORM = 0.5


def _clipping(model: torch.nn.Module, norms: list[float]) -> Any:
    """``tte.clip_grad_norm_`` over every parameter (the tables' row gradients included), each norm recorded."""
    return lambda: norms.append(float(tte.clip_grad_norm_(model.parameters(), MAX_NORM)))


def _by_hand(data: list[Any], stale: bool, clip: bool = True) -> tuple[torch.nn.Module, list[float]]:
    model, norms = _model(), []
    train_by_hand(model, _opts(model), data, _step, stale=stale, clip=_clipping(model, norms) if clip else None)
    return model, norms


def _same(model: torch.nn.Module, want: torch.nn.Module) -> None:
    for name, value in want.state_dict().items():
        got = model.state_dict()[name]
        assert torch.equal(got, value), f"{name}: max diff {(got - value).abs().max()}"


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_gradient_clip_before_the_update_equals_the_loop_that_clips(stale: bool, prefetch: bool) -> None:
    """The plain loop ``backward(); clip_grad_norm_(...); step(); zero_grad()`` (pipelined execution: the same with
    each lookup reading the tables before the previous update), bitwise, each step's norm the same too."""
    data = pipeline_batches(7, seed=21)
    want, want_norms = _by_hand(data, stale)
    # (the clip scales: most norms are above MAX_NORM, and the run differs from the one without it)
    assert sum(n > MAX_NORM for n in want_norms) >= 4, want_norms
    assert not torch.equal(_by_hand(data, stale, clip=False)[0]["head"].weight, want["head"].weight)
    model, norms = _model(), []
    pipe = tte.TrainPipeline(model, _opts(model), step=_step, features=lambda b: b["sparse"], prefetch=prefetch,
                             pipeline_execution_with_tensor_core=stale, before_update=_clipping(model, norms))
    assert sum(1 for _ in pipe.run(data)) == 7 and pipe.steps == 7
    assert norms == want_norms
    _same(model, want)


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_before_update_that_raises_leaves_the_state_a_failed_loss_leaves(stale: bool, prefetch: bool) -> None:
    """At the third step, ``before_update`` clips and then raises (its gradients computed and scaled), and in another
    pipeline the loss raises instead: both stop with the same tables, optimizer state, gradients (none), counts and
    unfinished batches (the failed one first). Each goes on to the run that never failed: the failed batch trained
    again from no gradient."""
    data = pipeline_batches(6, seed=22)
    flags = {"prefetch": prefetch, "pipeline_execution_with_tensor_core": stale}
    want = _by_hand(data, stale)[0]
    stopped = []
    for where in ("loss", "before_update"):
        model = _model()
        clip = _clipping(model, [])
        count = {"updates": 0, "armed": True}

        def step(model: Any, batch: Any, where: str = where, count: dict[str, Any] = count) -> torch.Tensor:
            loss = _step(model, batch)
            if where == "loss" and count["armed"] and count["updates"] == 2:
                raise RuntimeError("failed at the third step")
            return loss

        def before_update(where: str = where, count: dict[str, Any] = count, clip: Any = clip) -> None:
            clip()
            if where == "before_update" and count["armed"] and count["updates"] == 2:
                raise RuntimeError("failed at the third step")
            count["updates"] += 1

        opts = _opts(model)
        pipe = tte.TrainPipeline(model, opts, step=step, features=lambda b: b["sparse"], before_update=before_update,
                                 **flags)
        it = iter(data)
        with pytest.raises(RuntimeError, match="failed at the third step"):
            for _ in pipe.run(it):
                pass
        assert not _threads() and pipe.steps == 2 and pipe.unfinished()[0] is data[2]
        assert all(p.grad is None for p in model.parameters())
        state = pipe.state_dict()  # (the state after step 1: tests/train/test_pipeline_failed_state.py)
        left = state["unfinished"]
        assert state["steps"] == 2 and left == pipe.unfinished() and state["taken"] == 2 + len(left)
        stopped.append(({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy([o.state_dict() for o in opts]),
                        [id(b) for b in pipe.unfinished()]))
        count["armed"] = False
        assert sum(1 for _ in pipe.run(it)) == 4 and pipe.steps == 6 and pipe.unfinished() == []
        _same(model, want)
    (loss_model, loss_opts, loss_left), (hook_model, hook_opts, hook_left) = stopped
    # Each leaves the stream from the failed batch on: how many of them the prefetch thread had taken by then
    # depends on the machine's load, not on where the step failed.
    # (the pipeline's own count of batches taken moves with that thread too: state_dict()'s `taken`, checked above for
    # each run, is the count a resumed run starts from)
    for left in (loss_left, hook_left):
        assert left == [id(b) for b in data[2:2 + len(left)]]
    _equal(hook_model, loss_model)
    _equal(hook_opts, loss_opts)


def test_a_before_update_that_is_not_callable_is_refused() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"Argument `before_update` must be callable\. Received: 0\.5"):
        tte.TrainPipeline(model, _opts(model), step=_step, features=lambda b: b["sparse"], before_update=0.5)
