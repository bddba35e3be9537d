"""The lookup on one XLA device: same activations and row gradients as CPU, no fallbacks, one compile."""

from __future__ import annotations

import os

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402
from torch_tpu_embedding._rows.dedup import coalesce_rows  # noqa: E402

assert os.environ.get("PJRT_DEVICE"), "run the XLA tests with PJRT_DEVICE=CPU"
DEV = torch_xla.device()  # before any backward: the autograd engine sizes its device queues once
V, D = 50, 4


def build(device: torch.device, combiner: str):
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner=combiner)
    u = tte.TableConfig(30, D, name="u", combiner="sum")
    return tte.EmbeddingCollection({
        "jag": tte.FeatureConfig(t, max_ids_per_bag=4),
        "sparse": tte.FeatureConfig(t),
        "dense": tte.FeatureConfig(u),
        "seq": tte.FeatureConfig(u, max_sequence_length=3),
        "padded": tte.FeatureConfig(t),
    }, device=device)


def inputs(step: int, device: torch.device):
    g = torch.Generator().manual_seed(step)
    jag = tte.Jagged(torch.randint(0, V, (9,), generator=g), lengths=torch.tensor([4, 0, 3, 2]),
                     weights=torch.rand(9, generator=g) + 0.1)
    idx = torch.tensor([[0, 0, 1, 3, 3], [0, 2, 1, 0, 3]])
    sparse = torch.sparse_coo_tensor(idx, torch.randint(0, V, (5,), generator=g), (4, 4))
    dense = torch.randint(0, 30, (4, 1), generator=g)
    seq = tte.Jagged(torch.randint(0, 30, (6,), generator=g), lengths=torch.tensor([1, 4, 0, 1]))
    pids = torch.randint(0, V, (4, 3), generator=g)
    mask = torch.rand(4, 3, generator=g) > 0.3
    padded = tte.Padded(pids.to(device), mask.to(device))  # built on the device: no host work
    return {"jag": jag, "sparse": sparse, "dense": dense, "seq": seq, "padded": padded}


def run(device: torch.device, combiner: str, steps: int = 1, lr: float = 0.1):
    ec = build(device, combiner)
    outs, grads = [], []
    for s in range(steps):
        out = ec(inputs(s, device))
        loss = sum((v * (i + 1)).square().sum() for i, v in enumerate(out.values()))
        loss.backward()
        with torch.no_grad():  # a plain SGD consuming the row gradients, sentinel dropped by XLA
            for name, (ids, rows) in ec.row_grads().items():
                w = ec.embedding_tables[name]
                uniq, g = coalesce_rows(ids, rows, w.shape[0])
                if s == 0:
                    keep = uniq < w.shape[0]
                    grads.append((name, uniq.cpu()[keep.cpu()], g.cpu()[keep.cpu()]))
                w.index_add_(0, uniq, -lr * g)
        ec.zero_grad()
        outs.append({k: v.detach().cpu() for k, v in out.items()})
        if device.type == "xla":
            torch_xla.sync()
    return ec, outs, grads


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_xla_forward_and_row_grads_match_cpu(combiner: str) -> None:
    _, cpu_out, cpu_grads = run(torch.device("cpu"), combiner)
    _, xla_out, xla_grads = run(DEV, combiner)
    for k in cpu_out[0]:
        torch.testing.assert_close(xla_out[0][k], cpu_out[0][k], rtol=1e-6, atol=1e-6, msg=k)
    for (n1, u1, g1), (n2, u2, g2) in zip(cpu_grads, xla_grads, strict=True):
        assert n1 == n2 and torch.equal(u1, u2)
        torch.testing.assert_close(g2, g1, rtol=1e-6, atol=1e-6)


def test_five_steps_one_compile_no_fallbacks_and_matches_cpu() -> None:
    ec_cpu, out_cpu, _ = run(torch.device("cpu"), "mean", steps=5)
    build(DEV, "mean")
    torch_xla.sync()
    met.clear_all()
    ec_xla, out_xla, _ = run(DEV, "mean", steps=5)
    assert met.executed_fallback_ops() == []
    # One graph for the steady step (the table upload after construction is data, not a compile).
    assert met.counter_value("UncachedCompile") == 1
    for name, w in ec_cpu.embedding_tables.items():
        torch.testing.assert_close(ec_xla.embedding_tables[name].detach().cpu(), w.detach(), rtol=1e-5, atol=1e-6)


def test_no_table_sized_gradient() -> None:
    ec = build(DEV, "sum")
    out = ec(inputs(0, DEV))
    sum(v.sum() for v in out.values()).backward()
    assert all(p.grad is None for p in tte.split_parameters(ec)[0])  # the parameters: tables and groups
    for name, (ids, rows) in ec.row_grads().items():
        w = ec.embedding_tables[name]
        assert rows.shape[0] == ids.shape[0] < w.shape[0] * 2  # per looked-up position, not per row of V
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([rows])
        assert f"f32[{w.shape[0]},{D}]" not in hlo.split("ENTRY")[-1].split("ROOT")[-1]


def test_unbounded_bags_pad_to_power_of_two() -> None:
    t = tte.TableConfig(V, D, name="t")
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t)}, device=DEV)
    from torch_tpu_embedding.inputs import to_bags

    for n, width in ((3, 4), (4, 4), (5, 8)):
        bags = to_bags("f", ec._features[0][2], tte.Jagged(torch.zeros(n, dtype=torch.long), lengths=torch.tensor([n])),
                       None, sentinel=V, device=DEV, dtype=torch.float32)
        assert bags.ids.shape == (1, width)


def test_variable_length_inputs_on_device_are_rejected() -> None:
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(V, D, name="t"))}, device=DEV)
    with pytest.raises(ValueError, match=r"variable-length inputs must be host \(CPU\) tensors"):
        ec({"f": tte.Jagged(torch.tensor([1, 2]).to(DEV), lengths=torch.tensor([2]))})


def test_device_resident_out_of_range_ids_are_counted_dropped_and_raised() -> None:
    """Ids built on the XLA device cannot be checked without a sync: they are screened on the device
    (dropped, never remapped to a row) and check_ids() raises at the user's sync point."""
    dev = torch_xla.device()
    torch.manual_seed(0)
    t = tte.TableConfig(10, 3, name="t", combiner="sum")
    ec = tte.EmbeddingCollection({"g": tte.FeatureConfig(t), "p": tte.FeatureConfig(t, max_ids_per_bag=2)},
                                 device=dev)
    opt = tte.optim.SGD(ec.parameters(), lr=1.0)
    opt.init_state()
    torch_xla.sync()
    w0 = ec.tables.t.weight.detach().cpu().clone()
    met.clear_all()
    for step in range(3):
        lr = 1.0 if step == 0 else 0.0
        opt.param_groups[0]["lr"] = lr
        g = torch.tensor([1, 12, -3], device=dev)  # two bad ids on the device
        p = tte.Padded(torch.tensor([[2, 10], [3, 4]], device=dev))  # 10 == num_embeddings: bad
        out = ec({"g": g, "p": p})
        (out["g"].sum() + out["p"].sum()).backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    assert met.counter_value("UncachedCompile") == 1  # the screening is part of the one step graph
    assert ec.invalid_id_counts() == {"g": 6, "p": 3}
    with pytest.raises(ValueError, match=r"Feature `g`: 6 id\(s\) outside \[0, 10\); Feature `p`: 3 id\(s\)"):
        ec.check_ids()
    ec.check_ids()  # reset: nothing new since
    assert met.executed_fallback_ops() == []  # reading the counters is a transfer, not a fallback
    w = ec.tables.t.weight.detach().cpu()
    assert torch.equal(out["g"][1].cpu(), torch.zeros(3)) and torch.equal(out["g"][2].cpu(), torch.zeros(3))
    changed = sorted(int(i) for i in torch.nonzero((w != w0).any(1)).flatten())
    assert changed == [1, 2, 3, 4]  # no bad id trained any row (row 9 = clamp target untouched)
