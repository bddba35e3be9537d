"""Checkpoint interchange matrix worker (used by test_ckpt_matrix.py).

Usage: python _ckpt_script.py LAYOUT PHASE DIR (float32 and float64 runs, each optimizer)
  LAYOUT: cpu | xla1 | row4 | col4 (row4/col4: 4-device SPMD, the big table row- or column-sharded)
  PHASE save:   per optimizer, 5 steps → DIR/<layout>-<opt>.pt (tte.checkpoint.save), 5 more steps →
                DIR/final-<layout>-<opt>.pt (the uninterrupted run)
  PHASE resume: per saved checkpoint of any layout, load here, 5 steps → DIR/resumed-<from>-<layout>-<opt>.pt
Each final file holds the logical CPU state: {"model": ..., "optimizer": ..., "spec": sharding spec}.
"""

import glob
import os
import sys

import torch

LAYOUT, PHASE, DIR = sys.argv[1], sys.argv[2], sys.argv[3]
xla = LAYOUT != "cpu"
if xla:
    import torch_xla
    import torch_xla.runtime as xr

    if LAYOUT in ("row4", "col4"):
        xr.use_spmd()
    DEV = torch_xla.device()
else:
    DEV = torch.device("cpu")

import torch_tpu_embedding as tte  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: the registry
from optim_registry import CKPT_MATRIX, cases  # noqa: E402

OPTS = {c.id: c.make for c in cases(CKPT_MATRIX)}  # tests/optim_registry.py, target ``ckpt_matrix``
V, D = 1001, 8


def build(opt_name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    placement = {"row4": "row", "col4": "column"}.get(LAYOUT, "auto")
    big = tte.TableConfig(V, D, name="big", combiner="mean", placement=placement, dtype=dtype)
    small = tte.TableConfig(40, D, name="small", combiner="sum", placement="replicated", dtype=dtype)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(big, max_ids_per_bag=8), "b": tte.FeatureConfig(small)},
                                 device=DEV)
    head = torch.nn.Linear(2 * D, 1).to(device=DEV, dtype=dtype)
    if LAYOUT in ("row4", "col4"):
        from torch_tpu_embedding.xla import replicate, shard

        shard(ec)
        replicate(head)
    model = torch.nn.ModuleDict({"ec": ec, "head": head})
    opt = OPTS[opt_name](list(model.parameters()))
    opt.init_state()
    if xla:
        torch_xla.sync()
    return model, opt


def train(model, opt, start: int, steps: int) -> None:
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        a = torch.randint(0, 600, (16,), generator=g)  # rows >= 600 never touched
        b = torch.randint(0, 40, (4,), generator=g)
        out = model["ec"]({"a": tte.Jagged(a, lengths=torch.tensor([4, 4, 0, 8])), "b": b})
        loss = model["head"](torch.cat([out["a"], out["b"]], 1)).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if xla:
            torch_xla.sync()


def spec(model) -> str:
    if LAYOUT not in ("row4", "col4"):
        return ""
    from torch_tpu_embedding.xla import sharding_spec

    return str(sharding_spec(model["ec"].tables.big.weight))


def write_final(model, opt, path: str) -> None:
    torch.save({"model": tte.checkpoint.to_cpu(model.state_dict()),
                "optimizer": tte.checkpoint.to_cpu(opt.state_dict()["state"]), "spec": spec(model)}, path)


for dt in ("float32", "float64"):
    dtype = getattr(torch, dt)
    for opt_name in OPTS:
        tag = f"{opt_name}.{dt}"
        if PHASE == "save":
            model, opt = build(opt_name, dtype)
            train(model, opt, 0, 5)
            tte.checkpoint.save(os.path.join(DIR, f"{LAYOUT}-{tag}.pt"), model=model, optimizer=opt)
            train(model, opt, 5, 5)
            write_final(model, opt, os.path.join(DIR, f"final-{LAYOUT}-{tag}.pt"))
            continue
        for ckpt in sorted(glob.glob(os.path.join(DIR, f"*-{tag}.pt"))):
            source = os.path.basename(ckpt).split("-")[0]
            if source in ("final", "resumed"):
                continue
            model, opt = build(opt_name, dtype)
            before = spec(model)
            tte.checkpoint.load(ckpt, model=model, optimizer=opt)
            if xla:
                torch_xla.sync()
            assert spec(model) == before, (spec(model), before)  # loading keeps the layout
            train(model, opt, 5, 5)
            write_final(model, opt, os.path.join(DIR, f"resumed-{source}-{LAYOUT}-{tag}.pt"))
print("ok")
