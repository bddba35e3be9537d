"""golden_tf.json section C, end to end: EmbeddingCollection + optimizer vs TF's per-row TPU formulas.

Each run: a 5×2 table (mean combiner), 3 steps of 3 weighted bags with duplicate ids; rows 2 and 4
are never looked up. The loss is Σ act · act_grad, so the activation gradient is the recorded one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from optim_registry import OPTIMIZER_INFOS

import torch_tpu_embedding as tte

GOLDEN = json.loads((Path(__file__).parents[1] / "data" / "golden_tf.json").read_text())["C_tpu_embedding_derived"]


def _optimizer(run: dict, params: list, lr: float):
    """The registry entry whose ``tf_golden`` claims the run (exactly one), with its arguments."""
    mine = [(info, kw) for info in OPTIMIZER_INFOS if info.tf_golden and (kw := info.tf_golden(run)) is not None]
    assert len(mine) == 1, (run["optimizer"], [info.name for info, _ in mine])
    info, kwargs = mine[0]
    return info.cls(params, lr=lr, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("run", GOLDEN["runs"], ids=[r["optimizer"] for r in GOLDEN["runs"]])
def test_golden_tf_section_c(run: dict, dtype: torch.dtype) -> None:
    tol = 1e-10 if dtype == torch.float64 else 1e-6
    table0 = torch.tensor(GOLDEN["table0"], dtype=dtype)
    cfg = tte.TableConfig(5, 2, name="t", combiner=GOLDEN["combiner"], initializer=table0, dtype=dtype)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(cfg)})
    opt = _optimizer(run, list(ec.parameters()), GOLDEN["lr"])
    for batch, expect in zip(GOLDEN["batches"], run["steps"], strict=True):
        ids = torch.tensor([i for bag in batch["ids"] for i in bag])
        weights = torch.tensor([w for bag in batch["weights"] for w in bag], dtype=dtype)
        lengths = torch.tensor([len(bag) for bag in batch["ids"]])
        act = ec({"f": tte.Jagged(ids, lengths=lengths, weights=weights)})["f"]
        torch.testing.assert_close(act, torch.tensor(expect["activations"], dtype=dtype), rtol=tol, atol=tol)
        (act * torch.tensor(batch["act_grad"], dtype=dtype)).sum().backward()
        opt.step()
        opt.zero_grad()
        w = ec.tables.t.weight.detach()
        torch.testing.assert_close(w, torch.tensor(expect["table"], dtype=dtype), rtol=tol, atol=tol)
        state = opt.state_dict()["state"]["table:t"]
        for name, value in expect["slots"].items():
            torch.testing.assert_close(state[name], torch.tensor(value, dtype=dtype), rtol=tol, atol=tol, msg=name)
    if run["optimizer"] != "adam_nonlazy":  # rows 2 and 4 are never looked up: bit-identical
        assert torch.equal(ec.tables.t.weight.detach()[[2, 4]], table0[[2, 4]])


FTRL_KERNELS = [
    r for r in json.loads((Path(__file__).parents[1] / "data" / "golden_tf.json").read_text())["B_ftrl_cpu_kernels"]
    if r["kernel"] == "ResourceApplyFtrl"
]


@pytest.mark.parametrize(
    "case", FTRL_KERNELS,
    ids=[f"{c['config']}-mult{c['multiply_linear_by_lr']}".replace(" ", "") for c in FTRL_KERNELS],
)
def test_golden_tf_section_b_ftrl_cpu_kernel(case: dict) -> None:
    """Real TF CPU ResourceApplyFtrl (dense: every row updated) vs FTRL on a dense parameter."""
    c = case["config"]
    w = torch.nn.Parameter(torch.tensor(case["initial_var"], dtype=torch.float64))
    opt = tte.optim.FTRL(
        [w], lr=c["lr"], learning_rate_power=c["p"], l1_regularization_strength=c["l1"],
        l2_regularization_strength=c["l2"], beta=c["beta"], initial_accumulator_value=c["a0"],
        multiply_linear_by_learning_rate=case["multiply_linear_by_lr"],
    )
    for g, expect in zip(case["grads"], case["steps"], strict=True):
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        torch.testing.assert_close(w.detach(), torch.tensor(expect["var"], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-6)
        for ours, theirs in (("accumulators", "accum"), ("linears", "linear")):
            if theirs in expect:
                torch.testing.assert_close(opt.state[w][ours], torch.tensor(expect[theirs], dtype=torch.float64),
                                           rtol=1e-6, atol=1e-6)


def test_golden_tf_section_d_tfa_lazy_adam() -> None:
    """tfa LazyAdam on IndexedSlices with duplicate indices == LazyAdam(bias_correction, eps outside)."""
    d = json.loads((Path(__file__).parents[1] / "data" / "golden_tf.json").read_text())["D_lazy_adam"]
    w = torch.nn.Parameter(torch.tensor(d["initial_var"], dtype=torch.float64))
    opt = tte.optim.LazyAdam([w], lr=d["lr"], betas=(d["beta_1"], d["beta_2"]), eps=d["epsilon"],
                             bias_correction=True, sum_inside_sqrt=False)
    for g, expect in zip(d["grads_indexed_slices"], d["tfa_lazy_adam"], strict=True):
        idx = torch.tensor(g["indices"])
        w.grad = torch.sparse_coo_tensor(idx.unsqueeze(0), torch.tensor(g["values"], dtype=torch.float64), w.shape)
        opt.step()
        torch.testing.assert_close(w.detach(), torch.tensor(expect["var"], dtype=torch.float64), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[w]["momenta"], torch.tensor(expect["m"], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-6)
    assert torch.equal(w.detach()[3], torch.tensor(d["initial_var"][3], dtype=torch.float64))
