"""``TableConfig(initializer=...)``: what a callable gives the table, stacked or not, on the meta device too.

A callable fills the tensor it is given in place (torch.nn.init) or returns the values (TF); one that does
neither used to leave the host allocator's uninitialised memory in the table, silently.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_tpu_embedding as tte

V, D = 300, 8


def build(init: Any, stack: bool, dtype: torch.dtype = torch.float32, device: str | None = None):
    # Two tables of one stack key: stacked, each is drawn alone and then copied into its group.
    a = tte.TableConfig(V, D, name="a", initializer=init, dtype=dtype)
    b = tte.TableConfig(7, D, name="b", initializer=torch.zeros(7, D), dtype=dtype)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(a), "g": tte.FeatureConfig(b)}, stack_tables=stack,
                                   device=device)


def _dirty_heap() -> None:
    """Leave freed, non-zero blocks of the table's size in the allocator (what an uninitialised table reads)."""
    for _ in range(4):
        torch.full((V, D), 123.0)


def _returns_none(t: torch.Tensor) -> None:
    return None


NOT_FILLING = [
    ("returns-None", _returns_none, "None"),
    ("identity", lambda t: t, "the tensor it was given"),
    ("scales-what-is-there", lambda t: t.mul_(0.1), "the tensor it was given"),
]


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("init, returned", [c[1:] for c in NOT_FILLING], ids=[c[0] for c in NOT_FILLING])
def test_an_initializer_that_fills_nothing_is_refused(init, returned: str, stack: bool) -> None:
    _dirty_heap()
    label = "_returns_none" if init is _returns_none else "<lambda>"
    with pytest.raises(ValueError, match=rf"Table `a`: its initializer '{label}' neither filled the \[300, 8\] weight "
                       rf"tensor it was given in place nor returned a tensor of values \(it returned {returned};.*"
                       r"uninitialised memory.*return a tensor of shape \(300, 8\)"):
        build(init, stack)


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_returned_values_are_the_table(stack: bool, dtype: torch.dtype) -> None:
    """TF style: the initializer returns the values (float64 here, cast to the table's dtype)."""
    want = torch.arange(V * D, dtype=torch.float64).reshape(V, D) / (V * D)
    _dirty_heap()
    ec = build(lambda t: want.clone(), stack, dtype)
    assert torch.equal(ec.tables["a"].weight.detach(), want.to(dtype))


def _numpy_fill(t: torch.Tensor) -> None:
    t.numpy()[:] = np.arange(V * D, dtype=np.float32).reshape(V, D)


def _data_fill(t: torch.Tensor) -> None:
    t.data.copy_(torch.arange(V * D, dtype=torch.float32).reshape(V, D))


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("init", [_numpy_fill, _data_fill, lambda t: t.data.copy_(torch.arange(float(V * D)).reshape(V, D))],
                         ids=["numpy", "data-returns-None", "data-returned"])
def test_writes_autograd_does_not_see_still_fill(init, stack: bool) -> None:
    _dirty_heap()
    ec = build(init, stack)
    assert torch.equal(ec.tables["a"].weight.detach(), torch.arange(V * D, dtype=torch.float32).reshape(V, D))


@pytest.mark.parametrize("returned, kind", [(lambda t: np.ones((V, D)), "ndarray"), (lambda t: 0.5, "float")],
                         ids=["ndarray", "float"])
def test_a_returned_non_tensor_is_refused(returned, kind: str) -> None:
    with pytest.raises(TypeError, match=rf"Table `a`: its initializer '<lambda>' returned a {kind}, which is neither "
                       r"the values \(a \(300, 8\) torch.Tensor\) nor None.*torch.as_tensor"):
        build(returned, False)


def test_a_returned_tensor_of_another_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Table `a`: the initializer returned shape \(8, 300\), expected \(300, 8\)"):
        build(lambda t: torch.zeros(D, V), False)


def test_a_callable_is_refused_on_the_meta_device_whatever_it_fills() -> None:
    """The deferred path draws only the default initializer and tensors: no callable reaches to_empty()."""
    with pytest.raises(ValueError, match=r"Table `a`: built on the meta device.*initializer=_returns_none"):
        build(_returns_none, False, device="meta")


class _BigOps(TorchDispatchMode):
    """The aten ops whose output has the table's size: one per pass over it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() == V * D and not func.is_view:
            self.ops.append(func.__name__)
        return out


@pytest.mark.parametrize("init, passes", [
    (functools.partial(torch.nn.init.normal_, std=0.01), ["empty.memory_format", "normal_.default"]),
    (lambda t: t.data.uniform_(), ["empty.memory_format", "uniform_.default"]),  # same memory: not copied again
    (lambda t: torch.ones(V, D), ["empty.memory_format", "ones.default", "copy_.default"]),
], ids=["nn.init", "data", "returned"])
def test_no_extra_pass_over_the_table(init, passes: list[str]) -> None:
    with _BigOps() as seen:
        build(init, False)
    assert seen.ops == passes
