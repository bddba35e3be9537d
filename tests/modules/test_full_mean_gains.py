"""Full padded bags (no padding, no per-id weights) under ``mean``: the lookup fills every gain with ``1 / L`` in one
op instead of :func:`~torch_tpu_embedding.combiners.bag_gains`' passes over the ids, bitwise its gains, so the
forward and the recorded rows are bitwise what ``bag_gains`` gives, for every width and float dtype."""

from __future__ import annotations

import pytest
import torch
from test_stacked_groups import _CountOps as _Ops

from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding.combiners import bag_gains
from torch_tpu_embedding.modules.lookup import bags_lookup, lookup


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_full_mean_bags_get_bag_gains_bitwise(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 6, generator=g, dtype=dtype).requires_grad_()
    for width in [*range(2, 65), 100, 1000, 4097]:
        ids = torch.randint(0, 50, (7, width), generator=g)
        got_rows, want_rows = RowGrad(), RowGrad()
        with _Ops() as ops:
            (got,) = bags_lookup(weight, ids, None, "mean", got_rows, {"t"}, full=True)
        assert ops.counts["ne"] == 0 and ops.counts["sum"] == 0, ops.counts  # (no pass over the ids)
        (want,) = lookup(weight, ids, bag_gains(ids != 50, None, "mean", dtype), want_rows, frozenset({"t"}))
        assert torch.equal(got, want), width
        head = torch.randn(6, generator=g, dtype=dtype)
        (got * head).sum().backward()
        (want * head).sum().backward()
        (gi, gr), (wi, wr) = got_rows.collect(), want_rows.collect()
        assert torch.equal(gi, wi) and torch.equal(gr, wr), width
