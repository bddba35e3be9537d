"""Full ``mean`` bags without per-id weights (no padding: every bag ``L`` real ids) have one gain, ``1 / L``, which the
lookup fills in (``combiners.full_mean_gain``, once per ``L``): the backward's factored rows apply that number
(``BagRows.constant``) instead of finding each bag's gain with an ``amax`` over ``[N, L]``, and a gradient that is one
row broadcast (``loss = out.sum()``) stays one row (the C row loops read it with row stride 0). Every optimizer's
result is bitwise the one the per-bag path gives, and the step dispatches fewer ops.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch
from test_broadcast_gradient import OPTIMIZERS, kernel_path  # noqa: F401 (a fixture)
from test_stacked_groups import _CountOps

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.row_grad import BagRows, RowGrad
from torch_tpu_embedding.combiners import bag_gains, full_mean_gain
from torch_tpu_embedding.modules.lookup import bags_lookup
from torch_tpu_embedding.optim._kernels import c_rules


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_a_constant_gain_per_bag_is_bitwise_the_amax_path(dtype: torch.dtype, combiner: str) -> None:
    g = torch.Generator().manual_seed(0)
    for width in (2, 3, 7, 20, 129, 4097):
        ids = torch.zeros(37, width, dtype=torch.int64)
        gains = bag_gains(ids >= 0, None, combiner, dtype)
        constant = float(gains[0, 0])
        if combiner == "mean":
            assert full_mean_gain(width, dtype) == constant
        dense = torch.randn(37, 16, generator=g, dtype=dtype)
        broadcast = torch.randn(1, 1, generator=g, dtype=dtype).expand(37, 16)
        for grad_out in (dense, broadcast, dense[:, ::2]):
            got = BagRows(gains, grad_out, uniform=True, constant=constant).per_bag()
            want = BagRows(gains, grad_out, uniform=True).per_bag()
            assert torch.equal(got, want), (width, grad_out.stride())
            if grad_out.stride(0) == 0:
                assert got.stride(0) == 0  # (one row, kept broadcast)
            out, out_want = torch.empty_like(want), torch.empty_like(want)
            BagRows(gains, grad_out, uniform=True, constant=constant).per_bag(out=out)
            BagRows(gains, grad_out, uniform=True).per_bag(out=out_want)
            assert torch.equal(out, out_want)


def _train(make: Any, combiner: str, broadcast: bool, freeze: bool = False, steps: int = 3
           ) -> tuple[dict[str, torch.Tensor], Counter[str]]:
    """4 features of one table width and combiner (one stacked group), full bags of 5 ids."""
    torch.manual_seed(0)
    tables = [tte.TableConfig(500, 8, name=f"t{i}", combiner=combiner) for i in range(4)]
    ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t, max_ids_per_bag=5) for i, t in enumerate(tables)})
    if freeze:
        ec.tables.t1.requires_grad_(False)
    opt = make(ec.parameters())
    counts: Counter[str] = Counter()
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        batch = {f"f{i}": tte.Padded(torch.randint(0, 500, (96, 5), generator=g)) for i in range(4)}
        scale = torch.linspace(-1, 1, 32)
        with _CountOps() as ops:  # (the whole step: the lookup's fill of the gains too)
            out = ec(batch)
            joined = torch.cat([out[f] for f in ec.feature_names], dim=1)
            loss = joined.sum() if broadcast else (joined * scale).sum()
            loss.backward()
            opt.step()
        counts += ops.counts
        opt.zero_grad()
    return {k: v.clone() for k, v in ec.state_dict().items()}, counts


def _per_bag_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk's rows as the lookup recorded them before: each bag's gain found by amax."""
    add = RowGrad.add_bags

    def add_bags(self: RowGrad, *args: Any, **kwargs: Any) -> None:
        add(self, *args[:5], **{k: v for k, v in kwargs.items() if k != "constant"})

    monkeypatch.setattr(RowGrad, "add_bags", add_bags)


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
@pytest.mark.parametrize("broadcast", [True, False])
def test_full_bags_train_bitwise_as_the_per_bag_path(opt: str, combiner: str, broadcast: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    got, counts = _train(OPTIMIZERS[opt], combiner, broadcast)
    with monkeypatch.context() as m:
        _per_bag_path(m)
        want, old_counts = _train(OPTIMIZERS[opt], combiner, broadcast)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    if opt in ("rowwise_adagrad", "lazy_adam"):  # (the duplicate sum's per-bag rows: the C row loops)
        assert old_counts["amax"] > 0  # (the test sees the path it replaces)
        if combiner == "mean":  # (sqrtn's gains come from bag_gains: no number known, the per-bag path)
            assert counts["amax"] == 0, counts


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("opt", ["rowwise_adagrad", "lazy_adam"])
def test_a_frozen_member_keeps_the_per_bag_path_and_trains_bitwise_alike(opt: str, monkeypatch: pytest.MonkeyPatch
                                                                        ) -> None:
    """A frozen member's gains are 0 in its bags: not one gain for all, so those rows take ``amax``."""
    got, counts = _train(OPTIMIZERS[opt], "mean", True, freeze=True)
    with monkeypatch.context() as m:
        _per_bag_path(m)
        want, _ = _train(OPTIMIZERS[opt], "mean", True, freeze=True)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert counts["amax"] > 0


@pytest.mark.usefixtures("kernel_path")
def test_the_row_loop_reads_one_broadcast_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """``loss = out.sum()`` over full mean bags: the C row loop gets the gradient as one row (row stride 0), no
    ``[B·F, D]`` of per-bag rows is written."""
    strides: list[int] = []
    run = c_rules.run_rows

    def spy(fn: Any, p: torch.Tensor, slots: Any, ids: torch.Tensor, sums: Any, *rest: Any) -> None:
        strides.append(sums.src.stride(0))
        run(fn, p, slots, ids, sums, *rest)

    monkeypatch.setattr(c_rules, "run_rows", spy)
    _train(OPTIMIZERS["rowwise_adagrad"], "mean", True)
    # (the first step looks the features up one by one, before the group's plan is kept: several chunks, whose
    # per-bag rows are written into one source array)
    assert len(strides) == 3 and strides[1:] == [0, 0], strides


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_the_full_mean_gain_is_filled_in_one_op(dtype: torch.dtype) -> None:
    """The lookup of full mean bags fills its gains with one op: ``1 / L`` computed once per ``L`` and dtype (no
    ``reciprocal`` and no host read of it per step), bitwise ``bag_gains``' value."""
    weight = torch.randn(50, 6).to(dtype)
    ids = torch.randint(0, 50, (7, 9), generator=torch.Generator().manual_seed(0))
    bags_lookup(weight, ids, None, "mean", RowGrad(), {"t"}, full=True)  # (the first call may compute it)
    with _CountOps() as ops:
        bags_lookup(weight, ids, None, "mean", RowGrad(), {"t"}, full=True)
    assert ops.counts["full"] == 1 and ops.counts["reciprocal"] == 0 and ops.counts["_local_scalar_dense"] == 0, \
        ops.counts
    assert full_mean_gain(9, dtype) == float(bag_gains(ids >= 0, None, "mean", dtype)[0, 0])


def test_full_mean_bags_of_width_0_carry_no_infinite_gain() -> None:
    """Bags of width 0 have no id, hence no gain: their per-bag rows are 0 as on the per-bag path (``amax`` over no
    gain), not ``grad_out · 1 / 0`` (``inf``, ``nan`` where the gradient is 0), which ``1 / L`` made of ``L = 0``."""
    weight = torch.randn(10, 4, requires_grad=True)
    for grad_out in (torch.randn(5, 4), torch.zeros(5, 4), torch.ones(1, 1).expand(5, 4)):
        rows = RowGrad()
        rows.keep_factored = True
        (out,) = bags_lookup(weight, torch.empty(5, 0, dtype=torch.int64), None, "mean", rows, {"t"}, full=True)
        out.backward(grad_out)
        ((_, bag),) = rows.chunks()
        assert isinstance(bag, BagRows)
        assert bag.constant is None or math.isfinite(bag.constant)
        assert torch.equal(bag.per_bag(), torch.zeros(5, 4))
