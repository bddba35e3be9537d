"""The member table of each row of a stacked group (``segment_of``): right, and a fixed number of ops per step.

A stacked group's optimizer statistics stay per table (Adafactor's row sums, ``clipnorm``), so the update asks which
member each touched row belongs to. That used to be one compare, cast and add per member: a step of a group of 100
tables dispatched 3 ops for each (issue [host]: the step's work follows the groups, not the tables). Now it is one
binary search against the members' first rows (``searchsorted``), or on XLA, where ``searchsorted`` falls back to the
host, one compare against every boundary and its sum. Checked here: both forms against numpy, ``segment_of`` on real
groups against each member's row range, the boundaries made once per group and device, and the ops of a steady stacked
step the same at 4 and 100 tables (the meta device: the accelerator's static-shape path). The XLA form runs in
tests/xla/test_stacked_xla.py (stacked on XLA == unstacked on the CPU, no host fallback) and, sharded,
tests/xla_spmd/test_stacked_spmd.py, which also covers the rows of a sharded group (``owned``: shard-local rows,
device-major) and of one stored permuted (``layout``).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch
from optim_registry import STACKED, cases
from test_stacked_groups import _CountOps

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.tables import table_info
from torch_tpu_embedding.modules import plan
from torch_tpu_embedding.optim._core.stacked_members import (
    boundaries,
    members_by_compare,
    members_by_search,
    segment_of,
)

# the stacked configurations whose rule sums over rows per member (Adafactor) or clips per member (clipnorm)
PER_MEMBER = [c for c in cases(STACKED) if not c.info.per_row_rule or "clipnorm" in c.kwargs]


def test_there_are_configurations_with_per_member_statistics() -> None:
    assert PER_MEMBER


@pytest.mark.parametrize("form", [members_by_search, members_by_compare], ids=["search", "compare"])
@pytest.mark.parametrize("firsts", [[], [1], [5, 9, 30], [3, 3, 8], list(range(2, 200, 2))],
                         ids=["one member", "two", "four", "an empty member", "100 members"])
@pytest.mark.parametrize("shape", [(0,), (37,), (4, 9)])
def test_both_forms_count_the_boundaries_at_or_below_each_row(form: Any, firsts: list[int],
                                                              shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(firsts))
    top = (firsts[-1] if firsts else 10) + 5
    rows = torch.randint(0, top, shape, generator=g)
    if rows.numel():  # every boundary itself and the rows either side of it
        edges = torch.tensor([x + d for x in firsts for d in (-1, 0, 1) if 0 <= x + d < top] or [0])
        rows.view(-1)[: min(rows.numel(), edges.numel())] = edges[: rows.numel()]
    bounds = torch.tensor(firsts, dtype=torch.int64)
    want = np.searchsorted(np.array(firsts, dtype=np.int64), rows.numpy(), side="right")
    got = form(rows, bounds)
    assert got.dtype == torch.int64 and got.shape == rows.shape
    np.testing.assert_array_equal(got.numpy(), want)


def _group(sizes: list[int]) -> tuple[torch.Tensor, list[tuple[str, int, int]]]:
    tables = [tte.TableConfig(n, 4, name=f"t{i}") for i, n in enumerate(sizes)]
    ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t) for i, t in enumerate(tables)})
    (p,) = list(ec.parameters())
    info = table_info(p)
    assert info is not None and info.members is not None and len(info.members) == len(sizes)
    return p, list(info.members)


@pytest.mark.parametrize("sizes", [[7, 1, 12], [3] * 100, [50, 2]], ids=["a one-row member", "100 members", "two"])
def test_segment_of_names_the_member_whose_rows_hold_each_row(sizes: list[int]) -> None:
    p, members = _group(sizes)
    rows = torch.arange(p.shape[0])
    want = torch.cat([torch.full((n,), m) for m, (_, _, n) in enumerate(members)])
    seg = segment_of(p, rows)
    assert seg is not None and seg.dtype == torch.int64
    assert seg.tolist() == want.tolist()
    # any shape; the sentinel row and beyond (padding) clamp to the last member
    grid = torch.tensor([[0, p.shape[0] - 1], [p.shape[0], p.shape[0] + 7]])
    assert segment_of(p, grid).tolist() == [[0, len(sizes) - 1], [len(sizes) - 1, len(sizes) - 1]]
    assert segment_of(torch.nn.Parameter(torch.zeros(3, 4)), rows) is None  # not a stacked group


def test_boundaries_are_made_once_per_group_and_device() -> None:
    p, members = _group([4, 6, 5])
    info = table_info(p)
    assert info is not None and info.members is not None
    first = boundaries(info.members, torch.device("cpu"))
    assert first.tolist() == [4, 10]
    assert boundaries(info.members, torch.device("cpu")) is first  # no tensor made nor moved at later steps
    on_meta = boundaries(info.members, torch.device("meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == (2,) and on_meta.dtype == torch.int64
    assert boundaries(info.members, torch.device("meta")) is on_meta
    equal = tuple(list(info.members))  # an equal tuple of another group: its own entry, the same values
    assert equal is not info.members
    other = boundaries(equal, torch.device("cpu"))
    assert other is not first and other.tolist() == [4, 10]


def test_boundaries_made_under_inference_mode_or_for_fake_rows_are_not_kept() -> None:
    """A step's rows under inference mode, or fake ones (a tracing mode outside torch.compile): their boundaries are
    made for that call alone, so a later real step does not get an inference tensor or a fake one back."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    p, _ = _group([4, 6, 5])
    info = table_info(p)
    assert info is not None and info.members is not None
    rows = torch.tensor([0, 5, 12])
    with torch.inference_mode():
        assert segment_of(p, rows).tolist() == [0, 1, 2]  # type: ignore[union-attr]
    with FakeTensorMode() as fake:
        assert segment_of(p, fake.from_tensor(rows)).shape == (3,)  # type: ignore[union-attr]
    kept = boundaries(info.members, torch.device("cpu"))
    assert type(kept) is torch.Tensor and not kept.is_inference() and kept.tolist() == [4, 10]
    assert segment_of(p, rows).tolist() == [0, 1, 2]  # type: ignore[union-attr]


def _steady_ops(tables: int, make: Any, device: str) -> collections.Counter[str]:
    torch.manual_seed(0)
    names = [f"f{i}" for i in range(tables)]
    features = {f: tte.FeatureConfig(tte.TableConfig(50, 8, name=f"t{f}", combiner="mean"), max_ids_per_bag=3)
                for f in names}
    ec = tte.EmbeddingCollection(features, device=device)
    opt = make(ec.parameters())
    g = torch.Generator().manual_seed(0)
    data = [{f: tte.Padded(torch.randint(0, 50, (8, 3), generator=g)) for f in names} for _ in range(4)]

    def step(i: int) -> None:
        ec(data[i % 4], concat=True).sum().backward()
        opt.step()
        opt.zero_grad()

    for i in range(6):
        step(i)
    with _CountOps() as ops:  # six steps: every update of accumulating configurations (over 2 or 3 steps) among them
        for i in range(6):
            step(i)
    return ops.counts


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("cfg", PER_MEMBER, ids=str)
def test_a_steady_stacked_step_dispatches_as_many_ops_at_100_tables_as_at_4(
        cfg: Any, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta device stands in for an accelerator (the static-shape path, tests/optim/test_sync_free_step.py)."""
    monkeypatch.setattr(plan, "check_not_meta", lambda *args: None)
    counts = {t: _steady_ops(t, cfg.make, device) for t in (4, 100)}
    totals = {t: sum(c.values()) for t, c in counts.items()}
    print(f"{cfg} on {device}: ops in six steady steps at 4 and 100 tables {totals}")
    assert counts[100] == counts[4], totals
    assert counts[4]["searchsorted"] >= 1  # (the members were asked for)
