"""A stacked group's host ids joined by one C pass (``c_gather.join_ids``, ``AssembledBatch.join``): the features'
ids side by side, shifted to their tables' rows, each checked against its own table's rows, ids masked out written as
the padding id (and not checked), int32 where asked and they fit. Bitwise ``torch.stack`` + the add of the shifts (+
``torch.where`` of the masks); where it does not apply (library not loaded, other dtypes, strides, shapes, an id out
of range) the torch ops run as before, and a bad id raises the feature's own error. Host ids bound for an accelerator
take it on XLA (tests/xla/test_cached_plan_xla.py) and on the meta device (tests/optim/test_sync_free_step.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_cached_plan import _variants, test_another_signature_plans_afresh
from test_stacked_groups import _CountOps

import torch_tpu_embedding as tte
from torch_tpu_embedding.modules import assembly
from torch_tpu_embedding.optim._kernels import c_library
from torch_tpu_embedding.optim._kernels.c_gather import join_ids


@pytest.fixture
def lib() -> Iterator[c_library.Library]:
    found = c_library.library()
    if found is None:
        pytest.skip("no C compiler builds the library here")
    yield found


@pytest.mark.parametrize("features", [1, 3, 7])
@pytest.mark.parametrize("width", [0, 1, 5])  # (0: dense ids, [B])
def test_join_ids_is_stack_plus_shift(lib: c_library.Library, features: int, width: int) -> None:
    g = torch.Generator().manual_seed(features * 10 + width)
    vocabs = [int(v) for v in torch.randint(1, 1000, (features,), generator=g)]
    shifts = [sum(vocabs[:f]) for f in range(features)]
    shape = (33,) if width == 0 else (33, width)
    values = [torch.randint(0, v, shape, generator=g) for v in vocabs]
    got = join_ids(values, shape, shifts, vocabs)
    want = torch.stack([v if width else v.unsqueeze(-1) for v in values], 1) \
        + torch.tensor(shifts).view(1, -1, 1)
    assert got is not None and got.dtype == torch.int64 and torch.equal(got, want)
    assert all(got.data_ptr() != v.data_ptr() for v in values)  # (never the caller's)


@pytest.mark.parametrize("narrow", [False, True])
@pytest.mark.parametrize("b,width", [(33, 4), (700, 3), (5, 512), (3000, 1)])  # (blocks of 512 ids: cut, whole, one)
def test_join_ids_with_masks_pads_and_narrows(lib: c_library.Library, narrow: bool, b: int, width: int) -> None:
    g = torch.Generator().manual_seed(b + width)
    vocabs = [int(v) for v in torch.randint(1, 1000, (5,), generator=g)]
    shifts = [sum(vocabs[:f]) for f in range(5)]
    sentinel = sum(vocabs)
    values = [torch.randint(0, v, (b, width), generator=g) for v in vocabs]
    masks = [torch.rand(b, width, generator=g) > 0.3 for _ in vocabs]
    for v, m in zip(values, masks, strict=True):  # masked out: any value, unchecked
        v[~m] = torch.randint(-10**12, 10**12, (int((~m).sum()),), generator=g)
    got = join_ids(values, (b, width), shifts, vocabs, masks, sentinel, narrow)
    want = torch.where(torch.stack(masks, 1), torch.stack(values, 1) + torch.tensor(shifts).view(1, -1, 1), sentinel)
    assert got is not None and got.dtype == (torch.int32 if narrow else torch.int64)
    assert torch.equal(got.to(torch.int64), want)
    masks[3][b // 2, width - 1] = True  # a kept id out of range: the torch ops' join (and its error)
    values[3][b // 2, width - 1] = vocabs[3]
    assert join_ids(values, (b, width), shifts, vocabs, masks, sentinel, narrow) is None
    assert join_ids(values, (b, width), shifts, vocabs, [*masks[:4], masks[4].to(torch.uint8)], sentinel) is None


def test_join_ids_narrows_only_what_fits_and_takes_bags_of_at_most_512_ids(lib: c_library.Library) -> None:
    ids = torch.randint(0, 10, (8, 3))
    big = join_ids([ids, ids], (8, 3), [0, 2**31 - 10], [10, 10], None, 0, True)  # (the last row: 2**31 - 1)
    assert big is not None and big.dtype == torch.int32 and int(big[:, 1].max()) <= 2**31 - 1
    over = join_ids([ids, ids], (8, 3), [0, 2**31 - 9], [10, 10], None, 0, True)
    assert over is not None and over.dtype == torch.int64 and torch.equal(over[:, 1], ids + 2**31 - 9)
    assert join_ids([ids], (8, 3), [0], [10], [ids > 4], 2**31, True).dtype == torch.int64  # (the padding id)
    low = join_ids([ids], (8, 3), [0], [10], [ids > 4], -(2**31) - 1, True)  # (a padding id below int32's)
    assert low is not None and low.dtype == torch.int64 and int(low.min()) == -(2**31) - 1
    wide = torch.randint(0, 10, (2, 513))
    assert join_ids([wide], (2, 513), [0], [10]) is None
    assert torch.equal(join_ids([wide[:, :512].contiguous()], (2, 512), [3], [10]), wide[:, None, :512] + 3)


def test_join_ids_splits_large_joins_over_threads(lib: c_library.Library) -> None:
    """At least 2**17 ids per thread: bag ranges joined on several threads at once, each checked."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(3)
        values = [torch.randint(0, 50, (40_000, 4), generator=g) for _ in range(2)]
        masks = [torch.rand(40_000, 4, generator=g) > 0.5 for _ in range(2)]
        got = join_ids(values, (40_000, 4), [0, 50], [50, 50], masks, 100, True)
        want = torch.where(torch.stack(masks, 1), torch.stack(values, 1) + torch.tensor([0, 50]).view(1, 2, 1), 100)
        assert got is not None and torch.equal(got.to(torch.int64), want)
        values[1][39_999, 3], masks[1][39_999, 3] = 50, True  # (in the second thread's range)
        assert join_ids(values, (40_000, 4), [0, 50], [50, 50], masks, 100, True) is None
    finally:
        torch.set_num_threads(before)


def test_join_ids_leaves_what_it_does_not_take_to_torch(lib: c_library.Library) -> None:
    ids = torch.randint(0, 10, (8, 3))
    ok = join_ids([ids, ids], (8, 3), [0, 10], [10, 10])
    assert ok is not None
    for bad in (-1, 10):  # (below 0, and the table's row count)
        wrong = ids.clone()
        wrong[5, 2] = bad
        assert join_ids([ids, wrong], (8, 3), [0, 10], [10, 10]) is None
    assert join_ids([ids, ids.to(torch.int32)], (8, 3), [0, 10], [10, 10]) is None
    assert join_ids([ids, torch.randint(0, 10, (3, 8)).t()], (8, 3), [0, 10], [10, 10]) is None  # (strided)
    assert join_ids([ids, ids[:4]], (8, 3), [0, 10], [10, 10]) is None
    assert join_ids([ids[:0], ids[:0]], (0, 3), [0, 10], [10, 10]) is None
    assert join_ids([], (8, 3), [], []) is None
    column = torch.randint(0, 10, (8, 1))  # (a [B, 1] among [B] values, or the other way: not the shape given)
    assert join_ids([column[:, 0], column], (8,), [0, 10], [10, 10]) is None
    assert join_ids([column, column[:, 0]], (8, 1), [0, 10], [10, 10]) is None


def _model(padded: bool) -> tte.EmbeddingCollection:
    # one stacked group of tables of different sizes: ids of the larger ones pass the smallest's row count
    tables = [tte.TableConfig(rows, 4, name=f"t{i}", combiner="mean") for i, rows in enumerate((30, 500, 70))]
    width = 3 if padded else None
    return tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t, max_ids_per_bag=width) for i, t in enumerate(tables)})


def _batch(padded: bool, s: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(s)
    out: dict[str, Any] = {}
    for i, rows in enumerate((30, 500, 70)):
        ids = torch.randint(0, rows, (16, 3) if padded else (16,), generator=g)
        out[f"f{i}"] = tte.Padded(ids) if padded else ids
    return out


def _train(padded: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[Any]]:
    torch.manual_seed(0)
    ec = _model(padded)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    outs, counts = [], []
    for s in range(4):
        batch = _batch(padded, s)
        with _CountOps() as ops:
            out = ec(batch)
        counts.append(ops.counts)
        joined = torch.cat([out[f] for f in ec.feature_names], 1)
        outs.append(joined.detach().clone())
        (joined * torch.linspace(-1, 1, joined.shape[1])).sum().backward()
        opt.step()
        opt.zero_grad()
    return outs, {k: v.clone() for k, v in ec.state_dict().items()}, counts


@pytest.mark.parametrize("padded", [True, False])
def test_a_stacked_group_joins_in_one_pass_and_trains_bitwise_alike(lib: c_library.Library, padded: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    got_outs, got, counts = _train(padded)
    with monkeypatch.context() as m:
        m.setattr(assembly, "join_ids", lambda *args: None)  # the torch ops' join
        want_outs, want, old_counts = _train(padded)
    for a, b in zip(got_outs, want_outs, strict=True):
        assert torch.equal(a, b)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    for c, old in zip(counts[1:], old_counts[1:], strict=True):  # (the first: full_mean_gain's first call too)
        assert c["stack"] == 0 and c["aminmax"] == 0 and c["_local_scalar_dense"] == 0, c
        assert old["stack"] == 1 and old["aminmax"] == 1, old  # (the test sees the ops it replaces)
        assert sum(c.values()) < sum(old.values())


@pytest.mark.parametrize("bad", [-1, 70])
def test_a_bad_id_raises_the_features_own_error(lib: c_library.Library, bad: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ec = _model(True)
    ec(_batch(True, 0))  # (the group's plan kept: the next call replays it)
    batch = _batch(True, 1)
    batch["f2"].ids[3, 1] = bad
    with pytest.raises(Exception) as got:
        ec(batch)
    with monkeypatch.context() as m:
        m.setattr(assembly, "join_ids", lambda *args: None)
        with pytest.raises(Exception) as want:
            ec(batch)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert "f2" in str(got.value)


def test_a_changed_form_between_replayed_steps_is_not_joined_as_the_plans(lib: c_library.Library,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense ids ``[B]``, then ``[B, 1]`` for one feature, then ``[B]`` again: each step's plan fits its own forms (the
    C join takes the signature's shape, as ``torch.stack`` refuses unequal ones), bitwise as the torch ops' join."""

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        ec = _model(False)
        outs = []
        for s, column in enumerate((False, False, True, False, False)):
            batch = _batch(False, s)
            if column:
                batch["f1"] = batch["f1"].unsqueeze(1)
            out = ec(batch)
            outs.append(torch.cat([out[f] for f in ec.feature_names], 1).detach().clone())
        return outs

    got = run()
    with monkeypatch.context() as m:
        m.setattr(assembly, "join_ids", lambda *args: None)
        want = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("name,change", _variants(), ids=[n for n, _ in _variants()])
def test_cached_plans_with_the_c_join(lib: c_library.Library, name: str, change: Any,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """test_cached_plan's changed forms between replayed steps, with the library loaded (the C join taken)."""
    test_another_signature_plans_afresh(name, change, monkeypatch)


def test_join_ids_reads_the_ids_values_not_their_memory(lib: c_library.Library) -> None:
    """A tensor whose values are not its memory as it lies (a negative view: memory ``x``, values ``-x``) is joined
    as its values, by the torch ops: the C pass, reading memory, took ids ``x`` of the table where the values are
    negative and the torch ops raise."""
    ids = torch.randint(1, 10, (8, 3))
    neg = torch._neg_view(ids)  # values -ids, out of every table's range
    assert join_ids([ids, neg], (8, 3), [0, 10], [10, 10]) is None
    back = torch._neg_view(-ids)  # values ids, memory -ids
    got = join_ids([back], (8, 3), [5], [10])
    assert got is None or torch.equal(got, ids.unsqueeze(1) + 5)


def test_join_ids_leaves_a_tensor_without_memory_to_torch(lib: c_library.Library) -> None:
    """A zero tensor (``_efficientzerotensor``: no storage, ``data_ptr()`` 0) is not read through its null pointer
    (which crashed the process): the torch ops join its zeros."""
    zeros = torch._efficientzerotensor((8, 3), dtype=torch.int64)
    got = join_ids([zeros], (8, 3), [4], [10])
    assert got is None or torch.equal(got, torch.full((8, 1, 3), 4))


def test_a_negative_view_of_ids_raises_the_features_own_error(lib: c_library.Library,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's join of a feature given a negative view (values out of range, memory in range) raises the
    feature's own error, as the torch ops' join does, instead of looking up the rows its memory names."""
    ec = _model(True)
    ec(_batch(True, 0))
    batch = _batch(True, 1)
    batch["f1"] = tte.Padded(torch._neg_view(batch["f1"].ids.clamp(min=1)))
    with monkeypatch.context() as m:
        m.setattr(assembly, "join_ids", lambda *args: None)
        with pytest.raises(Exception) as want:
            ec(batch)
    with pytest.raises(Exception) as got:
        ec(batch)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert "f1" in str(got.value)


def _misaligned(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` (int64) copied into memory 3 bytes past an 8-byte boundary, as ``torch.frombuffer`` of a packed record
    with a 3-byte header makes it: a tensor torch's ops read as any other."""
    buf = bytearray(ids.numel() * 8 + 8)
    at = (3 - torch.frombuffer(buf, dtype=torch.uint8).data_ptr()) % 8
    out = torch.frombuffer(buf, dtype=torch.int64, count=ids.numel(), offset=at)
    out.copy_(ids.reshape(-1))
    return out.view(ids.shape)


def test_join_ids_is_never_handed_misaligned_ids(lib: c_library.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    """int64 ids whose memory does not start on an 8-byte boundary are joined by the torch ops: the C pass reads them
    as ``int64_t`` (a misaligned load is undefined behaviour: UBSan's "load of misaligned address", and where the
    compiler aligns its vector loads to the pointer's type, a fault), at the group's lookup too."""
    handed: list[int] = []

    def seen(out: int, narrow: int, src: Any, *rest: Any) -> int:
        handed.extend(src[f] for f in range(rest[4]))  # (rest[4]: the number of features)
        return lib.join_ids(out, narrow, src, *rest)

    spy = lib._replace(join_ids=seen)
    ids = torch.randint(0, 10, (64, 3))
    odd = _misaligned(ids)
    assert odd.data_ptr() % 8 and torch.equal(odd, ids)
    got = join_ids([ids, odd], (64, 3), [0, 10], [10, 10], None, 20, False, False, spy)
    assert all(p % 8 == 0 for p in handed), [p % 8 for p in handed]
    assert got is None or torch.equal(got, torch.stack([ids, ids + 10], 1))
    monkeypatch.setattr(c_library, "_LIBRARY", [spy])  # (the library a host table's join takes once loaded)
    ec = _model(True)
    batch = _batch(True, 0)
    want = ec(batch)
    assert handed  # (the spy sees the group's join)
    handed.clear()
    batch["f1"] = tte.Padded(_misaligned(batch["f1"].ids))
    out = ec(batch)
    assert all(p % 8 == 0 for p in handed), [p % 8 for p in handed]
    assert all(torch.equal(out[f], want[f]) for f in want)
