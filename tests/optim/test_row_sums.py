"""The kernel path's duplicate sum (``optim/_kernels/row_sums.py``) against the reference path's, bitwise.

The reference path multiplies every (bag, position) row out, ``gains[n, l] · dL/dout[n]``, and adds the
rows into zeros in lookup order (``index_add_``). :func:`row_sums` keeps them factored; for bags without
per-id weights (``BagRows.uniform``) it applies each bag's one gain once per bag instead of once per id.
Both must give the same bits for every combiner, padding (the sentinel id), empty bags, an expanded
``dL/dout``, and a step whose pieces mix factored bags with rows already multiplied out (a jagged feature's).
"""

from __future__ import annotations

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.row_grad import RowGrad
from torch_tpu_embedding.combiners import bag_gains
from torch_tpu_embedding.optim._kernels.row_sums import row_sums

ROWS, DIM = 40, 7


def _pieces(combiner: str, weighted: bool, chunks: int, plain: bool) -> tuple[RowGrad, torch.Tensor]:
    """A table's pending gradient and the reference sum ``[ROWS + 1, DIM]`` (the sentinel's row last)."""
    g = torch.Generator().manual_seed(chunks * 10 + weighted)
    pieces, want = RowGrad(), torch.zeros(ROWS + 1, DIM)
    for c in range(chunks):
        n, width = 23 + c, 1 if c == 1 else 5
        valid = torch.rand(n, width, generator=g) < 0.7
        valid[::4] = False  # empty bags
        ids = torch.where(valid, torch.randint(0, 9, (n, width), generator=g), ROWS)  # 9 rows: duplicates
        w = torch.rand(n, width, generator=g) + 0.5 if weighted else None
        gains = bag_gains(valid, w, combiner, torch.float32)
        grad_out = torch.randn(n, DIM, generator=g)
        if c == 0:  # an expanded gradient, as a `.sum()` hands the lookup
            grad_out = torch.randn(1, DIM, generator=g).expand(n, DIM)
        pieces.add_bags(ids, gains, grad_out, unit=combiner == "sum" and not weighted, uniform=not weighted)
        want.index_add_(0, ids.reshape(-1), (gains.unsqueeze(-1) * grad_out.unsqueeze(1)).reshape(-1, DIM))
    if plain:  # rows already multiplied out (a jagged feature), with a padding id
        ids = torch.tensor([3, ROWS, 0, 3, 8])
        rows = torch.randn(5, DIM, generator=g)
        pieces.add(ids, rows)
        want.index_add_(0, ids, rows)
    return pieces, want


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True], ids=["no-weights", "weights"])
@pytest.mark.parametrize(("chunks", "plain"), [(1, False), (3, False), (3, True)], ids=["1", "3", "3+rows"])
def test_summed_rows_are_the_reference_sum_bitwise(combiner: str, weighted: bool, chunks: int, plain: bool) -> None:
    pieces, want = _pieces(combiner, weighted, chunks, plain)
    sums = row_sums(pieces, torch.zeros(ROWS, DIM))
    assert sums is not None
    # Unweighted bags: one gain per bag, applied once per bag (no per-id weights to gather and multiply).
    assert (sums.weights is None) == (not weighted), sums.weights
    assert int(sums.ids.max()) < ROWS and torch.equal(sums.ids, sums.ids.unique())
    got = sums.rows()
    assert torch.equal(got, want[sums.ids]), (got - want[sums.ids]).abs().max()
    u = sums.ids.shape[0]
    ranges = torch.cat([sums.rows(a, min(a + 3, u)) for a in range(0, u, 3)])
    assert torch.equal(ranges, got)


def test_uniform_bags_take_their_gain_once_per_bag() -> None:
    """Mean bags of 5 ids without weights: ``per_bag`` is ``[N, D]`` (one multiply per bag), bitwise each
    real position's ``gain · dL/dout``; padding positions hold gain 0 and are left out of the sum."""
    pieces, _ = _pieces("mean", False, 1, False)
    (_, bag), = pieces.chunks()
    assert not isinstance(bag, torch.Tensor) and bag.uniform and not bag.unit
    per_bag = bag.per_bag()
    assert per_bag.shape == bag.grad_out.shape
    full = bag.gains.unsqueeze(-1) * bag.grad_out.unsqueeze(1)
    real = bag.gains > 0
    assert torch.equal(full[real], per_bag.unsqueeze(1).expand_as(full)[real])


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_bags_of_width_0_sum_to_no_rows(combiner: str) -> None:
    """``Padded`` bags of width 0 (no id at all): no row, and no reduction over their empty width."""
    pieces = RowGrad()
    valid = torch.zeros(5, 0, dtype=torch.bool)
    gains = bag_gains(valid, None, combiner, torch.float32)
    pieces.add_bags(torch.zeros(5, 0, dtype=torch.int64), gains, torch.randn(5, DIM), unit=combiner == "sum",
                    uniform=True)
    pieces.add_bags(torch.tensor([[3], [ROWS]]), torch.ones(2, 1), torch.randn(2, DIM), unit=True)
    sums = row_sums(pieces, torch.zeros(ROWS, DIM))
    assert sums is not None and sums.ids.tolist() == [3]
    assert torch.equal(sums.rows(), pieces.chunks()[1][1].grad_out[:1])  # type: ignore[union-attr]


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "RowWiseAdagrad"])
@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize(("width", "batch"), [(0, 5), (0, 0), (3, 0)])
def test_empty_bags_and_batches_train_without_error(name: str, combiner: str, width: int, batch: int) -> None:
    """Padded bags of width 0, and batches of 0 bags, through the eager steps (SGD's additive one with the
    rows kept factored from the second step on): zero activations, and the table unchanged."""
    t = tte.TableConfig(50, 4, name="t", combiner=combiner)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t, max_ids_per_bag=3), "b": tte.FeatureConfig(t, max_ids_per_bag=3)})
    opt = getattr(tte.optim, name)(ec.parameters(), lr=0.1)
    before = [p.detach().clone() for p in ec.parameters()]
    for _ in range(3):
        ids = torch.zeros(batch, width, dtype=torch.int64)
        valid = torch.ones(batch, width, dtype=torch.bool)
        out = ec({"a": tte.Padded(ids, valid), "b": tte.Padded(ids, valid)})
        assert out["a"].shape == (batch, 4) and not out["a"].any()
        sum(o.sum() for o in out.values()).backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, ec.parameters(), strict=True))
