"""Row-sharded tables under SPMD (the id exchange, ``xla/routed.py``) against float64 numpy written here, on a
4-device mesh (``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4``), a table shared by two features and a stacked group:

* a feature whose activations the loss does not use touches no row (docs/optimizers.md, "Touched rows"), as in one
  device's lookup (tests/optim/test_unused_feature_rows.py): before, the exchange's backward got zeros for it and
  its ids reached their owners, so lazy Adam's moments decayed and moved those rows;
* ``torch.autograd.grad`` of a table's weight is refused by table name and records no row (before, with
  ``allow_unused=True`` it returned, and the rows it recorded were applied on top of the next backward's);
  ``torch.autograd.grad`` of the per-id weights adds no row either (docs/guide.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()
from suite_helpers import summed_bag_rows  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import shard  # noqa: E402

DEV = torch_xla.device()
V, D, B, LR = 16, 2, 8, 0.1
RNG = np.random.default_rng(0)
INIT = {t: RNG.normal(size=(V, D)) for t in "ab"}
IDS = {f: RNG.integers(0, V, size=B) for f in "uvw"}  # u, v: table a; w: table b
TABLE = {"u": "a", "v": "a", "w": "b"}
ACT_GRAD = [{f: RNG.normal(size=(B, D)) for f in "uvw"} for _ in range(3)]
PER_ID = RNG.uniform(0.5, 2.0, size=B)


def used(step: int) -> tuple[str, ...]:
    return ("u", "v", "w") if step == 1 else ("u", "w")  # v is looked up every step, used only in step 1


def build(stacked: bool) -> tte.EmbeddingCollection:
    cfgs = {t: tte.TableConfig(V, D, name=t, combiner="sum", dtype=torch.float64, placement="row",
                               initializer=torch.tensor(INIT[t])) for t in "ab"}
    ec = tte.EmbeddingCollection({f: tte.FeatureConfig(cfgs[t]) for f, t in TABLE.items()}, stack_tables=stacked,
                                 device=DEV)
    assert set(shard(ec).values()) == {"row"}
    return ec


def np_lazy_adam(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, touched: set[int]) -> None:
    """TF TPU lazy Adam (betas 0.9, 0.999, eps 1e-7 inside the sqrt, no bias correction) on the touched rows."""
    for r in touched:
        m[r] = 0.9 * m[r] + 0.1 * g[r]
        v[r] = 0.999 * v[r] + 0.001 * g[r] ** 2
        w[r] -= LR * m[r] / np.sqrt(v[r] + 1e-14)


@pytest.mark.parametrize("stacked", [False, True], ids=["shared_table", "stacked"])
def test_a_feature_the_loss_does_not_use_touches_no_row(stacked: bool) -> None:
    ec = build(stacked)
    opt = tte.optim.Adam(ec.parameters(), lr=LR)
    w = {t: INIT[t].copy() for t in "ab"}
    m = {t: np.zeros((V, D)) for t in "ab"}
    v = {t: np.zeros((V, D)) for t in "ab"}
    for step in range(3):
        out = ec({f: torch.tensor(IDS[f]) for f in "uvw"})
        sum((out[f] * torch.tensor(ACT_GRAD[step][f]).to(DEV)).sum() for f in used(step)).backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        for t in "ab":
            np_lazy_adam(w[t], m[t], v[t], *summed_bag_rows(t, used(step), TABLE, IDS, ACT_GRAD[step], (V, D)))
    state = opt.state_dict()["state"]
    for t in "ab":
        np.testing.assert_allclose(ec.state_dict()[f"tables.{t}.weight"].cpu().numpy(), w[t], rtol=0, atol=1e-12)
        for slot, want in (("momenta", m[t]), ("velocities", v[t])):
            np.testing.assert_allclose(state[f"table:{t}"][slot].cpu().numpy(), want, rtol=0, atol=1e-12, err_msg=slot)


def _loss(ec: tte.EmbeddingCollection, per_id: torch.Tensor) -> torch.Tensor:
    u = tte.Jagged(torch.tensor(IDS["u"]), lengths=torch.ones(B, dtype=torch.int64), weights=per_id)
    out = ec({"u": u, "v": torch.tensor(IDS["v"]), "w": torch.tensor(IDS["w"])})
    return sum((out[f] * torch.tensor(ACT_GRAD[0][f]).to(DEV)).sum() for f in "uvw")  # type: ignore[return-value]


@pytest.mark.parametrize("stacked", [False, True], ids=["shared_table", "stacked"])
def test_autograd_grad_adds_no_rows_and_refuses_a_table_weight(stacked: bool) -> None:
    ec = build(stacked)
    opt = tte.optim.SGD(ec.parameters(), lr=LR)
    weight = next(iter(ec.parameters()))  # table a's, or the stacked group's that holds a and b
    names = "`a`, `b`" if stacked else "`a`"
    for allow_unused in (False, True):
        with pytest.raises(RuntimeError, match=rf"Argument `inputs` of torch.autograd.grad holds the weight of "
                                               rf"embedding table\(s\) {names}: .*EmbeddingCollection.row_grads\(\)"):
            torch.autograd.grad(_loss(ec, torch.tensor(PER_ID, requires_grad=True)), [weight],
                                allow_unused=allow_unused)
        assert ec.row_grads() == {}
    per_id = torch.tensor(PER_ID, requires_grad=True)
    (got_gw,) = torch.autograd.grad(_loss(ec, per_id), [per_id])
    assert ec.row_grads() == {}
    _loss(ec, per_id).backward()
    opt.step()
    torch_xla.sync()
    want_gw = (INIT["a"][IDS["u"]] * ACT_GRAD[0]["u"]).sum(1)  # d loss / d per_id[i] = <row, dL/dout_i>
    np.testing.assert_allclose(got_gw.cpu().numpy(), want_gw, rtol=0, atol=1e-12)
    for t in "ab":  # one SGD step of the loss's gradient (not two)
        g = np.zeros((V, D))
        for f in "uvw":
            if TABLE[f] == t:
                for i, r in enumerate(IDS[f]):
                    g[r] += ACT_GRAD[0][f][i] * (PER_ID[i] if f == "u" else 1.0)
        np.testing.assert_allclose(ec.state_dict()[f"tables.{t}.weight"].cpu().numpy(), INIT[t] - LR * g, rtol=0,
                                   atol=1e-12)
