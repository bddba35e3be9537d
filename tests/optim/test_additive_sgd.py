"""SGD's eager step (``Path.ADDITIVE``): ``increment(g)`` added per looked-up id, taken once per bag and spread
over the bag's ids by their gains; and the lookup's backward, which keeps each feature's ``dL/dout`` as it came.

Every case is compared with the same run through the summed-rows path (an option that needs the summed rows and
never binds, ``clip_weight_min=-1e9``): the same update up to the order of the additions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.row_grad import BagRows
from torch_tpu_embedding.optim import SGD
from torch_tpu_embedding.optim._kernels import additive
from torch_tpu_embedding.optim.sgd import sgd_rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_increment_is_the_rule_minus_w_to_the_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 7, generator=g).to(dtype) * 10
    grad = torch.randn(300, 7, generator=g).to(dtype)
    for lr in (0.1, 0.0371, 3.0, 1e-7):
        lr_t = torch.tensor(lr, dtype=dtype)
        want, _ = sgd_rule(w, grad, {}, lr_t, torch.tensor(1), {}, None)  # type: ignore[arg-type]
        assert torch.equal(w + SGD.increment(grad, lr_t), want), lr
        assert SGD.increment(grad, lr_t).dtype == dtype


def _features(case: str, dtype: torch.dtype) -> dict[str, tte.FeatureConfig]:
    combiner = {"sum1": "sum", "sum5": "sum", "mean": "mean", "sqrtn": "sqrtn", "weighted": "mean"}[case]
    a = tte.TableConfig(40, 6, name="a", combiner=combiner, dtype=dtype)
    b = tte.TableConfig(30, 6, name="b", combiner=combiner, dtype=dtype)  # stacked with "a" by default
    width = 1 if case == "sum1" else 5
    return {"x": tte.FeatureConfig(a, max_ids_per_bag=width), "y": tte.FeatureConfig(b, max_ids_per_bag=width),
            "z": tte.FeatureConfig(a, max_ids_per_bag=width)}  # "z" shares "a"


def _batch(case: str, g: torch.Generator) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rows in (("x", 40), ("y", 30), ("z", 40)):
        if case == "sum1":  # one id per bag, some bags empty (padding at width 1)
            lengths = torch.randint(0, 2, (12,), generator=g)
            out[name] = tte.Jagged(torch.randint(0, rows, (int(lengths.sum()),), generator=g), lengths=lengths)
            continue
        ids = torch.randint(0, rows, (12, 5), generator=g)  # duplicates, within and across bags
        mask = torch.rand(12, 5, generator=g) > 0.3
        weights = torch.rand(12, 5, generator=g) + 0.5 if case == "weighted" else None
        out[name] = tte.Padded(ids, mask, weights=weights)
    return out


def _run(case: str, dtype: torch.dtype, frozen: bool, **options: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection(_features(case, dtype))
    if frozen:
        ec.tables["b"].requires_grad_(False)
    opt = SGD(ec.parameters(), lr=0.05, **options)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        out = ec(_batch(case, g))
        head = torch.linspace(-1, 1, 18, dtype=torch.float64)
        (torch.cat([out["x"], out["y"], out["z"]], dim=1).to(torch.float64) @ head).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.to(torch.float64) for k, v in ec.state_dict().items()}


CASES = ["sum1", "sum5", "mean", "sqrtn", "weighted"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("options", [{}, {"loss_scale_factor": 4.0}, {"gradient_accumulation_steps": 2}],
                         ids=["plain", "loss_scale", "accumulation"])
@pytest.mark.parametrize("chunk", [16384, 7, 10])  # every piece added together; pieces of a chunk and fewer
def test_additive_equals_the_summed_update(case: str, options: dict[str, Any], chunk: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(additive, "ADDITIVE_CHUNK", chunk)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        fast = _run(case, dtype, False, **options)
        summed = _run(case, dtype, False, clip_weight_min=-1e9, **options)
        for k, v in summed.items():
            torch.testing.assert_close(fast[k], v, rtol=tol, atol=tol, msg=f"{case} {dtype} {k}")


@pytest.mark.parametrize("case", ["sum1", "mean"])
def test_additive_keeps_a_frozen_member_and_16_bit_tables(case: str) -> None:
    fast = _run(case, torch.float64, True)
    summed = _run(case, torch.float64, True, clip_weight_min=-1e9)
    torch.manual_seed(0)
    init = {k: v.to(torch.float64) for k, v in tte.EmbeddingCollection(_features(case, torch.float64)).state_dict().items()}
    assert torch.equal(fast["tables.b.weight"], init["tables.b.weight"])  # the frozen member never moves
    torch.testing.assert_close(fast["tables.a.weight"], summed["tables.a.weight"], rtol=1e-12, atol=1e-12)
    assert not torch.equal(fast["tables.a.weight"], init["tables.a.weight"])
    # bfloat16: rows added in the table's dtype one id at a time against summed in float32 and cast once
    fast16 = _run(case, torch.bfloat16, False)
    summed16 = _run(case, torch.bfloat16, False, clip_weight_min=-1e9)
    for k, v in summed16.items():
        torch.testing.assert_close(fast16[k], v, rtol=2e-2, atol=2e-2, msg=k)


def test_backward_keeps_each_feature_gradient_as_it_came() -> None:
    """Three features of one stacked group looked up together (assembled: bags batch-major), their outputs
    concatenated by the caller: the features' ``dL/dout`` reach the table as the concatenation's gradient
    itself, viewed (no ``[N, D]`` copy), in one piece."""
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection(_features("sum1", torch.float32))
    opt = SGD(ec.parameters(), lr=0.1)
    ids = {n: torch.randint(0, 30, (16,)) for n in ("x", "y", "z")}
    seen: list[torch.Tensor] = []
    for step in range(2):  # the first step asks the lookups to keep their rows factored
        out = ec(ids)
        cat = torch.cat([out["x"], out["y"], out["z"]], dim=1)
        cat.register_hook(seen.append)
        (cat * torch.arange(18.0)).sum().backward()
        if step == 1:
            chunks = ec.tables["a"].row_grad.chunks()
            assert len(chunks) == 1 and all(isinstance(r, BagRows) and r.unit for _, r in chunks)
            base = seen[-1].untyped_storage().data_ptr()
            assert all(r.grad_out.untyped_storage().data_ptr() == base for _, r in chunks)  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()


def test_spread_reuses_one_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bags of several ids: each piece is spread into one buffer, kept between pieces and steps."""
    monkeypatch.setattr(additive, "_SCRATCH", {})
    monkeypatch.setattr(additive, "ADDITIVE_CHUNK", 10)  # two bags of 5 a piece: six pieces a lookup
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection(_features("mean", torch.float32))
    opt = SGD(ec.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    ptrs = set()
    for _ in range(3):
        sum(o.sum() for o in ec(_batch("mean", g)).values()).backward()
        opt.step()
        opt.zero_grad()
        ptrs |= {(k, b.data_ptr()) for k, b in additive._SCRATCH.items()}
    assert len(ptrs) == 1, ptrs


def test_the_features_of_a_step_are_added_in_one_call() -> None:
    """Four features of one stacked group at one id per bag, looked up as a dict: their rows are added by one
    index_add_ (one sort of the ids, one wake of the thread pool), not one per feature."""
    from test_stacked_groups import _CountOps

    torch.manual_seed(0)
    tables = [tte.TableConfig(100, 4, name=f"t{i}", combiner="sum") for i in range(4)]
    ec = tte.EmbeddingCollection({f"f{i}": tte.FeatureConfig(t) for i, t in enumerate(tables)})
    opt = SGD(ec.parameters(), lr=0.1)
    for _ in range(2):  # the first step asks the lookups to keep their rows factored
        out = ec({f"f{i}": torch.randint(0, 100, (32,)) for i in range(4)})
        torch.cat([out[f"f{i}"] for i in range(4)], dim=1).sum().backward()
        with _CountOps() as ops:
            opt.step()
        opt.zero_grad()
    assert ops.counts["index_add_"] == 1, ops.counts
    # The increment is written where the index_add_ reads it (the scratch buffer): no float rows are copied
    # or concatenated, nor the ids (the group's bags are one piece, batch-major); one copy_: the step count.
    assert ops.counts["cat"] == 0 and ops.counts["copy_"] == 1, ops.counts


def test_clip_grad_norm_keeps_the_rows_factored_and_unit() -> None:
    """tte.clip_grad_norm_ scales the pending rows in their form: sum bags of one id stay ``unit`` (no product
    in SGD's step), and the step equals the one without clipping when the norm is under the bound."""
    runs = []
    for clip in (False, True):
        torch.manual_seed(0)
        ec = tte.EmbeddingCollection(_features("sum1", torch.float64))
        opt = SGD(ec.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for step in range(3):  # dense ids: bags of one id looked up padded (a jagged lookup multiplies out)
            out = ec({n: torch.randint(0, v, (12,), generator=g) for n, v in (("x", 40), ("y", 30), ("z", 40))})
            torch.cat([out["x"], out["y"], out["z"]], dim=1).pow(2).sum().backward()
            if clip:
                tte.clip_grad_norm_(ec.parameters(), max_norm=1e9)
                chunks = ec.tables["a"].row_grad.chunks()  # (factored from the second step: SGD asks for it)
                assert step == 0 or (chunks and all(isinstance(r, BagRows) and r.unit for _, r in chunks))
            opt.step()
            opt.zero_grad()
        runs.append(ec.state_dict())
    for k, v in runs[0].items():
        assert torch.equal(runs[1][k], v), k
