"""``TrainPipeline.close()`` keeps every batch taken and not trained, once.

With a source blocked in ``next()`` (a queue that never yields; here a ``threading.Event`` at batch 3), close returns
without the background thread, and the batch that source returns later is trained once, neither lost nor twice.
After ``load_state_dict``, the restored batches the run had not reached yet stay in ``unfinished()``. Bounds on waits
are hang guards, not timings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from suite_helpers import pipeline_batches, run_script
from test_pipeline_lifecycle import _model, _opts, _step

import torch_tpu_embedding as tte

AT = 3  # the batch the source blocks before


def _blocking(data: list[Any], gate: threading.Event, reached: threading.Event) -> Iterator[Any]:
    for i, batch in enumerate(data):
        if i == AT:
            reached.set()  # the thread is in next(), taking batch 3
            gate.wait()
        yield batch


def _eventually(condition: Callable[[], bool]) -> bool:
    for _ in range(6000):  # (a hang guard of a minute)
        if condition():
            return True
        time.sleep(0.01)
    return False


def _ids(batches: list[Any]) -> list[int]:
    return [id(b) for b in batches]


@pytest.mark.parametrize("stale", [False, True], ids=["plain", "pipelined-execution"])
def test_close_returns_and_the_late_batch_is_trained_once(stale: bool) -> None:
    data = pipeline_batches(7, seed=7)
    flags = {"pipeline_execution_with_tensor_core": stale}
    want = _model()
    assert sum(1 for _ in tte.TrainPipeline(want, _opts(want), step=_step, features=lambda b: b["sparse"],
                                            **flags).run(data)) == 7
    calls: list[Any] = []

    def step(model: Any, batch: Any) -> torch.Tensor:
        calls.append(batch)
        return _step(model, batch)

    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=step, features=lambda b: b["sparse"], **flags)
    pipe.close_timeout = 0.05
    gate, reached = threading.Event(), threading.Event()
    it = _blocking(data, gate, reached)
    # Trained up to where the thread blocks taking batch 3 (pipelined execution: batch 2 is looked up ahead).
    before = [data[2]] if stale else []
    try:
        for _ in range(AT - len(before)):
            pipe.progress(it)
        assert reached.wait(timeout=60)
        closer = threading.Thread(target=pipe.close, daemon=True)
        closer.start()
        closer.join(timeout=10)
        assert not closer.is_alive(), "close() waited for a source blocked in next()"
        assert _ids(pipe.unfinished()) == _ids(before)  # batch 3 is not taken yet
        with pytest.raises(RuntimeError, match=r"state_dict\(\): the source has not returned the batch"):
            pipe.state_dict()
        with pytest.raises(RuntimeError, match=r"run\(\)/progress\(\): the source has not returned the batch"):
            next(pipe.run(it))
    finally:
        gate.set()
    assert _eventually(lambda: len(pipe.unfinished()) == len(before) + 1)
    assert _ids(pipe.unfinished()) == _ids([*before, data[AT]])  # kept once, after the batches taken before it
    assert pipe.state_dict()["taken"] == AT + 1
    trained = pipe.steps
    assert sum(1 for _ in pipe.run(it)) == 7 - trained
    assert _ids(calls) == _ids(data) and pipe.unfinished() == []  # every batch once, in order
    for name, value in want.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "left-running"])
def test_a_process_whose_source_blocks_forever_exits(closed: bool) -> None:
    """The thread blocked in the source is a daemon: the interpreter's exit does not wait for it."""
    script = (
        "import threading, torch, torch_tpu_embedding as tte\n"
        "ec = tte.EmbeddingCollection({'f': tte.FeatureConfig(tte.TableConfig(10, 2, name='t'))})\n"
        "model = torch.nn.ModuleDict({'ec': ec})\n"
        "opt = tte.optim.SGD(model.parameters(), lr=0.1)\n"
        "pipe = tte.TrainPipeline(model, opt, step=lambda m, b: m['ec'](b)['f'].sum(), features=lambda b: b)\n"
        "pipe.close_timeout = 0.05\n"
        "never = threading.Event()\n"
        "def source():\n"
        "    for i in range(2):\n"
        "        yield {'f': torch.tensor([i, 3])}\n"
        "    never.wait()\n"
        "it = source()\n"
        "for _ in range(2):\n"
        "    pipe.progress(it)\n"
        + ("pipe.close()\n" if closed else "")
        + "print('trained', pipe.steps)\n"
    )
    assert run_script(script).strip() == "trained 2"


@pytest.mark.parametrize("prefetch", [True, False])
def test_restored_batches_not_reached_stay_unfinished(prefetch: bool) -> None:
    """A pipeline restored with 4 unfinished batches trains 1 and is closed: the other 3 are still unfinished (they
    were dropped with the run's source), ``taken`` counts them, and a later run trains each once."""
    data = pipeline_batches(8, seed=8)
    want = _model()
    assert sum(1 for _ in tte.TrainPipeline(want, _opts(want), step=_step, features=lambda b: b["sparse"],
                                            prefetch=prefetch).run(data)) == 8
    calls: list[Any] = []

    def step(model: Any, batch: Any) -> torch.Tensor:
        calls.append(batch)
        return _step(model, batch)

    model = _model()
    pipe = tte.TrainPipeline(model, _opts(model), step=step, features=lambda b: b["sparse"], prefetch=prefetch)
    pipe.load_state_dict({"steps": 0, "taken": 4, "unfinished": data[:4], "outputs_ahead": None,
                          "pipeline_execution_with_tensor_core": False})
    it = iter(data[4:])
    pipe.progress(it)
    assert _ids(pipe.unfinished()) == _ids(data[1:4]) and pipe.state_dict()["taken"] == 4
    pipe.close()
    assert _ids(pipe.unfinished()) == _ids(data[1:4]) and pipe.state_dict()["taken"] == 4
    assert sum(1 for _ in pipe.run(it)) == 7
    assert _ids(calls) == _ids(data)
    for name, value in want.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
