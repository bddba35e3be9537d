"""``choose_path`` — the one place that decides how an update runs — per path, and that a step runs
the path it chose (each path's numbers are checked against references elsewhere: test_optim_reference,
test_row_chunks, test_optim_generic's lazy-equals-dense)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._core import update_paths
from torch_tpu_embedding.optim._core.update_paths import Path, choose_path
from torch_tpu_embedding.optim._kernels import kernel_policy

O = tte.optim  # noqa: E741

CASES: list[tuple[str, Any, dict[str, Any], str, Path]] = [
    # (id, optimizer, kwargs, which parameter, expected path)
    ("dense-param", O.Adagrad, {"lr": 0.1}, "head", Path.DENSE),
    ("nonlazy-adam-table", O.Adam, {"lr": 0.1, "lazy_adam": False}, "table", Path.DENSE),
    ("sgd-table", O.SGD, {"lr": 0.1}, "table", Path.ADDITIVE),
    ("sgd-accumulation-table", O.SGD, {"lr": 0.1, "gradient_accumulation_steps": 2}, "table", Path.ADDITIVE),
    ("sgd-clipvalue-table", O.SGD, {"lr": 0.1, "clipvalue": 0.5}, "table", Path.ROW_CHUNKS),
    ("sgd-ema-table", O.SGD, {"lr": 0.1, "use_ema": True}, "table", Path.ROW_CHUNKS),
    ("sgd-skip-nonfinite-table", O.SGD, {"lr": 0.1, "skip_nonfinite": True}, "table", Path.ROW_CHUNKS),
    ("adagrad-table", O.Adagrad, {"lr": 0.1}, "table", Path.ROW_CHUNKS),
    ("adagrad-no-dedup-table", O.Adagrad, {"lr": 0.1, "use_gradient_accumulation": False}, "table", Path.NO_DEDUP),
    ("adafactor-table", O.Adafactor, {"lr": 0.1}, "table", Path.ROWS),
    ("lazy-adam-table", O.LazyAdam, {"lr": 0.1}, "table", Path.ROW_CHUNKS),
]


def model() -> tuple[tte.EmbeddingCollection, torch.nn.Linear]:
    torch.manual_seed(0)
    t = tte.TableConfig(10, 3, name="t", dtype=torch.float64)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=2)}), torch.nn.Linear(3, 1).double()


@pytest.mark.parametrize("cls, kwargs, which, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_choose_path_and_the_step_runs_it(cls: Any, kwargs: dict[str, Any], which: str, expected: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel path off (its cases: the next tests), whatever ``TTE_UPDATE_KERNEL`` the suite runs with."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", False)
    ec, head = model()
    opt = cls([*ec.parameters(), *head.parameters()], **kwargs)
    p = ec.tables.t.weight if which == "table" else head.weight
    group = opt.param_groups[0]
    assert choose_path(p, group, row_grad=which == "table") is expected
    ran: list[tuple[Path, int]] = []
    real = update_paths.update

    def spy(item: Any) -> None:
        ran.append((item.path, id(item.p)))
        real(item)

    monkeypatch.setattr(update_paths, "update", spy)
    monkeypatch.setattr("torch_tpu_embedding.optim._core.base.update", spy)
    k = kwargs.get("gradient_accumulation_steps") or 1
    for s in range(k):
        out = ec({"f": tte.Jagged(torch.tensor([1, 1, 4, 7]) + s, lengths=torch.tensor([2, 1, 1]))})["f"]
        head(out).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert (expected, id(p)) in ran


def test_sparse_coo_grad_takes_the_row_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_policy, "_ENABLED", False)  # (with it on Adagrad takes KERNEL)
    emb = torch.nn.Embedding(6, 2, sparse=True)
    # Adafactor: densified (statistics over every row; tests/optim/test_adafactor_sparse_grad.py)
    for cls, expected in ((O.SGD, Path.ADDITIVE), (O.Adagrad, Path.ROW_CHUNKS), (O.Adafactor, Path.DENSE)):
        assert choose_path(emb.weight, cls(emb.parameters(), lr=0.1).param_groups[0], row_grad=True) is expected
    assert choose_path(emb.weight, O.Adam(emb.parameters(), lazy_adam=False).param_groups[0],
                       row_grad=True) is Path.DENSE


@pytest.mark.parametrize("cls, kwargs, which, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_with_kernel_updates_on_the_row_chunk_cases_take_kernel(cls: Any, kwargs: dict[str, Any], which: str,
                                                              expected: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TTE_UPDATE_KERNEL`` on (the suite runs with it off, tests/conftest.py): every eager update with summed
    rows is ``KERNEL``, in chunks (per-row rules) or in one pass (Adafactor); the other paths do not change.
    tests/optim/test_kernel_update.py steps each optimizer on it."""

    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    ec, head = model()
    opt = cls([*ec.parameters(), *head.parameters()], **kwargs)
    p = ec.tables.t.weight if which == "table" else head.weight
    want = Path.KERNEL if expected in (Path.ROW_CHUNKS, Path.ROWS) else expected
    assert choose_path(p, opt.param_groups[0], row_grad=which == "table") is want
    if which == "table":
        ec16 = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10, 3, name="h", dtype=torch.bfloat16))})
        p16 = ec16.tables.h.weight
        # (a 16-bit table's moving average reads its stored weight, rounded: not compiled, update_paths._compiles)
        want16 = expected if kwargs.get("use_ema") else want
        assert choose_path(p16, cls(ec16.parameters(), **kwargs).param_groups[0], row_grad=True) is want16
    monkeypatch.setattr(kernel_policy, "_ENABLED", False)
    assert choose_path(p, opt.param_groups[0], row_grad=which == "table") is expected


def test_owner_local_is_chosen_for_a_table_trained_through_the_id_exchange() -> None:
    """A table that ``xla.shard`` set up for the id exchange (``TableInfo.sharding.exchange``) takes OWNER_LOCAL,
    lazy or not (its gradient arrives at the owning shards); a dense parameter never does. The path itself runs
    on SPMD meshes (tests/xla_spmd/test_routed_training.py)."""
    import types

    from torch_tpu_embedding._rows.tables import table_info

    ec, head = model()
    p = ec.tables.t.weight
    info = table_info(p)
    assert info is not None and not info.owner_local
    info.sharding = types.SimpleNamespace(exchange=True)
    for opt in (O.Adagrad([p], lr=0.1), O.SGD([p], lr=0.1), O.Adam([p], lazy_adam=False),
                O.SGD([p], lr=0.1, use_gradient_accumulation=False)):
        assert choose_path(p, opt.param_groups[0], row_grad=True) is Path.OWNER_LOCAL
    # Each device's duplicates are summed before they travel: no-dedup is refused but where it is exact (SGD's add;
    # tests/xla_spmd/test_shard_refusals.py)
    with pytest.raises(ValueError, match="use_gradient_accumulation=False"):
        choose_path(p, O.Adagrad([p], lr=0.1, use_gradient_accumulation=False).param_groups[0], row_grad=True)
    assert choose_path(head.weight, O.Adagrad(head.parameters()).param_groups[0], row_grad=False) is Path.DENSE


@pytest.mark.parametrize("cls", [O.SGD, O.Adagrad, O.AdagradMomentum, O.Adam, O.FTRL], ids=lambda c: c.__name__)
@pytest.mark.parametrize("side", ["max", "min"])
def test_no_dedup_keeps_the_weights_within_clip_weight(cls: Any, side: str) -> None:
    """``use_gradient_accumulation=False`` (``Path.NO_DEDUP``) adds the changes of each id's contributions, each
    clipped to ``[clip_weight_min, clip_weight_max]``; their sum overshot the bound (0.25 + 3·0.04 = 0.37 with
    ``clip_weight_max=0.3``). TF clips the weights as the last step of an update, so a touched row ends within
    the bounds whatever the order of the contributions: here three pushes the same way past the bound end
    exactly at it. An untouched row outside the bounds is not clipped (TF clips the updated rows only)."""
    sign = -1.0 if side == "max" else 1.0  # the loss pushes the weights towards the bound
    bound = {"max": {"clip_weight_max": 0.3}, "min": {"clip_weight_min": -0.3}}[side]
    init = torch.full((4, 2), -0.25 * sign, dtype=torch.float64)
    init[3] = 0.5 * -sign  # outside the bounds, never looked up
    t = tte.TableConfig(4, 2, name="t", combiner="sum", dtype=torch.float64, initializer=init)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=4)})
    opt = cls(ec.parameters(), lr=0.1, use_gradient_accumulation=False, **bound)
    ids = torch.tensor([[0, 0, 0, 1], [1, 2, 2, 2]])
    assert choose_path(ec.tables.t.weight, opt.param_groups[0], row_grad=True) is Path.NO_DEDUP
    (ec({"f": tte.Padded(ids)})["f"].sum() * sign * 4.0).backward()
    opt.step()
    w = ec.tables.t.weight.detach()
    assert torch.equal(w[:3], torch.full((3, 2), -0.3 * sign, dtype=torch.float64)), w
    assert torch.equal(w[3], init[3])


def _index_selects_in_step(**bound: float) -> int:
    t = tte.TableConfig(8, 2, name="t", combiner="sum", dtype=torch.float64)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=2)})
    opt = O.Adagrad(ec.parameters(), lr=0.1, use_gradient_accumulation=False, **bound)
    ec({"f": tte.Padded(torch.tensor([[0, 0], [1, 2]]))})["f"].sum().backward()
    with _Count() as count:
        opt.step()
    return count.ops.count(torch.ops.aten.index_select.default)


class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_no_dedup_clip_weight_without_ema_reads_the_rows_once_more_not_twice() -> None:
    """With ``use_gradient_accumulation=False`` the clip of the summed rows reads each distinct row after the
    update; the rows before it are read again only for the moving average (``use_ema``), which this group lacks."""
    plain, clipped = _index_selects_in_step(), _index_selects_in_step(clip_weight_max=0.3)
    assert clipped == plain + 1, (plain, clipped)
