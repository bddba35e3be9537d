"""The model, optimizer and batches of the pre-exchange distributed checkpoint (see ``make.py``)."""

from __future__ import annotations

from typing import Any

import torch

import torch_tpu_embedding as tte


def build(device: torch.device, spmd: bool) -> tuple[torch.nn.ModuleDict, Any]:
    """Two row-sharded tables (Adafactor with EMA and gradient accumulation; Adam by a per-table override),
    a replicated table and a dense head."""
    torch.manual_seed(0)
    big = tte.TableConfig(501, 8, name="big", combiner="mean", placement="row")
    user = tte.TableConfig(300, 8, name="user", combiner="sum", placement="row", optimizer="adam")
    small = tte.TableConfig(40, 8, name="small", combiner="sum", placement="replicated")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(big, max_ids_per_bag=4), "u": tte.FeatureConfig(user),
                                  "b": tte.FeatureConfig(small)}, device=device)
    head = torch.nn.Linear(8, 1).to(device)
    if spmd:
        from torch_tpu_embedding.xla import replicate, shard

        shard(ec)
        replicate(head)
    model = torch.nn.ModuleDict({"ec": ec, "head": head})
    opt = tte.optim.Adafactor(model.parameters(), lr=0.1, use_ema=True, gradient_accumulation_steps=2)
    opt.init_state()
    return model, opt


def step(model: torch.nn.ModuleDict, opt: Any, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    a = torch.randint(0, 501, (16,), generator=g)
    u = torch.randint(0, 300, (4,), generator=g)
    b = torch.randint(0, 40, (4,), generator=g)
    out = model["ec"]({"a": tte.Jagged(a, lengths=torch.full((4,), 4)), "u": u, "b": b})
    (model["head"](out["a"] + out["u"]) * out["b"]).sum().backward()
    opt.step()
    opt.zero_grad()
