"""``torch.autograd.grad`` and ``backward(inputs=...)`` through a lookup, against plain torch.

In torch, ``torch.autograd.grad`` leaves every ``.grad`` as it was, and ``backward(inputs=xs)`` accumulates
into ``xs`` only. A table's ``.grad`` is its pending rows (``ec.row_grads()``): they follow the same rule, so
a gradient asked for the per-id weights (or dense layers) does not add rows that the next step would apply
on top of the loss's own. ``torch.autograd.grad`` of a table's weight itself is refused by table name (its
gradient is row-sparse, never a ``[V, D]`` tensor).
"""

from __future__ import annotations

import pytest
import torch

import torch_tpu_embedding as tte

_IDS = torch.tensor([1, 2, 2, 7])
_LENGTHS = torch.tensor([3, 1])
_PER_ID = [0.5, 2.0, -1.0, 3.0]
_LR = 0.25


def _make(stack: bool) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    tables = [tte.TableConfig(10, 3, name=n, combiner="sum") for n in "ab"]
    return tte.EmbeddingCollection({n: tte.FeatureConfig(t) for n, t in zip("ab", tables, strict=True)},
                                   stack_tables=stack)


def _loss(ec: tte.EmbeddingCollection, w: torch.Tensor) -> torch.Tensor:
    out = ec({"a": tte.Jagged(_IDS, lengths=_LENGTHS), "b": _IDS[:2]}, {"a": w, "b": None})
    return out["a"].square().sum() + 3 * out["b"].sum()


def _reference(start: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain torch in float64: d loss / d per-id weights, and each table after one SGD step of the loss."""
    a = start["tables.a.weight"].double().requires_grad_()
    b = start["tables.b.weight"].double().requires_grad_()
    w = torch.tensor(_PER_ID, dtype=torch.float64, requires_grad=True)
    rows = a[_IDS] * w.unsqueeze(1)
    bags = torch.stack([rows[:3].sum(0), rows[3:].sum(0)])
    loss = bags.square().sum() + 3 * b[_IDS[:2]].sum()
    ga, gb, gw = torch.autograd.grad(loss, [a, b, w])
    return gw, {"tables.a.weight": a.detach() - _LR * ga, "tables.b.weight": b.detach() - _LR * gb}


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_autograd_grad_of_the_per_id_weights_adds_no_table_rows(stack: bool) -> None:
    ec = _make(stack)
    start = {k: v.clone() for k, v in ec.state_dict().items()}
    want_gw, want_tables = _reference(start)
    opt = tte.optim.SGD(ec.parameters(), lr=_LR)
    w = torch.tensor(_PER_ID, requires_grad=True)
    (gw,) = torch.autograd.grad(_loss(ec, w), [w])
    torch.testing.assert_close(gw.double(), want_gw, rtol=1e-6, atol=1e-6)
    assert ec.row_grads() == {}  # as torch.autograd.grad leaves .grad alone
    w.grad = None
    _loss(ec, w).backward()
    opt.step()
    for k, v in want_tables.items():  # the loss's gradient once (not twice)
        torch.testing.assert_close(ec.state_dict()[k].double(), v, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), want_gw, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_backward_with_inputs_that_leave_the_tables_out_adds_no_rows(stack: bool) -> None:
    ec = _make(stack)
    w = torch.tensor(_PER_ID, requires_grad=True)
    _loss(ec, w).backward(inputs=[w])
    assert ec.row_grads() == {} and w.grad is not None
    _loss(ec, w).backward(inputs=[w, *ec.parameters()])  # naming the table's parameter: its rows, as .grad
    assert sorted(ec.row_grads()) == ["a", "b"]


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_autograd_grad_of_a_table_weight_is_refused_by_table_name(stack: bool) -> None:
    ec = _make(stack)
    w = torch.tensor(_PER_ID, requires_grad=True)
    weight = next(iter(ec.parameters()))  # a table's, or the stacked group's that holds `a` and `b`
    names = "`a`, `b`" if stack else "`a`"
    with pytest.raises(RuntimeError, match=rf"Argument `inputs` of torch.autograd.grad holds the weight of "
                                           rf"embedding table\(s\) {names}: .*EmbeddingCollection.row_grads\(\)"):
        torch.autograd.grad(_loss(ec, w), [weight, w])
    assert ec.row_grads() == {}
