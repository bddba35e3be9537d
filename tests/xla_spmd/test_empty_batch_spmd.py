"""An empty batch on a row-sharded table under SPMD (issue 28, item 10) gives ``[0, D]`` outputs, as on the CPU
and on one XLA device: a step after it changes nothing, and the next batch trains (the id exchange used to
refuse it: ``ids_per_device must be >= 1``)."""

from __future__ import annotations

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, replicate, shard  # noqa: E402

DEV = torch_xla.device()


def test_an_empty_batch_gives_empty_outputs_and_trains_nothing() -> None:
    torch.manual_seed(0)
    row = tte.TableConfig(1001, 8, name="row", placement="row", combiner="mean")
    rep = tte.TableConfig(20, 8, name="rep")
    ec = tte.EmbeddingCollection({"bag": tte.FeatureConfig(row, max_ids_per_bag=3), "pad": tte.FeatureConfig(row),
                                  "one": tte.FeatureConfig(row), "seq": tte.FeatureConfig(row, max_sequence_length=2),
                                  "small": tte.FeatureConfig(rep)}, device=DEV)
    head = torch.nn.Linear(32, 1).to(DEV)
    assert shard(ec, device_mesh()) == {"row": "row", "rep": "replicated"}
    replicate(head)
    opt = tte.optim.Adam([*ec.parameters(), *head.parameters()], lr=0.1)
    opt.init_state()
    torch_xla.sync()

    def inputs(b: int) -> dict[str, object]:
        g = torch.Generator().manual_seed(b)
        lengths = torch.randint(0, 4, (b,), generator=g)
        return {"bag": tte.Jagged(torch.randint(0, 1001, (int(lengths.sum()),), generator=g), lengths=lengths),
                "pad": tte.Padded(torch.randint(0, 1001, (b, 2), generator=g)),
                "one": torch.randint(0, 1001, (b,), generator=g),
                "seq": tte.Jagged(torch.randint(0, 1001, (2 * b,), generator=g), lengths=torch.full((b,), 2)),
                "small": torch.randint(0, 20, (b,), generator=g)}

    def step(b: int) -> dict[str, torch.Tensor]:
        out = ec(inputs(b))
        x = torch.cat([out["bag"], out["pad"], out["one"], out["small"]], dim=1)
        (head(x).sum() + out["seq"].sum()).backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        return out

    before = {k: v.cpu().clone() for k, v in ec.state_dict().items()}
    out = step(0)
    assert {k: tuple(v.shape) for k, v in out.items()} == {"bag": (0, 8), "pad": (0, 8), "one": (0, 8),
                                                           "seq": (0, 2, 8), "small": (0, 8)}
    ec.check_ids()
    for k, v in ec.state_dict().items():
        assert torch.equal(v.cpu(), before[k]), k  # nothing looked up, nothing trained
    step(8)
    ec.check_ids()
    assert not torch.equal(ec.state_dict()["tables.row.weight"].cpu(), before["tables.row.weight"])
