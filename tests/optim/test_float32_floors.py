"""Positive hyper-parameters that an update divides by where a gradient is 0 (Adagrad's and FTRL's initial
accumulator, AdagradMomentum's epsilon, Adam's eps or its square, RowWiseAdagrad's eps, Adafactor's epsilon_1) must be
normal float32 numbers: XLA devices flush a subnormal float32 to 0 (measured on XLA's CPU client: Adagrad with
``initial_accumulator_value=1e-40``, AdagradMomentum with ``epsilon=1e-40`` and Adam with ``eps=1e-22``, all accepted
before, gave NaN rows), and a coordinate with a zero gradient is then updated by 0/0. ``torch.set_flush_denormal``
does on the CPU what XLA does, so the values at the floor are checked here under it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

O = tte.optim  # noqa: E741
TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, 2**-126
ROOT_TINY = math.sqrt(TINY)

# (id, class, the argument, its floor, other arguments)
CASES: list[tuple[str, Any, str, float, dict[str, Any]]] = [
    ("adagrad", O.Adagrad, "initial_accumulator_value", TINY, {}),
    ("ftrl", O.FTRL, "initial_accumulator_value", TINY, {}),
    ("adagrad_momentum", O.AdagradMomentum, "epsilon", TINY, {"momentum": 0.5}),
    ("adam-inside", O.Adam, "eps", ROOT_TINY, {}),
    ("adam-outside", O.Adam, "eps", TINY, {"sum_inside_sqrt": False}),
    ("rowwise_adagrad", O.RowWiseAdagrad, "eps", TINY, {"initial_accumulator_value": 0.0}),
    ("adafactor", O.Adafactor, "epsilon_1", TINY, {}),
]
IDS = [c[0] for c in CASES]


@pytest.fixture
def flushing() -> Iterator[None]:
    """Subnormal float32 results flushed to 0 on the CPU, as on an XLA device."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormal numbers (no SSE3)")
    yield
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("below", [0.5, 1e-3], ids=["half", "thousandth"])
@pytest.mark.parametrize("cls, name, floor, extra", [c[1:] for c in CASES], ids=IDS)
def test_a_value_below_the_smallest_normal_float32_is_refused(cls: Any, name: str, floor: float,
                                                               extra: dict[str, Any], below: float) -> None:
    value = floor * below
    with pytest.raises(ValueError, match=rf"Argument `{name}` must .* >= .* smallest normal float32 .*0/0 = NaN\)\. "
                                         rf"Received: {value!r}"):
        cls([torch.nn.Parameter(torch.zeros(3, 2))], lr=0.1, **{name: value}, **extra)


def test_ftrl_allows_any_small_accumulator_with_allow_zero_accumulator() -> None:
    """There a 0/0 weight is set to 0 (docs/optimizers.md), so a flushed accumulator is not a NaN."""
    O.FTRL([torch.nn.Parameter(torch.zeros(3, 2))], initial_accumulator_value=TINY / 4, allow_zero_accumulator=True)


@pytest.mark.parametrize("cls, name, floor, extra", [c[1:] for c in CASES], ids=IDS)
def test_the_floor_trains_zero_gradient_coordinates_finitely_when_flushed(flushing: None, cls: Any, name: str,
                                                                          floor: float, extra: dict[str, Any]) -> None:
    """At the floor (its float32 value rounded up), one step on float32 rows with a gradient of 0 in column 0 and in
    all of row 3: every weight finite; the zero-gradient coordinates as the formulas give in float64 (unchanged; FTRL
    sets w = (clip(z) − z)/den with z = 0: 0)."""
    value = float(np.nextafter(np.float32(floor), np.float32(1)))
    torch.manual_seed(0)
    t = tte.TableConfig(5, 3, name="t", combiner="sum")
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
    opt = cls(ec.parameters(), lr=0.1, **{name: value}, **extra)
    w0 = ec.tables.t.weight.detach().double().numpy().copy()
    out = ec({"f": torch.tensor([1, 2, 3])})["f"]
    (out[:2, 1:] * torch.tensor([[0.5, -1.0], [2.0, 0.25]])).sum().backward()  # row 3 looked up, gradient 0
    opt.step()
    w = ec.tables.t.weight.detach().double().numpy()
    assert np.isfinite(w).all(), w
    zero = np.zeros((5, 3), dtype=bool)
    zero[[1, 2, 3], 0] = True
    zero[3] = True
    expected = np.zeros_like(w0) if cls is O.FTRL else w0  # float64: w − η·0/… ; FTRL's z = 0 gives w = 0
    np.testing.assert_array_equal(w[zero], expected[zero])
