"""``tte.TrainPipeline`` around the user's code: a step that edits its batch in place, and a pipeline dropped or left
running when its process ends (no thread kept alive by it)."""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from typing import Any

import pytest
import torch
from suite_helpers import pipeline_batches, run_script, train_by_hand

import torch_tpu_embedding as tte


def _model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    t1 = tte.TableConfig(7, 3, name="t1", dtype=torch.float64)
    t2 = tte.TableConfig(5, 3, name="t2", dtype=torch.float64, combiner="sum")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t1), "b": tte.FeatureConfig(t2), "c": tte.FeatureConfig(t1)})
    return torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(9, 1).double()})


def _opts(model: Any) -> list[torch.optim.Optimizer]:
    tables, dense = tte.split_parameters(model)
    return [tte.optim.Adagrad(tables, lr=0.1), torch.optim.SGD(dense, lr=0.05)]


def _step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    out = model["ec"](batch["sparse"])
    x = torch.cat([out["a"], out["b"], out["c"]], dim=1)
    return torch.nn.functional.mse_loss(model["head"](torch.tanh(x)).squeeze(1), batch["label"])


def _editing_step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """A step that rewrites its batch's ids in place before the forward (say, hashing them into a smaller table)."""
    batch["sparse"]["b"].remainder_(3)
    return _step(model, batch)


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tte-prefetch"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_step_that_edits_its_batch_in_place_equals_the_plain_loop(prefetch: bool) -> None:
    """The batch was prepared before its step edited it: the forward plans the inputs again, as they are now (it
    looked up the ids as prepared, before the edit)."""
    data = pipeline_batches(5, seed=1)
    plain = _model()
    plain_opts = _opts(plain)
    train_by_hand(plain, plain_opts, copy.deepcopy(data), _editing_step)
    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=_editing_step, features=lambda b: b["sparse"],
                             prefetch=prefetch)
    assert sum(1 for _ in pipe.run(copy.deepcopy(data))) == 5
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_with_pipelined_execution_an_edit_after_the_lookup_ahead_raises_naming_the_input() -> None:
    """Batch 1 is looked up during step 0: its step's edit comes after that lookup, which read the ids unedited."""
    data = pipeline_batches(4, seed=2)
    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=_editing_step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=True)
    done = []
    with pytest.raises(ValueError, match=r"Input `b` was modified in place after it was looked up ahead .*"
                                         r"in your data source, or in `features\(batch\)`"):
        for loss in pipe.run(data):
            done.append(loss)
    assert len(done) == 1 and pipe.steps == 1 and not _threads()
    assert pipe.unfinished()[0] is data[1]


def test_a_pipeline_dropped_without_close_is_collected_and_its_thread_ends() -> None:
    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=_step, features=lambda b: b["sparse"])
    it = iter(pipeline_batches(6, seed=3))
    pipe.progress(it)
    (thread,) = _threads()
    ref = weakref.ref(pipe)
    del pipe
    gc.collect()
    assert ref() is None  # (the thread holds it weakly)
    thread.join(timeout=120)  # (a bound on a hang, not a timing: it ends once told)
    assert not thread.is_alive() and not _threads()


def test_a_process_that_leaves_a_pipeline_running_exits() -> None:
    """A script that trains a few steps through ``progress`` and ends without closing its pipeline: it exits with
    status 0 (the thread is a daemon waiting for its next turn; the pipeline's finalizer tells it to stop)."""
    script = (
        "import torch, torch_tpu_embedding as tte\n"
        "ec = tte.EmbeddingCollection({'f': tte.FeatureConfig(tte.TableConfig(10, 2, name='t'))})\n"
        "model = torch.nn.ModuleDict({'ec': ec})\n"
        "opt = tte.optim.SGD(model.parameters(), lr=0.1)\n"
        "pipe = tte.TrainPipeline(model, opt, step=lambda m, b: m['ec'](b)['f'].sum(), features=lambda b: b)\n"
        "it = iter([{'f': torch.tensor([i % 10, 3])} for i in range(50)])\n"
        "for _ in range(3):\n"
        "    pipe.progress(it)\n"
        "print('trained', pipe.steps)\n"
    )
    assert run_script(script).strip() == "trained 3"


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_later_run_trains_the_failed_batch_first_and_equals_the_uninterrupted_run(stale: bool, prefetch: bool) -> None:
    """Step 2's backward raises (a hook on its activations: the head's gradients are accumulated already). A later
    run trains the batches ``unfinished()`` lists, the failed one first, with no gradient left from the failure;
    the result equals the run that never failed, and ``state_dict()`` is taken again between its steps."""
    data = pipeline_batches(6, seed=5)
    flags = {"prefetch": prefetch, "pipeline_execution_with_tensor_core": stale}
    want = _model()
    want_pipe = tte.TrainPipeline(want, _opts(want), step=_step, features=lambda b: b["sparse"], **flags)
    assert sum(1 for _ in want_pipe.run(data)) == 6
    calls = []

    def step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
        calls.append(batch)
        out = model["ec"](batch["sparse"])
        x = torch.cat([out["a"], out["b"], out["c"]], dim=1)
        if len(calls) == 3:
            x.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("interrupted in the backward")))
        return torch.nn.functional.mse_loss(model["head"](torch.tanh(x)).squeeze(1), batch["label"])

    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=step, features=lambda b: b["sparse"], **flags)
    it = iter(data)
    with pytest.raises(RuntimeError, match="interrupted in the backward"):
        for _ in pipe.run(it):
            pass
    assert pipe.steps == 2 and pipe.unfinished()[0] is data[2]
    run = pipe.run(it)
    next(run)  # the failed batch, trained now
    assert calls[-1] is data[2] and pipe.state_dict()["taken"] == 3 + len(pipe.state_dict()["unfinished"])
    assert sum(1 for _ in run) == 3 and pipe.steps == 6 and pipe.unfinished() == []
    assert [id(b) for b in calls[3:]] == [id(b) for b in data[2:]]
    for name, value in want.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


class _CachingKJT:
    """A KeyedJaggedTensor as torchrec's: given offsets, ``lengths()`` computes them once and keeps them (a tensor
    the object makes after the pipeline prepared it: not an edit of the batch)."""

    def __init__(self, keys: list[str], values: torch.Tensor, offsets: torch.Tensor) -> None:
        self._keys, self._values, self._offsets = keys, values, offsets
        self._lengths: torch.Tensor | None = None

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def offsets(self) -> torch.Tensor:
        return self._offsets

    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            self._lengths = torch.diff(self._offsets)
        return self._lengths

    def weights_or_none(self) -> None:
        return None


@pytest.mark.parametrize("stale", [False, True])
def test_a_keyed_input_that_caches_a_tensor_when_read_is_not_an_edit(stale: bool) -> None:
    def build() -> tuple[Any, list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        t = tte.TableConfig(9, 2, name="t", dtype=torch.float64)
        ec = tte.EmbeddingCollection({"x": tte.FeatureConfig(t), "y": tte.FeatureConfig(t)})
        model = torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(4, 1).double()})
        return model, _opts(model)

    def step(model: Any, batch: Any) -> torch.Tensor:
        x = model["ec"](batch["kjt"], concat=True)
        return torch.nn.functional.mse_loss(model["head"](x).squeeze(1), batch["label"])

    g = torch.Generator().manual_seed(6)

    def batch() -> dict[str, Any]:
        lengths = torch.randint(0, 3, (8,), generator=g)  # (x's 4 bags, then y's)
        kjt = _CachingKJT(["x", "y"], torch.randint(0, 9, (int(lengths.sum()),), generator=g),
                          torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]))
        return {"kjt": kjt, "label": torch.rand(4, generator=g, dtype=torch.float64)}

    data = [batch() for _ in range(5)]
    plain, plain_opts = build()
    train_by_hand(plain, plain_opts, copy.deepcopy(data), step, stale=stale)
    model, opts = build()
    pipe = tte.TrainPipeline(model, opts, step=step, features=lambda b: b["kjt"], concat=True,
                             pipeline_execution_with_tensor_core=stale)
    assert sum(1 for _ in pipe.run(data)) == 5
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_a_keyboard_interrupt_in_a_step_stops_the_thread_and_the_run_goes_on_from_that_batch() -> None:
    data = pipeline_batches(5, seed=7)
    plain = _model()
    plain_opts = _opts(plain)
    train_by_hand(plain, plain_opts, data, _step)
    calls = []

    def step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
        calls.append(batch)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return _step(model, batch)

    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=step, features=lambda b: b["sparse"])
    it = iter(data)
    with pytest.raises(KeyboardInterrupt):
        for _ in pipe.run(it):
            pass
    assert pipe.steps == 1 and not _threads() and pipe.unfinished()[0] is data[1]
    assert sum(1 for _ in pipe.run(it)) == 4 and pipe.steps == 5 and not _threads()
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("stale", [False, True])
def test_a_lookup_under_no_grad_in_the_step_trains_no_table(stale: bool) -> None:
    """A step that looks its features up under ``torch.no_grad()`` (embeddings used as fixed inputs, the head
    trained): no gradient reaches the tables, as in the plain loop; with pipelined execution too, where the lookup
    ran ahead, outside the step's no_grad (its activations carried gradients, and the tables were updated)."""

    def step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            out = model["ec"](batch["sparse"])
        x = torch.cat([out["a"], out["b"], out["c"]], dim=1)
        return torch.nn.functional.mse_loss(model["head"](torch.tanh(x)).squeeze(1), batch["label"])

    data = pipeline_batches(5, seed=8)
    plain = _model()
    train_by_hand(plain, _opts(plain), data, step, stale=stale)
    model = _model()
    tables = {n: t.detach().clone() for n, t in model["ec"].named_parameters()}
    pipe = tte.TrainPipeline(model, _opts(model), step=step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=stale)
    assert sum(1 for _ in pipe.run(data)) == 5
    for name, value in model["ec"].named_parameters():
        assert torch.equal(value, tables[name]), name
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def _twice_step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """A step that looks its batch up twice: both lookups train."""
    first, second = model["ec"](batch["sparse"]), model["ec"](batch["sparse"])
    x = torch.cat([first["a"], second["b"], first["c"] * second["c"]], dim=1)
    return torch.nn.functional.mse_loss(model["head"](torch.tanh(x)).squeeze(1), batch["label"])


def _target_step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """A step that looks its batch up under ``torch.no_grad()`` first (a fixed target), then to train."""
    with torch.no_grad():
        target = model["ec"](batch["sparse"])
    out = model["ec"](batch["sparse"])
    x = torch.cat([out["a"], out["b"], out["c"] - target["c"]], dim=1)
    return torch.nn.functional.mse_loss(model["head"](torch.tanh(x)).squeeze(1), batch["label"])


@pytest.mark.parametrize("step", [_twice_step, _target_step], ids=["twice", "no_grad-first"])
@pytest.mark.parametrize(("stale", "prefetch"), [(False, True), (True, True), (True, False)])
def test_a_step_that_looks_its_batch_up_twice_equals_its_schedule(step: Any, stale: bool, prefetch: bool) -> None:
    """Every lookup of a step's batch is one step stale with pipelined execution, as in TF's schedule (the hand-written
    reference looks the whole step up in the tables before the last update): the second lookup of the batch used to
    read the tables as they are, silently, a schedule of neither kind."""
    data = pipeline_batches(6, seed=31)
    plain = _model()
    train_by_hand(plain, _opts(plain), data, step, stale=stale)
    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=step, features=lambda b: b["sparse"], prefetch=prefetch,
                             pipeline_execution_with_tensor_core=stale)
    assert sum(1 for _ in pipe.run(data)) == 6
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
