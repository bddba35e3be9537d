"""A partial last batch under SPMD: a row-sharded table and a replicated table, their outputs concatenated
into a ``Linear``, trained on a batch that is not a multiple of the device count, against the same model on
the CPU (issue 28, item 1: XLA's partitioner used to abort the process, ``Check failed:
ShapeUtil::IsScalarWithElementType``, on the step's sort of the replicated table's ids).

Used by test_partial_batch.py in a child process (an abort kills the process, not pytest):
``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python _partial_batch_script.py B [B ...]`` prints one JSON line per batch
size: the largest error of the trained state against the CPU and how far the CPU state moved.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import torch_tpu_embedding as tte

V, P, D, L, STEPS = 1001, 50, 8, 3, 3


def train(batch: int, device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    row = tte.TableConfig(V, D, name="row", placement="row")
    rep = tte.TableConfig(P, D, name="rep", combiner="sum")
    feats = {"bag": tte.FeatureConfig(row, max_ids_per_bag=L), "one": tte.FeatureConfig(row),
             "dev": tte.FeatureConfig(row), "small": tte.FeatureConfig(rep)}
    ec = tte.EmbeddingCollection(feats, device=device)
    head = torch.nn.Linear(4 * D, 1).to(device)
    xla = device.type == "xla"
    if xla:
        import torch_xla

        from torch_tpu_embedding.xla import device_mesh, replicate, shard

        assert shard(ec, device_mesh()) == {"row": "row", "rep": "replicated"}
        replicate(head)
    opt = tte.optim.Adam([*ec.parameters(), *head.parameters()], lr=0.05)
    start = ec.state_dict()["tables.row.weight"].cpu().double()
    g = torch.Generator().manual_seed(batch)
    for _ in range(STEPS):
        lengths = torch.randint(0, L + 1, (batch,), generator=g)
        inputs: dict[str, Any] = {
            "bag": tte.Jagged(torch.randint(0, V, (int(lengths.sum()),), generator=g), lengths=lengths),
            "one": torch.randint(0, V, (batch,), generator=g),
            "dev": torch.randint(0, V, (batch,), generator=g).to(device),  # resident ids, replicated
            "small": torch.randint(0, P, (batch,), generator=g),
        }
        y = torch.randn(batch, generator=g).to(device)
        out = ec(inputs)
        x = torch.cat([out["bag"], out["one"], out["dev"], out["small"]], dim=1)
        ((head(x).squeeze(1) - y) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
        if xla:
            torch_xla.sync()
    ec.check_ids()
    state = {k: v.detach().cpu().double() for k, v in ec.state_dict().items()}
    state.update({f"head.{k}": v.detach().cpu().double() for k, v in head.state_dict().items()})
    for key, slots in opt.state_dict()["state"].items():
        state.update({f"{key}/{s}": v.detach().cpu().double() for s, v in slots.items()})
    return state, start


def run(batch: int) -> dict[str, Any]:
    import torch_xla

    (got, _), (want, start) = train(batch, torch_xla.device()), train(batch, torch.device("cpu"))
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    error = max(float((got[k] - want[k]).abs().max()) for k in want if want[k].numel())
    moved = float((want["tables.row.weight"] - start).abs().max())
    return {"batch": batch, "error": error, "moved": moved}


if __name__ == "__main__":
    import torch_xla.runtime as xr

    xr.use_spmd()
    for b in sys.argv[1:]:
        print(json.dumps(run(int(b))), flush=True)
