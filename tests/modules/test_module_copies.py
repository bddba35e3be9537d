"""A collection copied with ``copy.deepcopy`` or saved whole with ``torch.save`` (pickled) is a
collection like the original from its first use: its weights are known as tables before any forward
(an optimizer built on the copy keys its state by table and loads the original's), and it trains as
the original does. Weights replaced in place of the old (``load_state_dict(assign=True)``) are never
trained silently through an optimizer that still holds the old ones."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows.tables import table_info


def _make(stack: bool) -> tte.EmbeddingCollection:
    torch.manual_seed(0)
    tables = [tte.TableConfig(10 + i, 4, name=n) for i, n in enumerate("abc")]
    return tte.EmbeddingCollection({n: tte.FeatureConfig(t) for n, t in zip("abc", tables, strict=True)},
                                   stack_tables=stack)


def _train(ec: tte.EmbeddingCollection, opt: Any, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        out = ec({n: torch.randint(0, 10, (5,), generator=g) for n in "abc"})
        sum((i + 1) * o.square().sum() for i, o in enumerate(out.values())).backward()
        opt.step()
        opt.zero_grad()


def _pickled(ec: tte.EmbeddingCollection) -> tte.EmbeddingCollection:
    buf = io.BytesIO()
    torch.save(ec, buf)
    buf.seek(0)
    out: tte.EmbeddingCollection = torch.load(buf, weights_only=False)  # our own module, trusted here
    return out


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_a_copy_of_a_trained_collection_resumes_like_the_original(how: str, stack: bool) -> None:
    ec = _make(stack)
    opt = tte.optim.LazyAdam(ec.parameters(), lr=0.1)
    _train(ec, opt, 2, seed=1)
    twin = copy.deepcopy(ec) if how == "deepcopy" else _pickled(ec)
    assert all(table_info(p) is not None for p in twin.parameters())  # before any forward
    twin_opt = tte.optim.LazyAdam(twin.parameters(), lr=0.1)
    twin_opt.load_state_dict(opt.state_dict())  # keyed table:a, table:b, table:c on both sides
    assert sorted(twin_opt.state_dict()["state"]) == ["table:a", "table:b", "table:c"]
    _train(ec, opt, 2, seed=2)
    _train(twin, twin_opt, 2, seed=2)
    for k, v in ec.state_dict().items():
        assert torch.equal(twin.state_dict()[k], v), k


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_weights_replaced_by_an_assigning_load_are_refused_by_an_older_optimizer(stack: bool) -> None:
    src, ec = _make(stack), _make(stack)
    _train(src, tte.optim.SGD(src.parameters(), lr=0.5), 1, seed=1)
    stale = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    ec.load_state_dict({k: v.clone() for k, v in src.state_dict().items()}, assign=True)  # new Parameters
    for k, v in src.state_dict().items():
        assert torch.equal(ec.state_dict()[k], v), k
    with pytest.raises(RuntimeError, match=r"no longer (the table's|theirs): the table's weight parameter was replaced"):
        _train(ec, stale, 1, seed=2)
    ec.zero_grad()
    fresh = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    _train(ec, fresh, 1, seed=2)
    assert all(not torch.equal(ec.state_dict()[k], v) for k, v in src.state_dict().items())


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_a_weight_copied_on_its_own_is_not_a_table(stack: bool) -> None:
    """The registration is an attribute of the weight naming the tensor it was made for: a shallow copy carries
    the attribute along but is not that tensor, a deep copy or pickle drops it, ``detach`` has none."""
    from torch_tpu_embedding._rows.tables import stacked_rows

    ec = _make(stack)
    params = list(ec.parameters())
    views = [ec.tables[n].weight for n in "abc"]
    assert all(table_info(p) is not None for p in params)
    assert all(stacked_rows(v) is not None for v in views) == stack
    for p in params:
        for twin in (copy.copy(p), copy.deepcopy(p), p.detach()):
            assert table_info(twin) is None and stacked_rows(twin) is None
    for v in views:  # (a stacked table's weight is a view, which deepcopy refuses)
        for twin in (v.detach(), v.view_as(v)):
            assert table_info(twin) is None and stacked_rows(twin) is None
    assert all(table_info(p) is not None for p in params)  # the originals still are


@pytest.mark.parametrize("stack", [True, False])
def test_functional_call_reads_substituted_weights_and_leaves_the_tables_trainable(stack: bool) -> None:
    """``torch.func.functional_call`` with other values for the tables: the lookup reads them (under no_grad),
    a gradient for them is refused by name (a table's gradient reaches only its own parameter, so it would be
    lost), and the collection's own weights stay its tables: an optimizer still trains them afterwards."""
    ec = _make(stack)
    opt = tte.optim.SGD(ec.parameters(), lr=1.0)
    ids = {n: torch.tensor([1, 3]) for n in "abc"}
    values = {k: torch.arange(v.numel(), dtype=v.dtype).view_as(v) for k, v in ec.named_parameters()}
    with torch.no_grad():
        out = torch.func.functional_call(ec, values, (ids,))
    first = next(iter(values.values()))
    torch.testing.assert_close(out["a"], first[ids["a"]], rtol=0, atol=0)
    wanting = {k: v.clone().requires_grad_() for k, v in values.items()}
    tables = r"Tables `a`, `b`, `c` \(stacked together\)" if stack else r"Table `a`"  # the user's names
    with pytest.raises(RuntimeError, match=tables + r": a tensor substituted.*torch.no_grad"):
        torch.func.functional_call(ec, wanting, (ids,))
    before = {k: v.clone() for k, v in ec.state_dict().items()}
    _train(ec, opt, 1, seed=1)  # the tables' own weights: still registered, trained
    assert any(not torch.equal(before[k], v) for k, v in ec.state_dict().items())


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_functional_call_with_replacement_parameters_leaves_the_tables_theirs(stack: bool) -> None:
    """Replacement ``nn.Parameter`` objects (as ``dict(model.named_parameters())`` copies give) are substitutes
    for one call like plain tensors: read under no_grad (the plain-torch numbers), a gradient refused (each call,
    not only the first), and the collection's own weights stay its tables, trained by its optimizer."""
    ec = _make(stack)
    opt = tte.optim.SGD(ec.parameters(), lr=0.5)
    ids = {n: torch.tensor([1, 3, 3]) for n in "abc"}
    start = {k: v.clone() for k, v in ec.state_dict().items()}
    swapped = {k: torch.nn.Parameter(v.detach() * 2 + 1) for k, v in ec.named_parameters()}
    with torch.no_grad():
        out = torch.func.functional_call(ec, swapped, (ids,))
    for n in "abc":  # plain torch: the replacement's rows of each table
        weight = 2 * start[f"tables.{n}.weight"] + 1
        torch.testing.assert_close(out[n], weight[ids[n]], rtol=0, atol=0)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"a tensor substituted for the weight .* cannot get a gradient"):
            torch.func.functional_call(ec, swapped, (ids,))
    assert all(table_info(p) is None for p in swapped.values())  # the caller's tensors stay theirs
    out = ec(ids)
    sum((i + 1) * o.sum() for i, o in enumerate(out.values())).backward()
    opt.step()  # its own weights: still its tables (no "no longer the table's")
    for i, n in enumerate("abc"):  # plain torch SGD: -lr · (i + 1) per occurrence of an id
        want = start[f"tables.{n}.weight"].clone()
        want[1] -= 0.5 * (i + 1)
        want[3] -= 0.5 * (i + 1) * 2
        torch.testing.assert_close(ec.state_dict()[f"tables.{n}.weight"], want)


class _Model(torch.nn.Module):
    def __init__(self, stack: bool) -> None:
        super().__init__()
        self.ec = _make(stack)
        self.scale = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, ids: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.ec(ids)
        return sum(s * o.square().sum() for s, o in zip(self.scale, out.values(), strict=True))


_PENDING_IDS = {n: torch.tensor([1, 3, 3, 7]) for n in "abc"}


def _sgd_reference(start: dict[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
    """Plain torch in float64: each table after one SGD step of _Model's loss at ``start``."""
    out = {}
    for i, n in enumerate("abc"):
        w = start[f"ec.tables.{n}.weight"].double().requires_grad_()
        ((i + 1) * w[_PENDING_IDS[n]].square().sum()).backward()
        out[f"ec.tables.{n}.weight"] = (w - lr * w.grad).detach()
    return out


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_a_copy_made_while_rows_are_pending_starts_without_them(how: str, stack: bool) -> None:
    """As torch's copies of a parameter carry no ``.grad``, a copy of a model made between backward and step has
    no pending rows; the original keeps its own, and each steps with its own optimizer to the plain-torch numbers."""
    model = _Model(stack)
    start = {k: v.clone() for k, v in model.state_dict().items() if ".tables." in k}
    model(_PENDING_IDS).backward()
    twin = copy.deepcopy(model) if how == "deepcopy" else _pickled(model)
    assert sorted(model.ec.row_grads()) == ["a", "b", "c"] and twin.ec.row_grads() == {}
    opt, twin_opt = tte.optim.SGD(model.ec.parameters(), lr=0.5), tte.optim.SGD(twin.ec.parameters(), lr=0.5)
    opt.step()
    twin_opt.step()  # nothing pending: nothing changes
    want = _sgd_reference(start, 0.5)
    for k, v in want.items():
        torch.testing.assert_close(model.state_dict()[k].double(), v)
        assert torch.equal(twin.state_dict()[k], start[k]), k
    twin(_PENDING_IDS).backward()  # the copy's own backward: the same step from the same start
    twin_opt.step()
    for k, v in want.items():
        torch.testing.assert_close(twin.state_dict()[k].double(), v)


@pytest.mark.parametrize("swap", [False, True], ids=["copy", "swap_module_params_on_conversion"])
@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_pending_rows_survive_a_cast_and_loads_work_with_torch_swapping_params(swap: bool, stack: bool) -> None:
    """``model.double()`` between backward and step keeps the pending rows (torch casts ``.grad`` along); with
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` the cast and ``load_state_dict`` work too (a
    table's weight is written in place: torch's swap refuses tensors with weak references)."""
    model = _Model(stack)
    start = {k: v.clone() for k, v in model.state_dict().items() if ".tables." in k}
    model(_PENDING_IDS).backward()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model.double()
        model.load_state_dict(model.state_dict())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert sorted(model.ec.row_grads()) == ["a", "b", "c"]
    opt = tte.optim.SGD(model.ec.parameters(), lr=0.5)
    opt.step()
    for k, v in _sgd_reference(start, 0.5).items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-6)  # float32 gradient rows


class _Served(torch.nn.Module):
    def __init__(self, ec: tte.EmbeddingCollection) -> None:
        super().__init__()
        self.ec = ec

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.ec({n: tte.Padded(ids, mask) for n in "abc"})
        return torch.cat([out[n] for n in "abc"], dim=1)


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_torch_export_leaves_the_tables_theirs(stack: bool) -> None:
    """torch.export traces with fake parameters in place of the weights (under grad): the export equals eager mode,
    and the collection's own weights stay its tables (an optimizer built before the export still trains them)."""
    ec = _make(stack)
    opt = tte.optim.SGD(ec.parameters(), lr=0.5)
    ids, mask = torch.tensor([[1, 3], [3, 0]]), torch.tensor([[True, True], [True, False]])
    program = torch.export.export(_Served(ec), (ids, mask))
    torch.testing.assert_close(program.module()(ids, mask), _Served(ec)(ids, mask), rtol=0, atol=0)
    start = {k: v.clone() for k, v in ec.state_dict().items()}
    out = ec({n: ids[:, 0] for n in "abc"})
    sum(o.sum() for o in out.values()).backward()
    opt.step()
    for n in "abc":  # plain torch SGD: -lr per occurrence of ids 1 and 3
        want = start[f"tables.{n}.weight"].clone()
        want[[1, 3]] -= 0.5
        torch.testing.assert_close(ec.state_dict()[f"tables.{n}.weight"], want)
