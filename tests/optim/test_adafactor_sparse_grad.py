"""Adafactor takes a sparse COO gradient (``nn.Embedding(sparse=True)``) as it takes the dense one
(issue 29, item 5): was ``KeyError: 'r_sum'`` on the first step.

Its statistics run over every row of the parameter (column mean, ``mean(r)``, RMS), which only a
table's bookkeeping (``r_sum``) keeps lazily; a plain parameter's sparse gradient is densified, as
Keras densifies ``IndexedSlices``, so the run equals the dense-gradient run.
"""

from __future__ import annotations

import pytest
import torch

import torch_tpu_embedding as tte

CONFIGS = {
    "default": {"lr": 0.1},
    "decay-clip-steps": {"lr": 0.7, "clip_threshold": 0.3, "weight_decay": 0.05, "relative_step": False},
    "clipnorm-accum": {"lr": 0.1, "clipnorm": 0.05, "gradient_accumulation_steps": 2},
    "ema-gclip": {"lr": 0.1, "use_ema": True, "global_clipnorm": 0.5},
}


def _run(sparse: bool, kw: dict[str, object]) -> tuple[torch.nn.Embedding, torch.Tensor, tte.optim.Adafactor]:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 4, sparse=sparse, dtype=torch.float64)
    opt = tte.optim.Adafactor(emb.parameters(), **kw)
    g = torch.Generator().manual_seed(1)
    touched = torch.zeros(20, dtype=torch.bool)
    for _ in range(5):
        ids = torch.randint(0, 12, (9,), generator=g)  # duplicates; rows >= 12 never looked up
        touched[ids] = True
        emb(ids).tanh().sum().backward()
        opt.step()
        opt.zero_grad()
    return emb, touched, opt


@pytest.mark.parametrize("name", CONFIGS)
def test_adafactor_sparse_gradient_equals_dense_gradient(name: str) -> None:
    dense, touched, opt_d = _run(False, CONFIGS[name])
    sparse, touched_s, opt_s = _run(True, CONFIGS[name])
    assert torch.equal(touched, touched_s) and touched.any() and not touched.all()
    torch.testing.assert_close(sparse.weight[touched], dense.weight[touched])
    torch.testing.assert_close(sparse.weight, dense.weight)
    mine = opt_s.state[sparse.weight]
    for k, v in opt_d.state[dense.weight].items():
        if k != "accumulated_gradients":  # pending sparse rows are kept as rows (acc_ids, acc_rows)
            torch.testing.assert_close(mine[k], v, msg=f"slot {k}")
    if CONFIGS[name].get("use_ema"):
        torch.testing.assert_close(opt_s.moving_average(sparse.weight), opt_d.moving_average(dense.weight))
