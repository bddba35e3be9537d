"""``tte.TrainPipeline.state_dict()`` after a step that raised: a job stopped by an error (or an interrupt) saves what
it has. A step that raised before its update wrote no table, slot or counter, so its state is the last completed
step's, bit for bit, and resumes to the run that never failed; after an optimizer's ``step()`` raised, the update may
be applied in part, so ``state_dict()`` refuses, saying what to do."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from suite_helpers import pipeline_batches, same_tree, train_by_hand
from test_pipeline_lifecycle import _model, _opts, _step, _threads

import torch_tpu_embedding as tte

N, FAIL = 7, 2  # batches; the step that raises (steps 0 and 1 done before it)
DATA = pipeline_batches(N, seed=31)


def _saved(model: Any, opts: list[torch.optim.Optimizer], pipe: tte.TrainPipeline) -> tuple[dict[str, Any], list[int]]:
    """The checkpoint a job writes (the model's, the optimizers' and the pipeline's state, through ``torch.save``),
    and the batches a run resumed from it trains, in order, by identity: the unfinished ones, then the source from
    ``taken`` on."""
    state = pipe.state_dict()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opts": [o.state_dict() for o in opts], "pipe": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False), [id(b) for b in [*state["unfinished"], *DATA[state["taken"]:]]]


@pytest.mark.parametrize("where", ["loss", "before_update"])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("stale", [False, True], ids=["exact", "pipelined"])
def test_a_step_that_raised_before_its_update_saves_the_last_completed_steps_state(
        stale: bool, prefetch: bool, where: str) -> None:
    """Step 2 raises in its loss (after its lookup and, pipelined, the lookup ahead of batch 3) or in
    ``before_update`` (after its backward). The checkpoint then taken (it was refused: 'state_dict() is taken between
    steps') equals, to the bit, the one taken by a run that stopped after step 1: tables, optimizer slots and
    counters, ``steps``, the activations looked up ahead for batch 2 (pipelined), and the batches a resumed run
    trains. Resumed, it equals the plain loop (TF's one-step-stale schedule written out by hand) over every batch."""
    data = DATA
    flags = {"prefetch": prefetch, "pipeline_execution_with_tensor_core": stale}

    stopped = _model()
    opts = _opts(stopped)
    pipe = tte.TrainPipeline(stopped, opts, step=_step, features=lambda b: b["sparse"], **flags)
    it = iter(data)
    for _ in range(FAIL):
        pipe.progress(it)
    want, want_stream = _saved(stopped, opts, pipe)
    pipe.close()

    model = _model()
    opts = _opts(model)
    calls: list[Any] = []

    def step(m: Any, batch: Any) -> torch.Tensor:
        calls.append(batch)
        loss = _step(m, batch)
        if where == "loss" and len(calls) == FAIL + 1:
            raise RuntimeError("preempted")
        return loss

    def before_update() -> None:
        if where == "before_update" and len(calls) == FAIL + 1:
            raise RuntimeError("preempted")

    pipe = tte.TrainPipeline(model, opts, step=step, features=lambda b: b["sparse"], before_update=before_update,
                             **flags)
    with pytest.raises(RuntimeError, match="preempted"):
        for _ in pipe.run(iter(data)):
            pass
    assert not _threads() and pipe.unfinished()[0] is data[FAIL]
    got, got_stream = _saved(model, opts, pipe)

    assert same_tree(got["model"], want["model"]) and same_tree(got["opts"], want["opts"])
    assert got["pipe"]["steps"] == want["pipe"]["steps"] == FAIL
    assert (got["pipe"]["outputs_ahead"] is None) == (not stale)
    assert same_tree(got["pipe"]["outputs_ahead"], want["pipe"]["outputs_ahead"])
    assert got_stream == want_stream == [id(b) for b in data[FAIL:]]

    resumed = _model()
    resumed.load_state_dict(got["model"])
    ropts = _opts(resumed)
    for o, s in zip(ropts, got["opts"], strict=True):
        o.load_state_dict(s)
    rpipe = tte.TrainPipeline(resumed, ropts, step=_step, features=lambda b: b["sparse"], **flags)
    rpipe.load_state_dict(got["pipe"])
    assert sum(1 for _ in rpipe.run(data[got["pipe"]["taken"]:])) == N - FAIL and rpipe.steps == N
    plain = _model()
    train_by_hand(plain, _opts(plain), data, _step, stale=stale)
    assert same_tree(resumed.state_dict(), plain.state_dict())


class _FailingSGD(torch.optim.SGD):
    """SGD whose ``step()`` raises at its call ``fail`` (counted from 0), after the table optimizer's update."""

    def __init__(self, params: Any, fail: int) -> None:
        super().__init__(params, lr=0.05)
        self.calls, self.fail = 0, fail

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.calls += 1
        if self.calls == self.fail + 1:
            raise RuntimeError("the dense optimizer failed")
        return super().step(closure)


@pytest.mark.parametrize("stale", [False, True], ids=["exact", "pipelined"])
def test_state_dict_after_an_optimizer_raised_is_refused_saying_what_to_do(stale: bool) -> None:
    """Step 2's table optimizer updates its rows, then the dense one raises: the tables hold update 2 and the dense
    layer does not, no checkpoint of any step, so ``state_dict()`` raises naming the step and what to do (before, it
    saved that half of an update as step 2's). Trained on, a step later it saves again."""
    data = pipeline_batches(5, seed=32)
    model = _model()
    tables, dense = tte.split_parameters(model)
    opts = [tte.optim.Adagrad(tables, lr=0.1), _FailingSGD(dense, fail=FAIL)]
    pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=stale)
    it = iter(data)
    for _ in range(FAIL):
        pipe.progress(it)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="the dense optimizer failed"):
        pipe.progress(it)
    after = model.state_dict()
    assert not torch.equal(after["ec.tables.t1.weight"], before["ec.tables.t1.weight"])  # update 2 in part:
    assert torch.equal(after["head.weight"], before["head.weight"])  # the tables', not the dense layer's
    with pytest.raises(RuntimeError, match=r"TrainPipeline\.state_dict\(\): an optimizer's step\(\) raised in step 2, "
                                           r"so the tables and the optimizers' state may hold part of its update .*"
                                           r"Resume from the last checkpoint, or train on"):
        pipe.state_dict()
    pipe.progress(it)
    assert pipe.state_dict()["steps"] == FAIL + 2
    pipe.close()
