"""A feature whose activations the loss does not use touches no row (docs/optimizers.md, "Lazy semantics"),
also when it shares its lookup with used features: a table shared with them, or a stacked group.

Before, the lookup of several features was one autograd node, whose unused outputs autograd filled with zero
gradients: their ids were touched, so lazy Adam's moments decayed and moved those rows, and FTRL moved them,
(a never-touched row to 0) where the same feature alone in its lookup (another table, ``stack_tables=False``)
touched nothing. Checked against float64 numpy of TF's per-row TPU formulas (docs/optimizers.md, "Formulas"),
fed only the used features' ids.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from suite_helpers import summed_bag_rows

import torch_tpu_embedding as tte

V, D, LR = 6, 2, 0.1
IDS = {"u": [0, 1, 1], "v": [4, 5, 5], "w": [2, 3, 0]}  # u, v: table a; w: table b
TABLE = {"u": "a", "v": "a", "w": "b"}
RNG = np.random.default_rng(0)
INIT = {t: RNG.normal(size=(V, D)) for t in "ab"}
ACT_GRAD = [{f: RNG.normal(size=(len(ids), D)) for f, ids in IDS.items()} for _ in range(3)]


def used(step: int) -> tuple[str, ...]:
    return ("u", "v", "w") if step == 1 else ("u", "w")  # v is looked up every step, used only in step 1


def np_adam(w: np.ndarray, g: np.ndarray, s: dict, touched: set[int]) -> None:
    """TF TPU lazy Adam (defaults: betas 0.9, 0.999, eps 1e-7 inside the sqrt, no bias correction)."""
    for r in touched:
        s["momenta"][r] = 0.9 * s["momenta"][r] + 0.1 * g[r]
        s["velocities"][r] = 0.999 * s["velocities"][r] + 0.001 * g[r] ** 2
        w[r] -= LR * s["momenta"][r] / np.sqrt(s["velocities"][r] + 1e-14)


def np_ftrl(w: np.ndarray, g: np.ndarray, s: dict, touched: set[int]) -> None:
    """TF TPU FTRL (learning_rate_power -0.5, l1 = l2 = beta = 0, initial accumulator 0.1)."""
    for r in touched:
        n, z = s["accumulators"][r], s["linears"][r]
        n_new = n + g[r] ** 2
        z = z + g[r] - (np.sqrt(n_new) - np.sqrt(n)) * w[r] / LR
        w[r] = -z / (np.sqrt(n_new) / LR)
        s["accumulators"][r], s["linears"][r] = n_new, z


CASES = {
    "adam": (lambda p: tte.optim.Adam(p, lr=LR), np_adam, {"momenta": 0.0, "velocities": 0.0}),
    "ftrl": (lambda p: tte.optim.FTRL(p, lr=LR), np_ftrl, {"accumulators": 0.1, "linears": 0.0}),
}


def _input(kind: str, ids: list[int]) -> object:
    t = torch.tensor(ids)
    if kind == "dense":
        return t
    if kind == "jagged":
        return tte.Jagged(t, lengths=torch.ones(len(ids), dtype=torch.long))
    return tte.Padded(t.view(-1, 1))


@pytest.mark.parametrize("opt_name", sorted(CASES))
@pytest.mark.parametrize("stacked", [False, True], ids=["single", "stacked"])
@pytest.mark.parametrize("kind", ["dense", "jagged", "padded"])
def test_unused_feature_sharing_a_lookup_touches_no_row(kind: str, stacked: bool, opt_name: str) -> None:
    make, np_rule, slot_init = CASES[opt_name]
    cfgs = {t: tte.TableConfig(V, D, name=t, combiner="sum", dtype=torch.float64,
                               initializer=torch.tensor(INIT[t])) for t in "ab"}
    ec = tte.EmbeddingCollection({f: tte.FeatureConfig(cfgs[t]) for f, t in TABLE.items()}, stack_tables=stacked)
    opt = make(ec.parameters())
    w = {t: INIT[t].copy() for t in "ab"}
    slots = {t: {k: np.full((V, D), v) for k, v in slot_init.items()} for t in "ab"}
    for step in range(3):
        out = ec({f: _input(kind, ids) for f, ids in IDS.items()})
        sum((out[f] * torch.tensor(ACT_GRAD[step][f])).sum() for f in used(step)).backward()
        opt.step()
        opt.zero_grad()
        for t in "ab":
            g, touched = summed_bag_rows(t, used(step), TABLE, IDS, ACT_GRAD[step], (V, D))
            np_rule(w[t], g, slots[t], touched)
    state = opt.state_dict()["state"]
    for t in "ab":
        np.testing.assert_allclose(getattr(ec.tables, t).weight.detach().numpy(), w[t], rtol=0, atol=1e-12)
        for k, v in slots[t].items():
            np.testing.assert_allclose(state[f"table:{t}"][k].numpy(), v, rtol=0, atol=1e-12, err_msg=k)
