"""The lookup's prefetching C row gather (``optim/_kernels/c_gather.py``) against ``index_select``.

The loop alone: bitwise ``index_select`` for float32, float64 and bfloat16 rows, ids repeated, in any order, at 1
and 2 threads; an id outside the table refused with nothing written. In a lookup: once the kernel library is
loaded, a lookup of one id per bag (dict and ``concat=True``, stacked or not) gathers through the loop (no
``index_select``), and its output and the trained tables are bitwise those of ``index_select``'s path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_stacked_groups import _CountOps as _Ops

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._kernels import c_gather, c_library
from torch_tpu_embedding.optim._kernels.c_args import in_memory


@pytest.fixture
def gathers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The library loaded, its gather counted: the ids each call of the C loop gathered."""
    lib = c_library.library()
    if lib is None:
        pytest.skip("no C compiler builds the library here")
    calls: list[int] = []

    def counted(*args: Any) -> int:
        calls.append(args[-1])
        return lib.gather(*args)

    monkeypatch.setattr(c_library, "_LIBRARY", [lib._replace(gather=counted)])
    yield calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_loop_is_index_select_bitwise(gathers: list[int], dtype: torch.dtype, threads: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(c_gather, "_MIN_ROWS_PER_THREAD", 16)  # (small: split over threads all the same)
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(500, 24, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    ids = torch.cat([torch.randint(0, 500, (300,), generator=g), torch.tensor([0, 499, 499, 7])])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = c_gather.gather_rows(weight, ids)
    finally:
        torch.set_num_threads(before)
    want = weight.index_select(0, ids)
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # (bitwise: NaN payloads, -0.0 alike)
    assert sum(gathers) == ids.numel() and len(gathers) == threads


@pytest.mark.parametrize("operand", ["table", "ids"])
def test_a_zero_tensor_takes_index_select(gathers: list[int], operand: str) -> None:
    """A zero tensor (``torch._efficientzerotensor``) has no memory (a null pointer): the loop read through it and
    crashed the process (SIGSEGV). ``index_select`` gathers it."""
    weight, ids = torch.randn(10, 4), torch.tensor([1, 2, 1])
    if operand == "table":
        weight = torch._efficientzerotensor(10, 4)
    else:
        ids = torch._efficientzerotensor(3, dtype=torch.int64)
    assert torch.equal(c_gather.gather_rows(weight, ids), weight.index_select(0, ids))
    assert gathers == []


def test_misaligned_ids_take_index_select(gathers: list[int]) -> None:
    """int64 ids 3 bytes past an 8-byte boundary (``torch.frombuffer`` at an odd offset) are read by ``index_select``,
    not by the loop, whose int64 loads of them were undefined behaviour (UBSan: "load of misaligned address")."""
    weight, want = torch.randn(10, 4), torch.tensor([1, 7, 1, 9])
    buf = bytearray(8 * want.numel() + 8)
    ids = torch.frombuffer(buf, dtype=torch.int64, count=want.numel(),
                           offset=(3 - torch.frombuffer(buf, dtype=torch.uint8).data_ptr()) % 8)
    ids.copy_(want)
    assert ids.data_ptr() % 8
    assert torch.equal(c_gather.gather_rows(weight, ids), weight.index_select(0, want))
    assert gathers == []


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.float64, torch.bfloat16])
def test_in_memory_refuses_a_tensor_off_its_type_alignment(dtype: torch.dtype) -> None:
    """What every C loop is handed (ids, weights, slots, gradients) is checked by ``c_args.in_memory``: a tensor one
    byte past its type's alignment is not (the loops' typed loads of it would be undefined)."""
    size = torch.empty((), dtype=dtype).element_size()
    buf = bytearray(size * 5)
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    aligned = torch.frombuffer(buf, dtype=dtype, count=2, offset=(-base) % size)
    off = torch.frombuffer(buf, dtype=dtype, count=2, offset=(1 - base) % size)
    assert in_memory(aligned)
    assert not in_memory(off)


@pytest.mark.parametrize("bad", [-1, 500])
def test_the_loop_refuses_an_id_outside_the_table(gathers: list[int], bad: int) -> None:
    weight = torch.randn(500, 8)
    ids = torch.tensor([3, bad, 4])
    with pytest.raises(IndexError, match=f"index {bad} is out of bounds"):
        c_gather.gather_rows(weight, ids)


def test_not_loaded_takes_index_select(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(c_library, "_LIBRARY", [])  # (this process has not loaded the library: nothing is compiled)
    weight, ids = torch.randn(50, 4), torch.tensor([1, 2, 2])
    with _Ops() as ops:
        out = c_gather.gather_rows(weight, ids)
    assert ops.counts["index_select"] == 1 and torch.equal(out, weight[ids])
    assert c_library._LIBRARY == []


def test_other_tables_take_index_select(gathers: list[int]) -> None:
    ids = torch.tensor([1, 2, 2])
    for weight in (torch.empty(50, 4, device="meta"), torch.randn(4, 50).t(), torch.randn(50, 4, 2)[:, :, 0]):
        out = c_gather.gather_rows(weight, ids.to(weight.device))
        assert out.shape == (3, 4) and out.device == weight.device
    assert gathers == []


def _train(dtype: torch.dtype, concat: bool, stacked: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    tables = [tte.TableConfig(300, 8, name=f"t{i}", dtype=dtype) for i in range(3)]
    ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t) for i, t in enumerate(tables)},
                                 stack_tables=stacked)
    opt = tte.optim.SGD(ec.parameters(), lr=0.5)
    outs = []
    for s in range(3):
        g = torch.Generator().manual_seed(s)
        batch = {f"f{i}": torch.randint(0, 300, (64,), generator=g) for i in range(3)}
        if concat:
            out = ec(batch, concat=True)
        else:
            d = ec(batch)
            out = torch.cat([d[f] for f in ec.feature_names], dim=1)
        outs.append(out.detach().clone())
        (out * torch.linspace(-1, 1, out.shape[1], dtype=dtype)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return outs, {k: v.clone() for k, v in ec.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("concat", [False, True])
@pytest.mark.parametrize("stacked", [True, False])
def test_a_lookup_of_one_id_gathers_through_the_loop_bitwise(gathers: list[int], dtype: torch.dtype, concat: bool,
                                                             stacked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = _train(dtype, concat, stacked)
    assert len(gathers) == 3 * (1 if stacked else 3)  # every lookup of every step
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(300, 8, name="t", dtype=dtype))})
    with _Ops() as ops:
        ec({"f": torch.tensor([1, 2, 3])})
    assert ops.counts["index_select"] == 0, ops.counts
    monkeypatch.setattr(c_library, "_LIBRARY", [None])  # index_select's path
    reference = _train(dtype, concat, stacked)
    for got, want in zip(ours[0], reference[0], strict=True):
        assert torch.equal(got, want)
    for k, v in reference[1].items():
        assert torch.equal(ours[1][k], v), k
