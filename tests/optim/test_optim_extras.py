"""The Keras extras on every optimizer: lazy == dense, untouched rows, EMA catch-up, checkpoints.

Every configuration of the registry's ``extras`` target (one per optimizer, tests/optim_registry.py)
runs with every combination of ``KERAS_EXTRAS``; the extras' argument errors are the registry's
``SHARED_ERRORS`` (tests/optim/test_optim_errors.py).

Independent references: the same optimizer on a dense twin parameter fed the densified gradient (Keras
densifies sparse gradients), a float64 EMA of the recorded weight trajectory written from Keras 3.15.1's
keras/src/optimizers/base_optimizer.py, and one un-accumulated step on the mean gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
from optim_registry import EXTRAS, KERAS_EXTRAS, OptimizerConfig, cases

import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._core import slots

O = tte.optim  # noqa: E741
V, D = 10, 3
CFGS = cases(EXTRAS)  # one configuration per optimizer (tests/optim_registry.py)


def make(cfg: OptimizerConfig, extra: str, params: list[torch.Tensor]):
    return cfg.make(params, **KERAS_EXTRAS[extra])


def model(dtype: torch.dtype = torch.float64):
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner="sum", dtype=dtype)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=3)})
    head = torch.nn.Linear(D, 2).to(dtype)
    return ec, head


def batch(step: int, all_rows: bool):
    g = torch.Generator().manual_seed(step)
    if all_rows:  # every row at least once, plus duplicates
        ids = torch.cat([torch.randperm(V, generator=g), torch.randint(0, V, (5,), generator=g)])
    else:  # rows >= V // 2 never looked up
        ids = torch.randint(0, V // 2, (6,), generator=g)
    return ids.reshape(-1, 1)


def loss_of(out: torch.Tensor, head: torch.nn.Linear, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    target = torch.randn(out.shape[0], 2, generator=g, dtype=out.dtype)
    return (head(out) - target).square().sum() * 0.5


def twin_run(cfg: OptimizerConfig, extra: str, steps: int, all_rows: bool):
    """The table trained lazily, and a dense twin parameter trained on the densified gradient."""
    ec, head = model()
    head2 = copy.deepcopy(head)
    w = ec.tables.t.weight
    dense = torch.nn.Parameter(w.detach().clone())
    o_rows = make(cfg, extra, [w, *head.parameters()])
    o_dense = make(cfg, extra, [dense, *head2.parameters()])
    for s in range(steps):
        ids = batch(s, all_rows)
        loss_of(ec({"f": ids})["f"], head, s).backward()
        loss_of(torch.nn.functional.embedding(ids[:, 0], dense), head2, s).backward()
        o_rows.step()
        o_dense.step()
        o_rows.zero_grad()
        o_dense.zero_grad()
    return ec, head, o_rows, dense, head2, o_dense


@pytest.mark.parametrize("extra", list(KERAS_EXTRAS))
@pytest.mark.parametrize("cfg", CFGS, ids=str)
def test_lazy_equals_dense_when_every_row_is_touched(cfg: OptimizerConfig, extra: str) -> None:
    ec, head, o_rows, dense, head2, o_dense = twin_run(cfg, extra, 7, all_rows=True)
    w = ec.tables.t.weight
    tol = {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(w.detach(), dense.detach(), **tol)
    torch.testing.assert_close(head.weight.detach(), head2.weight.detach(), **tol)
    s_rows, s_dense = o_rows.state[w], o_dense.state[dense]
    for name in cfg.info.slot_names:
        twin = cfg.info.table_only_slots.get(name)  # e.g. Adafactor's Σr: the dense twin recomputes mean(r)
        torch.testing.assert_close(s_rows[name], s_dense[name] if twin is None else twin(s_dense), **tol, msg=name)
    if KERAS_EXTRAS[extra].get("use_ema"):
        torch.testing.assert_close(o_rows.moving_average(w), o_dense.moving_average(dense), **tol)
        o_rows.finalize_variable_values()
        o_dense.finalize_variable_values()
        torch.testing.assert_close(w.detach(), dense.detach(), **tol)


@pytest.mark.parametrize("extra", list(KERAS_EXTRAS))
@pytest.mark.parametrize("cfg", CFGS, ids=str)
def test_untouched_rows_bit_identical(cfg: OptimizerConfig, extra: str) -> None:
    ec, head = model()
    w = ec.tables.t.weight
    w0 = w.detach().clone()
    o = make(cfg, extra, [w, *head.parameters()])
    for s in range(7):
        loss_of(ec({"f": batch(s, False)})["f"], head, s).backward()
        o.step()
        o.zero_grad()
    assert torch.equal(w.detach()[V // 2 :], w0[V // 2 :])
    assert not torch.equal(w.detach()[: V // 2], w0[: V // 2])
    state = o.state[w]
    for name, spec in slots.specs(w, o.param_groups[0]).items():
        if spec.rows and name not in ("ema", "ema_last"):
            assert torch.all(state[name][V // 2 :] == spec.init), name
    if KERAS_EXTRAS[extra].get("use_ema"):  # the average of a constant row is that row, exactly
        assert torch.equal(o.moving_average(w)[V // 2 :], w0[V // 2 :])


@pytest.mark.parametrize("extra", ["ema", "ema-overwrite", "accumulate3", "accumulate2-ema-clipnorm",
                                   "accumulate2-gclip-scale", "clipnorm", "global_clipnorm"])
@pytest.mark.parametrize("cfg", [c for c in CFGS if c.info.zero_gradient_is_noop], ids=str)
def test_partial_batches_equal_dense(cfg: OptimizerConfig, extra: str) -> None:
    """Optimizers whose step leaves rows with g = 0 unchanged (SGD, Adagrad: zero_gradient_is_noop) have
    lazy == dense on any batch: this checks the EMA catch-up over idle calls, the overwrite of idle
    rows and accumulation across calls."""
    ec, head, o_rows, dense, head2, o_dense = twin_run(cfg, extra, 9, all_rows=False)
    w = ec.tables.t.weight
    torch.testing.assert_close(w.detach(), dense.detach(), rtol=1e-12, atol=1e-12)
    if KERAS_EXTRAS[extra].get("use_ema"):
        torch.testing.assert_close(o_rows.moving_average(w), o_dense.moving_average(dense),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [None, 2, 3])
@pytest.mark.parametrize("cfg", CFGS, ids=str)
def test_ema_equals_the_average_of_the_recorded_trajectory(cfg: OptimizerConfig, k: int | None) -> None:
    """Keras EMA (keras/src/optimizers/base_optimizer.py) in float64 over the weights recorded after each call."""
    ec, head = model()
    w = ec.tables.t.weight
    mu = 0.75
    o = cfg.make([w, *head.parameters()], use_ema=True, ema_momentum=mu, gradient_accumulation_steps=k)
    avg = None
    for it in range(8):
        loss_of(ec({"f": batch(it, False)})["f"], head, it).backward()
        o.step()
        o.zero_grad()
        m = 0.0 if it // (k or 1) == 0 else mu
        avg = w.detach().clone() if avg is None else m * avg + (1 - m) * w.detach()
        torch.testing.assert_close(o.moving_average(w), avg, rtol=1e-12, atol=1e-12)


def test_accumulation_is_one_step_on_the_mean_gradient() -> None:
    ec, head = model()
    ec2, head2 = model()
    w, w2 = ec.tables.t.weight, ec2.tables.t.weight
    o = O.Adagrad([w], lr=0.1, gradient_accumulation_steps=3)
    o2 = O.Adagrad([w2], lr=0.1)
    for s in range(3):
        loss_of(ec({"f": batch(s, False)})["f"], head, s).backward()
        loss_of(ec2({"f": batch(s, False)})["f"], head2, s).backward()
        o.step()
        if s < 2:
            assert torch.equal(w, w2)  # accumulate-only calls
    ids, rows = ec2.row_grads()["t"]
    ec2.zero_grad()
    ec2.tables.t.row_grad.add(ids, rows / 3)  # the mean of the three micro-batches
    o2.step()
    torch.testing.assert_close(w, w2, rtol=1e-14, atol=1e-14)
    assert o.state[w]["step"].item() == 1


def one_sgd_step(**extras: float):
    """One SGD (lr 1) step on table + head; returns (params, values before, densified gradients)."""
    ec, head = model()
    w = ec.tables.t.weight
    params = [w, head.weight, head.bias]
    o = O.SGD(params, lr=1.0, **extras)
    before = [p.detach().clone() for p in params]
    loss_of(ec({"f": batch(0, False)})["f"], head, 0).backward()
    ids, rows = ec.row_grads()["t"]
    keep = ids < V
    grads = [torch.zeros(V, D, dtype=w.dtype).index_add_(0, ids[keep], rows[keep]),
             head.weight.grad.clone(), head.bias.grad.clone()]
    o.step()
    return params, before, grads


def test_global_clipnorm_spans_tables_and_dense_parameters() -> None:
    params, before, grads = one_sgd_step(global_clipnorm=0.1)
    norm = torch.sqrt(sum((g * g).sum() for g in grads))
    assert norm > 0.1
    for p, p0, g in zip(params, before, grads, strict=True):
        torch.testing.assert_close(p.detach(), p0 - g * 0.1 / norm, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("extra", ["accumulate3", "accumulate2-ema-clipnorm", "ema-overwrite"])
@pytest.mark.parametrize("cfg", CFGS, ids=str)
def test_state_dict_mid_accumulation_continues_bitwise(cfg: OptimizerConfig, extra: str) -> None:
    ec, head = model()
    o = make(cfg, extra, [ec.tables.t.weight, *head.parameters()])

    def train(ec, head, o, start: int, n: int) -> None:
        for s in range(start, start + n):
            loss_of(ec({"f": batch(s, False)})["f"], head, s).backward()
            o.step()
            o.zero_grad()

    train(ec, head, o, 0, 4)  # mid-cycle for k = 3
    saved = copy.deepcopy((ec.state_dict(), head.state_dict(), o.state_dict()))
    assert saved[2]["iterations"] == 4
    train(ec, head, o, 4, 5)
    ec2, head2 = model()
    ec2.load_state_dict(saved[0])
    head2.load_state_dict(saved[1])
    o2 = make(cfg, extra, [ec2.tables.t.weight, *head2.parameters()])
    o2.load_state_dict(saved[2])
    train(ec2, head2, o2, 4, 5)
    assert torch.equal(ec.tables.t.weight, ec2.tables.t.weight)
    assert torch.equal(head.weight, head2.weight)
    if KERAS_EXTRAS[extra].get("use_ema"):
        assert torch.equal(o.moving_average(ec.tables.t.weight), o2.moving_average(ec2.tables.t.weight))


def test_float32_lazy_equals_dense_with_extras() -> None:
    ec, head = model(torch.float32)
    dense = torch.nn.Parameter(ec.tables.t.weight.detach().clone())
    o = O.Adafactor([ec.tables.t.weight], lr=0.1, use_ema=True, gradient_accumulation_steps=2, clipnorm=1.0)
    o2 = O.Adafactor([dense], lr=0.1, use_ema=True, gradient_accumulation_steps=2, clipnorm=1.0)
    for s in range(6):
        ids = batch(s, True)
        loss_of(ec({"f": ids})["f"], head, s).backward()
        loss_of(torch.nn.functional.embedding(ids[:, 0], dense), copy.deepcopy(head), s).backward()
        o.step()
        o2.step()
        o.zero_grad()
        o2.zero_grad()
    torch.testing.assert_close(ec.tables.t.weight.detach(), dense.detach(), rtol=1e-5, atol=1e-6)


P = [torch.nn.Parameter(torch.zeros(2))]


def test_moving_average_needs_use_ema() -> None:
    o = O.SGD(P, lr=0.1)
    with pytest.raises(ValueError, match="use_ema=True"):
        o.moving_average(P[0])


def test_clipnorm_clips_each_parameter_by_its_own_norm() -> None:
    params, before, grads = one_sgd_step(clipnorm=0.05)
    for p, p0, g in zip(params, before, grads, strict=True):
        norm = torch.linalg.vector_norm(g)
        assert norm > 0.05
        torch.testing.assert_close(p.detach(), p0 - g * 0.05 / norm, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg", CFGS, ids=str)
def test_loss_scale_factor_undoes_a_scaled_loss(cfg: OptimizerConfig) -> None:
    runs = []
    for scale in (None, 64.0):
        ec, head = model()
        o = cfg.make([ec.tables.t.weight, *head.parameters()], loss_scale_factor=scale)
        for s in range(3):
            (loss_of(ec({"f": batch(s, False)})["f"], head, s) * (scale or 1.0)).backward()
            o.step()
            o.zero_grad()
        runs.append(ec.tables.t.weight.detach())
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cfg", CFGS, ids=str)
def test_clipvalue_with_no_limit_on_either_side_does_not_clip(cfg: OptimizerConfig) -> None:
    """TF's ``clipvalue=(min, max)`` takes ``None`` for an open side, so ``(None, None)`` sets no gradient
    limit: it trains exactly as ``clipvalue=None`` (it failed at the first step, in ``torch.clamp``) and,
    clipping nothing, may go with ``clipnorm``. TF still refuses it without gradient accumulation (any
    ``clipvalue`` that is not None)."""
    runs = []
    for clip in (None, (None, None), [None, None]):
        ec, head = model()
        o = cfg.make([ec.tables.t.weight, *head.parameters()], clipvalue=clip)
        for s in range(3):
            loss_of(ec({"f": batch(s, False)})["f"], head, s).backward()
            o.step()
            o.zero_grad()
        runs.append([ec.tables.t.weight.detach().clone(), *(p.detach().clone() for p in head.parameters())])
    for run in runs[1:]:
        for got, want in zip(run, runs[0], strict=True):
            assert torch.equal(got, want)
    cfg.make(list(model()[1].parameters()), clipvalue=(None, None), clipnorm=1.0)
    if "use_gradient_accumulation" in cfg.info.shared_args:
        with pytest.raises(ValueError, match="gradient clipping cannot be used"):
            cfg.make(list(model()[1].parameters()), clipvalue=(None, None), use_gradient_accumulation=False)
