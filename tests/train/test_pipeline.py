"""``tte.TrainPipeline``: prefetch equals the plain loop bitwise; pipelined execution equals a hand-written
schedule of TF's one-step-stale semantics (float64, every optimizer); checkpoints mid-pipeline; errors, early stops
and the background thread."""

from __future__ import annotations

import copy
import io
import threading
from typing import Any

import pytest
import torch
from optim_registry import KERAS_EXTRAS, OPTIMIZER_INFOS
from suite_helpers import pipeline_batches, train_by_hand

import torch_tpu_embedding as tte


def _model(stack: bool = True) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    t1 = tte.TableConfig(7, 3, name="t1", dtype=torch.float64)
    t2 = tte.TableConfig(5, 3, name="t2", dtype=torch.float64, combiner="sum")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t1), "b": tte.FeatureConfig(t2), "c": tte.FeatureConfig(t1)},
                                 stack_tables=stack)
    head = torch.nn.Linear(9, 1).double()
    return torch.nn.ModuleDict({"ec": ec, "head": head})


def _step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    out = model["ec"](batch["sparse"])
    x = torch.cat([out["a"], out["b"], out["c"]], dim=1)
    return torch.nn.functional.mse_loss(model["head"](torch.tanh(x)).squeeze(1), batch["label"])


def _opts(model: Any, info: Any, kwargs: dict[str, Any]) -> list[torch.optim.Optimizer]:
    tables, dense = tte.split_parameters(model)
    return [info.cls(tables, **kwargs), torch.optim.SGD(dense, lr=0.05)]


def _state(model: Any, opts: list[torch.optim.Optimizer]) -> dict[str, Any]:
    return {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opts[0].state_dict()),
            "dense": copy.deepcopy(opts[1].state_dict())}


def _equal(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path}: max diff {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _plain(info: Any, kwargs: dict[str, Any], data: list[Any], stack: bool = True) -> dict[str, Any]:
    model = _model(stack)
    opts = _opts(model, info, kwargs)
    train_by_hand(model, opts, data, _step)
    return _state(model, opts)


def _stale_reference(info: Any, kwargs: dict[str, Any], data: list[Any]) -> dict[str, Any]:
    """TF's pipelined execution written out: step n looks up the tables as they were before update n - 1 (step 0
    and step 1 both read the initial tables); its gradient is applied to the tables as they are."""
    model = _model()
    opts = _opts(model, info, kwargs)
    train_by_hand(model, opts, data, _step, stale=True)
    return _state(model, opts)


def _piped(info: Any, kwargs: dict[str, Any], data: list[Any], stack: bool = True, **flags: Any) -> dict[str, Any]:
    model = _model(stack)
    opts = _opts(model, info, kwargs)
    pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"], **flags)
    steps = sum(1 for _ in pipe.run(data))
    assert steps == len(data) and pipe.steps == len(data)
    return _state(model, opts)


_CASES = [pytest.param(info, dict(info.default), id=info.name) for info in OPTIMIZER_INFOS] + [
    pytest.param(OPTIMIZER_INFOS[3], {**OPTIMIZER_INFOS[3].default, **KERAS_EXTRAS[name]}, id=f"adam-{name}")
    for name in ("accumulate2-ema-clipnorm", "accumulate2-gclip-scale", "ema-overwrite")
] + [pytest.param(OPTIMIZER_INFOS[1], {**OPTIMIZER_INFOS[1].default, "skip_nonfinite": True}, id="adagrad-skip")]


@pytest.mark.parametrize(("info", "kwargs"), _CASES)
def test_pipelined_execution_is_tf_one_step_stale_schedule(info: Any, kwargs: dict[str, Any]) -> None:
    assert OPTIMIZER_INFOS[3].name == "adam"
    data = pipeline_batches(7)
    want = _stale_reference(info, kwargs, data)
    _equal(_piped(info, kwargs, data, pipeline_execution_with_tensor_core=True), want)
    _equal(_piped(info, kwargs, data, pipeline_execution_with_tensor_core=True, prefetch=False), want)
    # and it is not the plain loop (the schedule matters: ids repeat across consecutive batches)
    plain = _plain(info, kwargs, data)
    assert not torch.equal(plain["model"]["head.weight"], want["model"]["head.weight"])


@pytest.mark.parametrize(("info", "kwargs"), _CASES)
def test_prefetch_equals_the_plain_loop_bitwise(info: Any, kwargs: dict[str, Any]) -> None:
    data = pipeline_batches(6, seed=1, last=4)  # the last batch partial
    want = _plain(info, kwargs, data)
    _equal(_piped(info, kwargs, data), want)  # prefetch on: the default
    _equal(_piped(info, kwargs, data, prefetch=False), want)


def test_unstacked_tables_and_the_keyed_input() -> None:
    info = OPTIMIZER_INFOS[1]
    data = pipeline_batches(5, seed=2)
    _equal(_piped(info, info.default, data, stack=False), _plain(info, info.default, data, stack=False))


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_a_checkpoint_mid_pipeline_resumes_to_the_uninterrupted_run(stale: bool, prefetch: bool) -> None:
    info = next(i for i in OPTIMIZER_INFOS if i.name == "lazy_adam")
    data = pipeline_batches(8, seed=3)
    flags = {"pipeline_execution_with_tensor_core": stale, "prefetch": prefetch}
    want = _piped(info, info.default, data, **flags)
    model = _model()
    opts = _opts(model, info, info.default)
    pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"], **flags)
    run = pipe.run(data)
    for _ in range(3):
        next(run)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opts": [o.state_dict() for o in opts], "pipe": pipe.state_dict()}, buf)
    saved = pipe.state_dict()
    assert saved["steps"] == 3 and saved["taken"] == 3 + len(saved["unfinished"])
    assert (saved["outputs_ahead"] is not None) == stale
    run.close()
    assert not _threads()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model2 = _model()
    model2.load_state_dict(ckpt["model"])
    opts2 = _opts(model2, info, info.default)
    for o, s in zip(opts2, ckpt["opts"], strict=True):
        o.load_state_dict(s)
    pipe2 = tte.TrainPipeline(model2, opts2, step=_step, features=lambda b: b["sparse"], **flags)
    pipe2.load_state_dict(ckpt["pipe"])
    assert sum(1 for _ in pipe2.run(data[ckpt["pipe"]["taken"]:])) == 5
    assert pipe2.steps == 8
    _equal(_state(model2, opts2), want)


def _counted(data: list[Any], given: list[Any]) -> Any:
    """``data``, each batch appended to ``given`` as the pipeline takes it."""
    for b in data:
        given.append(b)
        yield b


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tte-prefetch"]


@pytest.mark.parametrize("stale", [False, True])
def test_an_exception_in_a_step_stops_the_pipeline_and_its_thread(stale: bool) -> None:
    info = OPTIMIZER_INFOS[0]
    data = pipeline_batches(6, seed=4)
    model = _model()
    calls = []

    def step(model: Any, batch: Any) -> torch.Tensor:
        calls.append(batch)
        if len(calls) == 3:
            raise RuntimeError("boom at step 2")
        return _step(model, batch)

    pipe = tte.TrainPipeline(model, _opts(model, info, info.default), step=step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=stale)
    given: list[Any] = []

    with pytest.raises(RuntimeError, match="boom at step 2"):
        for _ in pipe.run(_counted(data, given)):
            pass
    assert not _threads()
    assert pipe.steps == 2
    left = pipe.unfinished()
    assert left[0] is data[2]  # the failed step's batch first, then every batch taken after it: none dropped
    assert left == data[2 : 2 + len(left)] and len(given) == 2 + len(left)
    state = pipe.state_dict()  # (the state after step 1: tests/train/test_pipeline_failed_state.py)
    assert state["steps"] == 2 and state["unfinished"] == left and state["taken"] == len(given)


@pytest.mark.parametrize("stale", [False, True])
def test_a_bad_id_raises_at_its_own_step_naming_the_feature(stale: bool) -> None:
    info = OPTIMIZER_INFOS[0]
    data = pipeline_batches(5, seed=5)
    data[3]["sparse"]["b"] = torch.tensor([0, 1, 9, 0, 1, 2])
    model = _model()
    opts = _opts(model, info, info.default)
    want = _stale_reference(info, info.default, data[:3]) if stale else _plain(info, info.default, data[:3])
    pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=stale)
    done = []
    with pytest.raises(ValueError, match="Feature `b`: ids must be in"):
        for loss in pipe.run(data):
            done.append(loss)
    assert len(done) == 3 and pipe.steps == 3 and not _threads()
    _equal(_state(model, opts), want)  # steps 0-2 trained (with pipelined execution, update 2 applied too)
    assert pipe.unfinished()[0] is data[3]


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_the_sources_error_is_raised_at_its_place_in_the_stream(stale: bool, prefetch: bool) -> None:
    """After the steps of the batches before it (with pipelined execution it is met while batch 1's step looks
    ahead: that step still trains, its update applied)."""
    info = OPTIMIZER_INFOS[0]
    data = pipeline_batches(4, seed=6)

    def source() -> Any:
        yield from data[:2]
        raise OSError("the reader failed")

    model = _model()
    opts = _opts(model, info, info.default)
    pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"], prefetch=prefetch,
                             pipeline_execution_with_tensor_core=stale)
    done = []
    with pytest.raises(OSError, match="the reader failed"):
        for loss in pipe.run(source()):
            done.append(loss)
    assert len(done) == 2 and pipe.steps == 2 and not _threads() and pipe.unfinished() == []
    want = _stale_reference(info, info.default, data[:2]) if stale else _plain(info, info.default, data[:2])
    _equal(_state(model, opts), want)
    assert pipe.state_dict()["taken"] == 2


@pytest.mark.parametrize("stale", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_an_error_of_features_raises_at_its_own_step(stale: bool, prefetch: bool) -> None:
    """``features(batch)`` raising for batch 2 (on the thread, or in the step before with pipelined execution):
    raised at step 2, after update 1; the batch is the first unfinished."""
    info = OPTIMIZER_INFOS[0]
    data = pipeline_batches(4, seed=8)

    def features(b: dict[str, Any]) -> Any:
        if b is data[2]:
            raise KeyError("no sparse features in this batch")
        return b["sparse"]

    model = _model()
    opts = _opts(model, info, info.default)
    pipe = tte.TrainPipeline(model, opts, step=_step, features=features, prefetch=prefetch,
                             pipeline_execution_with_tensor_core=stale)
    done = []
    with pytest.raises(KeyError, match="no sparse features"):
        for loss in pipe.run(data):
            done.append(loss)
    assert len(done) == 2 and pipe.steps == 2 and not _threads()
    assert pipe.unfinished()[0] is data[2]
    want = _stale_reference(info, info.default, data[:2]) if stale else _plain(info, info.default, data[:2])
    _equal(_state(model, opts), want)


def test_stopping_early_leaves_no_thread_and_keeps_the_batches_taken() -> None:
    info = OPTIMIZER_INFOS[0]
    data = pipeline_batches(6, seed=7)
    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model, info, info.default), step=_step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=True)
    given: list[Any] = []

    it = _counted(data, given)
    for _ in pipe.run(it):
        if pipe.steps == 2:
            break
    assert not _threads()
    left = pipe.unfinished()
    assert left == data[2 : 2 + len(left)] and len(left) >= 1 and len(given) == 2 + len(left)
    assert pipe.state_dict()["taken"] == 2 + len(left)
    # the same pipeline goes on with the batches it kept, then the rest of the source
    assert sum(1 for _ in pipe.run(it)) == 4 and pipe.steps == 6 and not _threads()


def test_progress_takes_the_same_iterator_at_every_call() -> None:
    """``progress(source)`` trains the next batch of the iterator it started on; another iterator is refused before
    anything is taken from either, and the pipeline goes on with its own."""
    info = OPTIMIZER_INFOS[0]
    data = pipeline_batches(3, seed=10)
    model = _model()
    opts = _opts(model, info, info.default)
    pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"])
    it = iter(data)
    pipe.progress(it)
    other = iter(data)
    with pytest.raises(ValueError, match="the same iterator at every call"):
        pipe.progress(other)
    assert next(other) is data[0]  # (nothing taken from it)
    pipe.progress(it)
    pipe.progress(it)
    with pytest.raises(StopIteration):
        pipe.progress(it)
    assert pipe.steps == 3 and pipe.unfinished() == [] and not _threads()
    _equal(_state(model, opts), _plain(info, info.default, data))


def test_a_model_that_does_not_look_up_the_prepared_objects_is_told() -> None:
    info = OPTIMIZER_INFOS[0]
    model = _model()

    def step(model: Any, batch: Any) -> torch.Tensor:
        return _step(model, {"sparse": dict(batch["sparse"]), "label": batch["label"]})  # a copy of the dict: fine
    pipe = tte.TrainPipeline(model, _opts(model, info, info.default), step=step, features=lambda b: b["sparse"])
    assert sum(1 for _ in pipe.run(pipeline_batches(2))) == 2  # (matched by its leaves, not by the dict)

    def other(model: Any, batch: Any) -> torch.Tensor:
        sparse = {k: (copy.copy(v)) for k, v in batch["sparse"].items()}
        return _step(model, {"sparse": sparse, "label": batch["label"]})
    pipe = tte.TrainPipeline(model, _opts(model, info, info.default), step=other, features=lambda b: b["sparse"])
    with pytest.raises(ValueError, match="did not look up the features TrainPipeline prepared"):
        next(pipe.run(pipeline_batches(2)))
    assert not _threads()


def test_arguments_are_checked_at_construction() -> None:
    model = _model()
    opts = _opts(model, OPTIMIZER_INFOS[0], OPTIMIZER_INFOS[0].default)
    with pytest.raises(TypeError, match="Argument `optimizers`"):
        tte.TrainPipeline(model, [], step=_step, features=lambda b: b)
    with pytest.raises(TypeError, match="Argument `pipeline_execution_with_tensor_core` must be a bool"):
        tte.TrainPipeline(model, opts, step=_step, features=lambda b: b, pipeline_execution_with_tensor_core=1)
    with pytest.raises(ValueError, match="Argument `collection`"):
        tte.TrainPipeline(torch.nn.Linear(2, 2), opts, step=_step, features=lambda b: b)
    pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"])
    with pytest.raises(ValueError, match="pipeline_execution_with_tensor_core=True"):
        pipe.load_state_dict({"steps": 1, "taken": 1, "unfinished": [], "outputs_ahead": None,
                              "pipeline_execution_with_tensor_core": True})


@pytest.mark.parametrize(("change", "why"), [
    ({"outputs_ahead": None}, "The state has no ['outputs_ahead']: it is not a TrainPipeline.state_dict()"),
    ({"taken": -1}, "The state's 'taken' must be an integer >= 0. Received -1"),
    ({"steps": 2.0}, "The state's 'steps' must be an integer >= 0. Received 2.0"),
    ({"unfinished": "ab"}, "The state's 'unfinished' must be a list of batches. Received str"),
    ({"taken": 1}, "The state's 'taken' (1) counts its 'unfinished' batches (2) too, so it cannot be fewer"),
])
def test_a_state_that_cannot_be_is_refused_before_anything_changes(change: dict[str, Any], why: str) -> None:
    """Before, a state without ``outputs_ahead`` set the step counters and dropped the batch looked up ahead, and
    then raised a KeyError."""
    model = _model()
    opts = _opts(model, OPTIMIZER_INFOS[0], OPTIMIZER_INFOS[0].default)
    pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"])
    good = {"steps": 4, "taken": 6, "unfinished": ["x", "y"], "outputs_ahead": None,
            "pipeline_execution_with_tensor_core": False}
    pipe.load_state_dict(good)
    before = (pipe.steps, pipe.taken, pipe.unfinished())
    bad = {k: v for k, v in {**good, **change}.items() if not (k in change and k == "outputs_ahead")}
    with pytest.raises(ValueError) as info:
        pipe.load_state_dict(bad)
    assert why in str(info.value), str(info.value)
    assert (pipe.steps, pipe.taken, pipe.unfinished()) == before == (4, 4, ["x", "y"])


def test_prepared_features_are_looked_up_once_by_their_collection() -> None:
    model = _model()
    ec = model["ec"]
    batch = pipeline_batches(1)[0]["sparse"]
    prepared = ec.prepare(batch)
    _equal(ec(prepared), ec(batch))
    with pytest.raises(ValueError, match="looked up already"):
        ec(prepared)
    with pytest.raises(ValueError, match="prepared by another EmbeddingCollection"):
        _model()["ec"](ec.prepare(batch))
    bad = dict(batch, b=torch.tensor([0, 9, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="Feature `b`"):
        ec.prepare(bad)
    kept = ec.prepare(bad, ahead=True)  # kept, raised by its lookup
    with pytest.raises(ValueError, match="Feature `b`"):
        ec(kept)
    with pytest.raises(ValueError, match="Feature `b`"):  # a lookup ahead raises it now
        ec.look_up_ahead(ec.prepare(bad, ahead=True))
    kept = ec.prepare(bad, ahead=True)
    ec.look_up_ahead(kept, keep_error=True)  # or keeps it for the forward that uses these features
    assert kept.outputs is None and isinstance(kept.ahead_error, ValueError)
    with pytest.raises(ValueError, match="looked up ahead already"):
        ec.look_up_ahead(kept, keep_error=True)
    with pytest.raises(ValueError, match="Feature `b`"), ec.use_prepared(kept):
        ec(bad)
    good = ec.prepare(batch, ahead=True)
    ec.look_up_ahead(good, keep_error=True)
    _equal(ec(good), ec(batch))


def test_the_docstring_examples_run() -> None:
    import doctest

    from torch_tpu_embedding.modules import ahead, prepared
    from torch_tpu_embedding.train import pipeline
    for module in (pipeline, prepared, ahead):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
    assert doctest.testmod(pipeline).attempted >= 5


def test_prefetch_replays_the_cached_plan_and_equals_the_plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padded and dense features only: every call after the first replays the collection's cached plan (on the
    thread when prefetching), bitwise as the plain loop."""
    from torch_tpu_embedding.modules import plan as plan_module

    replays: list[str] = []
    replay = plan_module._replay

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = replay(*args, **kwargs)
        replays.append(threading.current_thread().name if out is not None else "none")
        return out

    monkeypatch.setattr(plan_module, "_replay", counted)

    def build() -> tuple[Any, list[torch.optim.Optimizer]]:
        torch.manual_seed(0)
        t1 = tte.TableConfig(7, 3, name="t1", dtype=torch.float64)
        t2 = tte.TableConfig(5, 3, name="t2", dtype=torch.float64, combiner="sum")
        ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t1), "b": tte.FeatureConfig(t2)})
        model = torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(6, 1).double()})
        tables, dense = tte.split_parameters(model)
        return model, [tte.optim.Adam(tables, lr=0.05), torch.optim.SGD(dense, lr=0.05)]

    def step(model: Any, batch: Any) -> torch.Tensor:
        x = model["ec"](batch["sparse"], concat=True)
        return torch.nn.functional.mse_loss(model["head"](x).squeeze(1), batch["label"])

    data = [{"sparse": {"a": b["sparse"]["a"], "b": b["sparse"]["b"]}, "label": b["label"]} 
            for b in pipeline_batches(6, 8)]
    plain, plain_opts = build()
    train_by_hand(plain, plain_opts, data, step)
    for stale in (False, True):
        replays.clear()
        model, opts = build()
        pipe = tte.TrainPipeline(model, opts, step=step, features=lambda b: b["sparse"], concat=True,
                                 pipeline_execution_with_tensor_core=stale)
        assert sum(1 for _ in pipe.run(data)) == 6
        assert replays == ["tte-prefetch"] * 5, replays
        if not stale:
            _equal(_state(model, opts), _state(plain, plain_opts))


def test_a_model_trained_through_the_pipeline_pickles_and_copies() -> None:
    """The collection's per-process state of the pipeline (weak references to its tables, streams, the held
    inputs) is neither pickled nor copied: ``torch.save(model)`` and ``copy.deepcopy`` work after a run."""
    info = OPTIMIZER_INFOS[1]
    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model, info, info.default), step=_step, features=lambda b: b["sparse"],
                             pipeline_execution_with_tensor_core=True)
    data = pipeline_batches(3, seed=9)
    assert sum(1 for _ in pipe.run(data)) == 3
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        want = model["ec"](data[0]["sparse"])
        for other in (again, twin):
            _equal(other["ec"](data[0]["sparse"]), want)
    assert "_rows_known" in model["ec"].__dict__ and "_rows_known" not in twin["ec"].__dict__
