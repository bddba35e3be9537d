"""The fused C row update of RowWiseAdagrad and Adam (``optim/_kernels/c_rules.py``) against their rules.

The loop alone, for every option it accepts (RowWiseAdagrad: ``eps``, ``weight_decay``; Adam: ``betas``, ``eps``,
``sum_inside_sqrt``, ``bias_correction``), on the summed rows as given and on a factored gradient it sums itself
(per-id weights or one gain per bag, ids repeated, padding trailing): against the optimizer's rule in torch within
what tests/optim/test_kernel_update.py asks of the kernel path (torch's float32 ``sqrt`` on the CPU is not IEEE's
correctly rounded one: it differs from C's and numpy's in the last bit), and bitwise against a float32 numpy
statement of the rule in the loop's order (IEEE operations, each rounded once); the same result at 1 and 2
threads; ids or contributions outside their arrays refused with nothing written. In training: the kernel path of
these optimizers runs the loop (no inductor kernel is compiled) and equals the reference path; options it does not
cover (``clipvalue``, EMA, float64 tables, a subclass's own rule) take the compiled kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_row_sums import _pieces  # (a sibling module: tests/optim is on sys.path, tests/conftest.py)

import torch_tpu_embedding as tte
from torch_tpu_embedding._util.registry import RULE_KEY
from torch_tpu_embedding.optim._kernels import c_library, c_rules, kernel_policy, row_update
from torch_tpu_embedding.optim._kernels.row_sums import RowSums, row_sums
from torch_tpu_embedding.optim.adam import adam_rule
from torch_tpu_embedding.optim.rowwise_adagrad import rowwise_adagrad_rule

ROWS, DIM, UNIQUE = 700, 24, 300  # DIM: 16 lanes and a tail of 8

ADAGRAD = [{"eps": 1e-10, "weight_decay": 0.0}, {"eps": 1e-3, "weight_decay": 0.05}]
ADAM = [{"betas": b, "eps": e, "sum_inside_sqrt": inside, "bias_correction": bias}
        for b, e in [((0.9, 0.999), 1e-7), ((0.5, 0.75), 1e-3)] for inside in (True, False) for bias in (False, True)]
CASES = [("rowwise_adagrad", hp) for hp in ADAGRAD] + [("adam", hp) for hp in ADAM]


def _id(case: tuple[str, dict[str, Any]]) -> str:
    name, hp = case
    return name + "".join(f"-{k}={v}" for k, v in hp.items())


@pytest.fixture
def lib() -> c_library.Library:
    found = c_library.library()
    if found is None:
        pytest.skip("no C compiler builds the library here")
    return found


def _problem(name: str, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(ROWS, DIM, generator=g)
    slots = [torch.rand(ROWS, generator=g)] if name == "rowwise_adagrad" else \
        [torch.randn(ROWS, DIM, generator=g) * 0.1, torch.rand(ROWS, DIM, generator=g) * 0.01]
    ids = torch.randperm(ROWS, generator=g)[:UNIQUE].sort().values
    rows = torch.randn(UNIQUE, DIM, generator=g)
    return p, slots, ids, rows


def _factored(ids: torch.Tensor, weighted: bool) -> tuple[RowSums, torch.Tensor]:
    """A factored gradient of ``ids`` (each looked up 1–3 times, and 5 padding lookups trailing) and its sum per
    id as :meth:`RowSums.rows` makes it."""
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(1, 4, (ids.shape[0],), generator=g)
    offsets = torch.zeros(ids.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    src = torch.randn(int(offsets[-1]) // 2 + 1, DIM, generator=g)
    cols = torch.randint(0, src.shape[0], (int(offsets[-1]) + 5,), generator=g)
    weights = torch.rand(cols.shape[0], generator=g) if weighted else None
    sums = RowSums(ids, offsets, cols, weights, src)
    return sums, sums.rows()


def _hp(name: str, hp: dict[str, Any], lr: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    group = {"eps": 1e-10, "weight_decay": 0.0, "betas": (0.9, 0.999), "sum_inside_sqrt": True,
             "bias_correction": False, **hp}

    class Item:  # (what c_rules._hp reads of a Work)
        pass

    item: Any = Item()
    item.group, item.lr = group, lr
    return c_rules._hp(name, item, step)


def _refused_unwritten(lib: c_library.Library, name: str, p: torch.Tensor, slots: list[torch.Tensor], ids: torch.Tensor,
                       sums: RowSums, threads: int, match: str) -> None:
    """``run_rows`` of loop ``name`` at ``threads`` threads raises ``IndexError`` matching ``match``, and the table
    and its slots are as they were (a refused step writes nothing)."""
    p0, s0 = p.clone(), [s.clone() for s in slots]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.raises(IndexError, match=match):
            c_rules.run_rows(getattr(lib, name), p, slots, ids, sums, torch.empty(0, DIM),
                             _hp(name, {}, torch.tensor(0.1), torch.tensor(1.0)))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(p, p0) and all(torch.equal(a, b) for a, b in zip(slots, s0, strict=True))


def _rule(name: str, hp: dict[str, Any], p: torch.Tensor, slots: list[torch.Tensor], ids: torch.Tensor,
          rows: torch.Tensor, lr: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The optimizer's rule in torch on the rows ``ids`` (as the reference path runs it), written back."""
    p, slots = p.clone(), [s.clone() for s in slots]
    names = ["accumulators"] if name == "rowwise_adagrad" else ["momenta", "velocities"]
    rule = rowwise_adagrad_rule if name == "rowwise_adagrad" else adam_rule
    w, new = rule(p[ids], rows, {k: s[ids] for k, s in zip(names, slots, strict=True)}, lr, step, hp, None)
    p[ids] = w
    for k, s in zip(names, slots, strict=True):
        s[ids] = new[k]
    return p, slots


def _numpy(name: str, hp: dict[str, Any], p: torch.Tensor, slots: list[torch.Tensor], ids: torch.Tensor,
           rows: torch.Tensor, h: torch.Tensor) -> tuple[np.ndarray, list[np.ndarray]]:
    """The rule in float32 numpy, each operation rounded once, in the loop's order (RowWiseAdagrad's sum of
    ``g²`` in 16 lanes over the whole blocks of 16, halved 8, 4, 2, 1, then the rest added in order)."""
    f = np.float32
    p_, s_ = p.numpy().copy(), [s.numpy().copy() for s in slots]
    i, g, hv = ids.numpy(), rows.numpy().astype(f), h.numpy()
    w = p_[i]
    if name == "rowwise_adagrad":
        lr, eps, wd = hv
        if wd != 0:
            g = g + wd * w
        sq = g * g
        full = DIM - DIM % 16
        lanes = np.zeros((g.shape[0], 16), f)
        for j in range(full):
            lanes[:, j % 16] += sq[:, j]
        for q in (8, 4, 2):
            lanes[:, :q] += lanes[:, q : 2 * q]
        total = lanes[:, 0] + lanes[:, 1]
        for j in range(full, DIM):
            total += sq[:, j]
        m = s_[0][i] + total / f(DIM)
        s_[0][i] = m
        p_[i] = w - (lr * g) / (np.sqrt(m) + eps)[:, None]
    else:
        lr, b1, c1, b2, c2, eps, inside = hv
        m = b1 * s_[0][i] + c1 * g
        v = b2 * s_[1][i] + (c2 * g) * g
        s_[0][i], s_[1][i] = m, v
        p_[i] = w - (lr * m) / (np.sqrt(v + eps) if inside else np.sqrt(v) + eps)
    return p_, s_


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("grad", ["rows", "factored", "factored_weighted"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_loop_is_the_rule(lib: c_library.Library, case: tuple[str, dict[str, Any]], grad: str, threads: int,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    name, hp = case
    monkeypatch.setattr(c_rules, "_MIN_ROWS_PER_THREAD", 64)  # (small rows: split over threads all the same)
    p, slots, ids, rows = _problem(name)
    sums = None
    if grad != "rows":
        sums, rows = _factored(ids, weighted=grad == "factored_weighted")
    lr, step = torch.tensor(0.05), torch.tensor(3.0)
    h = _hp(name, hp, lr, step)
    want_p, want_s = _rule(name, hp, p, slots, ids, rows, lr, step)
    exact_p, exact_s = _numpy(name, hp, p, slots, ids, rows, h)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        c_rules.run_rows(getattr(lib, name), p, slots, ids, sums, rows if sums is None else torch.empty(0, DIM), h)
    finally:
        torch.set_num_threads(before)
    np.testing.assert_array_equal(p.numpy(), exact_p)
    for s, e in zip(slots, exact_s, strict=True):
        np.testing.assert_array_equal(s.numpy(), e)
    torch.testing.assert_close(p, want_p, rtol=1e-6, atol=1e-6)
    for s, e in zip(slots, want_s, strict=True):
        torch.testing.assert_close(s, e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("bad", ["float64_slot", "slot_shape", "strided_table", "float64_table", "short_hp",
                                 "zero_tensor_rows"])
def test_the_loop_refuses_a_table_slots_or_rows_it_would_misread_and_writes_nothing(lib: c_library.Library, name: str,
                                                                                   bad: str) -> None:
    """The loop writes the table and its slots through their pointers as contiguous float32 of the table's shape
    (a slot ``[rows]`` for RowWiseAdagrad, ``[rows, D]`` for Adam) and reads 3 or 7 hyper-parameters: anything
    else was written silently wrong (float32 bits in a float64 slot, rows of a wider slot); a zero tensor of rows
    (no memory: a null pointer) crashed the process. Each is refused, nothing written."""
    p, slots, ids, rows = _problem(name)
    h = _hp(name, {}, torch.tensor(0.1), torch.tensor(1.0))
    if bad == "float64_slot":
        slots[0] = slots[0].double()
    elif bad == "slot_shape":  # (more memory than the loop reads: wrong, not out of bounds)
        slots[0] = slots[0].reshape(ROWS, -1).repeat(1, 2)
    elif bad == "strided_table":
        p = torch.randn(DIM, ROWS).t()
    elif bad == "float64_table":
        p = p.double()
    elif bad == "short_hp":
        h = h[:2].clone()
    else:
        rows = torch._efficientzerotensor(rows.shape)
    p0, s0 = p.clone(), [s.clone() for s in slots]
    with pytest.raises(ValueError, match="run_rows"):
        c_rules.run_rows(getattr(lib, name), p, slots, ids, None, rows, h)
    assert torch.equal(p, p0) and all(torch.equal(a, b) for a, b in zip(slots, s0, strict=True))


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("bad", ["id_above", "id_below", "col_above"])
def test_the_loop_refuses_rows_outside_and_writes_nothing(lib: c_library.Library, name: str, bad: str) -> None:
    p, slots, ids, _ = _problem(name)
    sums, _ = _factored(ids, weighted=False)
    if bad == "id_above":
        ids[-1] = ROWS
    elif bad == "id_below":
        ids[0] = -1
    else:
        sums.cols[0] = sums.src.shape[0]
    sums.ids = ids
    p0, s0 = p.clone(), [s.clone() for s in slots]
    with pytest.raises(IndexError, match="outside"):
        c_rules.run_rows(getattr(lib, name), p, slots, ids, sums, torch.empty(0, DIM),
                         _hp(name, {}, torch.tensor(0.1), torch.tensor(1.0)))
    assert torch.equal(p, p0) and all(torch.equal(a, b) for a, b in zip(slots, s0, strict=True))


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("bad", ["first_id_below", "last_id_above", "last_col_above"])
def test_over_threads_a_refused_range_leaves_every_range_unwritten(lib: c_library.Library, name: str, bad: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads, one range each: an id or a gradient row outside in one range writes nothing in the other
    either (a failed step changes nothing), whichever range it is in."""
    monkeypatch.setattr(c_rules, "_MIN_ROWS_PER_THREAD", 64)  # (UNIQUE ids: two ranges of 150)
    p, slots, ids, _ = _problem(name)
    sums, _ = _factored(ids, weighted=False)
    if bad == "first_id_below":
        ids[0] = -1
    elif bad == "last_id_above":
        ids[-1] = ROWS
    else:  # the last id's first contribution
        sums.cols[int(sums.offsets[-2])] = sums.src.shape[0]
    sums.ids = ids
    _refused_unwritten(lib, name, p, slots, ids, sums, 2, "outside")


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("bad", ["duplicate_in_a_range", "duplicate_across_ranges", "descending"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_loop_refuses_ids_not_distinct_and_ascending_and_writes_nothing(lib: c_library.Library, name: str, bad: str,
                                                                            threads: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop takes distinct ids, ascending (as the duplicate sum and ``torch.unique`` give them): an id twice
    was updated twice from its one gradient (at one thread) or by two threads at once when its copies fell in two
    ranges (a race: a result that depends on timing), silently. Refused, nothing written, wherever the two are."""
    monkeypatch.setattr(c_rules, "_MIN_ROWS_PER_THREAD", 64)  # (UNIQUE ids: two ranges of 150 at 2 threads)
    p, slots, ids, _ = _problem(name)
    half = UNIQUE // 2
    if bad == "duplicate_in_a_range":
        ids[10] = ids[9]
    elif bad == "duplicate_across_ranges":  # (the last id of the first range, the first of the second)
        ids[half] = ids[half - 1]
    else:
        ids[10], ids[11] = ids[11].clone(), ids[10].clone()
    sums, _ = _factored(ids, weighted=False)
    _refused_unwritten(lib, name, p, slots, ids, sums, threads, "distinct and ascending")


# ------------------------------------------------------------------------------------------------- in training
@pytest.fixture
def kernel_path(monkeypatch: pytest.MonkeyPatch, lib: c_library.Library) -> Iterator[list[str]]:
    """The kernel path from the first step; the rules the C loop ran, one entry per update."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    before = kernel_policy.set_policy(0, 0)
    ran: list[str] = []
    real = c_rules.run_rows

    def counted(fn: Any, *args: Any) -> None:
        ran.append("ran")
        real(fn, *args)

    monkeypatch.setattr(c_rules, "run_rows", counted)
    yield ran
    kernel_policy.set_policy(*before)


def _train(make: Any, dtype: torch.dtype = torch.float32, steps: int = 3) -> tuple[dict[str, torch.Tensor], Any]:
    torch.manual_seed(0)
    t = tte.TableConfig(400, 8, name="t", combiner="sqrtn", dtype=dtype)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=4), "b": tte.FeatureConfig(t)})
    opt = make(ec.parameters())
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, 400, (64, 4), generator=g)
        out = ec({"a": tte.Padded(ids, ids % 5 != 0), "b": torch.randint(0, 400, (64,), generator=g)})
        (out["a"] * out["b"]).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in ec.state_dict().items()}, opt.state_dict()


OPTIMIZERS = {
    "rowwise_adagrad": lambda ps: tte.optim.RowWiseAdagrad(ps, lr=0.1, weight_decay=0.01),
    "lazy_adam": lambda ps: tte.optim.LazyAdam(ps, lr=0.01),
    "adam_sparseadam": lambda ps: tte.optim.Adam(ps, lr=0.01, bias_correction=True, sum_inside_sqrt=False),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_training_runs_the_loop_without_compiling_and_equals_the_reference_path(kernel_path: list[str],
                                                                                 opt: str) -> None:
    compiled = row_update.compiled_kernels()
    ours = _train(OPTIMIZERS[opt])
    assert len(kernel_path) == 3  # one update per step, each through the loop
    assert row_update.compiled_kernels() == compiled  # no inductor kernel built for these rules
    kernel_policy.set_enabled(False)
    try:
        reference = _train(OPTIMIZERS[opt])
    finally:
        kernel_policy.set_enabled(True)
    for k, v in reference[0].items():
        torch.testing.assert_close(ours[0][k], v, rtol=1e-6, atol=1e-6, msg=k)
    for key, state in reference[1]["state"].items():
        for n, v in state.items():
            torch.testing.assert_close(ours[1]["state"][key][n], v, rtol=1e-6, atol=1e-6, msg=n)


class _OwnRule(tte.optim.RowWiseAdagrad):  # (no algorithm of its own: not registered; set as a group's rule below)
    rule = staticmethod(lambda w, g, slots, lr, step, hp, ctx: rowwise_adagrad_rule(w, g, slots, lr, step, hp, ctx))


def _own_rule(params: Any) -> tte.optim.RowWiseAdagrad:
    opt = tte.optim.RowWiseAdagrad(params)
    opt.param_groups[0][RULE_KEY] = _OwnRule  # the group runs _OwnRule's rule (a rule the loop is not)
    return opt


@pytest.mark.parametrize("case", ["clipvalue", "ema", "float64", "own_rule", "warming_up", "disabled"])
def test_what_the_loop_does_not_cover_takes_the_other_paths(kernel_path: list[str], case: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[bool] = []
    to_reference = row_update._to_reference  # (the compiled kernel's own fallback: the reference path runs next)
    monkeypatch.setattr(row_update, "update", lambda item: taken.append(True) or to_reference(item))
    make: Any = {
        "clipvalue": lambda ps: tte.optim.RowWiseAdagrad(ps, clipvalue=0.1),
        "ema": lambda ps: tte.optim.LazyAdam(ps, use_ema=True),
        "own_rule": _own_rule,
    }.get(case, lambda ps: tte.optim.LazyAdam(ps))
    if case == "warming_up":
        kernel_policy.set_policy(after=10)
    if case == "disabled":
        kernel_policy.set_enabled(False)
    try:
        _train(make, torch.float64 if case == "float64" else torch.float32, steps=2)
    finally:
        kernel_policy.set_enabled(True)
    assert kernel_path == []
    assert len(taken) == (0 if case == "disabled" else 2)


def _run_in_child(name: str) -> None:
    p, slots, ids, rows = _problem(name)
    torch.set_num_threads(2)
    lib = c_library.library()
    assert lib is not None
    c_rules.run_rows(getattr(lib, name), p, slots, ids, None, rows, _hp(name, {}, torch.tensor(0.1), torch.tensor(1.0)))


def test_a_forked_child_runs_the_loop_over_threads(lib: c_library.Library, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranges' thread pool belongs to the process that made it: a child forked after it ran makes its own
    (the parent's threads are not in the child; a submit to their queue would wait forever)."""
    import multiprocessing

    monkeypatch.setattr(c_rules, "_MIN_ROWS_PER_THREAD", 64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _run_in_child("adam")  # (the pool made here, in the parent)
        child = multiprocessing.get_context("fork").Process(target=_run_in_child, args=("adam",))
        child.start()
        child.join(60)
        alive = child.is_alive()
        if alive:
            child.kill()
    finally:
        torch.set_num_threads(before)
    assert not alive and child.exitcode == 0


@pytest.mark.parametrize("n", [0, 1, 2, 1000, 40000])
def test_the_duplicate_sums_radix_sort_is_torch_sort(lib: c_library.Library, n: int) -> None:
    """``row_sums``' keys (``id · n + position``: distinct) sorted by the C radix sort once the library is loaded, as
    ``torch.sort`` sorts them; the ids of 0 to 2³⁷ rows (1 to 4 digits of 11 bits; the sentinel included)."""
    for rows in (1, 300, 4_000_000, 2**37):
        ids = torch.randint(0, rows + 1, (n,), generator=torch.Generator().manual_seed(n))
        keys = ids * n + torch.arange(n)
        assert torch.equal(c_rules.sorted_keys(keys.clone(), (rows + 1) * max(n, 1)), torch.sort(keys).values)


@pytest.mark.parametrize("n", [0, 1, 2, 1000, 40000])
@pytest.mark.parametrize("width", [1, 3, 20])
def test_the_duplicate_sums_grouping_is_torchs(lib: c_library.Library, n: int, width: int) -> None:
    """``row_sums``' grouping by one C call (sort of ``(id, position)``, distinct ids, their runs' starts, the
    permutation and it divided by the bag width) equals the torch ops' (``torch.sort``, ``unique_consecutive``,
    ``cumsum``, ``div``), the sentinel included; keys over 62 bits are left to torch."""
    for rows in (1, 300, 4_000_000, 2**37):
        ids = torch.randint(0, rows + 1, (n,), generator=torch.Generator().manual_seed(n + width))
        found = c_rules.grouped_ids(ids, rows + 1, width)
        if n == 0:
            assert found is None
            continue
        assert found is not None
        uniq, counts = torch.unique_consecutive(torch.sort(ids).values, return_counts=True)
        perm = torch.sort(ids, stable=True).indices
        assert torch.equal(found[0], uniq)
        assert torch.equal(found[1], torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))
        assert torch.equal(found[2], perm)
        assert torch.equal(found[3], torch.div(perm, width, rounding_mode="floor"))
    assert c_rules.grouped_ids(torch.tensor([0, 5]), 2**62, 1) is None  # (63 bits of keys)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_duplicate_sums_grouped_in_c_are_bitwise_torchs(lib: c_library.Library, combiner: str, weighted: bool) -> None:
    """:func:`.row_sums.row_sums` with the C grouping gives the same ids, runs, columns, weights and sums."""
    for chunks, plain in [(1, False), (3, False), (3, True)]:
        pieces, _ = _pieces(combiner, weighted, chunks, plain)
        p = torch.zeros(40, 7)
        got, want = row_sums(pieces, p, group=c_rules.grouped_ids), row_sums(pieces, p)
        assert got is not None and want is not None
        for name in ("ids", "offsets", "cols", "weights"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        assert torch.equal(got.rows(), want.rows())


@pytest.mark.parametrize("n", [2047, 2048, 2049, 65537])
@pytest.mark.parametrize("rows", [1, 2046, 2047, 2**22 - 1, 2**22, 2**33 + 5])
def test_the_grouping_sorts_the_id_digits_alone_stably(lib: c_library.Library, n: int, rows: int) -> None:
    """The C grouping sorts its keys ``(id << shift) | position`` by the id's digits alone, keys made in position
    order (a stable sort keeps ties so): the permutation is the stable sort's at the sizes where the position bits
    (``shift``) and the id bits (1 to 3 digits of 11) end, with many duplicates (few rows) and few (many)."""
    ids = torch.randint(0, rows + 1, (n,), generator=torch.Generator().manual_seed(rows % 1000 + n))
    found = c_rules.grouped_ids(ids, rows + 1, 3)
    assert found is not None
    perm = torch.sort(ids, stable=True).indices
    uniq, counts = torch.unique_consecutive(ids[perm], return_counts=True)
    assert torch.equal(found[0], uniq)
    assert torch.equal(found[1], torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))
    assert torch.equal(found[2], perm)
    assert torch.equal(found[3], torch.div(perm, 3, rounding_mode="floor"))
