"""Stacked table groups on XLA: the same numbers as unstacked tables on the CPU, one graph for the steady
loop, no host fallback, and a step graph whose gathers and scatters do not grow with the table count."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from optim_registry import XLA_STACKED, OptimizerConfig, case, cases

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402

DEV = torch_xla.device()  # before any backward (the autograd engine sizes its device queues then)
VOCABS = (30, 17, 41, 9)


def build(device: torch.device, stack: bool, cfg: OptimizerConfig, tables: int = 4) -> tuple[tte.EmbeddingCollection, Any]:
    torch.manual_seed(0)
    configs = [tte.TableConfig(VOCABS[i % 4], 4, name=f"t{i}", combiner=("sum", "mean", "sqrtn")[i % 3])
               for i in range(tables)]
    feats = {f"f{i}": tte.FeatureConfig(c, max_ids_per_bag=3) for i, c in enumerate(configs)}
    feats["seq"] = tte.FeatureConfig(configs[0], max_sequence_length=2)
    ec = tte.EmbeddingCollection(feats, device=device, stack_tables=stack)
    return ec, cfg.make(ec.parameters())


def step(ec: tte.EmbeddingCollection, opt: Any, g: torch.Generator, tables: int = 4) -> None:
    inputs: dict[str, Any] = {}
    for i in range(tables):
        ids = torch.randint(0, VOCABS[i % 4], (10,), generator=g)
        inputs[f"f{i}"] = tte.Jagged(ids, lengths=torch.tensor([3, 0, 2, 3, 2]))
    inputs["seq"] = tte.Jagged(torch.randint(0, VOCABS[0], (4,), generator=g), lengths=torch.tensor([2, 0, 1, 0, 1]))
    out = ec(inputs)
    sum((i + 1) * o.square().sum() for i, o in enumerate(out.values())).backward()
    opt.step()
    opt.zero_grad()
    if next(ec.parameters()).device.type == "xla":
        torch_xla.sync()


@pytest.mark.parametrize("cfg", cases(XLA_STACKED), ids=str)
def test_stacked_on_xla_matches_unstacked_on_cpu_in_one_graph(cfg: OptimizerConfig) -> None:
    cpu, cpu_opt = build(torch.device("cpu"), False, cfg)
    xla, xla_opt = build(DEV, True, cfg)
    assert list(xla.groups) == ["fused_0"]
    xla_opt.init_state()
    torch_xla.sync()
    g_cpu, g_xla = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for i in range(8):
        if i == 2:  # the first steps compile (the second: its inputs are now step outputs)
            met.clear_all()
        step(cpu, cpu_opt, g_cpu)
        step(xla, xla_opt, g_xla)
    assert (met.counter_value("UncachedCompile") or 0) == 0
    assert met.executed_fallback_ops() == []
    for k, v in cpu.state_dict().items():
        torch.testing.assert_close(xla.state_dict()[k].cpu(), v, rtol=1e-5, atol=1e-6, msg=k)
    cpu_state, xla_state = cpu_opt.state_dict()["state"], xla_opt.state_dict()["state"]
    assert sorted(xla_state) == sorted(cpu_state) == [f"table:t{i}" for i in range(4)]
    for key, slots in cpu_state.items():
        for slot, v in slots.items():
            if slot.startswith("acc_") or slot in ("ema", "ema_last"):  # sized / caught up per device
                continue
            torch.testing.assert_close(xla_state[key][slot].cpu(), v, rtol=1e-5, atol=1e-6, msg=f"{key}/{slot}")


def _step_hlo(tables: int, stack: bool) -> str:
    ec, opt = build(DEV, stack, case(XLA_STACKED, "lazy_adam"), tables)
    opt.init_state()
    torch_xla.sync()
    g = torch.Generator().manual_seed(0)
    inputs: dict[str, Any] = {
        f"f{i}": tte.Jagged(torch.randint(0, VOCABS[i % 4], (10,), generator=g), lengths=torch.tensor([3, 0, 2, 3, 2]))
        for i in range(tables)
    }
    inputs["seq"] = tte.Jagged(torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 0, 1, 0, 1]))
    sum(o.square().sum() for o in ec(inputs).values()).backward()
    opt.step()
    outs = [p for p in ec.parameters()] + [s for st in opt.state.values() for s in st.values()]
    hlo: str = torch_xla._XLAC._get_xla_tensors_hlo(outs)
    torch_xla.sync()
    return hlo


def test_step_graph_scatters_once_per_group_not_per_table() -> None:
    counts = {}
    for tables, stack in ((1, False), (8, False), (8, True)):
        hlo = _step_hlo(tables, stack)
        counts[(tables, stack)] = (len(re.findall(r"= \S+ scatter\(", hlo)), len(re.findall(r" sort\(", hlo)))
    # lazy Adam scatters the weight and its two slots per physical table, and sorts once (dedup)
    assert counts[(8, False)] == (8 * counts[(1, False)][0], 8 * counts[(1, False)][1])
    assert counts[(8, True)] == counts[(1, False)], counts


def test_default_stacked_state_dict_and_row_grads_per_table_on_xla() -> None:
    """The default construction stacks; its per-table views cost one graph, not one per table:
    ``state_dict`` after in-place updates (each slice of an updated parameter would otherwise be its
    own compile on every read), and ``row_grads`` reports each table with the group's static shape."""
    cfg = case(XLA_STACKED, "lazy_adam")
    ec, opt = build(DEV, stack=True, cfg=cfg, tables=8)
    assert list(ec.groups) == ["fused_0"] and len(ec.stacked_members()["fused_0"]) == 8
    g = torch.Generator().manual_seed(2)
    step(ec, opt, g, tables=8)
    torch_xla.sync()
    met.clear_all()
    host = {k: v.cpu() for k, v in ec.state_dict().items()}
    assert (met.counter_value("UncachedCompile") or 0) <= 1  # every table's rows in one graph
    cpu, cpu_opt = build(torch.device("cpu"), stack=False, cfg=cfg, tables=8)
    step(cpu, cpu_opt, torch.Generator().manual_seed(2), tables=8)
    for k, v in cpu.state_dict().items():
        torch.testing.assert_close(host[k], v, rtol=1e-5, atol=1e-6, msg=k)
    inputs = {f"f{i}": tte.Jagged(torch.arange(10) % VOCABS[i % 4], lengths=torch.tensor([3, 0, 2, 3, 2]))
              for i in range(8)}
    inputs["seq"] = tte.Jagged(torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 0, 1, 0, 1]))
    grads = {}
    for model in (ec, cpu):
        sum((i + 1) * o.square().sum() for i, o in enumerate(model(inputs).values())).backward()
        grads[model.parameters().__next__().device.type] = model.row_grads()
    assert list(grads["xla"]) == list(grads["cpu"]) == [f"t{i}" for i in range(8)]
    shapes = {ids.shape for ids, _ in grads["xla"].values()}
    assert len(shapes) == 1  # static: every table reports the group's entries, others as padding
    for name, (ids, rows) in grads["cpu"].items():
        vocab = VOCABS[int(name[1:]) % 4]
        dense = [torch.zeros(vocab + 1, 4).index_add_(0, i.cpu(), r.detach().cpu().float())[:-1]
                 for i, r in (grads["xla"][name], (ids, rows))]
        torch.testing.assert_close(dense[0], dense[1], rtol=1e-5, atol=1e-6, msg=name)


def test_a_frozen_member_adds_nothing_to_the_clipnorm_of_the_others() -> None:
    """A frozen member of a stacked group (``ec.tables.t1.requires_grad_(False)``): its ids become the sentinel,
    which XLA keeps as the duplicate sum's tail; its rows must be zero there, or ``clipnorm`` counts them in
    another member's norm (the others trained 1e-2 away from the CPU's)."""
    cfg = case(XLA_STACKED, "adagrad-slotfn-clipnorm")
    runs = []
    for device in (torch.device("cpu"), DEV):
        ec, _ = build(device, True, cfg)
        ec.tables.t1.requires_grad_(False)
        opt = cfg.make(ec.parameters())
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            step(ec, opt, g)
        runs.append({k: v.cpu() for k, v in ec.state_dict().items()})
    for k, v in runs[0].items():
        torch.testing.assert_close(runs[1][k], v, rtol=1e-5, atol=1e-6, msg=k)
