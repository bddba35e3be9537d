"""The per-device routing plan of the id exchange (torch_tpu_embedding.routing), on the CPU: plan_routes
against a plain-Python reference, and a whole exchange over n simulated devices (the all-to-alls emulated
by indexing) against dense float64 references. Ownership schemes themselves: tests/rows/test_exchange_layout.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_tpu_embedding.routing import (
    SCHEMES,
    RoutePlan,
    RowOwnership,
    bucket_rows,
    capacity_for_load,
    gather_owned_rows,
    plan_routes,
    rows_at_positions,
)

ROOT = Path(__file__).parents[2]
R = 3072  # a multiple of 512 and of lcm(512, 3) = lcm(512, 6) = 1536, so every n below is valid
NS = [1, 2, 3, 4, 6, 8]
N = 96  # ids per device
D = 3
PADDING = [-1, -7, R, R + 5, 2**40]


def chunks_for(n: int) -> int:
    """The row block lcm(512, n): "interleaved" needs n | chunks | rows."""
    return math.lcm(512, n)


def ownership(scheme: str, n: int) -> RowOwnership:
    own = RowOwnership(scheme, R, n, chunks_for(n))
    assert own.rows_per_shard * n == R and own.rows % own.chunks == 0 and own.chunks % n == 0
    return own


# ---------------------------------------------------------------------------------------------------
# Plain-Python reference


def ref_physical(i: int, scheme: str, rows: int, n: int, chunks: int) -> int:
    """The documented physical row of a valid id (module docstring of routing.py), in plain Python."""
    if scheme == "range":
        return i
    if scheme == "mod":
        return (i % n) * (rows // n) + i // n
    m, b = chunks, 0
    while m % 2 == 0:
        m, b = m // 2, b + 1
    x = i % chunks
    q = x // m
    rev_q = int(format(q, f"0{b}b")[::-1], 2) if b else 0
    return ((x % m) * 2**b + rev_q) * (rows // chunks) + i // chunks


def ref_plan(ids: list[int], own: RowOwnership, k: int) -> dict:
    """Dedup physical rows, group by owner, ascending; the first k of each owner are routed."""
    rows, n = own.rows, own.num_shards
    per = rows // n
    phys = {i: ref_physical(i, own.scheme, rows, n, own.chunks) for i in set(ids) if 0 <= i < rows}
    by_owner: list[list[int]] = [[] for _ in range(n)]
    for p in sorted(set(phys.values())):
        by_owner[p // per].append(p)
    send = [[p - d * per for p in group[:k]] + [per] * max(k - len(group), 0) for d, group in enumerate(by_owner)]
    slot = []
    for i in ids:
        if i not in phys:
            slot.append(n * k)
            continue
        d = phys[i] // per
        rank = by_owner[d].index(phys[i])
        slot.append(d * k + rank if rank < k else n * k)
    kept = {i for i, p in phys.items() if by_owner[p // per].index(p) < k}
    dropped = [len(group[k:]) for group in by_owner]
    return {"send": send, "slot": slot, "load": [len(g) for g in by_owner], "kept": kept, "dropped": dropped}


def draw_ids(rng: np.random.Generator, rows: int, hot: int = 40) -> list[int]:
    """N ids with duplicates (drawn from a pool of `hot` ids) and ~15% padding (negative or >= rows),
    always including both padding kinds and the first and last rows."""
    pool = rng.choice(rows, size=hot, replace=False)
    ids = rng.choice(pool, size=N)
    pad = rng.random(N) < 0.15
    ids[pad] = rng.choice(PADDING, size=int(pad.sum()))
    ids[:4] = [-1, rows, 0, rows - 1]
    rng.shuffle(ids)
    return [int(i) for i in ids]


def capacity(mode: str, loads: list[int]) -> int:
    """'roomy': every id fits with room to spare; 'exact': the largest load (fits, no spare slot in the
    fullest bucket); 'overflow': below the largest load; 'one': a single slot per bucket."""
    top = max(max(loads), 1)
    return {"roomy": N, "exact": top, "overflow": max(top // 2, 1), "one": 1}[mode]


def seed_of(*parts: object) -> int:
    return sum((i + 1) * 7919 * sum(map(ord, str(p))) for i, p in enumerate(parts)) % 2**31


# ---------------------------------------------------------------------------------------------------
# 1. plan_routes against the reference


@pytest.mark.parametrize("mode", ["roomy", "exact", "overflow", "one"])
@pytest.mark.parametrize("n", NS, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_plan_routes_matches_reference(scheme: str, n: int, mode: str) -> None:
    own = ownership(scheme, n)
    rng = np.random.default_rng(seed_of(scheme, n, mode))
    ids = draw_ids(rng, R)
    k = capacity(mode, ref_plan(ids, own, N)["load"])
    ref = ref_plan(ids, own, k)
    plan = plan_routes(torch.tensor(ids), own, k)
    assert isinstance(plan, RoutePlan)
    assert plan.send.dtype == torch.int32 and plan.send.shape == (n, k)
    assert plan.slot.dtype == torch.int64 and plan.slot.shape == (N,)
    assert plan.load.dtype == torch.int32 and plan.load.shape == (n,)
    assert plan.send.tolist() == ref["send"]
    assert plan.slot.tolist() == ref["slot"]
    assert plan.load.tolist() == ref["load"]
    overflow = (plan.load - k).clamp(min=0)
    assert overflow.tolist() == ref["dropped"]
    if mode in ("roomy", "exact"):
        assert int(overflow.sum()) == 0
    else:  # the case must drop something to test anything
        assert int(overflow.sum()) > 0


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_plan_routes_int32_ids_and_padding_only(dtype: torch.dtype) -> None:
    own = ownership("mod", 4)
    ids = [5, 2, 5, -1, R, 3071, 2, 8]
    ref = ref_plan(ids, own, 2)
    plan = plan_routes(torch.tensor(ids, dtype=dtype), own, 2)
    assert (plan.send.tolist(), plan.slot.tolist(), plan.load.tolist()) == (ref["send"], ref["slot"], ref["load"])
    pad = plan_routes(torch.tensor([-1, R, -3], dtype=dtype), own, 2)  # nothing to route
    assert pad.send.tolist() == [[R // 4] * 2] * 4 and pad.slot.tolist() == [8] * 3 and pad.load.tolist() == [0] * 4


def test_plan_routes_docstring_example() -> None:
    plan = plan_routes(torch.tensor([5, 2, 5, 8]), RowOwnership("mod", rows=8, num_shards=2), capacity=2)
    assert (plan.send.tolist(), plan.slot.tolist(), plan.load.tolist()) == ([[1, 4], [2, 4]], [2, 0, 2, 4], [1, 1])


# ---------------------------------------------------------------------------------------------------
# 2. A whole exchange over n simulated devices


def simulate(own: RowOwnership, ids: list[torch.Tensor], table_logical: torch.Tensor, grads: list[torch.Tensor],
             k: int) -> tuple[list[RoutePlan], list[torch.Tensor], torch.Tensor]:
    """Run the transport's per-device steps, emulating each all-to-all by indexing.

    Returns the plans, each device's looked-up rows [N, D] and the gradient the owners summed per
    local row, concatenated in physical order [R, D]."""
    n, per, d = own.num_shards, own.rows_per_shard, table_logical.shape[1]
    table_phys = torch.empty_like(table_logical)
    table_phys[own.physical_row(torch.arange(own.rows))] = table_logical
    plans = [plan_routes(x, own, k) for x in ids]
    # ids out: owner d receives send_s[d] from every source s
    recv = [torch.stack([plans[s].send[dst] for s in range(n)]) for dst in range(n)]  # [n_src, k]
    served = [gather_owned_rows(table_phys[dst * per:(dst + 1) * per], recv[dst]) for dst in range(n)]
    looked = []
    for s in range(n):
        back = torch.stack([served[dst][s] for dst in range(n)])  # rows back: [n_dst, k, D]
        looked.append(rows_at_positions(back.reshape(n * k, d), plans[s].slot))
    # backward: buckets out to the owners, which sum what every source sent for one local row
    sent = [bucket_rows(grads[s], plans[s].slot, n, k) for s in range(n)]  # [n_dst, k, D]
    summed = []
    for dst in range(n):
        got = torch.stack([sent[s][dst] for s in range(n)])  # [n_src, k, D]
        acc = torch.zeros(per + 1, d, dtype=got.dtype).index_add(0, recv[dst].reshape(-1).long(), got.reshape(-1, d))
        assert torch.count_nonzero(acc[per]) == 0  # unused slots (the sentinel) carry no gradient
        summed.append(acc[:per])
    return plans, looked, torch.cat(summed)


@pytest.mark.parametrize("mode", ["roomy", "overflow"])
@pytest.mark.parametrize("n", NS, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_simulated_exchange_matches_dense_reference(scheme: str, n: int, mode: str) -> None:
    own = ownership(scheme, n)
    rng = np.random.default_rng(seed_of("exchange", scheme, n, mode))
    torch.manual_seed(seed_of("exchange", scheme, n, mode))
    # a shared hot pool, so devices request the same rows and owners sum several sources
    ids = [draw_ids(rng, R, hot=60) for _ in range(n)]
    k = capacity(mode, [max(ref_plan(x, own, N)["load"]) for x in ids])
    refs = [ref_plan(x, own, k) for x in ids]
    table = torch.randn(R, D, dtype=torch.float64)
    grads = [torch.randint(-8, 9, (N, D)).to(torch.float64) for _ in range(n)]  # integer-valued: exact sums
    plans, looked, summed_phys = simulate(own, [torch.tensor(x) for x in ids], table, grads, k)

    full = torch.zeros(R, D, dtype=torch.float64)  # dense reference over every valid position
    kept_only = torch.zeros(R, D, dtype=torch.float64)  # over the positions whose id was routed
    for s in range(n):
        idx = torch.tensor(ids[s])
        valid = (idx >= 0) & (idx < R)
        kept = torch.tensor([i in refs[s]["kept"] for i in ids[s]])
        assert not (kept & ~valid).any()
        want = torch.where(kept.unsqueeze(-1), table[idx.clamp(0, R - 1)], torch.zeros(()).double())
        assert torch.equal(looked[s], want), f"device {s}"
        full.index_add_(0, idx[valid], grads[s][valid])
        kept_only.index_add_(0, idx[kept], grads[s][kept])
        assert ((plans[s].load - k).clamp(min=0)).tolist() == refs[s]["dropped"]
    summed = summed_phys[own.physical_row(torch.arange(R))]  # back to logical order
    assert torch.equal(summed, kept_only)
    dropped = sum(sum(r["dropped"]) for r in refs)
    if mode == "roomy":
        assert dropped == 0 and torch.equal(summed, full)
    else:
        assert dropped > 0 and not torch.equal(summed, full)


# ---------------------------------------------------------------------------------------------------
# 3. The per-device helpers


def test_gather_owned_rows_sentinel_reads_zero() -> None:
    shard = torch.arange(1.0, 13.0).reshape(4, 3)  # the last row (the clamp target) is non-zero
    wanted = torch.tensor([[0, 4, 3], [4, 4, 1]], dtype=torch.int32)
    got = gather_owned_rows(shard, wanted)
    assert got.shape == (2, 3, 3) and got.dtype == shard.dtype
    zero = torch.zeros(3)
    want = torch.stack([torch.stack([shard[0], zero, shard[3]]), torch.stack([zero, zero, shard[1]])])
    assert torch.equal(got, want)


def test_rows_at_positions_spare_slot_reads_zero() -> None:
    rows_back = torch.arange(1.0, 13.0).reshape(4, 3)  # n·k = 4 slots
    slot = torch.tensor([0, 4, 3, 4, 1, 3])
    got = rows_at_positions(rows_back, slot)
    zero = torch.zeros(3)
    assert got.shape == (6, 3)
    assert torch.equal(got, torch.stack([rows_back[0], zero, rows_back[3], zero, rows_back[1], rows_back[3]]))


def test_bucket_rows_sums_duplicates_and_drops_padding() -> None:
    grad = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0], [1000.0, 2000.0], [5.0, 7.0]])
    slot = torch.tensor([1, 1, 4, 0, 1])  # n = 2, k = 2: slot 4 is padding / overflow
    got = bucket_rows(grad, slot, 2, 2)
    assert got.shape == (2, 2, 2) and got.dtype == grad.dtype
    want = torch.tensor([[[1000.0, 2000.0], [16.0, 29.0]], [[0.0, 0.0], [0.0, 0.0]]])
    assert torch.equal(got, want)


def test_bucket_rows_is_the_adjoint_of_rows_at_positions() -> None:
    """The backward the transport builds by hand is autograd's backward of the forward's gather."""
    torch.manual_seed(0)
    n, k = 3, 4
    slot = torch.randint(0, n * k + 1, (40,))
    rows_back = torch.randn(n * k, D, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(40, D, dtype=torch.float64)
    rows_at_positions(rows_back, slot).backward(grad)
    torch.testing.assert_close(rows_back.grad, bucket_rows(grad, slot, n, k).reshape(n * k, D), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# 4. Static shapes


@pytest.mark.parametrize("scheme", SCHEMES)
def test_shapes_depend_only_on_n_k_and_the_id_count(scheme: str) -> None:
    n, k = 4, 5
    own = ownership(scheme, n)
    rng = np.random.default_rng(seed_of("static", scheme))
    draws = [torch.tensor(draw_ids(rng, R, hot=8)), torch.tensor(draw_ids(rng, R, hot=90)),
             torch.full((N,), -1), torch.arange(N)]
    shapes = set()
    for ids in draws:
        plan = plan_routes(ids, own, k)
        rows = gather_owned_rows(torch.randn(R // n, D), plan.send)
        back = rows_at_positions(rows.reshape(n * k, D), plan.slot)
        buckets = bucket_rows(torch.randn(N, D), plan.slot, n, k)
        shapes.add(tuple((tuple(t.shape), t.dtype) for t in (plan.send, plan.slot, plan.load, rows, back, buckets)))
    assert shapes == {(((n, k), torch.int32), ((N,), torch.int64), ((n,), torch.int32), ((n, k, D), torch.float32),
                       ((N, D), torch.float32), ((n, k, D), torch.float32))}


# ---------------------------------------------------------------------------------------------------
# 5. No torch_xla


def test_import_does_not_load_torch_xla() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    code = ("import sys, torch, torch_tpu_embedding.routing as r; r.plan_routes(torch.tensor([1]), r.RowOwnership('mod', 8, 2), 1); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch_xla'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------------
# 6. capacity_for_load


@pytest.mark.parametrize(
    ("load", "kwargs", "want"),
    [
        (0, {}, 8),  # at least one slot, rounded up
        (8, {}, 16),  # 10 -> 16
        (64, {}, 80),  # 80 exactly: no extra multiple
        (55, {"headroom": 1.0}, 56),
        (56, {"headroom": 1.0}, 56),
        (57, {"headroom": 1.0, "multiple": 1}, 57),
        (100, {"headroom": 1.5, "multiple": 16}, 160),
        (101, {"headroom": 1.5, "multiple": 16}, 160),  # ceil(151.5) = 152 -> 160
        (7, {"headroom": 2.0, "multiple": 5}, 15),
        (10, {"multiple": 1}, 13),  # ceil(12.5)
        (40, {"headroom": 1.21}, 56),  # ceil(48.4) = 49 -> 56
    ],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_capacity_for_load(load: int, kwargs: dict, want: int) -> None:
    assert capacity_for_load(load, **kwargs) == want
    multiple = kwargs.get("multiple", 8)
    assert want % multiple == 0 and want >= load * kwargs.get("headroom", 1.25)


def test_capacity_for_load_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="headroom"):
        capacity_for_load(10, headroom=0.5)
    with pytest.raises(ValueError, match="largest_load"):
        capacity_for_load(-1)
    with pytest.raises(ValueError, match="multiple"):
        capacity_for_load(10, multiple=0)


@pytest.mark.parametrize(
    "ids, capacity, match",
    [
        (torch.tensor([[1, 2], [3, 4]]), 2, r"Argument `ids` must be a 1-D integer tensor .*\(2, 2\)"),
        (torch.tensor([1.0, 2.0]), 2, r"Argument `ids` must be a 1-D integer tensor .*torch.float32"),
        (torch.tensor([True, False]), 2, r"Argument `ids` must be a 1-D integer tensor .*torch.bool"),
        ([1, 2], 2, r"Argument `ids` must be a 1-D integer tensor .*list"),
        (torch.tensor([1, 2]), 0, r"Argument `capacity` must be an int and must be >= 1. Received: 0"),
        (torch.tensor([1, 2]), 1.5, r"Argument `capacity` must be an int and must be >= 1. Received: 1.5"),
    ],
    ids=["2-d", "float", "bool", "list", "capacity-0", "capacity-float"],
)
def test_plan_routes_rejects_bad_arguments(ids: object, capacity: object, match: str) -> None:
    """One device's ids as a 1-D integer tensor and a capacity >= 1; anything else is named, not mis-routed."""
    with pytest.raises(ValueError, match=match):
        plan_routes(ids, RowOwnership("mod", rows=8, num_shards=2), capacity)  # type: ignore[arg-type]
