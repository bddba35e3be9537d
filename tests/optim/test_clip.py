"""``tte.clip_grad_norm_`` in one process: the norm and the clipped gradients equal the same clipping
computed by hand over every gradient, with each table's gradient densified (duplicate ids summed)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import torch_tpu_embedding as tte

V_A, V_B = 11, 6


def model(stack: bool = False) -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    a = tte.TableConfig(V_A, 4, name="a", combiner="mean", dtype=torch.float64)
    b = tte.TableConfig(V_B, 4, name="b", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"x": tte.FeatureConfig(a), "y": tte.FeatureConfig(a), "z": tte.FeatureConfig(b)},
                                 stack_tables=stack)
    return torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(12, 1, dtype=torch.float64)})


def backward(m: torch.nn.ModuleDict, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = tte.Padded(torch.randint(0, V_A, (8, 3), generator=g), torch.rand(8, 3, generator=g) > 0.3)
    y = torch.randint(0, 4, (8, 2), generator=g)  # few ids: many duplicates
    out = m["ec"]({"x": x, "y": tte.Padded(y), "z": torch.randint(0, V_B, (8,), generator=g)})
    pred = m["head"](torch.cat([out["x"], out["y"], out["z"]], dim=1))
    (pred**2).mean().backward()


def densified(m: torch.nn.ModuleDict) -> dict[str, torch.Tensor]:
    """Every gradient as a dense tensor: tables (per table, stacked or not) from their pending rows,
    summed per id."""
    out = {}
    for name, (ids, rows) in m["ec"].row_grads().items():
        w = m["ec"].embedding_tables[name]
        out[name] = torch.zeros(w.shape[0] + 1, w.shape[1], dtype=w.dtype).index_add_(0, ids, rows)[:-1]
    for name, p in m["head"].named_parameters():
        assert p.grad is not None
        out[name] = p.grad.clone()
    return out


def by_hand(grads: dict[str, torch.Tensor], max_norm: float, norm_type: float) -> tuple[float, float]:
    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    total = float(flat.abs().max()) if math.isinf(norm_type) else float((flat.abs() ** norm_type).sum() ** (1 / norm_type))
    return total, min(max_norm / (total + 1e-6), 1.0)


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf], ids=["l2", "l1", "inf"])
@pytest.mark.parametrize("max_norm", [0.01, 100.0], ids=["clips", "no-clip"])
def test_equals_clipping_by_hand(stack: bool, norm_type: float, max_norm: float) -> None:
    m = model(stack)
    backward(m, 0)
    before = densified(m)
    total, coef = by_hand(before, max_norm, norm_type)
    got = tte.clip_grad_norm_(m.parameters(), max_norm, norm_type=norm_type)
    assert isinstance(got, torch.Tensor) and got.dim() == 0
    assert abs(float(got) - total) <= 1e-12 * max(1.0, total)
    assert (coef < 1.0) == (max_norm == 0.01)
    after = densified(m)
    for k, g in before.items():
        torch.testing.assert_close(after[k], g * coef, rtol=1e-12, atol=1e-15, msg=k)


def test_the_step_applies_the_clipped_gradient() -> None:
    """After a first step SGD's backward keeps its rows factored (multiplied out in the step): clipping
    multiplies them out, and the step applies exactly the clipped gradient (SGD: w - lr·g)."""
    m = model()
    opt = tte.optim.SGD(m.parameters(), lr=0.5)
    backward(m, 0)
    opt.step()
    opt.zero_grad()
    backward(m, 1)
    assert m["ec"].tables.a.row_grad.keep_factored  # this backward's rows are factored
    before = densified(m)
    _, coef = by_hand(before, 0.02, 2.0)
    w0 = {k: v.detach().clone() for k, v in m.state_dict().items()}
    tte.clip_grad_norm_(m.parameters(), 0.02)
    opt.step()
    for k in before:
        key = f"ec.tables.{k}.weight" if k in ("a", "b") else f"head.{k}"
        torch.testing.assert_close(m.state_dict()[key], w0[key] - 0.5 * coef * before[k], rtol=1e-12, atol=1e-14)


def test_torch_signature_and_edge_cases() -> None:
    m = model()
    backward(m, 0)
    table = m["ec"].tables.a.weight
    g = densified(m)["a"]
    # One tensor (a table alone), like torch's.
    assert abs(float(tte.clip_grad_norm_(table, 1e9)) - float(g.norm())) < 1e-12
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert float(tte.clip_grad_norm_((p for p in []), 1.0)) == 0.0
    assert any("empty generator" in str(w.message) for w in caught)
    m["ec"].tables.b.row_grad.add(torch.tensor([0]), torch.full((1, 4), math.inf, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="non-finite"):
        tte.clip_grad_norm_(m.parameters(), 1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("norm_type", [math.inf, -math.inf, -1.0, 2.0], ids=["inf", "-inf", "-1", "l2"])
def test_a_table_looked_up_with_empty_bags_only_counts_as_zeros(stack: bool, norm_type: float) -> None:
    """Table ``b``'s feature has only empty bags: its densified gradient is zeros. Unstacked, its row gradient has
    no rows, and the norm of orders inf, -inf and < 0 raised (torch's norm of an empty tensor)."""
    torch.manual_seed(0)
    a = tte.TableConfig(2, 3, name="a", combiner="sum", dtype=torch.float64)
    b = tte.TableConfig(3, 3, name="b", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"x": tte.FeatureConfig(a), "z": tte.FeatureConfig(b)}, stack_tables=stack)
    out = ec({"x": tte.Jagged(torch.tensor([0, 1, 1]), lengths=torch.tensor([3, 0])),
              "z": tte.Jagged(torch.zeros(0, dtype=torch.int64), lengths=torch.tensor([0, 0]))})
    (out["x"] * torch.tensor([[1.0, -2.0, 0.5], [3.0, 3.0, 3.0]], dtype=torch.float64) + out["z"]).sum().backward()
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)  # a's row 0 gets g, row 1 2·g; b: zeros
    want = {math.inf: 4.0, -math.inf: 0.0, -1.0: 0.0, 2.0: float((5 * g.square()).sum().sqrt())}[norm_type]
    assert float(tte.clip_grad_norm_(ec.parameters(), 1e9, norm_type=norm_type)) == pytest.approx(want, abs=1e-12)


def test_torch_clip_grad_norm_does_not_see_tables() -> None:
    """Why tte.clip_grad_norm_ exists: torch's reads `.grad` only, so its norm leaves the tables out."""
    m = model()
    backward(m, 0)
    dense_only = torch.cat([p.grad.reshape(-1) for p in m["head"].parameters()]).norm()
    assert float(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)) == pytest.approx(float(dense_only))
    assert float(tte.clip_grad_norm_(m.parameters(), 1e9)) > float(dense_only)


def test_the_optimizer_tells_its_tables_how_their_rows_travel() -> None:
    """The clip exchanges a table's rows under data parallel before the step does, so it must send them as
    the step would: unsummed for a group with ``use_gradient_accumulation=False`` (RowGrad.raw_exchange, set
    by the optimizer's groups, at construction and from a loaded state). The 2-process check:
    tests/distributed/test_mp_dcp_optim.py::test_clip_that_scales_nothing_leaves_use_gradient_accumulation_false_bitwise."""
    m = model()
    a, b = m["ec"].tables.a, m["ec"].tables.b
    opt = tte.optim.Adagrad([{"params": [a.weight]}, {"params": [b.weight], "use_gradient_accumulation": False}],
                            lr=0.1)
    assert not a.row_grad.raw_exchange and b.row_grad.raw_exchange
    saved = opt.state_dict()
    fresh = model()  # built with the default (True) for both groups, then loads the saved False
    opt3 = tte.optim.Adagrad([{"params": [fresh["ec"].tables.a.weight]}, {"params": [fresh["ec"].tables.b.weight]}],
                             lr=0.1)
    opt3.load_state_dict(saved)
    assert fresh["ec"].tables.b.row_grad.raw_exchange and not fresh["ec"].tables.a.row_grad.raw_exchange


def test_clipping_keeps_bag_rows_factored_and_broadcast() -> None:
    """Full mean bags (``constant`` gains) with ``loss = out.sum()`` (a broadcast gradient), the rows kept factored
    for the optimizer's step: after ``clip_grad_norm_`` they keep their constant gain and stay one row broadcast (no
    ``[N, D]`` written), and equal the unclipped rows times the clipping coefficient."""
    from torch_tpu_embedding._rows.row_grad import BagRows
    from torch_tpu_embedding._rows.tables import table_info

    t = tte.TableConfig(50, 8, name="t", combiner="mean", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=3)})
    opt = tte.optim.SGD(ec.parameters(), lr=0.1)  # its steps add rows piecewise: they are kept factored
    ids = tte.Padded(torch.randint(0, 50, (16, 3), generator=torch.Generator().manual_seed(0)))
    ec({"f": ids})["f"].sum().backward()
    opt.step()  # (the first step tells the table's backward so)
    opt.zero_grad()
    ec({"f": ids})["f"].sum().backward()
    info = table_info(ec.embedding_tables["t"])
    assert info is not None
    assert [type(rows) for _, rows in info.row_grad.chunks()] == [BagRows]
    before = {k: (i.clone(), r.clone()) for k, (i, r) in ec.row_grads().items()}
    norm = tte.clip_grad_norm_(ec.parameters(), 0.5)
    assert float(norm) > 0.5
    coef = 0.5 / (float(norm) + 1e-6)
    after = ec.row_grads()
    for k, (i, r) in before.items():
        assert torch.equal(after[k][0], i)
        torch.testing.assert_close(after[k][1], r * coef, rtol=1e-12, atol=0)
    chunks = [rows for _, rows in info.row_grad.chunks()]
    assert [type(c) for c in chunks] == [BagRows]
    for c in chunks:
        assert isinstance(c, BagRows) and c.constant is not None
        assert c.grad_out.stride(0) == 0  # still one row broadcast


# ------------------------------------------------------------------ torch's clip_grad_norm_ on each table's dense gradient
V_C = 5


def three_tables(stack: bool) -> torch.nn.ModuleDict:
    """``model``'s tables a and b, and c (sum), whose looked-up rows' gradients cancel: stacked, one group of 3."""
    torch.manual_seed(0)
    a = tte.TableConfig(V_A, 4, name="a", combiner="mean", dtype=torch.float64)
    b = tte.TableConfig(V_B, 4, name="b", dtype=torch.float64)
    c = tte.TableConfig(V_C, 4, name="c", combiner="sum", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"x": tte.FeatureConfig(a), "y": tte.FeatureConfig(a), "z": tte.FeatureConfig(b),
                                  "w": tte.FeatureConfig(c)}, stack_tables=stack)
    return torch.nn.ModuleDict({"ec": ec, "head": torch.nn.Linear(12, 1, dtype=torch.float64)})


def lookups(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, V_A, (8, 3), generator=g), torch.rand(8, 3, generator=g) > 0.3,
            torch.randint(0, 4, (8, 2), generator=g), torch.randint(0, V_B, (8,), generator=g))


def loss(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
    # c's bags [2] and [2] get dL/dout +1 and -1: its one row's two entries cancel, its dense gradient is 0
    return (head(torch.cat([x, y, z], dim=1)) ** 2).mean() + (w * torch.tensor([[1.0], [-1.0]], dtype=w.dtype)).sum()


def torch_dense_reference(m: torch.nn.ModuleDict, step: int, max_norm: float, norm_type: float):
    """Plain torch, float64: each table's dense [V, D] gradient from the same lookups (gathers, the combiners by
    hand), clipped by torch.nn.utils.clip_grad_norm_ with the head's parameters; the total and the grads."""
    w = {n: t.detach().clone().requires_grad_() for n, t in m["ec"].embedding_tables.items()}
    head = torch.nn.Linear(12, 1, dtype=torch.float64)
    head.load_state_dict(m["head"].state_dict())
    ids_x, mask_x, ids_y, ids_z = lookups(step)
    mx = mask_x.double()
    x = (w["a"][ids_x] * mx[..., None]).sum(1) / mx.sum(1, keepdim=True).clamp(min=1)
    loss(x, w["a"][ids_y].mean(1), w["b"][ids_z], w["c"][torch.tensor([2, 2])], head).backward()
    params = [w["a"], w["b"], w["c"], head.weight, head.bias]
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return float(total), {"a": w["a"].grad, "b": w["b"].grad, "c": w["c"].grad, "weight": head.weight.grad,
                          "bias": head.bias.grad}


@pytest.mark.parametrize("stack", [False, True], ids=["unstacked", "stacked"])
@pytest.mark.parametrize("norm_type", [0.0, 1.0, 2.0, math.inf, -math.inf, 0.5], ids=["0", "1", "2", "inf", "-inf", "0.5"])
def test_equals_torch_on_each_tables_dense_gradient(stack: bool, norm_type: float) -> None:
    """norm_type=0 counts the gradient tensors with a nonzero entry: a, b and the head's weight and bias, not c
    (its rows cancel). The stacked group of a, b and c counted as one tensor: 3."""
    m = three_tables(stack)
    ids_x, mask_x, ids_y, ids_z = lookups(0)
    out = m["ec"]({"x": tte.Padded(ids_x, mask_x), "y": tte.Padded(ids_y), "z": ids_z,
                   "w": torch.tensor([2, 2])})
    loss(out["x"], out["y"], out["z"], out["w"], m["head"]).backward()
    unclipped, _ = torch_dense_reference(m, 0, math.inf, norm_type)
    max_norm = unclipped / 2 if unclipped else 1.0  # clips (but -inf's 0)
    want_total, want = torch_dense_reference(m, 0, max_norm, norm_type)
    if norm_type == 0:
        assert want_total == 4.0
    got = tte.clip_grad_norm_(m.parameters(), max_norm, norm_type=norm_type)
    assert float(got) == pytest.approx(want_total, rel=1e-13, abs=0.0)
    after = densified(m)
    for k, g in want.items():
        torch.testing.assert_close(after[k], g, rtol=1e-13, atol=1e-16, msg=k)
