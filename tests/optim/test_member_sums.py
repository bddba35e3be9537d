"""A stacked group's per-member sums (``RowContext.row_sum``) spread over lanes, as CUDA takes them.

On CUDA, ``index_add`` into ``[members, D]`` is atomic adds on a few addresses; there the adds are spread over
lanes first (:func:`~torch_tpu_embedding.optim._core.contract.member_sums`). It is checked here on the CPU: against
float64 numpy and ``index_add`` (non-finite values included), under ``torch.compile`` for several row counts, and a
stacked group trained with it forced on against the ``index_add`` path (every stacked configuration of an optimizer
whose statistics span rows: Adafactor). tests/optim/test_sync_free_step.py runs its accelerator cases (the
static-shape path against the CPU, the meta device, a frozen member) with it forced on as well (``-spread``). The choice
itself (:func:`~torch_tpu_embedding.optim._core.contract.spreads`) is checked on a stand-in with a CUDA device;
``tests/package/test_cuda.py`` trains every optimizer on a GPU against the CPU. Last, the context of touched rows
(``RowContext.touched``) and the rows per member table it hands a rule (``rows_of_table``).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from optim_registry import STACKED, SYNC_FREE, OptimizerConfig, cases
from test_stacked_groups import assert_same_state, build, train
from torch._dynamo.testing import CompileCounter

from torch_tpu_embedding.optim._core import contract
from torch_tpu_embedding.optim._core.contract import RowContext, member_sums, spreads

# the stacked configurations whose rule sums over rows (per member table in a group), and the accelerator's ones
# (test_sync_free_step.py's ``-spread`` cases)
SPANNING = [c for c in cases(STACKED) if not c.info.per_row_rule]
SPANNING_SYNC_FREE = [c for c in cases(SYNC_FREE) if not c.info.per_row_rule]


def test_there_are_configurations_that_sum_over_rows() -> None:
    assert SPANNING and SPANNING_SYNC_FREE


def force_spread(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``spreads`` made True everywhere (as on CUDA); returns the members of each per-member sum taken."""
    taken: list[int] = []

    def counted(x: torch.Tensor, segment: torch.Tensor, members: int) -> torch.Tensor:
        taken.append(members)
        return member_sums(x, segment, members)

    monkeypatch.setattr(contract, "spreads", lambda x: True)
    monkeypatch.setattr(contract, "member_sums", counted)
    return taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("rest", [(), (5,), (2, 3)])
@pytest.mark.parametrize("lanes", ["default", "3", "bounded to 1"])
def test_member_sums_equal_numpy(dtype: torch.dtype, rest: tuple[int, ...], lanes: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if lanes == "3":  # 19 rows a lane
        monkeypatch.setattr(contract, "LANES", 3)
    elif lanes == "bounded to 1":  # the buffer's bound leaves one lane a member: index_add itself
        monkeypatch.setattr(contract, "LANE_ELEMENTS", 4 * int(np.prod(rest)) + 1)
    g = torch.Generator().manual_seed(3)
    members, rows = 4, 57
    segment = torch.randint(0, members, (rows,), generator=g)
    segment[segment == 2] = 1  # a member without rows sums to zero
    if dtype == torch.int64:
        x = torch.randint(-9, 10, (rows, *rest), generator=g)
    else:
        x = (torch.randn((rows, *rest), generator=g, dtype=torch.float64) * 1e3).to(dtype)
    got = member_sums(x, segment, members)
    want, size = np.zeros((members, *rest)), np.zeros((members, *rest))
    np.add.at(want, segment.numpy(), x.double().numpy())
    np.add.at(size, segment.numpy(), np.abs(x.double().numpy()))
    assert got.dtype == dtype and got.shape == (members, *rest)
    if dtype == torch.int64:
        assert torch.equal(got, torch.from_numpy(want).to(dtype))  # exact: counts and integer sums
    else:
        # any order of n adds in x's dtype is within n·eps·Σ|x| of the exact sum (float64 numpy's own error aside)
        err = np.abs(got.double().numpy() - want)
        assert (err <= rows * torch.finfo(dtype).eps * size + 1e-9).all(), err.max()
    assert torch.equal(got[2], torch.zeros_like(got[2]))


@pytest.mark.parametrize(("members", "cols", "want"), [
    (4, 128, 1024),  # the benchmark's group: LANES
    (8, 1024, 512),  # members × cols past LANE_ELEMENTS / LANES: fewer lanes
    (64, 1 << 17, 1),  # past LANE_ELEMENTS itself: one lane, index_add as it was
    (3, 0, 1024),  # no columns
])
def test_lanes_keep_the_buffer_bounded(members: int, cols: int, want: int) -> None:
    lanes = contract.lanes_of(members, cols)
    assert lanes == want and lanes >= 1
    assert members * lanes * cols <= max(contract.LANE_ELEMENTS, members * cols)


def test_member_sums_make_the_lanes_buffer_of_lanes_of(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[int, ...]] = []
    real = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: (made.append(tuple(a[0])), real(*a, **k))[1])
    member_sums(torch.ones(50, 8), torch.arange(50) % 3, 3)
    assert made == [(3 * contract.lanes_of(3, 8), 8)]


def test_small_integers_keep_their_dtype() -> None:
    x = torch.arange(12, dtype=torch.int32).reshape(6, 2)
    segment = torch.tensor([0, 1, 1, 0, 2, 2])
    got = member_sums(x, segment, 3)
    assert got.dtype == torch.int32 and torch.equal(got, torch.zeros(3, 2, dtype=torch.int32).index_add(0, segment, x))


def test_member_sums_of_no_rows_are_zeros() -> None:
    got = member_sums(torch.zeros((0, 3)), torch.zeros(0, dtype=torch.int64), 2)
    assert torch.equal(got, torch.zeros((2, 3)))


def test_a_non_finite_value_stays_in_its_member() -> None:
    """As with ``index_add``: +inf in member 0, +inf and -inf in member 1 (NaN), NaN in member 2, member 3 finite."""
    x = torch.arange(16, dtype=torch.float32).reshape(8, 2)
    segment = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    x[0, 0] = torch.inf
    x[2, 1], x[3, 1] = torch.inf, -torch.inf
    x[4, 0] = torch.nan
    want = torch.zeros(4, 2).index_add(0, segment, x)
    got = member_sums(x, segment, 4)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.isfinite(got[3]).all() and got[0, 0] == torch.inf and got[1, 1].isnan() and got[1, 0] == 10.0


def test_one_graph_under_torch_compile_for_every_row_count() -> None:
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(member_sums, backend=counter, dynamic=True)
    for rows in (5, 9, 13, 40):
        segment = torch.arange(rows) % 3
        x = torch.ones(rows, 4)
        assert torch.equal(compiled(x, segment, 3), torch.zeros(3, 4).index_add(0, segment, x))
    assert counter.frame_count == 1


def test_row_sum_spreads_where_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    seg = torch.tensor([0, 0, 1, 2, 2, 2])
    ctx = RowContext(mask=None, count=None, num_rows=10, segment=seg, member_rows=(3, 3, 4))
    x = torch.arange(12, dtype=torch.float64).reshape(6, 2)
    by_index_add = ctx.row_sum(x)  # the CPU: index_add
    taken = force_spread(monkeypatch)
    assert torch.equal(ctx.row_sum(x), by_index_add) and taken == [3]
    assert torch.equal(ctx.row_sum(x), torch.tensor([[2.0, 4.0], [4.0, 5.0], [24.0, 27.0]]))


def test_spreads_on_cuda_only() -> None:
    assert spreads(types.SimpleNamespace(device=torch.device("cuda", 0)))  # type: ignore[arg-type]
    assert not spreads(torch.zeros(3))
    assert not spreads(torch.zeros(3, device="meta"))


@pytest.mark.parametrize("cfg", SPANNING, ids=str)
def test_a_stacked_group_trains_alike_spread(cfg: OptimizerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """float64 tables: the two paths sum the same numbers in another order (index_add row by row, the lanes
    each in their own order, then summed), so they agree to float64's rounding over six steps (≤ 1e-12), as stacked vs unstacked do."""
    ref, opt_ref = build(True, cfg)
    train(ref, opt_ref)
    taken = force_spread(monkeypatch)
    ec, opt = build(True, cfg)
    train(ec, opt)
    assert taken and set(taken) == {4, 2}, taken  # fused_0 (a, b, d, g) and fused_1 (c, e), every step
    assert_same_state(ref.state_dict(), ec.state_dict(), exact=False)
    sd_ref, sd = opt_ref.state_dict()["state"], opt.state_dict()["state"]
    assert sorted(sd_ref) == sorted(sd)
    for key, slots in sd_ref.items():
        assert_same_state(slots, sd[key], exact=False)


# ------------------------------------------------------------------ the context of touched rows
def test_touched_counts_the_real_rows_per_member_over_the_shards() -> None:
    """``RowContext.touched``, which the reference path and the compiled kernel both make: the real rows counted (the
    padding tail is not), per member in a stacked group, summed by ``all_reduce``."""
    mask, seg = torch.tensor([True, True, False, True]), torch.tensor([0, 1, 1, 1])
    plain = RowContext.touched(mask, 9)
    assert plain.count is not None and plain.count.item() == 3 and plain.segment is None and plain.num_rows == 9
    doubled = RowContext.touched(mask, 9, lambda x: 2 * x)
    assert doubled.count is not None and doubled.count.item() == 6
    stacked = RowContext.touched(mask, 9, lambda x: 2 * x, seg, (4, 5))
    assert stacked.count is not None and stacked.count.tolist() == [2, 4]
    assert stacked.segment is seg and stacked.member_rows == (4, 5) and stacked.mask is mask


@pytest.mark.parametrize("stacked", [False, True], ids=["one-table", "stacked"])
def test_the_count_is_summed_when_read_and_with_the_rule_s_sums(stacked: bool) -> None:
    """Over a process group ``all_reduce`` is a collective: ``RowContext.touched`` calls none until ``count`` is read,
    and ``counted_sums`` sums the count and every value it is given with one call, each element as alone."""
    calls: list[torch.Tensor] = []

    def over_three_shards(x: torch.Tensor) -> torch.Tensor:  # each shard held the same part
        calls.append(x)
        return 3 * x

    mask, seg = torch.tensor([True, True, False, True]), torch.tensor([0, 1, 1, 1])
    members = (4, 5) if stacked else ()

    def ctx() -> RowContext:
        return RowContext.touched(mask, 9, over_three_shards, seg if stacked else None, members)

    want_count = [3, 6] if stacked else 9
    read = ctx()
    assert not calls
    assert read.count is not None and read.count.tolist() == want_count and len(calls) == 1
    assert read.count.tolist() == want_count and len(calls) == 1  # (summed once)
    calls.clear()
    both = ctx()
    col, total = torch.tensor([[1.5, -2.0], [0.25, 4.0]], dtype=torch.float64), torch.tensor(7.0, dtype=torch.float64)
    count, (col3, total3) = both.counted_sums(col, total)
    assert len(calls) == 1 and calls[0].dtype == torch.float64 and calls[0].numel() == (2 if stacked else 1) + 5
    assert count is not None and count.dtype == torch.int64 and count.tolist() == want_count
    assert col3.tolist() == [[4.5, -6.0], [0.75, 12.0]] and total3.item() == 21.0
    assert both.count is count and len(calls) == 1  # (the count came with the sums)
    calls.clear()
    known = ctx()
    assert known.count is not None and len(calls) == 1
    _, (col3,) = known.counted_sums(col)
    assert len(calls) == 2 and calls[1].numel() == 4 and col3.tolist() == [[4.5, -6.0], [0.75, 12.0]]
    plain = RowContext.touched(mask, 9, segment=seg if stacked else None, member_rows=members)
    count, (same,) = plain.counted_sums(col)
    assert same is col and count is not None and count.tolist() == ([1, 2] if stacked else 3)


def test_rows_of_table_is_made_once_per_group_dtype_and_device() -> None:
    """A stacked group's rows per member, which Adafactor divides by at every step: one tensor per group, dtype and
    device, not one made and moved per call."""
    mask, seg, like = torch.tensor([True, False]), torch.tensor([0, 1]), torch.zeros(2)
    first = RowContext.touched(mask, 9, segment=seg, member_rows=(4, 5)).rows_of_table(like)
    again = RowContext.touched(mask, 9, segment=seg, member_rows=(4, 5)).rows_of_table(like)
    assert isinstance(first, torch.Tensor) and first is again and first.tolist() == [4.0, 5.0]
    wide = RowContext.touched(mask, 9, segment=seg, member_rows=(4, 5)).rows_of_table(like.double())
    assert isinstance(wide, torch.Tensor) and wide.dtype == torch.float64 and wide.tolist() == [4.0, 5.0]
    assert RowContext.touched(mask, 9).rows_of_table(like) == 9.0
    with torch.inference_mode():  # (an inference tensor is not kept: a later step records autograd on its own)
        assert RowContext.touched(mask, 9, segment=seg, member_rows=(4, 5)).rows_of_table(like) is not first
