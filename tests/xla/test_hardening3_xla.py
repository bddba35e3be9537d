"""Issue 28 (hardening3) items 6 and 8 on one XLA device: a frozen member of a stacked group stays bitwise
unchanged while its neighbours train (as on the CPU), and ``mean``/``sqrtn`` bags of finite weights whose
sum or sum of squares overflows float32 give the float64 result rounded (XLA keeps its padded bags)."""

from __future__ import annotations

import os

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")

import torch_tpu_embedding as tte  # noqa: E402

assert os.environ.get("PJRT_DEVICE"), "run the XLA tests with PJRT_DEVICE=CPU"
DEV = torch_xla.device()  # before any backward: the autograd engine sizes its device queues once


@pytest.mark.parametrize(("combiner", "w"), [("mean", [3e38, 3e38]), ("sqrtn", [1e20, 3e19])])
def test_mean_and_sqrtn_do_not_overflow_on_xla(combiner: str, w: list[float]) -> None:
    torch.manual_seed(0)
    t = tte.TableConfig(6, 3, name="t", combiner=combiner)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)}, device=DEV)
    out = ec({"f": tte.Jagged(torch.tensor([1, 2]), lengths=torch.tensor([2]))}, {"f": torch.tensor(w)})["f"].cpu()
    rows = ec.tables.t.weight.detach().cpu().double()[1:3]
    wd = torch.tensor(w).double()
    norm = wd.sum() if combiner == "mean" else wd.square().sum().sqrt()
    torch.testing.assert_close(out[0], ((wd[:, None] * rows).sum(0) / norm).float(), rtol=1e-6, atol=1e-6)


def _frozen_run(device: torch.device | str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    a, b = tte.TableConfig(10, 4, name="a", combiner="mean"), tte.TableConfig(8, 4, name="b")
    ec = tte.EmbeddingCollection({"x": tte.FeatureConfig(a, max_ids_per_bag=4), "y": tte.FeatureConfig(b)}, device=device)
    assert list(ec.stacked_members()) == ["fused_0"]
    opt = tte.optim.Adam(ec.parameters(), lr=0.1, lazy_adam=False)  # non-lazy: every row is stepped
    frozen_at = torch.empty(0)
    for s in range(4):
        if s == 2:
            ec.tables.b.requires_grad_(False)
            frozen_at = ec.tables.b.weight.detach().cpu().clone()
        g = torch.Generator().manual_seed(s)
        out = ec({"x": tte.Padded(torch.randint(0, 10, (6, 4), generator=g)), "y": torch.randint(0, 8, (6,), generator=g)})
        (out["x"] * out["y"]).sum().backward()
        opt.step()
        opt.zero_grad()
        if device != "cpu":
            torch_xla.sync()
    return frozen_at, {n: w.detach().cpu() for n, w in ec.embedding_tables.items()}


def test_frozen_member_of_a_stacked_group_on_xla() -> None:
    frozen_at, xla = _frozen_run(DEV)
    assert torch.equal(frozen_at, xla["b"])
    _, cpu = _frozen_run("cpu")
    torch.testing.assert_close(xla, cpu, rtol=1e-5, atol=1e-6)
