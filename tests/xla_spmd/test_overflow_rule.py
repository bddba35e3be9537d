"""The overflow rule (issue 28, item 4): a step whose lookup overflows a row-sharded table's id-exchange bucket
changes nothing in the tte optimizer that holds the model — the row table, a replicated table, the dense head,
the moving averages, the slots and step counters, the gradient-accumulation window — exactly as a
``skip_nonfinite`` skip; it is counted in ``skipped_steps``, ``last_step_skipped`` says so on the device, and
``check_ids()`` still names the features, the shard and the capacity that would have sufficed. The run with the
overflowing batch then trains on exactly as the run without it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

if not xr.is_spmd():  # once per process: a second call warns (XLA_USE_SPMD is set by the first)
    xr.use_spmd()

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding.xla import device_mesh, replicate, shard  # noqa: E402

DEV = torch_xla.device()
CAP = 2


def _model() -> tuple[tte.EmbeddingCollection, torch.nn.Module, Any]:
    torch.manual_seed(0)
    row = tte.TableConfig(1001, 8, name="row", placement="row", max_unique_ids_per_shard=CAP)
    rep = tte.TableConfig(20, 8, name="rep")
    ec = tte.EmbeddingCollection({"a": tte.FeatureConfig(row, max_ids_per_bag=4), "b": tte.FeatureConfig(row),
                                  "c": tte.FeatureConfig(rep)}, device=DEV)
    head = torch.nn.Linear(24, 1).to(DEV)
    assert shard(ec, device_mesh()) == {"row": "row", "rep": "replicated"}
    replicate(head)
    opt = tte.optim.Adam([*ec.parameters(), *head.parameters()], lr=0.1, use_ema=True, ema_momentum=0.5,
                         gradient_accumulation_steps=2)
    opt.init_state()
    torch_xla.sync()
    return ec, head, opt


def _batch(seed: int, overflow: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8 examples (2 per device). Ids from rows 1..5 fit the capacity of 2 per shard; ``overflow``: ids from
    the whole table (up to 10 distinct ids per device)."""
    g = torch.Generator().manual_seed(seed)
    hi = 1001 if overflow else 6
    a = torch.randint(1, hi, (8, 4), generator=g)
    if overflow:
        a = torch.arange(32).reshape(8, 4) * 31 + 7  # 32 distinct rows spread over the shards
    return a, torch.randint(1, hi, (8,), generator=g), torch.randint(0, 20, (8,), generator=g)


def _step(ec: tte.EmbeddingCollection, head: torch.nn.Module, opt: Any, batch: tuple[torch.Tensor, ...]) -> None:
    a, b, c = batch
    out = ec({"a": tte.Padded(a), "b": b, "c": c})
    x = torch.cat([out["a"], out["b"], out["c"]], dim=1)
    (head(x) ** 2).sum().backward()
    opt.step()
    opt.zero_grad()
    torch_xla.sync()


def _everything(ec: tte.EmbeddingCollection, head: torch.nn.Module, opt: Any) -> dict[str, torch.Tensor]:
    """The logical state of the model and the optimizer (``state_dict``: slots, pending accumulation
    buffers, moving averages and their counters, step counts; not the trash rows) and the caught-up moving
    averages, on the host."""
    out = {f"ec/{k}": v.detach().cpu() for k, v in ec.state_dict().items()}
    out.update({f"head/{k}": v.detach().cpu() for k, v in head.state_dict().items()})
    for key, slots in opt.state_dict()["state"].items():
        out.update({f"opt/{key}/{s}": v.detach().cpu() for s, v in slots.items()})
    for name, p in [*ec.named_parameters(), *head.named_parameters()]:
        out[f"ema_now/{name}"] = opt.moving_average(p).cpu()
    return out


def test_an_overflowing_step_changes_nothing_and_training_goes_on_as_without_it() -> None:
    fits = [_batch(s) for s in range(6)]
    over = _batch(99, overflow=True)
    ref_ec, ref_head, ref_opt = _model()
    for b in fits:
        _step(ref_ec, ref_head, ref_opt, b)
    want = _everything(ref_ec, ref_head, ref_opt)

    ec, head, opt = _model()
    for b in fits[:2]:  # one whole accumulation window
        _step(ec, head, opt, b)
    ec.check_ids()
    before = _everything(ec, head, opt)
    # The overflowing batch as the first micro-batch of a window, then as the second.
    for b in [over, fits[2], over]:
        met.clear_all()
        _step(ec, head, opt, b)
        assert met.executed_fallback_ops() == []
        if b is over:
            now = _everything(ec, head, opt)
            for key, v in before.items():
                assert torch.equal(now[key], v), key  # tables, replicated table, head, slots, window, EMA
            flag = opt.last_step_skipped
            assert flag.device.type == "xla" and flag.shape == () and flag.dtype == torch.bool
            assert bool(flag.cpu())
            with pytest.raises(ValueError) as info:
                ec.check_ids()
            msg = str(info.value)
            assert "Feature(s) `a`, `b` (table `row`): ids over the exchange capacity 2 were dropped" in msg, msg
            assert "for shard 0" in msg and "would have sufficed" in msg, msg
        else:
            assert not bool(opt.last_step_skipped.cpu())
            ec.check_ids()
        before = _everything(ec, head, opt)
    assert opt.skipped_steps == 2 and opt.overflowed_steps == 2
    for b in fits[3:]:
        _step(ec, head, opt, b)
    got = _everything(ec, head, opt)
    assert set(got) == set(want)
    for key, v in want.items():
        torch.testing.assert_close(got[key], v, rtol=1e-6, atol=1e-6, msg=key)
    assert not torch.equal(got["ec/tables.rep.weight"], _everything(*_model())["ec/tables.rep.weight"])
    sd = opt.state_dict()
    assert sd["skipped_steps"] == 2 and sd["overflowed_steps"] == 2


def test_the_flag_gates_another_optimizer() -> None:
    """``last_step_skipped`` is device data: a plain torch.optim optimizer's update can be kept or dropped
    with it, no sync."""
    ec, head, opt = _model()
    other = torch.nn.Linear(2, 1).to(DEV)
    replicate(other)
    sgd = torch.optim.SGD(other.parameters(), lr=0.5)
    for batch, skipped in [(_batch(1), False), (_batch(2, overflow=True), True), (_batch(3), False)]:
        _step(ec, head, opt, batch)
        old = [q.detach().clone() for q in other.parameters()]
        other(torch.ones(4, 2, device=DEV)).sum().backward()
        sgd.step()
        sgd.zero_grad()
        with torch.no_grad():
            for q, o in zip(other.parameters(), old, strict=True):
                q.copy_(torch.where(opt.last_step_skipped, o, q))
        torch_xla.sync()
        assert torch.equal(other.weight.cpu(), old[0].cpu()) == skipped
    with pytest.raises(ValueError):
        ec.check_ids()


def test_the_report_names_the_features_after_shard_re_formed_their_group() -> None:
    """Ids dropped by a stacked group, then ``shard`` called again with another threshold (table `ta` becomes
    replicated: the group is dissolved) before ``check_ids()``: the report still names the user's features and
    tables (it named none: "Feature(s)  (table `fused_0`)")."""
    ta = tte.TableConfig(1001, 8, name="ta", max_unique_ids_per_shard=1)  # "auto": row below, replicated above
    tb = tte.TableConfig(600, 8, name="tb", placement="row", max_unique_ids_per_shard=1)
    ec = tte.EmbeddingCollection({"fa": tte.FeatureConfig(ta, max_ids_per_bag=4), "fb": tte.FeatureConfig(tb)},
                                 device=DEV)
    assert shard(ec, replicate_below_bytes=0) == {"ta": "row", "tb": "row"}
    assert [[m[0] for m in ms] for ms in ec.stacked_members().values()] == [["ta", "tb"]]
    out = ec({"fa": tte.Padded(torch.arange(32).reshape(8, 4) * 31 + 7), "fb": torch.arange(8) * 7})
    (out["fa"].sum() + out["fb"].sum()).backward()
    torch_xla.sync()
    assert shard(ec, replicate_below_bytes=1 << 30) == {"ta": "replicated", "tb": "row"}
    assert ec.stacked_members() == {}
    with pytest.raises(ValueError, match=r"^Feature\(s\) `fa`, `fb` \(tables `ta`, `tb`, stacked as `fused_0`\): "
                       r"ids over the exchange capacity 2 were dropped"):
        ec.check_ids()
