"""``concat=True`` on an XLA device: the stacked group looked up side by side equals the CPU, forward and after
SGD and Adagrad steps, and a steady loop compiles no new graph after its first steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("torch_xla")

import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402


def _train(device: Any, opt_cls: Any, steps: int = 4) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    a = tte.TableConfig(40, 4, name="a", combiner="mean")
    b = tte.TableConfig(30, 4, name="b", combiner="mean")
    ec = tte.EmbeddingCollection({"u": tte.FeatureConfig(a, max_ids_per_bag=3),
                                  "v": tte.FeatureConfig(b, max_ids_per_bag=3),
                                  "w": tte.FeatureConfig(a, max_ids_per_bag=3)}, device=device)
    opt = opt_cls(ec.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    outs, compiles = [], 0
    for step in range(steps):
        batch = {}
        for name, rows in (("u", 40), ("v", 30), ("w", 40)):
            ids = torch.randint(0, rows, (6, 3), generator=g)
            batch[name] = tte.Padded(ids, torch.rand(6, 3, generator=g) > 0.3)
        if step == steps - 1 and device != "cpu":
            before = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
        out = ec(batch, concat=True)
        (out @ torch.linspace(-1, 1, 12, device=out.device)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        if device != "cpu":
            torch_xla.sync()
            if step == steps - 1:
                compiles = (met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0) - before
        outs.append(out.detach().cpu())
    return outs, {k: v.cpu() for k, v in ec.state_dict().items()}, compiles


@pytest.mark.parametrize("opt_cls", [tte.optim.SGD, tte.optim.Adagrad], ids=lambda c: c.__name__)
def test_concat_on_xla_equals_the_cpu(opt_cls: Any) -> None:
    device = torch_xla.device()  # the runtime first: before any backward on the CPU
    want_out, want_sd, _ = _train("cpu", opt_cls)
    got_out, got_sd, compiles = _train(device, opt_cls)
    for w, o in zip(want_out, got_out, strict=True):
        torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-6)
    for k, v in want_sd.items():
        torch.testing.assert_close(got_sd[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert compiles == 0  # the last step of a steady loop reuses its graphs
