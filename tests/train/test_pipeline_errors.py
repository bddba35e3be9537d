"""``tte.TrainPipeline``'s errors met ahead of their step and kept across a stop: the source's error taken by the
background thread (or by a lookup ahead) before the run stopped is raised when it goes on, at its place; a
``StopIteration`` from the user's code is not read as the end of the batches. Bounds on waits are hang guards."""

from __future__ import annotations

import collections
import copy
import io
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from suite_helpers import pipeline_batches, train_by_hand
from test_pipeline_lifecycle import _model, _opts, _step, _threads

import torch_tpu_embedding as tte
from torch_tpu_embedding.train.restored import restore


def _failing(data: list[Any], raised: threading.Event) -> Iterator[Any]:
    yield from data
    raised.set()
    raise OSError("the reader failed")


def _want(data: list[Any], stale: bool) -> torch.nn.Module:
    plain = _model()
    train_by_hand(plain, _opts(plain), data, _step, stale=stale)
    return plain


@pytest.mark.parametrize("how", ["break", "failed-step", "failed-step-pipelined"])
def test_the_sources_error_taken_before_a_stop_is_raised_when_the_run_goes_on(how: str) -> None:
    """The source raises after batch 2, and the pipeline has met that error (the thread took it, or step 2 looked
    ahead) when the run stops: by a break after step 2, or by step 2 raising. Going on (with the same source, a
    generator now done) trains what was taken, then raises the source's error, as the plain loop would."""
    stale = how == "failed-step-pipelined"
    data = pipeline_batches(3, seed=11)
    raised = threading.Event()
    calls: list[Any] = []

    def step(model: Any, batch: Any) -> torch.Tensor:
        calls.append(batch)
        if len(calls) == 3 and how != "break":
            assert raised.wait(120)  # (the thread, or the lookup ahead, has met the source's error)
            raise RuntimeError("step 2 failed")
        return _step(model, batch)

    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=stale)
    source = _failing(data, raised)
    if how == "break":
        for _ in pipe.run(source):
            if pipe.steps == 3:
                assert raised.wait(120)
                break
    else:
        with pytest.raises(RuntimeError, match="step 2 failed"):
            for _ in pipe.run(source):
                pass
    assert not _threads()
    done = []
    with pytest.raises(OSError, match="the reader failed"):
        for loss in pipe.run(source):
            done.append(loss)
    assert len(done) == (0 if how == "break" else 1) and pipe.steps == 3 and not _threads()
    for name, value in _want(data, stale).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("where", ["step", "features"])
@pytest.mark.parametrize("stale", [False, True])
def test_a_stop_iteration_raised_by_the_users_code_is_an_error_not_the_end(where: str, stale: bool) -> None:
    """``step`` (or ``features``, on the thread or in the lookup ahead) raising ``StopIteration`` at batch 2 (say, a
    ``next()`` on an exhausted iterator of its own): the run raises there, as a generator turns it into a
    RuntimeError; it did end quietly after step 1, as if the batches had run out."""
    data = pipeline_batches(4, seed=12)

    def step(model: Any, batch: Any) -> torch.Tensor:
        if where == "step" and batch is data[2]:
            next(iter(()))
        return _step(model, batch)

    def features(batch: Any) -> Any:
        if where == "features" and batch is data[2]:
            next(iter(()))
        return batch["sparse"]

    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=step, features=features,
                             pipeline_execution_with_tensor_core=stale)
    done = []
    with pytest.raises(RuntimeError, match="StopIteration was raised in step 2 of TrainPipeline") as info:
        for loss in pipe.run(data):
            done.append(loss)
    assert isinstance(info.value.__cause__, StopIteration)
    assert len(done) == 2 and pipe.steps == 2 and not _threads() and pipe.unfinished()[0] is data[2]


@pytest.mark.parametrize("stale", [False, True])
def test_a_step_that_raises_after_its_update_is_counted(stale: bool) -> None:
    """``after_step`` raising after update 1 (say, a logger's write failing): that update is applied and its batch
    spent, so ``steps`` counts it and ``state_dict()`` says ``taken == steps + len(unfinished)`` (it said one step
    fewer: a run resumed from it counts its steps one behind the updates applied). Going on equals the run that never
    failed."""
    data = pipeline_batches(5, seed=13)
    calls = []

    def after() -> None:
        calls.append(None)
        if len(calls) == 2:
            raise OSError("the logger failed")

    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=_step, features=lambda b: b["sparse"], after_step=after,
                             pipeline_execution_with_tensor_core=stale)
    it = iter(data)
    with pytest.raises(OSError, match="the logger failed"):
        for _ in pipe.run(it):
            pass
    state = pipe.state_dict()
    assert pipe.steps == 2 and state["steps"] == 2 and state["taken"] == 2 + len(state["unfinished"])
    assert sum(1 for _ in pipe.run(it)) == 3 and pipe.steps == 5
    for name, value in _want(data, stale).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def _refilling(data: list[Any]) -> Iterator[Any]:
    """A reader that gives every batch in the same tensors, refilled in place (it reuses its buffers)."""
    buffer = copy.deepcopy(data[0])
    for batch in data:
        for name in ("ids", "mask"):
            getattr(buffer["sparse"]["a"], name).copy_(getattr(batch["sparse"]["a"], name))
        buffer["sparse"]["b"].copy_(batch["sparse"]["b"])
        buffer["sparse"]["c"] = batch["sparse"]["c"]
        buffer["label"].copy_(batch["label"])
        yield buffer


@pytest.mark.parametrize(("prefetch", "stale"), [(True, False), (False, True), (True, True)])
def test_a_source_that_refills_its_buffers_is_told_when_batches_are_taken_ahead(prefetch: bool, stale: bool) -> None:
    """Taking batch ``N + 1`` while step ``N`` runs rewrites step ``N``'s tensors when the source reuses them: the run
    raised nothing and trained on the wrong ids and labels (prefetching), or blamed the step or the model
    (pipelined execution). It now raises naming the input, at the step of the batch taken (pipelined execution:
    at step 0, before its forward, whose batch was rewritten when batch 1 was taken). Without taking ahead it
    equals the plain loop."""
    data = pipeline_batches(4, seed=14)
    plain = _model()
    train_by_hand(plain, _opts(plain), data, _step)
    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=_step, features=lambda b: b["sparse"], prefetch=False)
    assert sum(1 for _ in pipe.run(_refilling(data))) == 4
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name

    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=_step, features=lambda b: b["sparse"], prefetch=prefetch,
                             pipeline_execution_with_tensor_core=stale)
    with pytest.raises(ValueError, match=r"Batch 1 from the source holds the tensors of the batch before it, "
                                         r"rewritten \(input `a`\): the source refills the buffers"):
        for _ in pipe.run(_refilling(data)):
            pass
    assert pipe.steps == (0 if stale else 1) and not _threads()


def test_a_second_run_while_one_goes_on_is_refused_and_leaves_it_running() -> None:
    """``run()`` while another ``run()`` of the pipeline is not finished: refused, naming run(), the other left as it
    was (it was refused as a "progress() given another iterator" and stopped the other run's thread)."""
    data = pipeline_batches(4, seed=15)
    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=_step, features=lambda b: b["sparse"])
    first = pipe.run(data)
    next(first)
    (thread,) = _threads()
    with pytest.raises(ValueError, match=r"TrainPipeline.run\(\) was called while another run\(\)"):
        next(pipe.run(data))
    assert _threads() == [thread] and thread.is_alive()
    assert sum(1 for _ in first) == 3 and pipe.steps == 4 and not _threads()
    for name, value in _want(data, False).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_restored_activations_keep_the_forwards_containers() -> None:
    """Activations restored into a step (a checkpoint's, looked up ahead) came back as a plain tuple or dict for a
    namedtuple or OrderedDict of features, where the forward gives the config's own containers."""
    nt = collections.namedtuple("nt", "a b")
    t = tte.TableConfig(10, 2, name="t")
    for config, ids in ((nt(tte.FeatureConfig(t), tte.FeatureConfig(t)), nt(torch.tensor([1]), torch.tensor([2]))),
                        (collections.OrderedDict(b=tte.FeatureConfig(t), a=tte.FeatureConfig(t)),
                         collections.OrderedDict(b=torch.tensor([1]), a=torch.tensor([2])))):
        out = tte.EmbeddingCollection(config)(ids)
        saved = {k: v.detach() + 1 for k, v in out._asdict().items()} if isinstance(out, tuple) else \
            {k: v.detach() + 1 for k, v in out.items()}
        back = restore(out, nt(**saved) if isinstance(out, tuple) else saved)
        assert type(back) is type(out)
        assert all(torch.equal(x, y.detach() + 1) for x, y in zip(
            back if isinstance(back, tuple) else back.values(), out if isinstance(out, tuple) else out.values(),
            strict=True))


@pytest.mark.parametrize("prefetch", [True, False])
def test_an_interrupt_while_the_next_batch_is_looked_up_ahead_keeps_that_batch(prefetch: bool) -> None:
    """With pipelined execution step 2 looks batch 3 up ahead; a ``KeyboardInterrupt`` there (Ctrl-C in
    ``features(batch)``, or in the lookup) dropped batch 3: ``unfinished()`` listed batch 2 then 4, and the run
    that went on trained 5 of 6 batches. Now step 2 is retried with batch 3 after it, and the run equals the
    uninterrupted one."""
    data = pipeline_batches(6, seed=17)
    interrupted = []

    def features(batch: dict[str, Any]) -> Any:
        if batch is data[3] and not interrupted:
            interrupted.append(batch)
            raise KeyboardInterrupt
        return batch["sparse"]

    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=_step, features=features, prefetch=prefetch,
                             pipeline_execution_with_tensor_core=True)
    it = iter(data)
    with pytest.raises(KeyboardInterrupt):
        for _ in pipe.run(it):
            pass
    assert interrupted and pipe.steps == 2 and not _threads()
    assert [id(b) for b in pipe.unfinished()[:2]] == [id(data[2]), id(data[3])]
    assert sum(1 for _ in pipe.run(it)) == 4 and pipe.steps == 6 and pipe.unfinished() == []
    for name, value in _want(data, stale=True).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("prefetch", [True, False])
def test_an_interrupt_in_the_first_step_after_a_restore_keeps_the_restored_activations(prefetch: bool) -> None:
    """Restored from a checkpoint taken after step 3 (pipelined execution), batch 3 is trained with the activations
    saved with it. A ``KeyboardInterrupt`` in that step before its lookup (Ctrl-C in ``features(batch)``) let go of
    them: the run that went on looked batch 3 up afresh, one update too new, and differed from the uninterrupted
    run. Now the retried step uses them."""
    data = pipeline_batches(6, seed=19)
    model = _model()
    opts = _opts(model)
    pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=True)
    run = pipe.run(data)
    for _ in range(3):
        next(run)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opts": [o.state_dict() for o in opts], "pipe": pipe.state_dict()},
               buffer)
    run.close()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    interrupted = []

    def features(batch: dict[str, Any]) -> Any:
        if not interrupted:
            interrupted.append(batch)
            raise KeyboardInterrupt
        return batch["sparse"]

    resumed = _model()
    resumed_opts = _opts(resumed)
    resumed.load_state_dict(saved["model"])
    for opt, state in zip(resumed_opts, saved["opts"], strict=True):
        opt.load_state_dict(state)
    again = tte.TrainPipeline(resumed, resumed_opts, step=_step, features=features, prefetch=prefetch,
                              pipeline_execution_with_tensor_core=True)
    again.load_state_dict(saved["pipe"])
    it = iter(data[saved["pipe"]["taken"]:])
    with pytest.raises(KeyboardInterrupt):
        for _ in again.run(it):
            pass
    assert interrupted and again.steps == 3 and not _threads()
    assert sum(1 for _ in again.run(it)) == 3 and again.steps == 6
    for name, value in _want(data, stale=True).state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


def _concat_step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    x = model["ec"](batch["sparse"], concat=True)  # (a, b, c side by side: the head's 9 inputs)
    return torch.nn.functional.mse_loss(model["head"](torch.tanh(x)).squeeze(1), batch["label"])


@pytest.mark.parametrize("saved_concat", [False, True])
def test_a_state_resumed_with_another_concat_names_it(saved_concat: bool) -> None:
    """A pipelined-execution state holds the activations of its first batch as the lookup gave them: a dict of
    features, or the one tensor of ``concat=True``. Resumed by a pipeline with the other ``concat``, the first step
    raised ``AttributeError: 'dict' object has no attribute 'to'`` (or ``new(): invalid data type 'str'``) from the
    library's internals; it now names the state's key, both layouts and the argument."""
    data = pipeline_batches(4, seed=23)
    model = _model()
    steps = {False: _step, True: _concat_step}
    pipe = tte.TrainPipeline(model, _opts(model), step=steps[saved_concat], features=lambda b: b["sparse"],
                             concat=saved_concat, pipeline_execution_with_tensor_core=True)
    run = pipe.run(data)
    next(run)
    state = copy.deepcopy(pipe.state_dict())
    run.close()
    resumed = _model()
    again = tte.TrainPipeline(resumed, _opts(resumed), step=steps[not saved_concat], features=lambda b: b["sparse"],
                              concat=not saved_concat, pipeline_execution_with_tensor_core=True)
    again.load_state_dict(state)
    with pytest.raises(ValueError, match=r"'outputs_ahead'.*Resume with the `concat`") as raised:
        next(again.run(data[state["taken"]:]))
    layouts = ["`a` [6, 3], `b` [6, 3], `c` [6, 3]", "one tensor of shape [6, 9]"]
    assert f"saved {layouts[saved_concat]}; looked up now {layouts[not saved_concat]}." in str(raised.value)
    assert again.steps == 1 and again.unfinished()[0] is state["unfinished"][0]


class _InterruptedOnce:
    """A reader whose ``next()`` is interrupted once, before batch ``at`` (Ctrl-C while it waits for its data); it
    goes on when asked again, as a DataLoader's iterator does."""

    def __init__(self, data: list[Any], at: int) -> None:
        self.data, self.at, self.i = data, at, 0

    def __iter__(self) -> _InterruptedOnce:
        return self

    def __next__(self) -> Any:
        if self.i == self.at:
            self.at = -1
            raise KeyboardInterrupt
        if self.i == len(self.data):
            raise StopIteration
        self.i += 1
        return self.data[self.i - 1]


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("prefetch", [True, False])
def test_progress_goes_on_after_the_source_is_interrupted(prefetch: bool, stale: bool) -> None:
    """``progress()`` after the source's ``next()`` raised ``KeyboardInterrupt`` raised ``StopIteration``: the
    interrupt had ended the pipeline's chain of the source (or its thread), and the 3 batches still in the source
    were never trained, silently. Now the next call goes on with the source, and the run equals the uninterrupted
    one. (With pipelined execution the interrupt comes in step 2, looking batch 3 up ahead: that step is retried.)"""
    data = pipeline_batches(6, seed=29)
    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=_step, features=lambda b: b["sparse"], prefetch=prefetch,
                             pipeline_execution_with_tensor_core=stale)
    source, interrupts = _InterruptedOnce(data, 3), 0
    while True:
        try:
            pipe.progress(source)
        except StopIteration:
            break
        except KeyboardInterrupt:
            interrupts += 1
    assert interrupts == 1 and pipe.steps == 6 and pipe.unfinished() == [] and not _threads()
    for name, value in _want(data, stale).state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
