"""Adafactor: Keras golden vectors on dense parameters, lazy factored state on tables, memory.

References: golden_keras.json (tests/data: real Keras 3.15.1 outputs); a float64 numpy implementation of the
lazy table semantics written from docs/optimizers.md (below, not from the code under test). Its
argument errors are the Adafactor entry's ``error_inputs`` in tests/optim_registry.py (run by
tests/optim/test_optim_errors.py), and the generic optimizer tests run it from that entry too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_tpu_embedding as tte

CASES = {c["name"]: c for c in json.loads((Path(__file__).parents[1] / "data" / "golden_keras.json").read_text())["cases"]}
ADAFACTOR = [n for n, c in CASES.items() if c["optimizer"] == "Adafactor"]
KEYS = ("beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold", "relative_step", "weight_decay", "clipnorm",
        "clipvalue", "global_clipnorm", "use_ema", "ema_momentum", "ema_overwrite_frequency", "loss_scale_factor",
        "gradient_accumulation_steps")


def run_case(case: dict, **override):
    cfg = {k: case["config"][k] for k in KEYS}
    cfg.update(override)
    lr = cfg.pop("lr", case["config"]["learning_rate"])
    w = torch.nn.Parameter(torch.tensor(case["initial_variable"], dtype=torch.float64))
    opt = tte.optim.Adafactor([w], lr=lr, **cfg)
    for g in case["gradients"]:
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        yield w.detach().clone(), opt.state[w]


@pytest.mark.parametrize("name", ADAFACTOR)
def test_golden_keras_adafactor(name: str) -> None:
    """Weights and every recorded slot (r, c, EMA) after each call, float64 vs Keras float32, <= 1e-6.

    Keras's ``relative_step=False`` still caps the step by 1/√t; here it does not (documented), so that
    case runs with ``relative_step=True``, which Keras's numbers equal.
    """
    case = CASES[name]
    override = {"relative_step": True} if name.endswith("relative_step_false") else {}
    steps = case["steps"]
    for (w, state), want in zip(run_case(case, **override), steps, strict=True):
        np.testing.assert_allclose(w.numpy(), want["variable"], rtol=0, atol=1e-6)
        slots = want["slots"]
        if w.dim() >= 2:
            np.testing.assert_allclose(state["r"].numpy(), slots["r"], rtol=0, atol=1e-6)
            np.testing.assert_allclose(state["c"].numpy(), slots["c"], rtol=0, atol=1e-6)
            assert "v" not in state  # factored: no full-size second moment (Keras stores one)
        else:
            np.testing.assert_allclose(state["v"].numpy(), slots["v"], rtol=0, atol=1e-6)
        if "model_variables_moving_average" in slots:
            np.testing.assert_allclose(state["ema"].numpy(), slots["model_variables_moving_average"], atol=1e-6)
        if "accumulated_gradients" in slots:
            np.testing.assert_allclose(state["accumulated_gradients"].numpy(), slots["accumulated_gradients"],
                                       atol=1e-6)


def test_relative_step_false_uses_lr_as_given() -> None:
    """Keras ignores relative_step=False (the two golden cases are identical); ours uses lr unchanged.
    With lr = min(1, 1/√t) as a callable, relative_step=False reproduces Keras's numbers."""
    case = CASES["adafactor_2d_lr1_relative_step_false"]
    assert case["steps"][-1]["variable"] == CASES["adafactor_2d_lr1_relative_step_true"]["steps"][-1]["variable"]
    t = [0]

    def lr() -> float:
        t[0] += 1
        return min(1.0, 1.0 / math.sqrt(t[0]))

    for (w, _), want in zip(run_case(case, lr=lr), case["steps"], strict=True):
        np.testing.assert_allclose(w.numpy(), want["variable"], atol=1e-6)
    *_, (w_plain, _) = run_case(case)  # lr = 1 as given: a different trajectory
    assert np.abs(w_plain.numpy() - np.array(case["steps"][-1]["variable"])).max() > 1e-2


# ------------------------------------------------------------------ lazy tables vs numpy
def np_lazy_adafactor(table, r, c, r_sum, ids, g_rows, t, lr, hp):
    """One lazy step, float64, from docs/optimizers.md: stats over the touched rows only."""
    u_ids = np.unique(ids)
    g = np.zeros((len(u_ids), table.shape[1]))
    for i, row in zip(ids, g_rows, strict=True):
        g[np.searchsorted(u_ids, i)] += row
    w = table[u_ids]
    rho = min(lr, 1 / math.sqrt(t))
    alpha = max(hp["epsilon_2"], math.sqrt(np.mean(w * w))) * rho
    g2 = g * g + hp["epsilon_1"]
    b2 = 1 - t ** hp["beta_2_decay"]
    r_new = b2 * r[u_ids] + (1 - b2) * g2.mean(1)
    c = b2 * c + (1 - b2) * g2.mean(0)
    r_sum = r_sum + (r_new - r[u_ids]).sum()
    r = r.copy()
    r[u_ids] = r_new
    v = (r_new / (r_sum / len(table)))[:, None] * c[None, :]
    u = g / np.sqrt(v)
    u = u / max(1.0, math.sqrt(np.mean(u * u)) / hp["clip_threshold"])
    table = table.copy()
    table[u_ids] = w - alpha * u
    return table, r, c, r_sum


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_lazy_table_matches_numpy(dtype: torch.dtype, tol: float) -> None:
    V, D = 20, 4
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner="sum", dtype=dtype)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t), "b": tte.FeatureConfig(t, max_ids_per_bag=3)})
    w = ec.tables.t.weight
    hp = {"epsilon_1": 1e-30, "epsilon_2": 1e-3, "clip_threshold": 1.0, "beta_2_decay": -0.8}
    opt = tte.optim.Adafactor(ec.parameters(), lr=0.3)
    table = w.detach().double().numpy().copy()
    r, c, r_sum = np.zeros(V), np.zeros(D), 0.0
    g = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        a = torch.randint(0, 12, (5,), generator=g)  # rows >= 12 never touched
        b = torch.randint(0, 12, (6,), generator=g)
        out = ec({"a": a, "b": tte.Jagged(b, lengths=torch.tensor([3, 0, 2, 1]))})
        (out["a"].square().sum() + (out["b"] * torch.arange(D, dtype=dtype)).sum()).backward()
        ids, rows = ec.row_grads()["t"]
        keep = ids < V
        table, r, c, r_sum = np_lazy_adafactor(table, r, c, r_sum, ids[keep].numpy(),
                                               rows[keep].double().numpy(), step, 0.3, hp)
        opt.step()
        opt.zero_grad()
        state = opt.state[w]
        np.testing.assert_allclose(w.detach().double().numpy(), table, rtol=tol, atol=tol)
        np.testing.assert_allclose(state["r"].double().numpy(), r, rtol=tol, atol=1e-30)
        np.testing.assert_allclose(state["c"].double().numpy(), c, rtol=tol, atol=1e-30)
        np.testing.assert_allclose(state["r_sum"].double().item(), r_sum, rtol=tol)
    assert sorted(state) == ["c", "r", "r_sum", "step"]
    assert np.all(state["r"].numpy()[12:] == 0)


def test_a_stacked_group_with_no_ids_in_a_step_trains_as_unstacked_tables() -> None:
    """A step whose bags are all empty for every table of a stacked group (the group is looked up, with no ids)
    crashed in the per-member sums (``reshape(0, -1)``); unstacked tables took it. Both now keep every row and
    statistic, advance the step counter, and then train alike."""
    got = {}
    for stack in (True, False):
        a = tte.TableConfig(4, 2, name="a", combiner="sum", dtype=torch.float64)
        b = tte.TableConfig(3, 2, name="b", combiner="sum", dtype=torch.float64)
        torch.manual_seed(0)
        ec = tte.EmbeddingCollection({"fa": tte.FeatureConfig(a), "fb": tte.FeatureConfig(b)}, stack_tables=stack)
        opt = tte.optim.Adafactor(ec.parameters(), lr=0.1)
        for ids in ([1, 2], [], [2, 3]):
            out = ec({"fa": tte.Jagged(torch.tensor(ids, dtype=torch.int64), lengths=torch.tensor([len(ids), 0])),
                      "fb": tte.Jagged(torch.tensor([0]), lengths=torch.tensor([0, 1]))
                      if ids == [2, 3] else tte.Jagged(torch.zeros(0, dtype=torch.int64), lengths=torch.tensor([0, 0]))})
            (out["fa"] * torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64) + out["fb"]).sum().backward()
            before = {n: w.detach().clone() for n, w in ec.embedding_tables.items()}
            opt.step()
            opt.zero_grad()
            if not ids:
                for n, w in ec.embedding_tables.items():
                    assert torch.equal(w.detach(), before[n])
        got[stack] = ({n: w.detach().clone() for n, w in ec.embedding_tables.items()},
                      opt.state_dict()["state"])
    for n in ("a", "b"):
        torch.testing.assert_close(got[True][0][n], got[False][0][n], rtol=1e-12, atol=1e-12)
        for k in ("r", "c", "r_sum", "step"):
            torch.testing.assert_close(got[True][1][f"table:{n}"][k], got[False][1][f"table:{n}"][k],
                                       rtol=1e-12, atol=1e-12)


def test_table_state_is_o_v_plus_d_and_under_1_1_percent() -> None:
    """1,000,000 × 64 float32: r [V] in bfloat16 + c [D] + r_sum = 0.78% of the table (Adam: 200%)."""
    V, D = 1_000_000, 64
    t = tte.TableConfig(V, D, name="big", initializer=torch.nn.init.zeros_)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
    w = ec.tables.big.weight
    table_bytes = w.numel() * w.element_size()

    def state_bytes(opt) -> int:
        opt.init_state()
        return sum(v.numel() * v.element_size() for v in opt.state[w].values())

    compact = state_bytes(tte.optim.Adafactor([w], row_stat_dtype=torch.bfloat16))
    default = state_bytes(tte.optim.Adafactor([w]))
    adam = state_bytes(tte.optim.Adam([w]))
    assert compact / table_bytes <= 0.011, compact / table_bytes
    assert default / table_bytes <= 1 / 64 + 1e-5  # r [V] float32: 1/D of the table
    assert adam / table_bytes >= 2.0


def test_bfloat16_row_statistic_trains_close_to_float32() -> None:
    runs = []
    for dt in (None, torch.bfloat16):
        torch.manual_seed(0)
        t = tte.TableConfig(50, 8, name="t", combiner="sum")
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
        opt = tte.optim.Adafactor(ec.parameters(), lr=0.05, row_stat_dtype=dt)
        g = torch.Generator().manual_seed(3)
        for _ in range(10):
            ids = torch.randint(0, 50, (32,), generator=g)
            (ec({"f": ids})["f"] - 1.0).square().sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append(ec.tables.t.weight.detach())
        if dt is not None:
            assert opt.state[ec.tables.t.weight]["r"].dtype == torch.bfloat16
    assert (runs[0] - runs[1]).abs().max() < 1e-2
    assert not torch.equal(runs[0], runs[1])


def test_table_config_can_name_adafactor() -> None:
    t = tte.TableConfig(10, 2, name="t", optimizer="adafactor")
    u = tte.TableConfig(10, 2, name="u")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t), "b": tte.FeatureConfig(u)})
    opt = tte.optim.SGD(ec.parameters(), lr=0.1)
    (ec({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])})["a"].sum() * 1.0).backward()
    opt.step()
    assert sorted(opt.state[ec.tables.t.weight]) == ["c", "r", "r_sum", "step"]


# ------------------------------------------------------------------ a zero row meeting a zero column
#: float32 rounding of one step of a weight: some 20 rounded operations (g², the means, r/mean(r)·c, rsqrt, RMS(u),
#: α, the subtraction), each within half an ulp, relative to |w| (< 1.5 here).
F32_STEP = 20 * 2.0**-24


def test_a_zero_row_meeting_a_zero_column_trains_finitely_as_the_float64_formula() -> None:
    """Where a row (looked up, gradient 0) and a column (gradient 0 in every touched row) meet, both statistics hold
    only ε1, and r_i·c_j/mean(r) ≈ 1e-60 underflows to 0 in float32: g·rsqrt(0) = 0·inf was NaN there and, through
    RMS(u), everywhere (a whole dense parameter; a table's touched rows). In float64 (the reference) v > 0 and u = 0:
    the weights at those coordinates stay, the others move. A table (lazy) and a dense parameter (every row)."""
    torch.manual_seed(0)
    t = tte.TableConfig(6, 3, name="t", combiner="sum")
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)})
    dense = torch.nn.Parameter(torch.randn(5, 3))
    opt = tte.optim.Adafactor([*ec.parameters(), dense], lr=0.3)
    hp = {"epsilon_1": 1e-30, "epsilon_2": 1e-3, "clip_threshold": 1.0, "beta_2_decay": -0.8}
    table, tr, tc, tsum = ec.tables.t.weight.detach().double().numpy().copy(), np.zeros(6), np.zeros(3), 0.0
    dw, dr, dc, dsum = dense.detach().double().numpy().copy(), np.zeros(5), np.zeros(3), 0.0
    coef = torch.tensor([[0.5, -1.0], [2.0, 0.25]])
    for step in range(1, 4):
        out = ec({"f": torch.tensor([1, 2, 3])})["f"]  # row 3 looked up with gradient 0, column 0 with gradient 0
        ((out[:2, 1:] * coef * step).sum() + (dense[1:3, 1:] * coef).sum()).backward()
        ids, rows = ec.row_grads()["t"]
        table, tr, tc, tsum = np_lazy_adafactor(table, tr, tc, tsum, ids.numpy(), rows.double().numpy(), step, 0.3, hp)
        dw, dr, dc, dsum = np_lazy_adafactor(dw, dr, dc, dsum, np.arange(5), dense.grad.double().numpy(), step, 0.3, hp)
        opt.step()
        opt.zero_grad()
        for got, want in ((ec.tables.t.weight, table), (dense, dw)):
            got = got.detach().double().numpy()
            assert np.isfinite(got).all(), got
            np.testing.assert_allclose(got, want, rtol=0, atol=step * F32_STEP * 1.5)  # steps add; |w| < 1.5
    assert np.array_equal(table[3], ec.tables.t.weight.detach().double().numpy()[3])  # row 3 never moved
