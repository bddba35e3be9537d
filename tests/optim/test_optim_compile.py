"""``torch.compile`` on this package's optimizers (issue [conformance] item 7).

``torch.compile(opt.step, fullgraph=True)`` traces the whole step as one graph and trains as the eager
step does, for every optimizer whose update of a row reads only that row (``per_row_rule`` in
tests/optim_registry.py: all but Adafactor), on a model with two stacked tables, a table of its own
and dense layers. The rows a batch touches are a data-dependent count (``torch.unique``), which the
graph holds only with dynamo's ``capture_dynamic_output_shape_ops`` (docs/optimizers.md). On main the
step broke into about 24 graphs (the state mapping's ``__missing__``, ``WeakIdKeyDictionary`` lookups of
table bookkeeping, assignments to the optimizer's attributes, a nested compile of the kernel row update,
``int()`` of a tensor in the duplicate sum) and ``fullgraph=True`` raised.

For a compiled forward + backward + step, the graph breaks are listed by ``torch._dynamo.explain`` and
each is checked against the causes named here (see :data:`TORCH_BREAKS`).
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _stacked_model import Model, batches
from optim_registry import OPTIMIZER_INFOS, OptimizerInfo
from suite_helpers import free_port

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.row_grad import RowGrad, row_grad_by_handle

PER_ROW = [i for i in OPTIMIZER_INFOS if i.per_row_rule]
# Adafactor's statistics span rows (r_sum, the column statistics). Its compiled step used to differ from
# eager from the second step (r_sum of a table of its own stuck at its first value): torch (2.9 to 2.13)
# drops an in-place write to a 0-d float64 CPU graph input (its fake tensor memoises `.item()` as a
# symbol, which the tensorify_python_scalars pass then specialises); optim/_paths._write writes such a
# tensor through a 1-element view. test_torch_drops_a_write_to_a_0d_float64_input pins torch's behaviour.
NOT_PER_ROW = [i for i in OPTIMIZER_INFOS if not i.per_row_rule]
PACKAGE = str(Path(tte.__file__).parent)
STEPS = 3




@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    # The count of rows a batch touches is data-dependent (torch.unique): the graph carries it as a
    # symbol only with this flag, which torch documents for such operators.
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        yield
    torch._dynamo.reset()


def train(info: OptimizerInfo, step: Callable[[Any], Callable[[], Any]]) -> tuple[Model, Any]:
    model = Model()
    opt = info.cls(model.parameters(), **info.default)
    run = step(opt)
    data = batches()
    for _ in range(STEPS):
        model(next(data)).backward()
        run()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("info", PER_ROW + NOT_PER_ROW, ids=str)
def test_compiled_step_is_one_graph_and_equals_eager(info: OptimizerInfo) -> None:
    """``torch.compile(opt.step, fullgraph=True)`` (which raises at the first graph break) on stacked
    tables, a table of its own and dense layers equals the eager step, weights and every slot (every
    optimizer, Adafactor's whole-table statistics included)."""
    eager_model, eager_opt = train(info, lambda opt: opt.step)
    compiled_model, compiled_opt = train(info, lambda opt: torch.compile(opt.step, fullgraph=True))
    for (name, want), got in zip(eager_model.state_dict().items(), compiled_model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    want_state, got_state = eager_opt.state_dict()["state"], compiled_opt.state_dict()["state"]
    assert want_state.keys() == got_state.keys()
    for key, slots in want_state.items():
        assert slots.keys() == got_state[key].keys(), key
        for slot, want in slots.items():
            got = got_state[key][slot]
            if isinstance(want, torch.Tensor):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m, k=key, s=slot: f"{k}/{s}: {m}")
            else:
                assert got == want, (key, slot)
    assert compiled_opt.state_dict()["param_groups"] == eager_opt.state_dict()["param_groups"]


def test_compiled_step_under_an_initialised_process_group() -> None:
    """Under torchrun ``torch.distributed`` is initialised: the compiled step reads each table's
    ``tte.distributed`` mark (``exchange_mark``), which dynamo once failed to trace (``InternalTorchDynamoError``,
    the tensor's ``__dict__``). A group of one process exchanges nothing: the compiled step equals the eager one."""
    info = next(i for i in PER_ROW if str(i) == "sgd")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        eager_model, _ = train(info, lambda opt: opt.step)
        compiled_model, _ = train(info, lambda opt: torch.compile(opt.step, fullgraph=True))
    finally:
        dist.destroy_process_group()
    for (name, want), got in zip(eager_model.state_dict().items(), compiled_model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


# Causes of graph breaks that are torch's own: (what, a phrase of dynamo's reason). Dynamo cannot trace
# ``Tensor.backward()`` (compiled autograd aside) and skips ``torch.optim.Optimizer.zero_grad``, which this
# package's zero_grad extends (it then clears the tables' pending row gradients).
# Each as phrases that all appear in dynamo's reason (torch 2.13 names zero_grad's file in between).
TORCH_BREAKS = {
    "Tensor.backward": ("does not support tracing `Tensor.backward()`",),
    "torch.optim.Optimizer.zero_grad": ("`Optimizer.zero_grad`", "should not be traced"),
}
# Causes in this package's own Python: none. Until 2026-11-26 the lookup's backward (a
# torch.autograd.Function) handed each table's row gradient to the table's RowGrad, a Python object
# outside the function, and dynamo, which traces an autograd.Function's backward only free of such side
# effects, broke the graph once per lookup group ("Mutating a variable not in the current scope");
# the backward now hands them over through the custom operator torch_tpu_embedding::add_rows.
LIBRARY_BREAKS: dict[str, str] = {}


def _frames(reason: Any) -> list[str]:
    return [f"{Path(f.filename).name}:{f.name}" for f in reason.user_stack if f.filename.startswith(PACKAGE)]


def test_forward_backward_step_breaks_are_named() -> None:
    """A compiled forward + backward + step: every graph break has one of the causes named above, and
    none happens inside ``opt.step`` or the input preparation of the forward."""
    model = Model()
    opt = tte.optim.Adagrad(model.parameters(), lr=0.1)

    def train_step(features: dict[str, tte.Jagged]) -> torch.Tensor:
        loss = model(features)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    explained = torch._dynamo.explain(train_step)(next(batches()))
    causes: list[str] = []
    for reason in explained.break_reasons:
        text, frames = reason.reason, _frames(reason)
        named = [name for name, phrases in TORCH_BREAKS.items() if all(p in text for p in phrases)]
        named += [name for name, phrase in LIBRARY_BREAKS.items() if phrase in text and name in frames]
        assert len(named) == 1, f"a graph break not named here: {text.splitlines()[0]} at {frames}"
        assert "base.py:step" not in frames and not any(f.startswith("inputs.py") for f in frames), (text, frames)
        causes.append(named[0])
    print(f"{explained.graph_count} graphs, {explained.graph_break_count} graph breaks, {len(causes)} reasons:",
          causes)
    # The forward is one graph up to `loss.backward()`, the step one graph up to `opt.zero_grad()`.
    assert sorted(causes) == ["Tensor.backward", "torch.optim.Optimizer.zero_grad"]
    assert explained.graph_count == 2


def _padded(data: Iterator[dict[str, tte.Jagged]]) -> Iterator[dict[str, tte.Padded]]:
    """The same bags as ``tte.Padded`` ``[5, 3]`` (the padded lookup, not the jagged one)."""
    for batch in data:
        out = {}
        for name, jagged in batch.items():
            ids = torch.zeros((5, 3), dtype=torch.int64)
            mask = torch.zeros((5, 3), dtype=torch.bool)
            for b, row in enumerate(torch.split(jagged.values, jagged.lengths.tolist())):
                ids[b, : row.numel()], mask[b, : row.numel()] = row, True
            out[name] = tte.Padded(ids, mask)
        yield out


@pytest.mark.parametrize(("name", "padded", "frozen", "backend"), [
    ("sgd", False, False, "aot_eager"),  # SGD's eager lookups keep their rows factored; compiled, multiplied out
    ("adagrad", False, False, "aot_eager"),
    ("adagrad", True, False, "aot_eager"),
    ("ftrl", False, True, "aot_eager"),  # a frozen member of the stacked group: its ids become the sentinel
    ("lazy_adam", True, False, "inductor"),  # inductor may reuse an intermediate's memory: add_rows copies
])
def test_compiled_forward_and_backward_train_as_eager(name: str, padded: bool, frozen: bool, backend: str) -> None:
    """``torch.compile(model, fullgraph=True)``: the lookup's forward and backward in the graph (the
    backward hands its rows to the table's RowGrad through ``torch_tpu_embedding::add_rows``); then
    ``backward()`` and the eager step train as the eager model does, every weight and slot."""
    info = next(i for i in OPTIMIZER_INFOS if i.name == name)

    def run(compiled: bool) -> tuple[Model, Any]:
        model = Model()
        if frozen:
            model.ec.tables.a.requires_grad_(False)
        opt = info.cls(model.parameters(), **info.default)
        forward = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        data = _padded(batches()) if padded else batches()
        for _ in range(STEPS):
            forward(next(data)).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    (want_model, want_opt), (got_model, got_opt) = run(False), run(True)
    for (key, want), got in zip(want_model.state_dict().items(), got_model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=lambda m, k=key: f"{k}: {m}")
    want_state, got_state = want_opt.state_dict()["state"], got_opt.state_dict()["state"]
    assert want_state.keys() == got_state.keys()
    for key, slots in want_state.items():
        for slot, want in slots.items():
            torch.testing.assert_close(got_state[key][slot], want, rtol=0, atol=1e-12, msg=f"{key}/{slot}")
    if frozen:
        assert torch.equal(got_model.ec.tables.a.weight, Model().ec.tables.a.weight)


def test_a_copied_row_gradient_has_a_handle_of_its_own() -> None:
    """A compiled backward names its table's RowGrad by an int handle: a copy of a collection (deepcopy,
    pickle) must not record into the original's."""
    grad = RowGrad.registered()
    assert RowGrad().handle == -1  # a temporary (RowGrad.take) is given to no lookup
    for other in (copy.deepcopy(grad), pickle.loads(pickle.dumps(grad))):
        assert other.handle != grad.handle and row_grad_by_handle(other.handle) is other
    assert row_grad_by_handle(grad.handle) is grad


def test_torch_drops_a_write_to_a_0d_float64_input() -> None:
    """torch's behaviour that optim/_paths._write works around: compiled through AOTAutograd, ``copy_``
    into a 0-d float64 CPU input is lost, into a 1-element view of it kept. The day torch keeps both,
    the first assertion fails and the workaround can go."""
    def direct(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        a.copy_(a + 1)
        return g * 2

    def through_view(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        a.view(1).copy_((a + 1).view(1))
        return g * 2

    got = []
    for fn in (direct, through_view):
        torch._dynamo.reset()
        a = torch.tensor(1.5, dtype=torch.float64)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        for _ in range(3):
            compiled(a, torch.ones(3))
        got.append(a.item())
    assert got == [1.5, 4.5]


@pytest.mark.parametrize("info", OPTIMIZER_INFOS, ids=str)
def test_compiled_step_on_a_0d_float64_parameter_equals_eager(info: OptimizerInfo) -> None:
    """A 0-d float64 parameter and its 0-d slots are written through the workaround (``_write``)."""
    def run(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        scale = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        bias = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
        opt = info.cls([scale, bias], **info.default)
        step = torch.compile(opt.step, backend="aot_eager", fullgraph=True) if compiled else opt.step
        x = torch.linspace(-1, 1, 3, dtype=torch.float64)
        for i in range(STEPS):
            ((scale * x + bias - i).square().sum()).backward()
            step()
            opt.zero_grad()
        return [scale.detach().clone(), bias.detach().clone(),
                *[v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]]

    for got, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
