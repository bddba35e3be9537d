"""Data parallel outside SPMD (torch_tpu_embedding.distributed): 2 and 3 processes, gloo on the CPU.

Each world size is one spawn running every case (tests/_dp_worker.py); the tests here compare its
ranks with each other (bitwise: every replica applies the same update) and with one process trained
on the global batch (float64 ≤ 1e-10, float32 ≤ 1e-6), which is the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _dp_worker as W
import pytest
import torch
import torch.distributed as dist
from suite_helpers import free_port, start_ranks

import torch_tpu_embedding as tte

WORLDS = (2, 3)
DTYPES = (torch.float64, torch.float32)
#: The dense head: its gradient is averaged by DDP (or by hand), whose float32 sums differ from one process's
#: by more than the tables' do: its Adagrad accumulator reaches 1.2e-6 relative on 3 ranks, where one
#: process on the same batch reversed already differs by 4.8e-7. The tables are held to W.TOL.
DENSE_TOL = {torch.float64: 1e-10, torch.float32: 3e-6}


_RUNS: dict[int, tuple[list[dict[str, Any]], Path]] = {}


def ranks(world: int, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """Every rank's results of one spawn of ``world`` processes (run once per session)."""
    if world not in _RUNS:
        out = tmp_path_factory.mktemp(f"dp{world}")
        start_ranks(W.worker, (world, free_port(), str(out)), world)
        _RUNS[world] = ([torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)], out)
    return _RUNS[world]


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts/lists by path."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in flat(sub, f"{prefix}/{i}").items()}
    return {prefix: tree}


def assert_replicas_equal(results: list[dict[str, Any]]) -> None:
    """Every rank's model and optimizer state bitwise equal to rank 0's."""
    first = flat(results[0])
    for r, other in enumerate(results[1:], 1):
        leaves = flat(other)
        assert leaves.keys() == first.keys()
        for k, v in first.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, leaves[k]), f"rank {r} differs at {k}"
            else:
                assert v == leaves[k], f"rank {r} differs at {k}"


def assert_close(got: dict[str, Any], want: dict[str, Any], tol: float, only: str | None = None,
                 dense_tol: float | None = None) -> None:
    """Every leaf within ``tol`` (relative above magnitude 1: float32 rounding grows with the value);
    ``only``: just the leaves of tables ``*__<only>`` (a table's weight and its optimizer slots);
    ``dense_tol``: the tolerance of the dense head's weights and slots (default ``tol``)."""
    a, b = flat(got), flat(want)
    assert a.keys() == b.keys()
    if only is not None:
        b = {k: v for k, v in b.items() if f"__{only}." in k or f"__{only}/" in k}
        assert b, only
    for k, v in b.items():
        if k.endswith("/acc_ids"):  # compared with acc_rows
            continue
        if k.endswith("/acc_rows"):  # pending accumulation: the same sums per id, in whatever layout
            ids = k[: -len("rows")] + "ids"
            a[k], v = _densify(a[ids], a[k]), _densify(b[ids], v)
        if isinstance(v, torch.Tensor):
            assert a[k].dtype == v.dtype, k
            limit = dense_tol if dense_tol is not None and ("/head." in k or "/param:" in k) else tol
            err = (a[k].double() - v.double()).abs() / v.double().abs().clamp(min=1)
            assert float(err.max()) <= limit if v.numel() else True, f"{k}: {float(err.max()):.3g} > {limit}"
        elif isinstance(v, float):
            assert abs(a[k] - v) <= tol, k
        else:
            assert a[k] == v, k


def _densify(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A ``[k, capacity]`` accumulation buffer as ``[k, max id + 1, D]`` sums per id (``-1``: padding)."""
    n = int(ids.max()) + 2
    out = torch.zeros(ids.shape[0], n, rows.shape[-1], dtype=rows.dtype)
    for i in range(ids.shape[0]):
        out[i].index_add_(0, torch.where(ids[i] < 0, n - 1, ids[i]), rows[i])
    return out[:, :-1]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("mode", ["ddp", "plain"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_replicas_equal_one_process_on_the_global_batch(
    world: int, mode: str, dtype: torch.dtype, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """10 steps of a model with two tables per optimizer of W.OPTIMIZERS (each table's TableConfig names
    it) and a head: DDP-wrapped (ranks start from different tables; rank 0's are broadcast) or without DDP
    (the head's grads averaged by hand, no tte.distributed call: the default group is used). Every rank's
    model and optimizer state is bitwise the same and equals one process on the global batch."""
    results, _ = ranks(world, tmp_path_factory)
    assert_replicas_equal([r[f"{mode}/{dtype}"] for r in results])
    assert_close(results[0][f"{mode}/{dtype}"], W.reference("zoo", dtype), W.TOL[dtype], dense_tol=DENSE_TOL[dtype])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", W.ZOO)
def test_each_optimizer(world: int, name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same comparison, one optimizer's tables at a time (weights and slots), DDP and not, both dtypes."""
    results, _ = ranks(world, tmp_path_factory)
    for mode in ("ddp", "plain"):
        for dtype in DTYPES:
            got = results[0][f"{mode}/{dtype}"]
            assert_close(got, W.reference("zoo", dtype), W.TOL[dtype], only=W._variant_key(name))
            first = W.Model(dtype, 0, variants=W.ZOO).state_dict()[f"ec.tables.a__{W._variant_key(name)}.weight"]
            assert not torch.equal(got["model"][f"ec.tables.a__{W._variant_key(name)}.weight"], first)  # trained


@pytest.mark.parametrize("world", WORLDS)
def test_stacked_tables(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    results, _ = ranks(world, tmp_path_factory)
    assert_replicas_equal([r["ddp-stacked"] for r in results])
    assert_close(results[0]["ddp-stacked"], W.reference("adagrad", torch.float64, stack=True), 1e-10)


@pytest.mark.parametrize("world", WORLDS)
def test_static_shape_exchange(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The XLA multi-process form of the exchange (raw padded rows, sizes checked once), run with gloo."""
    results, _ = ranks(world, tmp_path_factory)
    assert_replicas_equal([r["static"] for r in results])
    assert_close(results[0]["static"], W.reference("zoo", torch.float64), 1e-10)


@pytest.mark.parametrize("world", WORLDS)
def test_plain_torch_ddp_is_refused(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    results, _ = ranks(world, tmp_path_factory)
    for r in results:
        assert "Embedding table 'a' is reduced by DistributedDataParallel" in r["plain-ddp-error"]
        assert "tte.distributed.DistributedDataParallel(model, ...)" in r["plain-ddp-error"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_clip_grad_norm_data_parallel(world: int, dtype: torch.dtype, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The norm and clipped gradients of tte.clip_grad_norm_ under DDP equal the same clipping computed by
    hand over the global gradient (every rank), and the run equals one process clipping the global batch."""
    results, _ = ranks(world, tmp_path_factory)
    runs = [r[f"clip/{dtype}"] for r in results]
    assert all(run["max_error"] <= W.TOL[dtype] for run in runs), [run["max_error"] for run in runs]
    assert_replicas_equal(runs)
    ref = _clip_reference(dtype)
    assert max(abs(a - b) / b for a, b in zip(runs[0]["norms"], ref["norms"], strict=True)) <= W.TOL[dtype]
    assert min(ref["norms"]) > 0.05  # every step clipped
    assert_close({"model": runs[0]["model"], "optimizer": runs[0]["optimizer"]},
                 {"model": ref["model"], "optimizer": ref["optimizer"]}, W.TOL[dtype])


def _clip_reference(dtype: torch.dtype) -> dict[str, Any]:
    model = W.build("adagrad", dtype, seed=0)
    opt = W.make_opt("adagrad", model.parameters())
    norms = []
    for step in range(W.STEPS):
        batch, y = W.global_batch(step, dtype, model)
        opt.zero_grad()
        ((model(batch) - y) ** 2).mean().backward()
        norms.append(float(tte.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
    return {"norms": norms, **W.state(model, opt)}


@pytest.mark.parametrize("world", WORLDS)
def test_checkpoint_from_data_parallel_run(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 0 saved after 5 steps; every rank loaded and ran 5 more. The file equals the single-process
    checkpoint, and a single process that loads it continues as the ranks did."""
    results, out = ranks(world, tmp_path_factory)
    runs = [r["checkpoint"] for r in results]
    assert_replicas_equal(runs)
    single = W.build("lazy_adam", torch.float64, seed=7)
    opt = W.make_opt("lazy_adam", single.parameters())
    assert tte.checkpoint.load(out / "ckpt.pt", model=single, optimizer=opt) == {"step": 5}
    assert_close(W.state(single, opt), W.reference("lazy_adam", torch.float64, steps=5), 1e-10)
    W.train(single, opt, range(5, W.STEPS), torch.float64)
    assert_close(runs[0], W.state(single, opt), 1e-10)
    assert_close(runs[0], W.reference("lazy_adam", torch.float64), 1e-10)


@pytest.mark.parametrize("world", WORLDS)
def test_spmd_is_never_exchanged(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """With torch_xla's SPMD mode on (a stand-in module here) nothing is exchanged: the ranks' tables
    train on their own shares and differ; data_parallel refuses."""
    results, _ = ranks(world, tmp_path_factory)
    runs = [r["spmd"] for r in results]
    assert all(run["group"] is None for run in runs)
    assert all("not for torch_xla SPMD" in run["refused"] for run in runs)
    a = [run["model"]["ec.tables.a.weight"] for run in runs]
    assert not torch.equal(a[0], a[1])


def test_explicit_group_and_local_tables(tmp_path_factory: pytest.TempPathFactory) -> None:
    """3 ranks: 0 and 1 data parallel over new_group([0, 1]) on halves of the batch; rank 2 (local_tables)
    trains alone on the whole batch. All three agree; ranks 0 and 1 bitwise."""
    results, _ = ranks(3, tmp_path_factory)
    runs = [r["subgroup"] for r in results]
    assert_replicas_equal(runs[:2])
    assert_close(runs[0], runs[2], 1e-10)
    assert_close(runs[2], W.reference("adagrad", torch.float64), 0.0)


def test_should_exchange_rule() -> None:
    rule = tte.distributed.should_exchange
    assert rule(spmd=False, group_size=2, local=False)
    assert not rule(spmd=True, group_size=2, local=False)  # SPMD: gradients are global already
    assert not rule(spmd=True, group_size=8, local=False)
    assert not rule(spmd=False, group_size=1, local=False)
    assert not rule(spmd=False, group_size=4, local=True)


def test_single_process_needs_nothing() -> None:
    """Without a process group: no exchange, no error, and data_parallel says what is missing."""
    assert all(hasattr(tte.distributed, n) for n in tte.distributed.__all__)
    model = W.build("adagrad", torch.float64, seed=0)
    assert tte.distributed.exchange_group(model.ec.tables["a"].weight) is None
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        tte.distributed.data_parallel(model)


@pytest.fixture
def group_of_one(tmp_path: Path) -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_group_of_one(group_of_one: None) -> None:
    """The wrapper names the tables for DDP to ignore (root-level names as DDP spells them too), a model
    with tables only is sent to data_parallel, and a table with a dense `.grad` under a process group (a
    DDP that reduced it) is refused at step()."""
    model = W.build("adagrad", torch.float64, seed=0)
    ddp = tte.distributed.DistributedDataParallel(model)
    assert set(model._ddp_params_and_buffers_to_ignore) == {"ec.tables.a.weight", "ec.tables.a2.weight",
                                                           "ec.tables.b.weight"}
    assert {id(p) for p in ddp._module_parameters} == {id(p) for p in model.head.parameters()}
    table = tte.EmbeddingTable(tte.TableConfig(5, 2, name="t"), "t")
    tte.distributed.data_parallel(table)
    assert table._ddp_params_and_buffers_to_ignore == ["weight", ".weight"]
    with pytest.raises(ValueError, match="no dense parameter"):
        tte.distributed.DistributedDataParallel(model.ec)
    opt = W.make_opt("adagrad", model.parameters())
    model.ec.tables["a"].weight.grad = torch.zeros_like(model.ec.tables["a"].weight)
    # (or a loss term on the weight itself, the other way a table gets a dense .grad: both named)
    with pytest.raises(RuntimeError, match="(?s)Embedding table 'a' is reduced by DistributedDataParallel.*Or else "
                       "a loss term used the weight outside a lookup"):
        opt.step()
