"""Generic optimizer suite driven by the registry: invariants, state_dict, schedules, overrides."""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import numpy as np
import pytest
import torch
from optim_registry import GENERIC, OVERRIDE, OptimizerConfig, cases

import torch_tpu_embedding as tte

V, D = 12, 3


def make_model(seed: int = 0, dtype: torch.dtype = torch.float64, optimizer: object = None):
    torch.manual_seed(seed)
    t = tte.TableConfig(V, D, name="t", combiner="mean", dtype=dtype, optimizer=optimizer)
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(t), "b": tte.FeatureConfig(t)})
    head = torch.nn.Linear(D, 1).to(dtype)
    return ec, head


def batch(step: int, all_rows: bool = False):
    g = torch.Generator().manual_seed(100 + step)
    if all_rows:
        a = torch.randperm(V, generator=g)
        lengths = torch.full((V // 2,), 2)
    else:  # rows 0..V/2-1 only, with duplicates; rows >= V/2 never touched
        a = torch.randint(0, V // 2, (8,), generator=g)
        lengths = torch.tensor([3, 1, 0, 4])
    b = torch.randint(0, V // 2 if not all_rows else V, (lengths.numel(),), generator=g)
    return {"a": tte.Jagged(a, lengths=lengths), "b": b}


def train(ec, head, opt, steps: int, all_rows: bool = False, start: int = 0):
    for s in range(start, start + steps):
        out = ec(batch(s, all_rows))
        loss = (head(out["a"]).tanh() * 2 + head(out["b"]).square()).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("cfg", cases(GENERIC), ids=str)
def test_state_is_the_declared_size(cfg: OptimizerConfig) -> None:
    """A table's optimizer state holds exactly the slots the entry declares, at their declared shapes
    (plus the step counter): a [V] slot costs V numbers, not V·D."""
    ec, head = make_model()
    opt = cfg.make(list(ec.parameters()) + list(head.parameters()))
    train(ec, head, opt, 1)
    state = opt.state[ec.tables.t.weight]
    declared = cfg.info.table_slots(opt.param_groups[0], (V, D))
    assert {k: tuple(state[k].shape) for k in declared} == {k: v.shape for k, v in declared.items()}
    assert sum(t.numel() for t in state.values()) == sum(v.size for v in declared.values()) + 1  # + step


@pytest.mark.parametrize("cfg", [c for c in cases(GENERIC) if c.lazy], ids=str)
def test_untouched_rows_and_slots_bit_identical(cfg: OptimizerConfig) -> None:
    ec, head = make_model()
    opt = cfg.make(list(ec.parameters()) + list(head.parameters()))
    w0 = ec.tables.t.weight.detach().clone()
    train(ec, head, opt, 4)
    w = ec.tables.t.weight.detach()
    assert torch.equal(w[V // 2 :], w0[V // 2 :])
    assert not torch.equal(w[: V // 2], w0[: V // 2])
    state = opt.state[ec.tables.t.weight]
    init = cfg.info.table_slots(opt.param_groups[0], (V, D))
    for name, value in init.items():
        if name not in cfg.info.whole_slots:
            assert torch.all(state[name][V // 2 :] == torch.from_numpy(value[V // 2 :])), name


@pytest.mark.parametrize("cfg", cases(GENERIC), ids=str)
def test_lazy_equals_dense_when_every_row_is_touched(cfg: OptimizerConfig) -> None:
    """Table path (row-sparse grads) == dense path (the same grads densified on a plain param)."""
    ec, head = make_model()
    dense = torch.nn.Parameter(ec.tables.t.weight.detach().clone())
    opt_rows = cfg.make([ec.tables.t.weight])
    opt_dense = cfg.make([dense])
    for s in range(4):
        out = ec(batch(s, all_rows=True))
        loss = (head(out["a"]).tanh() + head(out["b"]).square()).sum()
        loss.backward()
        ids, rows = ec.row_grads()["t"]
        keep = ids < V
        dense.grad = torch.zeros_like(dense).index_add_(0, ids[keep], rows[keep])
        opt_rows.step()
        opt_dense.step()
        opt_rows.zero_grad()
        opt_dense.zero_grad()
        head.zero_grad()
    torch.testing.assert_close(ec.tables.t.weight.detach(), dense.detach(), rtol=1e-12, atol=1e-12)
    dense_state = opt_dense.state[dense]
    for name in cfg.info.slot_names:
        twin = cfg.info.table_only_slots.get(name)
        torch.testing.assert_close(
            opt_rows.state[ec.tables.t.weight][name], dense_state[name] if twin is None else twin(dense_state),
            rtol=1e-12, atol=1e-12,
        )


def test_nonlazy_adam_moves_untouched_rows() -> None:
    ec, head = make_model()
    opt = tte.optim.Adam(ec.parameters(), lr=0.01, lazy_adam=False)
    w0 = ec.tables.t.weight.detach().clone()
    train(ec, head, opt, 3)  # momentum keeps moving rows whose gradient became 0
    m = opt.state[ec.tables.t.weight]["momenta"]
    assert torch.all(m[V // 2 :] == 0)  # never touched: g = 0 always → m stays 0
    assert not torch.equal(ec.tables.t.weight.detach()[: V // 2], w0[: V // 2])


@pytest.mark.parametrize("cfg", cases(GENERIC), ids=str)
def test_state_dict_round_trip_continues_bitwise(cfg: OptimizerConfig) -> None:
    ec, head = make_model()
    opt = cfg.make(list(ec.parameters()) + list(head.parameters()))
    train(ec, head, opt, 2)
    saved_model = copy.deepcopy((ec.state_dict(), head.state_dict()))
    saved_opt = copy.deepcopy(opt.state_dict())
    assert set(saved_opt["state"]) == {"table:t", "param:1", "param:2"}
    for name, value in cfg.info.table_slots(opt.param_groups[0], (V, D)).items():
        assert saved_opt["state"]["table:t"][name].shape == value.shape, name
    train(ec, head, opt, 3, start=2)

    ec2, head2 = make_model(seed=99)
    ec2.load_state_dict(saved_model[0])
    head2.load_state_dict(saved_model[1])
    opt2 = cfg.make(list(ec2.parameters()) + list(head2.parameters()))
    opt2.load_state_dict(saved_opt)
    train(ec2, head2, opt2, 3, start=2)
    assert torch.equal(ec.tables.t.weight, ec2.tables.t.weight)
    assert torch.equal(head.weight, head2.weight)


@pytest.mark.parametrize("cfg", cases(GENERIC), ids=str)
def test_step_without_gradients_is_a_no_op(cfg: OptimizerConfig) -> None:
    ec, head = make_model()
    opt = cfg.make(list(ec.parameters()) + list(head.parameters()))
    w0 = ec.tables.t.weight.detach().clone()
    opt.step()
    assert torch.equal(ec.tables.t.weight, w0)
    assert len(opt.state) == 0
    ec(batch(0))  # forward without backward: still nothing to apply
    opt.step()
    assert torch.equal(ec.tables.t.weight, w0)


@pytest.mark.parametrize("cfg", cases(GENERIC), ids=str)
def test_lr_scheduler_and_callable_and_tensor_agree(cfg: OptimizerConfig) -> None:
    """LambdaLR through 0 and 1, a callable lr and a tensor lr set by hand give the same weights."""
    factors = [1.0, 0.0, 0.5, 1.0, 0.25]
    if not cfg.info.zero_lr_ok(cfg.kwargs):
        factors[1] = 0.01  # e.g. TF's FTRL divides by lr; lr = 0 needs multiply_linear_by_learning_rate
    base = cfg.kwargs["lr"]

    ec1, h1 = make_model()
    o1 = cfg.make(ec1.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(o1, lambda s: factors[min(s, len(factors) - 1)])
    ec2, h2 = make_model()
    k = {"i": 0}
    o2 = cfg.make(ec2.parameters(), lr=lambda: base * factors[k["i"]])
    ec3, h3 = make_model()
    lr_t = torch.tensor(base, dtype=torch.float64)
    o3 = cfg.make(ec3.parameters(), lr=lr_t)
    for s in range(len(factors)):
        for ec, h, o in ((ec1, h1, o1), (ec2, h2, o2), (ec3, h3, o3)):
            lr_t.fill_(base * factors[s])
            out = ec(batch(s))
            (h(out["a"]).square().sum() + out["b"].sum()).backward()
            o.step()
            o.zero_grad()
        sched.step()
        k["i"] += 1
    torch.testing.assert_close(ec1.tables.t.weight, ec2.tables.t.weight, rtol=0, atol=0)
    torch.testing.assert_close(ec1.tables.t.weight, ec3.tables.t.weight, rtol=0, atol=0)


def test_zero_lr_step_keeps_sgd_weights() -> None:
    ec, head = make_model()
    opt = tte.optim.SGD(ec.parameters(), lr=0.0)
    w0 = ec.tables.t.weight.detach().clone()
    train(ec, head, opt, 1)
    assert torch.equal(ec.tables.t.weight, w0)


OVERRIDES = [(f"{c.info.name}-name", c.info.name, c) for c in cases(OVERRIDE)] + [
    (f"{c.id}-partial", functools.partial(c.info.cls, **c.kwargs), c) for c in cases(OVERRIDE)]


@pytest.mark.parametrize("override, cfg", [o[1:] for o in OVERRIDES], ids=[o[0] for o in OVERRIDES])
def test_per_table_override_matches_standalone(override: object, cfg: OptimizerConfig) -> None:
    """Global SGD + a table-level override == the override optimizer run alone on that table."""
    expected = cfg.info.cls
    ec, head = make_model(optimizer=override)
    opt = tte.optim.SGD(list(ec.parameters()) + list(head.parameters()), lr=0.05)
    algos = sorted(g["algorithm"] for g in opt.param_groups)
    assert algos == sorted(["sgd", expected.algorithm])
    ec_ref, head_ref = make_model(optimizer=None)
    factory = expected if isinstance(override, str) else override
    opt_ref_table = factory([ec_ref.tables.t.weight])
    opt_ref_head = tte.optim.SGD(head_ref.parameters(), lr=0.05)
    for s in range(3):
        for e, h, opts in ((ec, head, [opt]), (ec_ref, head_ref, [opt_ref_table, opt_ref_head])):
            out = e(batch(s))
            (h(out["a"]).square().sum() + h(out["b"]).sum()).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    assert torch.equal(ec.tables.t.weight, ec_ref.tables.t.weight)
    assert torch.equal(head.weight, head_ref.weight)
    sd = opt.state_dict()
    assert set(sd["state"]["table:t"]) == set(cfg.info.slot_names) | {"step"}


def test_override_works_with_lr_scheduler() -> None:
    ec, head = make_model(optimizer=functools.partial(tte.optim.Adagrad, lr=0.4))
    opt = tte.optim.SGD(list(ec.parameters()) + list(head.parameters()), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(ec, head, opt, 1)
    sched.step()
    lrs = sorted(g["lr"] for g in opt.param_groups)
    assert lrs == [0.05, 0.2]


def test_split_parameters_and_separate_optimizers() -> None:
    ec, head = make_model()
    model = torch.nn.ModuleDict({"ec": ec, "head": head})
    tables, dense = tte.split_parameters(model)
    assert [t.shape for t in tables] == [(V, D)]
    assert len(dense) == 2
    opt_t = tte.optim.Adagrad(tables, lr=0.1)
    opt_d = torch.optim.AdamW(dense, lr=0.01)  # stock optimizer on dense params: fine
    w0 = ec.tables.t.weight.detach().clone()
    out = ec(batch(0))
    head(out["a"]).sum().backward()
    opt_t.step()
    opt_d.step()
    assert not torch.equal(ec.tables.t.weight, w0)


def test_stock_optimizer_refuses_tables() -> None:
    ec, _ = make_model()
    opt = torch.optim.Adam(ec.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"embedding table 't'.*row-sparse.*silently not train"):
        opt.step()


def test_dense_params_match_plain_sgd() -> None:
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 2).double()
    b = copy.deepcopy(a)
    oa = tte.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    assert torch.allclose(a.weight, b.weight, rtol=0, atol=1e-15)


def test_sparse_grad_of_nn_embedding_takes_row_path() -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True).double()
    ref = torch.nn.Embedding(10, 3, sparse=True).double()
    ref.load_state_dict(emb.state_dict())
    opt = tte.optim.LazyAdam(emb.parameters(), lr=0.01, bias_correction=True,
                             sum_inside_sqrt=False, eps=1e-8)
    opt_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-8)
    for s in range(10):
        ids = torch.randint(0, 6, (7,), generator=torch.Generator().manual_seed(s))
        for m, o in ((emb, opt), (ref, opt_ref)):
            m(ids).pow(3).sum().backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(emb.weight, ref.weight, rtol=1e-6, atol=1e-12)
    assert torch.equal(emb.weight[6:], ref.weight[6:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adam_takes_betas_given_as_tensors_as_torch_does(dtype: torch.dtype) -> None:
    """torch.optim.Adam takes ``betas`` as one-element tensors; ours refused them ("must be a finite number ...
    Received: tensor(0.9000)"). Their values are taken (a float32 0.8 as that float32 number), in the constructor
    and in a group: a table and a dense parameter against float64 numpy Adam (bias-corrected rate, eps outside the
    root; the table lazy), the dense one against torch.optim.Adam given the same tensors too (which adds eps after
    dividing by sqrt(1 - b2^t): 2e-8 apart)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True).double()
    lin, ref_lin = torch.nn.Linear(3, 1, bias=False).double(), torch.nn.Linear(3, 1, bias=False).double()
    ref_lin.load_state_dict(lin.state_dict())
    betas = (torch.tensor(0.8, dtype=dtype), torch.tensor([0.99], dtype=dtype))
    opt = tte.optim.Adam([{"params": emb.parameters()}], lr=0.01, betas=betas, bias_correction=True,
                         sum_inside_sqrt=False, eps=1e-8)
    opt.add_param_group({"params": lin.parameters(), "betas": betas})
    b1, b2 = (float(b) for b in betas)
    assert opt.param_groups[1]["betas"] == opt.param_groups[0]["betas"] == (b1, b2)
    ref = torch.optim.Adam(ref_lin.parameters(), lr=0.01, betas=(betas[0], betas[1].reshape(())), eps=1e-8)
    w = {"emb": emb.weight.detach().numpy().copy(), "lin": lin.weight.detach().numpy().copy()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    for t in range(1, 7):
        g = torch.Generator().manual_seed(t)
        ids, g_rows, g_lin = torch.randint(0, 6, (7,), generator=g), torch.randn(7, 3, generator=g).double(), \
            torch.randn(1, 3, generator=g).double()
        ((emb(ids) * g_rows).sum() + (lin.weight * g_lin).sum()).backward()
        (ref_lin.weight * g_lin).sum().backward()
        for o in (opt, ref):
            o.step()
            o.zero_grad()
        grads = {"emb": np.zeros_like(w["emb"]), "lin": g_lin.numpy()}
        np.add.at(grads["emb"], ids.numpy(), g_rows.numpy())
        rate = 0.01 * np.sqrt(1 - b2**t) / (1 - b1**t)
        for k, rows in (("emb", np.unique(ids.numpy())), ("lin", slice(None))):
            m[k][rows] = b1 * m[k][rows] + (1 - b1) * grads[k][rows]
            v[k][rows] = b2 * v[k][rows] + (1 - b2) * grads[k][rows] ** 2
            w[k][rows] = w[k][rows] - rate * m[k][rows] / (np.sqrt(v[k][rows]) + 1e-8)
    np.testing.assert_allclose(emb.weight.detach().numpy(), w["emb"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lin.weight.detach().numpy(), w["lin"], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lin.weight, ref_lin.weight, rtol=1e-6, atol=1e-12)
    sd = opt.state_dict()
    sd["param_groups"][0]["betas"] = betas  # (as torch.optim.Adam saves them): loaded as the constructor takes them
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["betas"] == (b1, b2) and all(type(b) is float for b in opt.param_groups[0]["betas"])
    with pytest.raises(ValueError, match=r"Argument `betas\[0\]` must be a finite number in \[0, 1\): a float or a "
                                         r"one-element real tensor. Received a torch.float32 tensor of shape \(2,\)"):
        tte.optim.Adam(emb.parameters(), betas=(torch.tensor([0.9, 0.8]), 0.999))
    with pytest.raises(ValueError, match=r"Argument `betas\[1\]` must be a finite number and >= 0.0 and < 1.0. "
                                         r"Received: 1.5"):
        tte.optim.Adam(emb.parameters(), betas=(0.9, torch.tensor(1.5)))


def test_lazy_adam_matches_torch_sparse_adam_on_tables() -> None:
    """LazyAdam(bias_correction=True, sum_inside_sqrt=False) == torch.optim.SparseAdam, 10 steps."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        ec, head = make_model(dtype=dtype)
        ref = torch.nn.Embedding(V, D, sparse=True).to(dtype)
        with torch.no_grad():
            ref.weight.copy_(ec.tables.t.weight)
        opt = tte.optim.LazyAdam(ec.parameters(), lr=0.01, bias_correction=True,
                                 sum_inside_sqrt=False, eps=1e-8)
        opt_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.01, eps=1e-8)
        for s in range(10):
            out = ec(batch(s))
            (head(out["a"]).square().sum() + head(out["b"]).sum()).backward()
            ids, rows = ec.row_grads()["t"]
            keep = ids < V
            ref.weight.grad = torch.sparse_coo_tensor(ids[keep].unsqueeze(0), rows[keep], (V, D))
            opt.step()
            opt_ref.step()
            opt.zero_grad()
            head.zero_grad()
        torch.testing.assert_close(ec.tables.t.weight.detach(), ref.weight.detach(),
                                   rtol=tol, atol=tol)


def test_gradient_accumulation_false_is_exact_for_sgd() -> None:
    ec1, h1 = make_model()
    ec2, h2 = make_model()
    o1 = tte.optim.SGD(ec1.parameters(), lr=0.1)
    o2 = tte.optim.SGD(ec2.parameters(), lr=0.1, use_gradient_accumulation=False)
    train(ec1, h1, o1, 3)
    train(ec2, h2, o2, 3)
    torch.testing.assert_close(ec1.tables.t.weight, ec2.tables.t.weight, rtol=1e-12, atol=1e-12)


def test_gradient_accumulation_false_approximates_adagrad() -> None:
    """The no-dedup path differs from the exact one only where an id repeats within a step."""
    ec1, h1 = make_model()
    ec2, h2 = make_model()
    o1 = tte.optim.Adagrad(ec1.parameters(), lr=0.1)
    o2 = tte.optim.Adagrad(ec2.parameters(), lr=0.1, use_gradient_accumulation=False)
    train(ec1, h1, o1, 3)
    train(ec2, h2, o2, 3)
    diff = (ec1.tables.t.weight - ec2.tables.t.weight).abs().max().item()
    assert 0 < diff < 0.5


def test_slot_creation_fn_is_used() -> None:
    ec, head = make_model()
    calls = []

    def make_slots(param, names, initial):
        calls.append((tuple(param.shape), tuple(names), dict(initial)))
        return {n: torch.full_like(param, 0.7) for n in names}

    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1, slot_creation_fn=make_slots)
    train(ec, head, opt, 1)
    assert calls == [((V, D), ("accumulators",), {"accumulators": 0.1})]
    acc = opt.state[ec.tables.t.weight]["accumulators"]
    assert torch.all(acc[V // 2 :] == 0.7)


def test_load_state_dict_reports_mismatches() -> None:
    ec, head = make_model()
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    train(ec, head, opt, 1)
    sd = opt.state_dict()
    other = tte.optim.FTRL(make_model()[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"saved by optimizer 'adagrad', loading into 'ftrl'"):
        other.load_state_dict(sd)
    t2 = tte.TableConfig(V, D, name="u", dtype=torch.float64)
    ec2 = tte.EmbeddingCollection({"a": tte.FeatureConfig(t2)})
    with pytest.raises(ValueError, match=re.escape("missing ['table:u'], unexpected ['table:t']")):
        tte.optim.Adagrad(ec2.parameters(), lr=0.1).load_state_dict(sd)


def test_load_state_dict_names_groups_built_in_another_order() -> None:
    """Groups built in another order than saved (each table's own ``lr``): one message that says so, naming each
    table's group here and saved. The groups were compared by position: "group 0: missing ['table:u'], unexpected
    ['table:t']" (and so on for every group), as if tables were missing."""
    def build(order: str) -> tuple[tte.EmbeddingCollection, Any]:
        torch.manual_seed(0)
        ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(tte.TableConfig(10, 4, name="t")),
                                      "b": tte.FeatureConfig(tte.TableConfig(12, 4, name="u"))}, stack_tables=False)
        groups = {"t": {"params": [ec.tables.t.weight], "lr": 0.1}, "u": {"params": [ec.tables.u.weight], "lr": 0.5}}
        return ec, tte.optim.Adagrad([groups[k] for k in order])

    ec, opt = build("tu")
    out = ec({"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])})
    (out["a"] + out["b"]).sum().backward()
    opt.step()
    sd = opt.state_dict()
    ec2, opt2 = build("ut")
    with pytest.raises(ValueError, match=r"the parameter groups hold the tables they were saved with, in another order "
                       + re.escape("(['table:u'] in group 0 here, group 1 saved; ['table:t'] in group 1 here, group 0 "
                                   "saved)") + r".*build the groups in the saved order") as err:
        opt2.load_state_dict(sd)
    assert "missing" not in str(err.value)
    assert [g["lr"] for g in opt2.param_groups] == [0.5, 0.1]  # nothing loaded
    build("tu")[1].load_state_dict(sd)  # the saved order loads


def test_allow_zero_accumulator_gives_zero_not_nan() -> None:
    """Our choice (docs/optimizers.md): with n0 = 0, a coordinate whose gradient is 0 gets w = 0, not 0/0."""
    w = torch.nn.Parameter(torch.tensor([[0.5, -0.5]], dtype=torch.float64))
    opt = tte.optim.FTRL([w], lr=0.1, initial_accumulator_value=0.0, allow_zero_accumulator=True)
    w.grad = torch.tensor([[0.2, 0.0]], dtype=torch.float64)
    opt.step()
    assert torch.isfinite(w).all() and w[0, 1] == 0
    # The other coordinate follows the formula with n0 = 0: z = g − √(g²)·w/lr, w = −z / (√(g²)/lr).
    g, w0, lr = 0.2, 0.5, 0.1
    z = g - (g - 0.0) * w0 / lr
    assert torch.isclose(w[0, 0], torch.tensor(-z / (g / lr), dtype=torch.float64))


def test_ftrl_zero_lr_needs_multiply_linear_by_learning_rate() -> None:
    """As TF: the default FTRL divides by lr (NaN at lr = 0); the lr-multiplied mode does not."""
    for mult, finite in ((False, False), (True, True)):
        w = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64))
        opt = tte.optim.FTRL([w], lr=0.0, multiply_linear_by_learning_rate=mult)
        w.grad = torch.ones(2, 2, dtype=torch.float64)
        opt.step()
        assert bool(torch.isfinite(w).all()) is finite


def test_stock_optimizer_guard_rechecks_after_add_param_group() -> None:
    ec, head = make_model()
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    opt.step()  # dense only: fine (and remembered)
    opt.add_param_group({"params": [ec.tables.t.weight]})
    with pytest.raises(TypeError, match="embedding table 't'"):
        opt.step()
