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


# ------------------------------------------------------------------ a tensor of values must fit the table's dtype
OVERFLOW = [
    ("f64-to-f16", torch.float64, torch.float16, -7e4, r"torch.float16 can represent \(its largest finite value is "
     r"65504;.*Received: a torch.float64 tensor whose largest value is -70000.0 \(in the TableConfig 'user'\)$"),
    ("f32-to-f16", torch.float32, torch.float16, 65520.0, r"torch.float16.*torch.float32 tensor whose largest value "
     r"is 65520.0 "),
    ("f64-to-bf16", torch.float64, torch.bfloat16, 1e39, r"torch.bfloat16 can represent \(its largest finite value "
     r"is 3.38953e\+38;.*whose largest value is 1e\+39 "),
    ("f64-to-f32", torch.float64, torch.float32, -1e39, r"torch.float32.*whose largest value is -1e\+39 "),
    ("i64-to-f16", torch.int64, torch.float16, 70000, r"torch.float16.*torch.int64 tensor whose largest value is 70000 "),
]


_NP = {torch.float16: np.float16, torch.float32: np.float32,
       torch.bfloat16: np.float32}  # (numpy has no bfloat16: its float32 overflows at these values too)


@pytest.mark.parametrize("src, dtype, big, pattern", [c[1:] for c in OVERFLOW], ids=[c[0] for c in OVERFLOW])
@pytest.mark.parametrize("nan", [False, True], ids=["", "with-nan"])
def test_values_beyond_the_tables_dtype_are_refused(src, dtype, big, pattern: str, nan: bool) -> None:
    values = torch.zeros(V, D, dtype=src)
    values[V // 2, 3] = big
    if nan and src.is_floating_point:  # aminmax gives NaN: the other values' extremes are checked
        values[0, 0] = float("nan")
    with np.errstate(over="ignore"):
        assert np.isinf(np.asarray(big, dtype=np.float64).astype(_NP[dtype]))  # numpy rounds it to inf too
    with pytest.raises(ValueError, match=r"Argument `initializer` must hold values that the table's dtype " + pattern):
        tte.TableConfig(V, D, name="user", initializer=values, dtype=dtype)



@pytest.mark.parametrize("dtype, edge", [(torch.float16, 65519.0), (torch.float16, -65504.0),
                                         (torch.bfloat16, 3.3895e38), (torch.float32, 3.4028234e38)], ids=str)
def test_values_that_round_into_range_are_kept(dtype: torch.dtype, edge: float) -> None:
    values = torch.zeros(V, D, dtype=torch.float64)
    values[1, 2] = edge
    if dtype == torch.float16:
        assert np.isfinite(np.float16(edge))  # rounds to ±65504, not to inf (independent of torch)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(V, D, name="t", initializer=values,
                                                                          dtype=dtype))})
    assert torch.equal(ec.tables["t"].weight.detach(), values.to(dtype))
    assert torch.isfinite(ec.tables["t"].weight).all()


def test_a_tensor_its_dtype_holds_is_not_read() -> None:
    """The check reads a tensor only when the table's dtype is narrower than the tensor's."""
    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    for src, dtype in ((torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float16, torch.bfloat16)):
        values = torch.ones(V, D, dtype=src)
        with Reads() as seen:
            tte.TableConfig(V, D, initializer=values, dtype=dtype)
        assert "aminmax.default" not in seen.ops, (src, dtype)
    with Reads() as seen:
        tte.TableConfig(V, D, initializer=torch.ones(V, D, dtype=torch.float64), dtype=torch.float16)
    assert "aminmax.default" in seen.ops
