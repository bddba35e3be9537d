"""The bookkeeping of the id exchange, without a device: ownership schemes, bucket capacity, chunk-aligned
optimizer slots, and the HLO collective counter (torch_tpu_embedding.xla.ownership / .hlo; no torch_xla)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch_tpu_embedding._rows.routing import _binomial_tail
from torch_tpu_embedding.routing import (
    RowOwnership,
    capacity_for_load,
    default_capacity,
    slot_from_table_order,
    slot_row,
    slot_rows,
    slot_table_order,
)
from torch_tpu_embedding.xla.hlo import collective_bytes, collectives, large_copies

R, C = 4096, 512


@pytest.mark.parametrize("scheme", ["range", "mod", "interleaved"])
@pytest.mark.parametrize("n", [1, 2, 4, 8, 512])
def test_ownership_is_a_bijection_onto_the_shards(scheme: str, n: int) -> None:
    own = RowOwnership(scheme, R, n, C)
    ids = torch.arange(R)
    phys = own.physical_row(ids)
    assert sorted(phys.tolist()) == list(range(R))  # a permutation
    assert torch.equal(own.logical_id(phys), ids)
    assert torch.equal(own.owner(ids), phys // (R // n))
    assert torch.equal(own.owner(ids) * (R // n) + own.local_row(ids), phys)
    assert torch.equal(torch.bincount(own.owner(ids), minlength=n), torch.full((n,), R // n))
    pad = torch.tensor([-1, R, R + 7])
    assert own.physical_row(pad).tolist() == [R] * 3 and own.owner(pad).tolist() == [n] * 3


def test_schemes_owners() -> None:
    ids = torch.arange(R)
    assert torch.equal(RowOwnership("range", R, 8).owner(ids), ids // (R // 8))
    assert torch.equal(RowOwnership("mod", R, 8).owner(ids), ids % 8)
    assert torch.equal(RowOwnership("mod", R, 8).local_row(ids), ids // 8)
    # interleaved: mod with the shards relabelled by bit reversal (3 bits at n = 8)
    bitrev3 = torch.tensor([0, 4, 2, 6, 1, 5, 3, 7])
    assert torch.equal(RowOwnership("interleaved", R, 8, C).owner(ids), bitrev3[ids % 8])


def test_interleaved_physical_order_is_independent_of_the_device_count() -> None:
    """The same physical table at every n (a checkpoint of it reshards in place); mod's order changes."""
    ids = torch.arange(R)
    inter = [RowOwnership("interleaved", R, n, C).physical_row(ids) for n in (1, 2, 4, 8, 64, 512)]
    assert all(torch.equal(p, inter[0]) for p in inter)
    assert not torch.equal(RowOwnership("mod", R, 2).physical_row(ids), RowOwnership("mod", R, 4).physical_row(ids))


@pytest.mark.parametrize("chunks", [512, 1536, 2560, 3 * 1024])
def test_interleaved_with_an_odd_factor_is_mod_relabelled(chunks: int) -> None:
    """C = m·2^b (m odd: 6 or 768 devices give lcm(512, n) = 1536): a bijection for every n dividing C;
    for n = m·2^j the owner is a one-to-one function of i % n (mod relabelled), the same physical order for
    all of them; other divisors still hold whole chunks, the same number each. C = 512 is the bit reversal."""
    m = chunks >> ((chunks & -chunks).bit_length() - 1)
    rows = 2 * chunks
    ids = torch.arange(rows)
    orders = []
    for n in [d for d in range(1, chunks + 1) if chunks % d == 0]:
        own = RowOwnership("interleaved", rows, n, chunks)
        phys = own.physical_row(ids)
        assert sorted(phys.tolist()) == list(range(rows)) and torch.equal(own.logical_id(phys), ids)
        owner = own.owner(ids)
        assert torch.equal(torch.bincount(owner, minlength=n), torch.full((n,), rows // n))
        if n % m == 0 and (n // m) & (n // m - 1) == 0:  # n = m·2^j
            first = owner[:n]
            assert sorted(first.tolist()) == list(range(n))  # one shard per residue
            assert torch.equal(owner, first[ids % n])
            orders.append(phys)
    assert all(torch.equal(p, orders[0]) for p in orders)
    if chunks == 512:
        bitrev3 = torch.tensor([0, 4, 2, 6, 1, 5, 3, 7])
        assert torch.equal(RowOwnership("interleaved", rows, 8, chunks).owner(ids), bitrev3[ids % 8])


def test_zipf_loads_range_vs_mod() -> None:
    """Unique ids per shard of one device's Zipf(1.1) ids (id 0 hottest): range puts the head on shard 0."""
    g = np.random.default_rng(0)
    p = 1.0 / np.arange(1, R + 1) ** 1.1
    ids = torch.unique(torch.from_numpy(g.choice(R, size=576, p=p / p.sum())))
    loads = {s: torch.bincount(RowOwnership(s, R, 8, C).owner(ids), minlength=8) for s in ("range", "mod", "interleaved")}
    assert loads["range"].max() > 0.6 * len(ids)
    assert loads["mod"].max() < 0.25 * len(ids)
    assert sorted(loads["mod"].tolist()) == sorted(loads["interleaved"].tolist())  # the same loads, relabelled


def test_ownership_errors() -> None:
    with pytest.raises(ValueError, match=r"Argument `scheme` must be one of"):
        RowOwnership("hash", R, 4)
    with pytest.raises(ValueError, match=r"Argument `rows` must be a multiple of num_shards=3"):
        RowOwnership("mod", 4096, 3)
    with pytest.raises(ValueError, match=r"'interleaved' needs `chunks` divisible by num_shards and dividing rows"):
        RowOwnership("interleaved", 3 * 512, 3, 512)
    with pytest.raises(ValueError, match=r"'interleaved' needs `chunks` divisible by num_shards and dividing rows"):
        RowOwnership("interleaved", 2 * 1536 + 3, 3, 1536)


def test_binomial_tail_matches_the_exact_sum() -> None:
    for trials, p, c in [(10, 0.5, 5), (576, 0.125, 100), (576, 0.5, 300), (40, 0.25, 39)]:
        exact = sum(math.comb(trials, j) * p**j * (1 - p) ** (trials - j) for j in range(c + 1, trials + 1))
        assert _binomial_tail(trials, p, c) == pytest.approx(exact, rel=1e-9, abs=1e-300)


def test_default_capacity() -> None:
    caps = {n: default_capacity(576, n) for n in (1, 2, 4, 8, 64)}
    assert caps == {1: 576, 2: 352, 4: 208, 8: 120, 64: 40}
    for n, k in caps.items():
        if n > 1:  # the smallest multiple of 8 whose n² buckets overflow with probability <= 1e-6
            assert n * n * _binomial_tail(576, 1 / n, k) <= 1e-6 < n * n * _binomial_tail(576, 1 / n, k - 8)
    assert default_capacity(10, 4) == 10  # never more than the ids of a device
    assert default_capacity(576, 8, multiple=1) == 119
    with pytest.raises(ValueError, match=r"Argument `num_shards` must be an int and must be >= 1. Received: 0"):
        default_capacity(576, 0)
    assert capacity_for_load(55) == 72 and capacity_for_load(0) == 8 and capacity_for_load(55, headroom=1.0) == 56


@pytest.mark.parametrize("k", [1, 2, 3])
def test_chunked_slots_align_with_the_table_shards(k: int) -> None:
    """Slot k: k trash rows after each of C chunks. For every n dividing C, shard d of the slot holds the slot
    rows of exactly the table rows of shard d (and k·C/n trash rows); today's layout (trash at the end) does not."""
    c = R // C
    rows = slot_rows(R, k, C)
    assert rows == R + k * C
    at = slot_row(torch.arange(R), k, c)
    assert len(set(at.tolist())) == R and int(at.max()) < rows
    for n in (1, 2, 4, 8, 16, 512):
        table_shard, slot_shard = R // n, rows // n
        assert torch.equal(at // slot_shard, torch.arange(R) // table_shard)  # same shard
        local = torch.arange(table_shard)
        for d in (0, n - 1):  # the local formula is the global one with local rows
            assert torch.equal(at[d * table_shard + local] - d * slot_shard, slot_row(local, k, c))
        assert int(slot_row(torch.tensor(table_shard), k, c)) == slot_shard  # the local sentinel: one past the end
        end_trash_shard = torch.arange(R) // ((R + k * C) // n)  # logical row r at slot row r
        if n > 1:
            assert not torch.equal(end_trash_shard, torch.arange(R) // table_shard)
    values = torch.randn(R, 3)
    slot = slot_from_table_order(values, k, C, fill=-1.0)
    assert slot.shape == (rows, 3)
    assert torch.equal(slot[at], values) and torch.equal(slot_table_order(slot, k, C), values)
    assert int((slot == -1.0).all(1).sum()) == k * C


HLO = """
  %all-to-all.2 = (s32[1,1,1,6]{3,2,1,0}, s32[1,1,1,6]{3,2,1,0}) all-to-all(%a, %b), channel_id=1, replica_groups={{0,1}}
  %all-reduce = f32[64,16]{1,0} all-reduce(%x), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %all-gather-start = (s64[48]{0}, s64[96]{0}) all-gather-start(%ids), channel_id=3, dimensions={0}
  %all-gather-done = s64[96]{0} all-gather-done(%all-gather-start)
  ROOT %r = s32[] all-reduce(%c), channel_id=4, replica_groups={{0,1}}, to_apply=%add.1
  %copy.7 = f32[100000,64]{1,0} copy(%p7)
  %copy.8 = f32[12,64]{1,0} copy(%p8)
"""


def test_hlo_collectives_count_tuple_and_async_results() -> None:
    ops = collectives(HLO)
    assert [op for op, _, _ in ops] == ["all-to-all", "all-reduce", "all-gather", "all-reduce"]
    assert collective_bytes(HLO) == {"all-to-all": 2 * 6 * 4, "all-reduce": 64 * 16 * 4 + 4, "all-gather": 96 * 8}
    assert large_copies(HLO, 1000) == [(100000, 64)]
