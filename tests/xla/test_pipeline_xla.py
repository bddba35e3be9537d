"""``tte.TrainPipeline`` on XLA (one CPU device): one compile for the steady step and no host fallback, the
one-step-stale lookup visible in the step's HLO, and the same numbers as on the CPU.

The model is tests/train/test_pipeline.py's: two tables stacked into one group, a masked ``Padded`` feature, a
dense one and a ``Jagged`` one (static on XLA through ``max_ids_per_bag``), a ``Linear`` head; Adam or Adagrad
for the tables and the same torch optimizer for the head; ``after_step=torch_xla.sync`` (a step is one graph).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
from suite_helpers import pipeline_batches  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.modules import collection  # noqa: E402
from torch_tpu_embedding.modules.plan import plan_lookups  # noqa: E402
from torch_tpu_embedding.modules.prepared import NotAhead  # noqa: E402

DEV = torch_xla.device()  # before any backward (the autograd engine sizes its device queues then)
B = 6
STEPS = 8


def _batches(n: int, dtype: torch.dtype, seed: int = 0) -> list[dict[str, Any]]:
    """Batches of one shape (ids repeat within and across batches: a stale lookup reads rows updated since)."""
    return pipeline_batches(n, seed, dtype, size=B)


def _model(device: torch.device, dtype: torch.dtype) -> torch.nn.ModuleDict:
    torch.manual_seed(0)  # (tables are initialised on the host: the same values on every device)
    t1 = tte.TableConfig(7, 3, name="t1", dtype=dtype)
    t2 = tte.TableConfig(5, 3, name="t2", dtype=dtype, combiner="sum")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t1), "b": tte.FeatureConfig(t2),
                                  "c": tte.FeatureConfig(t1, max_ids_per_bag=2)}, device=device)
    head = torch.nn.Linear(9, 1).to(dtype)
    return torch.nn.ModuleDict({"ec": ec, "head": head.to(device)})


def _step(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    out = model["ec"](batch["sparse"])
    x = torch.cat([out["a"], out["b"], out["c"]], dim=1)
    label = batch["label"].to(x.device)
    return torch.nn.functional.mse_loss(model["head"](torch.tanh(x)).squeeze(1), label)


OPTIMIZERS: dict[str, Callable[[Any, Any], list[torch.optim.Optimizer]]] = {
    "adam": lambda tables, dense: [tte.optim.Adam(tables, lr=0.05), torch.optim.Adam(dense, lr=0.05)],
    "adagrad": lambda tables, dense: [tte.optim.Adagrad(tables, lr=0.1), torch.optim.Adagrad(dense, lr=0.1)],
}


def _setup(device: torch.device, dtype: torch.dtype, opt: str) -> tuple[Any, list[torch.optim.Optimizer]]:
    model = _model(device, dtype)
    assert list(model["ec"].groups) == ["fused_0"]  # t1 and t2 stacked: one table parameter
    return model, OPTIMIZERS[opt](*tte.split_parameters(model))


MODES = {  # TrainPipeline's flags
    "stale-prefetch": {"pipeline_execution_with_tensor_core": True, "prefetch": True},
    "stale-main_thread": {"pipeline_execution_with_tensor_core": True, "prefetch": False},
    "prefetch": {"pipeline_execution_with_tensor_core": False, "prefetch": True},
}


def _run(device: torch.device, dtype: torch.dtype, opt: str, mode: str | None,
         after_step: Callable[[], Any] | None = None) -> dict[str, torch.Tensor]:
    """The state after ``STEPS`` steps (model, every optimizer slot, the losses) on the host; ``mode`` ``None``:
    the plain loop, with the pipeline's order of calls."""
    model, opts = _setup(device, dtype, opt)
    data = _batches(STEPS, dtype)
    sync = after_step if after_step is not None else (torch_xla.sync if device.type == "xla" else None)
    losses = []
    if mode is None:
        for batch in data:
            loss = _step(model, batch)
            loss.backward()
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad()
            if sync is not None:
                sync()
            losses.append(loss.detach())
    else:
        pipe = tte.TrainPipeline(model, opts, step=_step, features=lambda b: b["sparse"], after_step=sync,
                                 **MODES[mode])
        losses = [loss.detach() for loss in pipe.run(data)]
        assert pipe.steps == STEPS
    state = {f"model/{k}": v.detach().cpu() for k, v in model.state_dict().items()}
    for i, o in enumerate(opts):
        for key, slots in o.state_dict()["state"].items():
            state.update({f"opt{i}/{key}/{s}": v.cpu() for s, v in slots.items() if isinstance(v, torch.Tensor)})
    state["losses"] = torch.stack([loss.cpu() for loss in losses])
    return state


# ---------------------------------------------------------------------------------------------- compiles
@pytest.mark.parametrize("mode", list(MODES))
def test_the_steady_pipelined_step_compiles_once_without_host_fallbacks(mode: str) -> None:
    """Steps 0 and 1 compile (step 0 makes the optimizers' slots in its graph, step 1 reads them; with pipelined
    execution step 0 also looks its own batch up, later steps use the previous graph's activations); steps 2 to 6
    reuse step 1's graph. With pipelined execution the last step has no batch to look up ahead: its own graph,
    compiled at most once (the modes share a process: a graph compiled by an earlier one is cached). Every step runs
    exactly one graph (the prefetch thread only takes batches from the source), and nothing falls back to the
    host."""
    per_step: list[tuple[int, int]] = []

    def counts() -> tuple[int, int]:
        xm.wait_device_ops()  # (ExecuteTime is recorded when an execution ends, after sync() returns)
        executed = met.metric_data("ExecuteTime")
        return int(met.counter_value("UncachedCompile") or 0), executed[0] if executed else 0

    def after_step() -> None:
        torch_xla.sync()
        per_step.append(counts())

    met.clear_all()
    per_step.append(counts())
    state = _run(DEV, torch.float32, "adam", mode, after_step)
    assert met.executed_fallback_ops() == []  # (read before the state's host copies, which read device data)
    compiles = [b[0] - a[0] for a, b in zip(per_step[:-1], per_step[1:], strict=True)]
    executions = [b[1] - a[1] for a, b in zip(per_step[:-1], per_step[1:], strict=True)]
    assert len(compiles) == STEPS and executions == [1] * STEPS, (compiles, executions)
    assert compiles[2:-1] == [0] * (STEPS - 3), compiles
    assert compiles[-1] <= (1 if MODES[mode]["pipeline_execution_with_tensor_core"] else 0), compiles
    assert bool(torch.isfinite(state["losses"]).all())


#: what a thread may read of an XLA tensor: fields of the tensor object, not of its data (which torch_xla.sync() on
#: the main thread rewrites unlocked: a size read or a transfer from another thread races with it)
_OUTSIDE_THE_DATA = {"device", "dtype", "requires_grad", "is_meta", "layout", "is_sparse", "is_nested"}


class _XlaTouches(TorchFunctionMode):
    """Every torch function (and tensor attribute read) on an XLA tensor, by name (a mode is per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.touched: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves = [*args, *(kwargs or {}).values()]
        if any(isinstance(a, torch.Tensor) and a.device.type == "xla" for a in leaves):
            owner = getattr(func, "__self__", None)  # a getter: Tensor.<attribute>.__get__
            self.touched.append(getattr(owner, "__name__", None) or getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def test_tables_on_xla_are_prepared_on_the_thread_without_touching_xla_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefetch thread plans every batch (checks, padding, the group's id assembly on the host) and touches no
    XLA tensor's data: off the thread that runs ``torch_xla.sync()`` even a table's size read or a transfer races
    with it in torch_xla 2.9 (``Check failed: data()->tensor_data``, heap corruption). The sizes come from
    ``know_rows()`` (recorded on the main thread; without it, ``prepare(ahead=True)`` refuses before reading
    anything); the lookup moves the ids, on the main thread."""
    ec = _model(DEV, torch.float32)["ec"]
    features = _batches(1, torch.float32)[0]["sparse"]
    torch_xla.sync()
    made = met.counter_value("CreateXlaTensor") or 0
    with pytest.raises(NotAhead, match="know_rows"):
        ec.prepare(features, ahead=True)
    ec.know_rows()
    with _XlaTouches() as mode:
        prepared = ec.prepare(features, ahead=True)
    assert (met.counter_value("CreateXlaTensor") or 0) == made  # nothing moved yet
    assert set(mode.touched) <= _OUTSIDE_THE_DATA, mode.touched
    with torch.no_grad():
        got = {k: v.cpu() for k, v in ec(prepared).items()}  # (the transfers, on this thread)
        want = {k: v.cpu() for k, v in ec(features).items()}
    assert (met.counter_value("CreateXlaTensor") or 0) > made
    assert all(torch.equal(got[k], want[k]) for k in want)
    torch_xla.sync()

    planned: list[str] = []
    touched: list[str] = []
    prepare_ahead = tte.TrainPipeline._prepare_ahead

    def plan(*args: Any, **kwargs: Any) -> Any:
        planned.append(threading.current_thread().name)
        return plan_lookups(*args, **kwargs)

    def watched(self: Any, batch: Any) -> Any:
        with _XlaTouches() as mode:
            try:
                return prepare_ahead(self, batch)
            finally:
                touched.extend(mode.touched)

    monkeypatch.setattr(collection, "plan_lookups", plan)
    monkeypatch.setattr(tte.TrainPipeline, "_prepare_ahead", watched)
    for mode_name in ("stale-prefetch", "prefetch"):
        planned.clear()
        _run(DEV, torch.float32, "adagrad", mode_name)
        assert planned == ["tte-prefetch"] * STEPS, mode_name
    assert set(touched) <= _OUTSIDE_THE_DATA, sorted(set(touched))


# ---------------------------------------------------------------------------------------------- the HLO
class _Hlo:
    """The entry computation of an unoptimized HLO module as a dataflow graph: each instruction's op and
    operands, and the roots (the elements of the ROOT tuple, in the order the tensors were given)."""

    _LINE = re.compile(r"^\s*(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+(?P<op>[\w\-]+)\((?P<rest>.*)$")

    def __init__(self, text: str) -> None:
        entry = text[text.index("\nENTRY "):]
        self.op: dict[str, str] = {}
        self.type: dict[str, str] = {}
        refs: dict[str, list[str]] = {}
        root = None
        for line in entry.splitlines()[1:]:
            m = self._LINE.match(line)
            if m is None:
                continue
            name = m.group("name")
            self.op[name], self.type[name] = m.group("op"), m.group("type")
            refs[name] = re.findall(r"%([\w.\-]+)", m.group("rest"))
            if m.group("root"):
                root = name
        # (references to other computations, to_apply=%..., are not instructions of the entry)
        self.operands = {n: [r for r in rs if r in self.op] for n, rs in refs.items()}
        assert root is not None and self.op[root] == "tuple", "the HLO of several tensors ends in a tuple"
        self.roots = self.operands[root]

    def cone(self, name: str) -> set[str]:
        """``name`` and every instruction it depends on."""
        seen, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(self.operands[n])
        return seen

    def of(self, names: set[str], op: str) -> set[str]:
        return {n for n in names if self.op[n] == op}

    def updated_from(self, name: str) -> str:
        """The parameter an in-place update writes into: ``scatter``'s first operand, through reshapes."""
        while self.op[name] != "parameter":
            assert self.op[name] in ("scatter", "reshape", "copy", "bitcast"), (name, self.op[name])
            name = self.operands[name][0]
        return name

    def computed(self, names: set[str]) -> set[str]:
        """The instructions of ``names`` that compute (not the graph's inputs and constants)."""
        return {n for n in names if self.op[n] not in ("parameter", "constant")}


def _pipelined_step_hlo(order: str) -> tuple[_Hlo, torch.Size]:
    """The HLO of step 2 of a pipelined run driven by hand with the calls ``TrainPipeline`` makes on XLA
    (``_train``: ``prepare`` and ``look_up_ahead`` of batch 3, the step under ``use_prepared``, backward, the
    optimizer steps), taken before its ``torch_xla.sync()``; roots: the updated table, batch 3's activations
    (a, b, c), the loss, the updated head weight and bias.

    ``order="late"``: batch 3 is looked up after the optimizer steps instead (a non-stale order, the check's
    counterpart). ``order="plain"``: no lookup ahead (batch 2 looked up in its own forward; roots: the table, the
    loss, the head)."""
    model, opts = _setup(DEV, torch.float32, "adam")
    ec = model["ec"]
    data = _batches(4, torch.float32)
    tables, dense = tte.split_parameters(model)
    prepared: dict[int, Any] = {}

    def prepare(i: int) -> Any:  # (XLA tables: prepared on the main thread, when the pipeline first needs them)
        if i not in prepared:
            prepared[i] = ec.prepare(data[i]["sparse"])
        return prepared[i]

    hlo = None
    for n in range(3):
        current = prepare(n)
        if order == "stale" or (order == "late" and n < 2):
            ec.look_up_ahead(prepare(n + 1))
        with ec.use_prepared(current):
            loss = _step(model, data[n])
        loss.backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
        if n == 2:
            if order == "late":
                ec.look_up_ahead(prepare(3))
            outs = [] if order == "plain" else [prepared[3].outputs[f] for f in ("a", "b", "c")]
            hlo = _Hlo(torch_xla._XLAC._get_xla_tensors_hlo([*tables, *outs, loss, *dense]))
            assert len(hlo.roots) == len(tables) + len(outs) + 1 + len(dense)
        torch_xla.sync()
    assert hlo is not None
    return hlo, tables[0].shape


def test_the_lookup_ahead_reads_the_table_as_it_enters_the_step() -> None:
    """TF's pipelined execution in the step's graph: batch N + 1's gathers read the table parameter itself (the
    tables after update N - 1), not the output of this step's update; and the loss, the head's update and the
    table's update depend on no instruction of that lookup (so XLA may run them side by side)."""
    hlo, shape = _pipelined_step_hlo("stale")
    table_out, *ahead, loss, weight, bias = hlo.roots
    table = hlo.updated_from(table_out)  # the table's parameter, as the step's update writes it back
    assert hlo.op[table_out] == "scatter" and hlo.type[table].startswith(f"f32[{shape[0]},{shape[1]}]")
    for out in ahead:
        cone = hlo.cone(out)
        gathers = hlo.of(cone, "gather")
        assert gathers and {hlo.operands[g][0] for g in gathers} == {table}, out  # the parameter, as it enters
        assert not hlo.of(cone, "scatter"), out  # nothing of this step's update
        for other in (loss, weight, bias, table_out):
            assert not hlo.computed(cone) & hlo.computed(hlo.cone(other)), (out, other)
    # (the step's own forward read last step's activations: the dense part gathers nothing from the table)
    for dense in (loss, weight, bias):
        assert table not in hlo.cone(dense)


def test_the_stale_read_check_sees_a_lookup_after_the_update_and_a_loss_that_looks_up() -> None:
    """The counterparts, so the checks above can fail: a lookup made after the optimizer step gathers from the
    step's scatter output; a step that looks its own batch up (no pipelining) has a loss that depends on a
    gather of the table parameter."""
    hlo, _ = _pipelined_step_hlo("late")
    table_out, *ahead, loss, _, _ = hlo.roots
    for out in ahead:
        cone = hlo.cone(out)
        read = {hlo.operands[g][0] for g in hlo.of(cone, "gather")}
        assert table_out in read and read != {hlo.updated_from(table_out)}  # it gathers from the scatter's output
        assert hlo.of(cone, "scatter")
    hlo, _ = _pipelined_step_hlo("plain")
    table_out, loss, _, _ = hlo.roots
    table = hlo.updated_from(table_out)
    assert table in {hlo.operands[g][0] for g in hlo.of(hlo.cone(loss), "gather")}


# ---------------------------------------------------------------------------------------------- numerics
def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=k)


# Tolerances of XLA vs CPU. Both devices run the same algorithm on the same inputs, but round differently (XLA
# fuses and reorders reductions, CPU runs eager kernels; the tables' update is XLA's one-pass ROWS path and CPU's
# chunked reference path). Every value here is O(0.01..1) and is the result of at most ~50 roundings per step
# (the forward, backward and update chains), 8 steps: ~400 roundings of eps each. Adam's and Adagrad's
# g / sqrt(v) is homogeneous of degree 0 in g, so relative errors of the gradients are not amplified by it;
# allowing a further factor 100 for the rest (tanh', the loss's squares, a few cancelling sums) gives
# 400 * 100 * eps: float64 (eps 1.1e-16) rtol 5e-12, with atol 5e-13 for the entries near 0. Measured:
# 5.6e-16 abs at most. float32 (eps 6e-8) would give 2.4e-3, too loose to mean anything: it uses the tolerance
# of the other XLA-vs-CPU tests (tests/xla/test_stacked_xla.py, rtol 1e-5, atol 1e-6; measured 4.8e-7 abs).
# A schedule one step off (the plain loop instead of the stale one) differs by 3e-2..5e-1 on this model.
TOLERANCES = {torch.float64: (5e-12, 5e-13), torch.float32: (1e-5, 1e-6)}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_pipelined_execution_on_xla_equals_it_on_cpu(dtype: torch.dtype, opt: str) -> None:
    """The one-step-stale run (prefetching, after_step=torch_xla.sync) on XLA equals the same run on the CPU
    (whose schedule tests/train/test_pipeline.py checks against a hand-written one), and not the plain loop."""
    rtol, atol = TOLERANCES[dtype]
    got = _run(DEV, dtype, opt, "stale-prefetch")
    want = _run(torch.device("cpu"), dtype, opt, "stale-prefetch")
    _close(got, want, rtol, atol)
    plain = _run(torch.device("cpu"), dtype, opt, None)
    with pytest.raises(AssertionError):
        _close(got, plain, rtol, atol)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_prefetch_on_xla_equals_the_plain_xla_loop_bitwise(opt: str) -> None:
    """Prefetch only (batches taken from the source by the thread, prepared on the main thread) runs the plain
    loop's graphs: every value, slot and loss equal bitwise, in float64."""
    got = _run(DEV, torch.float64, opt, "prefetch")
    want = _run(DEV, torch.float64, opt, None)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k}: {(got[k] - want[k]).abs().max()}"
