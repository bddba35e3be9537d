"""Models built on the meta device and sharded over a process group (tte.distributed.shard): no rank ever
allocates a whole sharded table, and each rank's rows are exactly those one process draws with the seed.

Each world size is one spawn of gloo processes running every case (tests/_mp_build_worker.py); the
peak-memory measurement is a spawn of its own at world 2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import _mp_build_worker as B
import _mp_worker as W
import pytest
import torch
from suite_helpers import free_port, start_ranks

import torch_tpu_embedding as tte
from torch_tpu_embedding.modules import deferred_init

_RUNS: dict[tuple[int, str, Callable[..., None]], list[dict[str, Any]]] = {}


def ranks(world: int, job: str, tmp_path_factory: pytest.TempPathFactory,
          worker: Callable[..., None] = B.worker) -> list[dict[str, Any]]:
    """Every rank's results of one spawn of ``world`` gloo processes running ``worker``'s ``job`` (once per
    session): ``worker(rank, world, port, out_dir, job)`` saves each rank's to ``out_dir/rank<r>.pt``."""
    key = (world, job, worker)  # (two workers may both have a job called "dcp")
    if key not in _RUNS:
        out = tmp_path_factory.mktemp(f"build{world}{job.split(':')[0]}")
        start_ranks(worker, (world, free_port(), str(out), job), world)
        _RUNS[key] = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return _RUNS[key]


@pytest.mark.parametrize("world", (2, 3))
def test_each_rank_draws_exactly_its_rows(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every initializer the package offers (None, tte.default_initializer, a tensor), four dtypes, row-wise,
    table-wise and replicated tables (some stacked, then unstacked or restacked by shard), drawn in chunks
    of a few rows: each rank's rows equal bit for bit the rows one process draws from the same seed; each
    sharded weight's storage is the rank's shard; the generator moves on as a whole build moves it."""
    ref, after = B.build(meta=False)
    whole = {k.split(".")[1]: v for k, v in ref.state_dict().items()}
    seen: dict[str, int] = {}
    for r, res in enumerate(ranks(world, "values", tmp_path_factory)):
        got = res["values"]
        assert torch.equal(got["after"], after), "the generator after the meta build differs from a whole build"
        assert all(got["built_on_meta"].values()), got["built_on_meta"]
        for name in B.SHARDED:
            t = got["tables"][name]
            want = whole[name]
            ids, rows = t["ids"], t["rows"]
            real = ids < want.shape[0]
            assert rows.dtype == want.dtype, name
            assert torch.equal(rows[real], want[ids[real]]), f"rank {r} of {world}: table {name}"
            assert not rows[~real].any(), f"{name}: padding rows are zero"
            assert t["bytes"] == rows.numel() * rows.element_size(), f"{name}: storage is the shard"
            seen[name] = seen.get(name, 0) + int(real.sum())
            if got["placements"][name] == "row":
                assert rows.shape[0] < want.shape[0], f"{name}: a row-sharded rank holds part of the table"
        for name in B.REPLICATED:
            assert got["placements"][name] == "replicated"
            holder = next(t for t in got["tables"].values() if t["members"] and name in [m[0] for m in t["members"]])
            first, n = next((f, n) for m, f, n in holder["members"] if m == name)
            assert torch.equal(holder["rows"][first : first + n], whole[name]), name
    for name in B.SHARDED:  # every row is held by exactly one rank
        assert seen[name] == whole[name].shape[0], name


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("name", ("adagrad", "adafactor-global_clipnorm-ema"))
def test_training_a_meta_built_model_equals_one_process(
    world: int, name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tests/_mp_worker.py's model (row-wise, table-wise and replicated tables, a DDP head) built whole on the
    meta device trains to the same values bit for bit as the model built with its values, and, as that one
    (tests/distributed/test_mp_shard.py), equals one process trained on the global batch (checked here in float64)."""
    for r, res in enumerate(ranks(world, "values", tmp_path_factory)):
        for dtype in (torch.float64, torch.float32):
            meta, built = res[f"{name}/{dtype}/True"], res[f"{name}/{dtype}/False"]
            for key, v in built["model"].items():
                assert torch.equal(meta["model"][key], v), f"rank {r} of {world} {dtype}: {key}"
            for key, slots in built["optimizer"]["state"].items():
                for slot, v in slots.items():
                    got = meta["optimizer"]["state"][key][slot]
                    assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, (key, slot)
            for t, s in meta["sharded"].items():
                assert s["bytes"] == s["rows"].numel() * s["rows"].element_size(), t
            if dtype != torch.float64:
                continue  # float32 against one process: tests/distributed/test_mp_shard.py's bounds, for the run equal to this
            ref, tol = W.reference(name, dtype)["model"], W.TOL[dtype]
            for t, s in meta["sharded"].items():
                real = s["ids"] < ref[f"ec.tables.{t}.weight"].shape[0]
                if not bool(real.any()):
                    continue  # a table-wise table another rank holds
                err = (s["rows"][real].double() - ref[f"ec.tables.{t}.weight"][s["ids"][real]].double()).abs().max()
                assert float(err) <= tol, f"rank {r} of {world} {dtype}: {t} {float(err):.3g}"


def test_peak_memory_is_the_shard_and_a_chunk(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A 300 MiB float32 table, row-sharded over 2 processes: built on the meta device, each rank's peak host
    memory grows by at most its shard, the drawn chunk and the chunk's rows it keeps (2 × CHUNK_BYTES),
    and 8 MiB of fixed overhead (a chunk's index temporaries, the allocator's heap; measured after the same
    path ran once on a small table, so the kernels' code pages are resident already); built
    whole, by at least the whole table (the measurement sees a whole table)."""
    for r, res in enumerate(ranks(2, "peak", tmp_path_factory)):
        meta, built = res["meta"], res["whole"]
        if "unmeasurable" in meta:
            pytest.skip(meta["unmeasurable"])
        assert meta["shard"] == meta["table"] // 2, meta
        bound = meta["shard"] + 2 * meta["chunk"] + (8 << 20)
        assert meta["growth"] <= bound, f"rank {r}: peak grew {meta['growth'] / 2**20:.1f} MiB > {bound / 2**20:.1f}"
        assert built["growth"] >= built["table"], f"rank {r}: a whole build peaked {built['growth'] / 2**20:.1f} MiB"


@pytest.mark.parametrize("world", (2, 3))
def test_torch_dcp_round_trips_a_sharded_model(world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``shard(..., dtensor_state_dict=True)``: torch's ``get_model_state_dict`` gives each row- and table-sharded
    table as a DTensor Shard(0) of its logical rows (each rank's block, no more than its rows' share);
    ``dcp.save`` and ``dcp.load`` + ``set_model_state_dict`` into a model of other values restore every rank's
    stored rows exactly, and the dense head and replicated tables; world 2's checkpoint loads at world 3 (each
    rank its rows of world 2's tables); and the checkpoint loads into one process (plain tensors) as the
    logical tables, row for row. tte.distributed.save_sharded / load_sharded still work on such a model (its rank
    0 reads the state_dict alone: the stored rows, no collective)."""
    other = ranks(2, "dcp", tmp_path_factory)[0]["dcp"]["path"] if world == 3 else ""
    results = ranks(world, "dcp:" + other if other else "dcp", tmp_path_factory)
    whole: dict[str, torch.Tensor] = {}
    vocab = {n: c.num_embeddings for n, c in W.Model(torch.float64).ec.table_configs.items()}
    for r, res in enumerate(results):
        got = res["dcp"]
        for t in W.SHARDED:
            kind, shape, placements = got["entries"][f"ec.tables.{t}.weight"]
            v = vocab[t]
            block = -(-v // world)
            assert kind == "DTensor" and placements == "(Shard(dim=0),)", (t, kind, placements)
            assert shape[0] == max(0, min(block, v - r * block)), (t, shape)
            assert got["local_bytes"][f"ec.tables.{t}.weight"] <= block * shape[1] * 8, t
            assert torch.equal(got["loaded"][t], got["saved"][t]["rows"]), f"rank {r} of {world}: table {t}"
            ids, rows = got["saved"][t]["ids"], got["saved"][t]["rows"]
            real = ids < v
            whole.setdefault(t, torch.zeros(v, rows.shape[1], dtype=rows.dtype))[ids[real]] = rows[real]
        assert all(got["dense"].values()), got["dense"]
        for opt_name, o in got["optim"].items():  # torch's get_/set_optimizer_state_dict, no opt-in
            assert all(o["same"].values()), (opt_name, r, o["same"])
            for t in W.SHARDED:
                block = -(-vocab[t] // world)
                for slot, (kind, shape, nbytes) in o["kinds"][t].items():
                    assert kind == "DTensor" and shape[0] == vocab[t], (opt_name, t, slot, kind, shape)
                    assert nbytes <= block * max(1, int(torch.tensor(shape[1:]).prod())) * 8, (opt_name, t, slot)
        assert all(got["tte"].values()) and got["tte_dense"], ("tte.distributed.save_sharded / load_sharded", got["tte"])
    if other:  # world 3 loaded world 2's checkpoint too: every rank's rows are world 2's, by logical id
        saved2: dict[str, torch.Tensor] = {}
        for res in ranks(2, "dcp", tmp_path_factory):
            for t, s in res["dcp"]["saved"].items():
                real = s["ids"] < vocab[t]
                saved2.setdefault(t, torch.zeros(vocab[t], s["rows"].shape[1], dtype=s["rows"].dtype))
                saved2[t][s["ids"][real]] = s["rows"][real]
        for r, res in enumerate(results):
            for t, s in res["dcp"]["other"].items():
                real = s["ids"] < vocab[t]
                assert torch.equal(s["rows"][real], saved2[t][s["ids"][real]]), f"world 2 -> 3, rank {r}: {t}"
                assert not s["rows"][~real].any(), t
    import torch.distributed.checkpoint as dcp

    one = W.Model(torch.float64, seed=7)
    sd = one.state_dict()
    dcp.load(sd, checkpoint_id=results[0]["dcp"]["path"], no_dist=True)
    for t in W.SHARDED:
        assert torch.equal(sd[f"ec.tables.{t}.weight"], whole[t]), t


def test_callable_initializers_are_refused_on_meta() -> None:
    """A callable of the user's own cannot be drawn per row range: refused by table and initializer name."""
    init = functools.partial(torch.nn.init.normal_, std=0.01)
    config = tte.TableConfig(100, 4, name="mine", initializer=init)
    with torch.device("meta"), pytest.raises(ValueError, match=r"Table `mine`.*initializer=partial"):
        tte.EmbeddingCollection({"f": tte.FeatureConfig(config)})

    def my_init(w: torch.Tensor) -> None:
        w.fill_(0.5)

    other = tte.TableConfig(100, 4, name="other", initializer=my_init)
    with pytest.raises(ValueError, match=r"Table `other`.*initializer=my_init"):
        tte.EmbeddingCollection({"f": tte.FeatureConfig(other)}, device="meta")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16, torch.float16))
def test_chunked_draw_equals_a_whole_draw(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process: a table built on the meta device and materialized with ``to_empty`` (its recorded draw,
    in chunks of 1, 7 and many rows, into rows of a permuted order) equals the table drawn whole."""
    config = tte.TableConfig(2049, 33, name="t", dtype=dtype)
    torch.manual_seed(3)
    want = tte.EmbeddingCollection({"f": tte.FeatureConfig(config)}, stack_tables=False).tables["t"].weight.detach()
    for chunk in (1, 7 * 33 * want.element_size(), 1 << 20):
        monkeypatch.setattr(deferred_init, "CHUNK_BYTES", chunk)
        torch.manual_seed(3)
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(config)}, device="meta", stack_tables=False)
        table = ec.tables["t"]
        assert isinstance(table, tte.EmbeddingTable) and table.weight.is_meta
        perm = torch.randperm(2049, generator=torch.Generator().manual_seed(chunk))
        out = table.fill_rows(torch.empty(2049, 33, dtype=dtype), lambda ids, perm=perm: perm[ids])
        assert torch.equal(out[perm], want), chunk
        ec.to_empty(device="cpu")
        assert torch.equal(ec.tables["t"].weight.detach(), want), chunk


def test_a_table_moved_to_meta_is_refused() -> None:
    """A table moved to the meta device lost its values: drawing it names the table."""
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10, 2, name="lost"))}).to("meta")
    table = ec.tables["lost"]
    assert isinstance(table, tte.EmbeddingTable)
    with pytest.raises(RuntimeError, match=r"Table `lost` is on the meta device without a recorded draw"):
        table.fill_rows(torch.empty(10, 2), lambda ids: ids)
