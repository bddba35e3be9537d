"""Under ``torch.__future__.set_swap_module_params_on_conversion(True)`` a table's weight is written in place
(``_util/in_place.py``: torch's swap refuses a tensor with weak references) without the process-wide flag being
turned off: another thread's modules are still converted and loaded by swapping. The flag-off path is torch's own:
each load below is compared with it (same values, same errors)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte


class _Logged(torch.Tensor):
    """A parameter type whose ``module_load`` torch calls only when it swaps (the flag on)."""

    calls = 0

    def module_load(self, other: Any, assign: bool = False) -> Any:
        _Logged.calls += 1
        return super().module_load(other, assign)


@pytest.fixture
def swap() -> Iterator[None]:
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


def _collection(stack: bool, pad: bool = False) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({n: tte.FeatureConfig(tte.TableConfig(10 + i, 4, name=n))
                                  for i, n in enumerate("abc")}, stack_tables=stack)
    if pad:
        for table in ec.modules():
            if isinstance(table, tte.EmbeddingTable):
                table.pad_rows(8)
    return ec


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_another_threads_conversions_still_swap_while_tables_are_cast_and_loaded(swap: None, stack: bool) -> None:
    """Before, each table's cast and load turned the flag off meanwhile: a thread loading an ``nn.Linear`` read it off
    in 2000 of 2000 reads and its parameter's ``module_load`` ran in 0 of 300 loads (300 of 300 alone)."""
    ec = _collection(stack)
    sd = ec.state_dict()
    stop, casts = threading.Event(), [0]

    def tables() -> None:
        while not stop.is_set():
            ec.load_state_dict(sd)
            ec.double()
            ec.float()
            casts[0] += 1

    lin = torch.nn.Linear(4, 4)
    lin.weight = torch.nn.Parameter(torch.randn(4, 4).as_subclass(_Logged))
    lin_sd = {k: v.clone() for k, v in lin.state_dict().items()}
    _Logged.calls = 0
    worker = threading.Thread(target=tables)
    worker.start()
    try:
        off = sum(not torch.__future__.get_swap_module_params_on_conversion() for _ in range(2000))
        for _ in range(200):
            lin.load_state_dict(lin_sd)
    finally:
        stop.set()
        worker.join()
    assert casts[0] > 0
    assert (off, _Logged.calls) == (0, 200)
    assert all(p.dtype == torch.float32 for p in ec.parameters())


def _load(ec: tte.EmbeddingCollection, sd: dict[str, Any], swap: bool, **kw: Any) -> Any:
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        return ec.load_state_dict(sd, **kw)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


@pytest.mark.parametrize("pad", [False, True], ids=["plain", "padded"])
@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_loads_under_the_flag_equal_torchs_loads_without_it(stack: bool, pad: bool) -> None:
    """Values (logical rows into padded tables too), ``assign=True``, and the errors of a wrong shape, a missing or
    an unexpected key, as torch's own load with the flag off gives them."""
    ec = _collection(stack, pad)
    assert any(t.padding_rows for t in ec.modules() if isinstance(t, tte.EmbeddingTable)) == pad
    want = {k: torch.randn_like(v) for k, v in ec.state_dict().items()}
    key = next(iter(want))
    for kw in ({}, {"assign": True}):
        got = [_collection(stack, pad) for _ in range(2)]
        keys = [_load(ec, want, swap, **kw) for ec, swap in zip(got, (False, True), strict=True)]
        assert keys[0] == keys[1]
        for ec in got:
            assert ec.state_dict().keys() == want.keys()
            for k, v in want.items():
                assert torch.equal(ec.state_dict()[k], v), k
            assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in ec.parameters())
            out = ec({n: torch.tensor([1, 2]) for n in "abc"})  # still trained as tables
            sum(o.sum() for o in out.values()).backward()
            tte.optim.SGD(ec.parameters(), lr=0.1).step()
    bad = [{**want, key: torch.zeros(3, 4)}, {k: v for k, v in want.items() if k != key},
           {**want, "x.weight": want[key]}]
    for sd in bad:
        errors = []
        for swap in (False, True):
            with pytest.raises(RuntimeError) as info:
                _load(_collection(stack, pad), sd, swap)
            errors.append(str(info.value))
        assert errors[0] == errors[1]
