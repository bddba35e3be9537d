"""Distributed-checkpoint resharding chain worker (used by test_dcp_resharding.py).

Usage: python _dcp_script.py STAGE DIR
  save4: 4 devices, big table row-sharded: 3 steps, save_distributed(DIR/dcp4), logical reference DIR/ref.pt
  load2: 2 devices, big table column-sharded: load DIR/dcp4 → DIR/after2.pt, save_distributed(DIR/dcp2)
  load1: 1 device (SPMD), row placement: load DIR/dcp2 → DIR/after1.pt, save_distributed(DIR/dcp1)
  cpu:   no torch_xla at all: load DIR/dcp1 into a CPU model → DIR/aftercpu.pt; convert_distributed → DIR/conv.pt
  save8: 8 devices, row-sharded (the id exchange): 3 steps, save_distributed(DIR/dcp8), reference DIR/ref8.pt
  load8to2: 2 devices, row-sharded: load DIR/dcp8 in place (same shapes and row order) → DIR/after8to2.pt,
         3 more steps → DIR/trained8to2.pt
  cpu8:  no torch_xla: load DIR/dcp8 into a CPU model → DIR/aftercpu8.pt, 3 more steps → DIR/trainedcpu8.pt;
         convert_distributed → DIR/conv8.pt
  save6, load6to4, cpu6: the same with 6 devices (1,536-row block, its own chunk order) loaded on 4 devices
         (1,024-row block: through the host, not in place)
Each "after" file is tte.checkpoint.save of the loaded model and optimizer (logical rows).
"""

import os
import sys

STAGE, DIR = sys.argv[1], sys.argv[2]
if STAGE in ("cpu", "cpu8", "cpu6"):
    sys.modules["torch_xla"] = None  # type: ignore[assignment]  # prove the CPU path needs no torch_xla

import torch  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402

PLACEMENT = {"save4": "row", "load2": "column", "load1": "row", "cpu": "auto", "save8": "row", "load8to2": "row",
             "cpu8": "auto", "save6": "row", "load6to4": "row", "cpu6": "auto"}[STAGE]
CPU = STAGE in ("cpu", "cpu8", "cpu6")
if not CPU:
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()
    DEV = torch_xla.device()
else:
    DEV = torch.device("cpu")


def build():
    torch.manual_seed(0)
    big = tte.TableConfig(1001, 8, name="big", combiner="mean", placement=PLACEMENT)
    small = tte.TableConfig(40, 8, name="small", combiner="sum", placement="replicated")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(big, max_ids_per_bag=4), "b": tte.FeatureConfig(small)},
                                 device=DEV)
    head = torch.nn.Linear(8, 1).to(DEV)
    if not CPU:
        from torch_tpu_embedding.xla import replicate, shard

        shard(ec)
        replicate(head)
    model = torch.nn.ModuleDict({"ec": ec, "head": head})
    opt = tte.optim.Adafactor(model.parameters(), lr=0.1, use_ema=True, gradient_accumulation_steps=2)
    opt.init_state()
    if not CPU:
        torch_xla.sync()
    return model, opt


def step(model, opt, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    a = torch.randint(0, 1001, (16,), generator=g)
    b = torch.randint(0, 40, (4,), generator=g)
    out = model["ec"]({"a": tte.Jagged(a, lengths=torch.full((4,), 4)), "b": b})
    (model["head"](out["a"]) * out["b"]).sum().backward()
    opt.step()
    opt.zero_grad()
    if not CPU:
        torch_xla.sync()


def spec(model) -> str:
    if CPU:
        return ""
    from torch_tpu_embedding.xla import sharding_spec

    return str(sharding_spec(model["ec"].tables.big.weight))


model, opt = build()
if STAGE in ("save4", "save8", "save6"):
    for s in range(3):  # 3 calls with k = 2: a pending accumulation buffer is saved too
        step(model, opt, s)
    tte.checkpoint.save_distributed(os.path.join(DIR, f"dcp{STAGE[4:]}"), model=model, optimizer=opt)
    tte.checkpoint.save(os.path.join(DIR, "ref.pt" if STAGE == "save4" else f"ref{STAGE[4:]}.pt"), model=model,
                        optimizer=opt)
    if STAGE != "save4":  # the uninterrupted run, for the loads that train on
        for s in range(3, 6):
            step(model, opt, s)
        tte.checkpoint.save(os.path.join(DIR, f"trained{STAGE[4:]}.pt"), model=model, optimizer=opt)
else:
    source = {"load2": "dcp4", "load1": "dcp2", "cpu": "dcp1", "load8to2": "dcp8", "cpu8": "dcp8", "load6to4": "dcp6",
              "cpu6": "dcp6"}[STAGE]
    before = spec(model)
    if STAGE == "load8to2":  # the same shapes and row order at 8 and 2 devices: loaded in place, shard by shard
        from torch_tpu_embedding.checkpoint.api import _physical

        meta = torch.load(os.path.join(DIR, source, "tte_meta.pt"), weights_only=True)
        assert meta["layouts"] == _physical(model, opt)[2]["layouts"]
        assert meta["layouts"]["model/ec.tables.big.weight"] == ("interleaved", 512, 0)
    tte.checkpoint.load_distributed(os.path.join(DIR, source), model=model, optimizer=opt)
    if not CPU:
        torch_xla.sync()
    assert spec(model) == before, (spec(model), before)  # loaded in place: the layout is kept
    if STAGE == "load6to4":  # another row block and chunk order: read through the host
        meta = torch.load(os.path.join(DIR, source, "tte_meta.pt"), weights_only=True)
        assert meta["layouts"]["model/ec.tables.big.weight"] == ("interleaved", 1536, 0)
    name = {"load2": "after2", "load1": "after1", "cpu": "aftercpu", "load8to2": "after8to2", "cpu8": "aftercpu8",
            "load6to4": "after6to4", "cpu6": "aftercpu6"}
    tte.checkpoint.save(os.path.join(DIR, f"{name[STAGE]}.pt"), model=model, optimizer=opt)
    if STAGE in ("cpu", "cpu8", "cpu6"):
        tte.checkpoint.convert_distributed(os.path.join(DIR, source), os.path.join(DIR, f"conv{STAGE[3:]}.pt"))
    if STAGE in ("load8to2", "cpu8", "load6to4", "cpu6"):
        for s in range(3, 6):
            step(model, opt, s)
        tte.checkpoint.save(os.path.join(DIR, f"trained{STAGE.replace('load', '')}.pt"), model=model, optimizer=opt)
    elif STAGE != "cpu":
        tte.checkpoint.save_distributed(os.path.join(DIR, {"load2": "dcp2", "load1": "dcp1"}[STAGE]), model=model,
                                        optimizer=opt)
        step(model, opt, 3)  # training continues on the new layout
print("ok", model["ec"].tables.big.weight.shape[0])
