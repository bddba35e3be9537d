"""Models built on the meta device and sharded over a process group, for tests/distributed/test_mp_build.py: one
process per rank (gloo, CPU).

:func:`values` builds :func:`features` under ``torch.device("meta")`` with a tiny draw chunk (so every
table is drawn in many chunks), shards it and returns each rank's rows, their logical ids and storage
sizes. :func:`trained` trains tests/_mp_worker.py's model built whole and built on the meta device.
:func:`peak` measures the host memory peak (``VmHWM``) of building and sharding a table of 300 MiB, on
the meta device and whole.
"""

from __future__ import annotations

import os
import re
from typing import Any

import _mp_worker as W
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from suite_helpers import finish_rank, init_rank

import torch_tpu_embedding as tte
from torch_tpu_embedding.modules import deferred_init

#: A chunk of a few rows (the tables' rows are 12 to 48 bytes): each table is drawn in many chunks.
SMALL_CHUNK = 1003
SHARDED = ("row_none", "row_default", "row_tensor", "row_f16", "tw_bf16", "tw_f64")
REPLICATED = ("rep", "rep2")
PEAK_ROWS, PEAK_DIM = 1_228_800, 64  # 300 MiB of float32


def features() -> dict[str, tte.FeatureConfig]:
    """Every initializer the package offers (None, tte.default_initializer, a tensor), every dtype, row-wise,
    table-wise and replicated tables, some stacked before shard unstacks them."""
    pretrained = torch.randn(900, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    tables = [
        tte.TableConfig(1500, 5, name="row_none", placement="row"),
        tte.TableConfig(1100, 5, name="row_default", placement="row", initializer=tte.default_initializer),
        tte.TableConfig(900, 4, name="row_tensor", placement="row", dtype=torch.float32, initializer=pretrained),
        tte.TableConfig(700, 6, name="row_f16", placement="row", dtype=torch.float16),
        tte.TableConfig(600, 3, name="tw_bf16", placement="table", dtype=torch.bfloat16),
        tte.TableConfig(400, 3, name="tw_f64", placement="table", dtype=torch.float64),
        tte.TableConfig(20, 2, name="rep", placement="replicated", dtype=torch.float64),
        tte.TableConfig(30, 2, name="rep2", placement="auto", dtype=torch.float64),  # small: replicated
    ]
    return {c.name or "": tte.FeatureConfig(c) for c in tables}


def build(meta: bool) -> tuple[tte.EmbeddingCollection, torch.Tensor]:
    """:func:`features`' collection from seed 0 (on the meta device or drawn whole), and the next draws."""
    configs = features()  # off the meta device: the pretrained tensor holds values
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            ec = tte.EmbeddingCollection(configs)
    else:
        ec = tte.EmbeddingCollection(configs)
    return ec, torch.rand(4)


def storage_bytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def values(rank: int, world: int) -> dict[str, Any]:
    deferred_init.CHUNK_BYTES = SMALL_CHUNK
    ec, after = build(meta=True)
    metas = {n: t.weight.is_meta for n, t in ec.physical_tables().items()}
    placements = tte.distributed.shard(ec)
    tables = ec.physical_tables()
    out: dict[str, Any] = {"after": after, "placements": placements, "built_on_meta": metas, "tables": {}}
    for name, t in tables.items():
        w = t.weight.detach()
        out["tables"][name] = {"ids": tte.distributed.logical_ids(t), "rows": w.clone(), "bytes": storage_bytes(w),
                               "device": str(w.device), "members": t.members()}
    return out


def trained(name: str, dtype: torch.dtype, rank: int, world: int, meta: bool) -> dict[str, Any]:
    """tests/_mp_worker.py's model and loop; ``meta``: the whole model built under ``torch.device("meta")``,
    its dense head materialized as FSDP does (``to_empty`` and ``reset_parameters``, which draws from where
    the tables left the generator: the head of a whole build), its tables by ``shard``."""
    if meta:
        with torch.device("meta"):
            model = W.Model(dtype, seed=0)
        model.head.to_empty(device="cpu")
        model.head.reset_parameters()
    else:
        model = W.Model(dtype, seed=0)
    tte.distributed.shard(model)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = W.make_opt(name, ddp.parameters())
    W.train(model, ddp, opt, dtype, rank, world, nan_step=W.nan_step(name), clip="clip_grad_norm" in name)
    tables = model.ec.physical_tables()
    sharded = {t: {"ids": tte.distributed.logical_ids(tables[t]), "rows": tables[t].weight.detach().clone(),
                   "bytes": storage_bytes(tables[t].weight)} for t in W.SHARDED}
    return {"sharded": sharded, "optimizer": opt.state_dict(),
            "model": {k: v.clone() for k, v in model.state_dict().items()}}


def _load_into_fresh(path: str, rank: int) -> dict[str, Any]:
    """A sharded model of other values (every entry must come from the files) loading the DCP checkpoint
    ``path`` with ``dcp.load`` and ``set_model_state_dict``: its stored rows and their logical ids."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    resumed = W.Model(torch.float64, seed=100 + rank)
    tte.distributed.shard(resumed, dtensor_state_dict=True)
    sd = get_model_state_dict(resumed)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(resumed, sd)
    back = resumed.ec.physical_tables()
    return {"model": resumed,
            "rows": {t: {"ids": tte.distributed.logical_ids(back[t]), "rows": back[t].weight.detach().clone()}
                     for t in W.SHARDED}}


def _optimizer_round_trip(model: Any, ddp: Any, opt: Any, config: str, path: str, rank: int) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict`` of a model sharded with ``dtensor_state_dict=True``, ``dcp.save``;
    a fresh model and optimizer ``dcp.load`` + ``set_optimizer_state_dict`` it. Returns what each sharded
    table's slots were in the helper's dict, their bytes on this rank, and whether every slot of every
    sharded table came back equal (stored rows, same world)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    osd = get_optimizer_state_dict(ddp, opt)
    tables = model.ec.physical_tables()
    fqn = {f"module.ec.tables.{t}.weight": t for t in W.SHARDED} | {f"ec.tables.{t}.weight": t for t in W.SHARDED}
    kinds = {fqn[k]: {slot: (type(v).__name__, tuple(v.shape),
                             storage_bytes(v.to_local()) if isinstance(v, DTensor) else storage_bytes(v))
                      for slot, v in e.items() if isinstance(v, torch.Tensor) and v.dim()}
             for k, e in osd["state"].items() if k in fqn}
    dcp.save({"optim": osd}, checkpoint_id=path)
    fresh = W.Model(torch.float64, seed=300 + rank)
    tte.distributed.shard(fresh, dtensor_state_dict=True)
    ddp2 = tte.distributed.DistributedDataParallel(fresh)
    opt2 = W.make_opt(config, ddp2.parameters())
    template = {"optim": get_optimizer_state_dict(ddp2, opt2)}
    dcp.load(template, checkpoint_id=path)
    set_optimizer_state_dict(ddp2, opt2, template["optim"])
    back = fresh.ec.physical_tables()
    same = {t: all(torch.equal(opt2.state[back[t].weight][k], v) for k, v in opt.state[tables[t].weight].items()
                   if isinstance(v, torch.Tensor))
            and opt2.state[back[t].weight].keys() == opt.state[tables[t].weight].keys() for t in W.SHARDED}
    return {"kinds": kinds, "same": same}


def dcp_round_trip(rank: int, world: int, out_dir: str, other: str) -> dict[str, Any]:
    """``shard(..., dtensor_state_dict=True)``: 5 steps, then torch's own ``get_model_state_dict`` and
    ``dcp.save``; a model of other values loads it (:func:`_load_into_fresh`), and, when ``other`` names
    the checkpoint of a run at another world size, that one too. Returns the models' stored rows and what
    the state_dict held."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    dtype, path = torch.float64, os.path.join(out_dir, "dcp")
    model = W.Model(dtype)
    tte.distributed.shard(model, dtensor_state_dict=True)
    ddp = tte.distributed.DistributedDataParallel(model)
    opt = W.make_opt("adagrad", ddp.parameters())
    W.train(model, ddp, opt, dtype, rank, world, steps=range(5))
    sd = get_model_state_dict(model)
    entries = {k: (type(v).__name__, tuple(v.to_local().shape) if isinstance(v, DTensor) else tuple(v.shape),
                   str(v.placements) if isinstance(v, DTensor) else "") for k, v in sd.items()}
    local_bytes = {k: storage_bytes(v.to_local()) for k, v in sd.items() if isinstance(v, DTensor)}
    dcp.save(sd, checkpoint_id=path)
    loaded = _load_into_fresh(path, rank)
    resumed, tables = loaded["model"], model.ec.physical_tables()
    out = {"entries": entries, "local_bytes": local_bytes, "path": path,
           "saved": {t: {"ids": tte.distributed.logical_ids(tables[t]), "rows": tables[t].weight.detach().clone()}
                     for t in W.SHARDED},
           "loaded": {t: v["rows"] for t, v in loaded["rows"].items()},
           "dense": {k: torch.equal(v, resumed.state_dict()[k]) for k, v in model.state_dict().items()
                     if not k.startswith("ec.tables.") or k.split(".")[2] not in W.SHARDED}}
    if other:
        out["other"] = _load_into_fresh(other, rank)["rows"]
    out["optim"] = {"adagrad": _optimizer_round_trip(model, ddp, opt, "adagrad", os.path.join(out_dir, "dcp_optim"), rank)}
    m1 = W.Model(dtype, seed=0)
    tte.distributed.shard(m1, dtensor_state_dict=True)
    d1 = tte.distributed.DistributedDataParallel(m1)
    o1 = W.make_opt("rowwise_adagrad", d1.parameters())  # a [rows] slot: DTensors of rank 1
    W.train(m1, d1, o1, dtype, rank, world, steps=range(2))
    out["optim"]["rowwise_adagrad"] = _optimizer_round_trip(m1, d1, o1, "rowwise_adagrad", os.path.join(out_dir, "dcp_optim_rw"),
                                                            rank)
    # tte's own sharded checkpoint reads the stored rows of the same model, whose state_dict is DTensors
    tte.distributed.save_sharded(os.path.join(out_dir, "tte"), model, opt)
    again = W.Model(dtype, seed=200 + rank)
    tte.distributed.shard(again, dtensor_state_dict=True)
    ddp2 = tte.distributed.DistributedDataParallel(again)
    opt2 = W.make_opt("adagrad", ddp2.parameters())
    tte.distributed.load_sharded(os.path.join(out_dir, "tte"), again, opt2)
    out["tte"] = {t: torch.equal(again.ec.physical_tables()[t].weight, tables[t].weight) for t in W.SHARDED}
    out["tte_dense"] = torch.equal(again.head.weight, model.head.weight)
    return out


def _status(field: str) -> int:
    """``field`` of /proc/self/status in bytes (``VmHWM``: the peak resident memory, ``VmRSS``: now)."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1)) * 1024


def peak(meta: bool) -> dict[str, Any]:
    """The growth of this process's peak resident memory while one 300 MiB row-sharded table is built and
    sharded (the peak is reset first: ``/proc/self/clear_refs``)."""
    config = tte.TableConfig(PEAK_ROWS, PEAK_DIM, name="huge", placement="row")
    # The same path once on a small table first: the code pages of the kernels it runs count as resident
    # memory when first touched, which is not what is measured here.
    small = tte.TableConfig(4096, PEAK_DIM, name="small", placement="row")
    tte.distributed.shard(tte.EmbeddingCollection({"f": tte.FeatureConfig(small)}, device="meta" if meta else None))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the resident memory now
    except OSError as e:  # not Linux, or a sandbox that forbids it: the peak cannot be isolated
        return {"unmeasurable": f"/proc/self/clear_refs: {e}"}
    base = _status("VmHWM")
    torch.manual_seed(0)
    if meta:
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(config)}, device="meta")
    else:
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(config)})
    tte.distributed.shard(ec)
    w = ec.tables["huge"].weight
    result = {"growth": _status("VmHWM") - base, "shard": storage_bytes(w),
              "chunk": deferred_init.CHUNK_BYTES, "table": PEAK_ROWS * PEAK_DIM * 4, "checksum_rows": int(w.shape[0])}
    del ec, w
    return result


def worker(rank: int, world: int, port: int, out_dir: str, job: str) -> None:
    init_rank(rank, world, port)
    results: dict[str, Any] = {}
    if job.startswith("dcp"):  # "dcp" or "dcp:<checkpoint of another world size>"
        results["dcp"] = dcp_round_trip(rank, world, out_dir, job[4:])
    elif job == "peak":
        results["meta"] = peak(meta=True)
        dist.barrier()
        results["whole"] = peak(meta=False)
    else:
        results["values"] = values(rank, world)
        deferred_init.CHUNK_BYTES = SMALL_CHUNK * 7
        for name in ("adagrad", "adafactor-global_clipnorm-ema"):
            for dtype in (torch.float64, torch.float32):
                for meta in (True, False):
                    results[f"{name}/{dtype}/{meta}"] = trained(name, dtype, rank, world, meta)
    finish_rank(results, out_dir, rank)
