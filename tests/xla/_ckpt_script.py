"""Checkpoint interchange matrix worker (used by test_ckpt_matrix.py).

Usage: python _ckpt_script.py LAYOUT[,LAYOUT] PHASE DIR (float32 and float64 runs, each optimizer)
  LAYOUT: cpu | xla1 | row4 | col4 (row4/col4: 4-device SPMD, the big table row- or column-sharded); layouts
          of one process share its device count and SPMD mode: cpu,xla1 or row4,col4
  PHASE save:   per optimizer, 5 steps → DIR/<layout>-<opt>.pt (tte.checkpoint.save), 5 more steps →
                DIR/final-<layout>-<opt>.pt (the uninterrupted run)
  PHASE resume: per saved checkpoint of any layout, load here, 5 steps → DIR/resumed-<from>-<layout>-<opt>.pt
Each final file holds the logical CPU state: {"model": ..., "optimizer": ..., "spec": sharding spec}.
"""

import glob
import os
import sys

import torch

LAYOUTS, PHASE, DIR = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
SPMD = {"row4", "col4"}
# One device count and SPMD mode per process: the 4-device layouts together, the CPU and XLA-1 together.
assert set(LAYOUTS) <= SPMD or not set(LAYOUTS) & SPMD, LAYOUTS
if any(layout != "cpu" for layout in LAYOUTS):
    import torch_xla
    import torch_xla.runtime as xr

    if set(LAYOUTS) <= SPMD:
        xr.use_spmd()
    # Started before any backward, the CPU layout's included: autograd sizes its device queues at the first one.
    XLA_DEV = torch_xla.device()

import torch_tpu_embedding as tte  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: the registry
from optim_registry import CKPT_MATRIX, cases  # noqa: E402

OPTS = {c.id: c.make for c in cases(CKPT_MATRIX)}  # tests/optim_registry.py, target ``ckpt_matrix``
V, D = 1001, 8


def build(layout: str, opt_name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    placement = {"row4": "row", "col4": "column"}.get(layout, "auto")
    big = tte.TableConfig(V, D, name="big", combiner="mean", placement=placement, dtype=dtype)
    small = tte.TableConfig(40, D, name="small", combiner="sum", placement="replicated", dtype=dtype)
    dev = torch.device("cpu") if layout == "cpu" else XLA_DEV
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(big, max_ids_per_bag=8), "b": tte.FeatureConfig(small)},
                                 device=dev)
    head = torch.nn.Linear(2 * D, 1).to(device=dev, dtype=dtype)
    if layout in SPMD:
        from torch_tpu_embedding.xla import replicate, shard

        shard(ec)
        replicate(head)
    model = torch.nn.ModuleDict({"ec": ec, "head": head})
    opt = OPTS[opt_name](list(model.parameters()))
    opt.init_state()
    if layout != "cpu":
        torch_xla.sync()
    return model, opt


def train(layout: str, model, opt, start: int, steps: int) -> None:
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(s)
        a = torch.randint(0, 600, (16,), generator=g)  # rows >= 600 never touched
        b = torch.randint(0, 40, (4,), generator=g)
        out = model["ec"]({"a": tte.Jagged(a, lengths=torch.tensor([4, 4, 0, 8])), "b": b})
        loss = model["head"](torch.cat([out["a"], out["b"]], 1)).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if layout != "cpu":
            torch_xla.sync()


def spec(layout: str, model) -> str:
    if layout not in SPMD:
        return ""
    from torch_tpu_embedding.xla import sharding_spec

    return str(sharding_spec(model["ec"].tables.big.weight))


def write_final(layout: str, model, opt, path: str) -> None:
    torch.save({"model": tte.checkpoint.to_cpu(model.state_dict()),
                "optimizer": tte.checkpoint.to_cpu(opt.state_dict()["state"]), "spec": spec(layout, model)}, path)


for layout in LAYOUTS:
    for dt in ("float32", "float64"):
        dtype = getattr(torch, dt)
        for opt_name in OPTS:
            tag = f"{opt_name}.{dt}"
            if PHASE == "save":
                model, opt = build(layout, opt_name, dtype)
                train(layout, model, opt, 0, 5)
                tte.checkpoint.save(os.path.join(DIR, f"{layout}-{tag}.pt"), model=model, optimizer=opt)
                train(layout, model, opt, 5, 5)
                write_final(layout, model, opt, os.path.join(DIR, f"final-{layout}-{tag}.pt"))
                continue
            for ckpt in sorted(glob.glob(os.path.join(DIR, f"*-{tag}.pt"))):
                source = os.path.basename(ckpt).split("-")[0]
                if source in ("final", "resumed"):
                    continue
                model, opt = build(layout, opt_name, dtype)
                before = spec(layout, model)
                tte.checkpoint.load(ckpt, model=model, optimizer=opt)
                if layout != "cpu":
                    torch_xla.sync()
                assert spec(layout, model) == before, (spec(layout, model), before)  # loading keeps the layout
                train(layout, model, opt, 5, 5)
                write_final(layout, model, opt, os.path.join(DIR, f"resumed-{source}-{layout}-{tag}.pt"))
print("ok")
