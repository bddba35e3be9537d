"""Tables sharded over a process group (tte.distributed.shard): 2, 3 and 4 gloo processes on the CPU.

Each world size is one spawn running every case (tests/_mp_worker.py). Every rank's stored rows of every
row- and table-sharded table (matched by logical id), their optimizer slots, the replicated tables and the
DDP-wrapped dense head equal one process trained on the global batch, for every optimizer of tte.optim and the
options with global statistics: float64 <= 1e-10; float32 within a bound per leaf derived from float32 arithmetic
(W.float32_bounds: 4 times the largest distance of the one float32 process, and of 8 runs whose every example's
term is perturbed by a rounding's worth, from the float64 shadow (the float32 start trained in float64), plus 20
roundings of the leaf's peak magnitude; the derivation is written above W.EPS32 in tests/_mp_worker.py), the same
rule for every configuration at every world size, on any CPU. With the DDP head frozen the sharded
tables of W.FROZEN_HEAD's configurations hold the same rule. No rank stores more of a sharded table or slot
than its shard plus padding.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _mp_worker as W
import pytest
import torch
from suite_helpers import free_port, start_ranks

import torch_tpu_embedding as tte

WORLDS = (2, 3, 4)
DTYPES = (torch.float64, torch.float32)
_RUNS: dict[int, list[dict[str, Any]]] = {}
_DIRS: dict[int, Any] = {}
_REFS: dict[tuple[str, torch.dtype, bool, bool], dict[str, Any]] = {}
_BOUNDS: dict[tuple[str, bool], dict[str, float]] = {}
VOCAB = {"big": 1500, "row2": 1000, "tw": 600, "tw2": 400}
DIM = {"big": 4, "row2": 4, "tw": 3, "tw2": 3}


def ranks(world: int, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results of one spawn of ``world`` processes (run once per session)."""
    if world not in _RUNS:
        out = tmp_path_factory.mktemp(f"mp{world}")
        start_ranks(W.worker, (world, free_port(), str(out)), world)
        _RUNS[world] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
        _DIRS[world] = out
    return _RUNS[world]


def reference(name: str, dtype: torch.dtype, frozen_head: bool = False, shadow: bool = False) -> dict[str, Any]:
    if (name, dtype, frozen_head, shadow) not in _REFS:
        _REFS[(name, dtype, frozen_head, shadow)] = W.reference(name, dtype, frozen_head, shadow)
    return _REFS[(name, dtype, frozen_head, shadow)]


def _error(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest error: float32 absolute; float64 relative above magnitude 1."""
    if not want.numel():
        return 0.0
    diff = (got.double() - want.double()).abs()
    return float((diff if dtype == torch.float32 else diff / want.double().abs().clamp(min=1)).max())


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str, dtype: torch.dtype) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = _error(got, want, dtype)
    assert err <= tol, f"{what}: {err:.3g} > {tol:.3g}"


Bound = Callable[[str], float]  # a leaf's name (a model key, or "<state key>/<slot>") -> its tolerance


def bound(name: str, dtype: torch.dtype, frozen_head: bool = False) -> Bound:
    """float64: W.TOL; float32: W.float32_bounds of the configuration (the same for every world size)."""
    if dtype == torch.float64:
        return lambda leaf: W.TOL[dtype]
    return float32_bounds(name, frozen_head).__getitem__


def float32_bounds(name: str, frozen_head: bool = False) -> dict[str, float]:
    """W.float32_bounds of a configuration: its one float32 process, float64 shadow and jittered shadows."""
    if (name, frozen_head) not in _BOUNDS:
        jittered = [W.reference(name, torch.float64, frozen_head, shadow=True, jitter=j) for j in range(W.JITTERS)]
        _BOUNDS[(name, frozen_head)] = W.float32_bounds(
            reference(name, torch.float32, frozen_head), reference(name, torch.float64, frozen_head, shadow=True),
            jittered)
    return _BOUNDS[(name, frozen_head)]


def compare(run: dict[str, Any], ref: dict[str, Any], dtype: torch.dtype, tol: Bound,
            sharded_only: bool = False) -> None:
    """One rank's run against the single-process reference, every leaf within ``tol`` of its slot (only the
    tables sharded over the group and their slots with ``sharded_only``)."""
    for key, want in ref["model"].items():
        table = key.split(".")[2] if key.startswith("ec.tables.") else None
        if table in W.SHARDED:
            s = run["sharded"][table]
            real = s["ids"] < VOCAB[table]
            _close(s["rows"][real], want[s["ids"][real]], tol(key), key, dtype)
            assert torch.equal(run["model"][key], s["rows"])  # state_dict holds the rank's rows as stored
            assert not s["rows"][~real].any(), key  # padding rows are never looked up nor updated
        elif not sharded_only:
            _close(run["model"][key], want, tol(key), key, dtype)
    got_state, want_state = run["optimizer"]["state"], ref["optimizer"]["state"]
    assert got_state.keys() == want_state.keys()
    for key, slots in want_state.items():
        table = key.split(":", 1)[1]
        if sharded_only and table not in W.SHARDED:
            continue
        for slot, want in slots.items():
            limit = tol(f"{key}/{slot}")
            got = got_state[key][slot]
            if table in W.SHARDED and want.dim() and want.shape[0] == VOCAB[table]:  # a row slot
                ids = run["sharded"][table]["ids"]
                real = ids < VOCAB[table]
                _close(got[real], want[ids[real]], limit, f"{key}/{slot}", dtype)
            elif table in ("tw", "tw2") and run["sharded"][table]["ids"].numel() == 0:
                continue  # a table-wise table's whole-table slots, on a rank that does not hold it
            elif slot in ("acc_ids", "acc_rows"):
                continue  # no accumulation is pending after 10 steps of 2-call windows
            else:
                _close(got, want, limit, f"{key}/{slot}", dtype)
    assert run["optimizer"]["iterations"] == ref["optimizer"]["iterations"]
    assert run["skipped"] == ref["optimizer"]["skipped_steps"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(W.CONFIGS))
def test_every_rank_equals_one_process(world: int, name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """10 steps of every optimizer and option (EMA, accumulation, clipnorm, global_clipnorm, skip_nonfinite)
    on row-wise, table-wise and replicated tables with a DDP head: every rank equals one process."""
    results = ranks(world, tmp_path_factory)
    for dtype in DTYPES:
        ref = reference(name, dtype)
        for r, res in enumerate(results):
            try:
                compare(res[f"{name}/{dtype}"], ref, dtype, bound(name, dtype))
            except AssertionError as e:
                raise AssertionError(f"rank {r} of {world}, {dtype}: {e}") from e


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", W.FROZEN_HEAD)
def test_sharded_tables_without_the_head_drift(world: int, name: str,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """W.FROZEN_HEAD's float32 configurations with the dense head frozen (no DDP reduction whose last bits
    differ from one process's): the tables sharded over the group and their slots hold W.float32_bounds of the
    frozen-head run, the exchange's own arithmetic without the head's amplification."""
    ref = reference(name, torch.float32, frozen_head=True)
    tol = bound(name, torch.float32, frozen_head=True)
    for r, res in enumerate(ranks(world, tmp_path_factory)):
        try:
            compare(res[f"{name}/frozen-head"], ref, torch.float32, tol, sharded_only=True)
        except AssertionError as e:
            raise AssertionError(f"rank {r} of {world}: {e}") from e


@pytest.mark.parametrize("name", list(W.CONFIGS))
def test_bounds_catch_a_wrong_update(name: str) -> None:
    """W.float32_bounds stay tight enough for a bug: in one float32 process, a learning rate 1 % off, or the
    gradient of one rank's share (8 of 24 examples) lost at one step, moves some leaf beyond 100 times its bound
    (here: 650 to 2.4e5 times)."""
    one = reference(name, torch.float32)
    bounds = float32_bounds(name)
    nan, clip = W.nan_step(name), "clip_grad_norm" in name

    def worst(model: W.Model, opt: torch.optim.Optimizer) -> float:
        """The largest ratio over the leaves of |run - one| to the leaf's bound."""
        got, want = W.leaves({"model": model.state_dict(), "optimizer": opt.state_dict()}), W.leaves(one)
        return max(float((got[k].double() - want[k].double()).abs().max()) / b for k, b in bounds.items() if b)

    cls, kw = W.CONFIGS[name]
    model = W.Model(torch.float32)
    opt = cls(model.parameters(), **{**kw, "lr": kw["lr"] * 1.01})
    W.train(model, model, opt, torch.float32, nan_step=nan, clip=clip)
    wrong_lr = worst(model, opt)

    model = W.Model(torch.float32)
    opt = W.make_opt(name, model.parameters())
    W.train(model, model, opt, torch.float32, nan_step=nan, clip=clip, steps=range(5))
    batch, y = W.global_batch(5, torch.float32)
    keep = torch.ones(W.GLOBAL_BATCH)
    keep[8:16] = 0  # rank 1's share of 3: its gradient never arrives
    opt.zero_grad()
    ((model(batch) - y) ** 2 * keep).mean().backward()
    if clip:
        tte.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    W.train(model, model, opt, torch.float32, nan_step=nan, clip=clip, steps=range(6, W.STEPS))
    lost = worst(model, opt)
    assert wrong_lr > 100 and lost > 100, (wrong_lr, lost)


def test_options_take_effect() -> None:
    """The clipping and skip configurations change the result (their global statistics are exercised)."""
    for name, base in (("adam-clipnorm", "adam"), ("sgd-clipnorm-accum2", "sgd"),
                       ("adafactor-global_clipnorm-ema", "adafactor"), ("ftrl-global_clipnorm-skip", "ftrl"),
                       ("adagrad-clip_grad_norm", "adagrad")):
        a = reference(name, torch.float64)["model"]["ec.tables.big.weight"]
        b = reference(base, torch.float64)["model"]["ec.tables.big.weight"]
        assert not torch.allclose(a, b, rtol=0, atol=1e-9), name
    assert reference("ftrl-global_clipnorm-skip", torch.float64)["optimizer"]["skipped_steps"] == 1


@pytest.mark.parametrize("world", WORLDS)
def test_no_rank_stores_more_than_its_shard(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Storage of every sharded table and of each of its optimizer slots: the rank's shard (row-wise: R/n
    rows, R the rows padded to lcm(512, n)) or the whole table on its one owner and nothing elsewhere."""
    results = ranks(world, tmp_path_factory)
    block = math.lcm(512, world)
    for name in W.CONFIGS:
        for dtype in DTYPES:
            owners: dict[str, list[int]] = {"tw": [], "tw2": []}
            for r, res in enumerate(results):
                for table, s in res[f"{name}/{dtype}"]["sharded"].items():
                    v, d = VOCAB[table], DIM[table]
                    if table in owners:
                        rows = v if s["ids"].numel() else 0
                        if rows:
                            owners[table].append(r)
                    else:
                        rows = -(-v // block) * block // world
                        assert rows < v  # the shard is smaller than the table
                    assert s["ids"].numel() == rows
                    assert s["bytes"] == rows * d * torch.empty((), dtype=dtype).element_size()
                    for slot, nbytes in s["slot_bytes"].items():
                        shape, size = s["slot_rows"][slot]
                        if slot in ("acc_ids", "acc_rows"):  # pending accumulation: batch-sized, not table-sized
                            assert shape[1] <= W.GLOBAL_BATCH * 7, (table, slot, shape)  # 7: ids of "big" per example
                            continue
                        most = max(rows * d, d, 1) * size  # a row slot's shard, or a whole-table statistic
                        assert nbytes <= most, (table, slot, shape, nbytes, most)
            assert owners == {"tw": [0], "tw2": [1]}  # spread by size: the larger on rank 0


@pytest.mark.parametrize("world", WORLDS)
def test_placements(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = ranks(world, tmp_path_factory)[0]["adagrad/torch.float64"]
    assert run["placements"] == {"big": "row", "row2": "row", "tw": "table", "tw2": "table",
                                 "rep": "replicated", "rep2": "replicated"}
    assert run["groups"] == ["fused_0"]  # the replicated tables stay stacked; the sharded ones were unstacked


@pytest.mark.parametrize("world", WORLDS)
def test_refusals(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    errors = ranks(world, tmp_path_factory)[0]["errors"]
    assert "Table `wide`: placement 'column'" in errors["column"] and "torch_xla SPMD" in errors["column"]
    assert "Received: placement='column'" in errors["column"]
    assert "sharded over a process group already" in errors["twice"]
    rows = -(-1500 // math.lcm(512, world)) * math.lcm(512, world) // world
    assert errors["moved"] == f"torch.float32 ({rows}, 4) {rows}"
    assert "`use_gradient_accumulation=False`" in errors["noaccum"] and "Table `row2` is sharded" in errors["noaccum"]


@pytest.mark.parametrize("world", WORLDS)
def test_collectives_of_a_step(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One step (Adafactor with global_clipnorm and skip_nonfinite, every placement, a DDP head), recorded by a
    wrapping backend (tests/_mp_worker.py: DDP's C++ all-reduces count too): only all_to_all_single with
    equal splits, all_reduce and all_gather_into_tensor / broadcast; for all the sharded tables together one
    all_reduce of the capacity and three all-to-alls (ids, rows, gradient rows: distributed/lookup_exchange.py);
    no collective moves as many bytes as the smallest sharded table holds (the rows travel as bytes)."""
    smallest = min(VOCAB[t] * DIM[t] for t in W.SHARDED) * torch.float64.itemsize  # (the step's tables: float64)
    for r, res in enumerate(ranks(world, tmp_path_factory)):
        log = res["collectives"]
        names = [c["name"] for c in log]
        assert set(names) <= {"all_to_all_single", "all_reduce", "all_gather_into_tensor", "broadcast"}, names
        a2a = [c for c in log if c["name"] == "all_to_all_single"]
        assert len(a2a) == 3, names
        for c in a2a:
            assert c["splits"] == [[], []], c  # equal splits: no split sizes given
            assert all(n % world == 0 for n in c["sizes"]), c
        assert names.count("all_gather_into_tensor") >= 1  # the replicated tables' row gradients
        # capacity (one for every sharded table), DDP's bucket of the head, Adafactor's sums, global_clipnorm, skip gate
        assert names.count("all_reduce") >= 1 + 1 + 2, names
        assert max(n for c in log for n in c["bytes"]) < smallest, (r, log)


def test_checkpoint_saved_at_4_loads_at_2_and_3(tmp_path_factory: pytest.TempPathFactory) -> None:
    """save_sharded after 5 steps at world 4 (Adafactor with global_clipnorm and EMA); groups of 2 and 3 ranks
    load it into models drawn from other seeds and train 5 more: every rank equals one uninterrupted process."""
    results = ranks(4, tmp_path_factory)
    ref = reference(W.CKPT, torch.float64)
    for w in (2, 3):
        for r in range(w):
            compare(results[r]["checkpoint"][w], ref, torch.float64, bound(W.CKPT, torch.float64))
    files = sorted(p.name for p in (_DIRS[4] / "ckpt").iterdir())
    assert files == ["meta.pt", "rows-0.pt", "rows-1.pt", "rows-2.pt", "rows-3.pt", "tte_manifest.json"]
    assert not [p for p in _DIRS[4].iterdir() if p.name.startswith(".ckpt.tte-")]  # staging published
    for r in range(4):  # each rank's file holds its rows only, in ascending logical id
        part = torch.load(_DIRS[4] / "ckpt" / f"rows-{r}.pt", weights_only=True)
        ids = part["big"]["ids"]
        assert ids.shape[0] < VOCAB["big"] and bool((ids[1:] > ids[:-1]).all())


def test_checkpoint_loads_into_one_process(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The world-4 checkpoint into one process with every table whole (stacked as the collection stacks
    them): 5 more steps on the global batch equal the uninterrupted run."""
    ranks(4, tmp_path_factory)
    model = W.Model(torch.float64, seed=7)
    opt = W.make_opt(W.CKPT, model.parameters())
    tte.distributed.load_sharded(_DIRS[4] / "ckpt", model, opt)
    W.train(model, model, opt, torch.float64, steps=range(5, W.STEPS))
    assert_equals_reference(model, opt, W.CKPT)


def assert_equals_reference(model: Any, opt: Any, config: str, skip: tuple[str, ...] = ()) -> None:
    """One process's model and optimizer (float64) within 1e-10 of the reference run of ``config``, every
    slot but ``skip``."""
    ref = reference(config, torch.float64)
    for k, v in ref["model"].items():
        _close(model.state_dict()[k], v, 1e-10, k, torch.float64)
    got = opt.state_dict()["state"]
    for key, slots in ref["optimizer"]["state"].items():
        for slot, v in slots.items():
            if slot not in skip:
                _close(got[key][slot], v, 1e-10, f"{key}/{slot}", torch.float64)


def test_a_damaged_sharded_checkpoint_changes_nothing(tmp_path_factory: pytest.TempPathFactory,
                                                      tmp_path: Path) -> None:
    """A rows file cut to 60 % (or a missing manifest: a save that never published) is refused before
    anything is written, with an Exception naming the file; the model and optimizer stay bitwise as they were."""
    ranks(4, tmp_path_factory)
    for damage in ("truncate", "no-manifest"):
        copy = tmp_path / damage
        shutil.copytree(_DIRS[4] / "ckpt", copy)
        if damage == "truncate":
            data = (copy / "rows-2.pt").read_bytes()
            (copy / "rows-2.pt").write_bytes(data[: len(data) * 6 // 10])
        else:
            (copy / "tte_manifest.json").unlink()
        model = W.Model(torch.float64, seed=7)
        opt = W.make_opt(W.CKPT, model.parameters())
        W.train(model, model, opt, torch.float64, steps=range(0, 2))
        before = copy_state(model, opt)
        with pytest.raises(tte.checkpoint.CheckpointCorruptError,
                           match="rows-2.pt" if damage == "truncate" else "tte_manifest.json"):
            tte.distributed.load_sharded(copy, model, opt)
        assert_same_state(before, copy_state(model, opt))


def copy_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": {k: {s: v.clone() if isinstance(v, torch.Tensor) else v for s, v in slots.items()}
                          for k, slots in opt.state_dict()["state"].items()}}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys() and a["optimizer"].keys() == b["optimizer"].keys()
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    for k, slots in a["optimizer"].items():
        for s, v in slots.items():
            w = b["optimizer"][k][s]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, s)


def test_assign_tables_rule() -> None:
    """Largest first onto the least-loaded rank; ties to the lower rank, equal sizes in name order."""
    assign = tte.distributed.assign_tables
    assert assign({"a": 10, "b": 30, "c": 20, "d": 5}, 2) == {"b": 0, "c": 1, "a": 1, "d": 0}
    assert assign({"x": 1, "y": 1, "z": 1}, 4) == {"x": 0, "y": 1, "z": 2}
    assert assign({}, 3) == {}


def test_auto_rule_is_the_spmd_rule() -> None:
    small = tte.TableConfig(100, 4, name="s")
    big = tte.TableConfig(20_000, 64, name="b")
    rule = tte.distributed.group_placement
    assert rule("s", small, 4, tte.distributed.DEFAULT_REPLICATE_BELOW_BYTES) == "replicated"
    assert rule("b", big, 4, tte.distributed.DEFAULT_REPLICATE_BELOW_BYTES) == "row"
    assert rule("b", big, 1, tte.distributed.DEFAULT_REPLICATE_BELOW_BYTES) == "replicated"
    assert rule("s", small, 4, 0) == "row"
    with pytest.raises(ValueError, match="placement 'column'"):
        rule("c", tte.TableConfig(10, 4, name="c", placement="column"), 2, 0)


def test_shard_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        tte.distributed.shard(W.Model(torch.float64))
