"""Hardening on one XLA device (issue 17): empty batches, per-id weight gradients, device-resident NaN/inf
weights, 16-bit combiners, and what a raw ``torch.save`` of an XLA state_dict needs to load elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")
import torch_xla.debug.metrics as met  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402

assert os.environ.get("PJRT_DEVICE"), "run the XLA tests with PJRT_DEVICE=CPU"
DEV = torch_xla.device()  # before any backward: the autograd engine sizes its device queues once
ROOT = Path(__file__).resolve().parents[2]
V, D = 12, 4


def collection(device, combiner: str = "mean", dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    t = tte.TableConfig(V, D, name="t", combiner=combiner, dtype=dtype)
    return tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=4),
                                    "s": tte.FeatureConfig(t, max_sequence_length=2),
                                    "p": tte.FeatureConfig(t, max_ids_per_bag=3)}, device=device)


def test_empty_batch_gives_empty_outputs_on_xla() -> None:
    """Eager CPU returns [0, D] for an empty batch; XLA used to fail reshaping 0 elements."""
    for combiner in ("sum", "mean", "sqrtn"):
        ec = collection(DEV, combiner)
        opt = tte.optim.Adagrad(ec.parameters(), lr=0.1)
        empty = tte.Jagged(torch.tensor([], dtype=torch.long), lengths=torch.tensor([], dtype=torch.long))
        out = ec({"f": empty, "s": empty, "p": tte.Padded(torch.zeros(0, 3, dtype=torch.long, device=DEV))})
        assert out["f"].shape == (0, D) and out["s"].shape == (0, 2, D) and out["p"].shape == (0, D)
        w0 = ec.tables.t.weight.detach().cpu().clone()
        sum(v.sum() for v in out.values()).backward()
        opt.step()
        torch_xla.sync()
        assert torch.equal(ec.tables.t.weight.detach().cpu(), w0)  # nothing looked up, nothing trained


def _bags(step: int):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, V, (9,), generator=g)
    w = (torch.rand(9, generator=g) * 2 - 0.5).requires_grad_()
    pw = (torch.rand(4, 3, generator=g) + 0.1)
    pids = torch.randint(0, V, (4, 3), generator=g)
    mask = torch.rand(4, 3, generator=g) > 0.3
    return ids, w, pids, mask, pw


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_per_id_weight_gradient_on_xla_matches_cpu(combiner: str) -> None:
    """Host weights (Jagged) and device weights (Padded) that require grad get the gradient the CPU
    path gives (itself checked against float64 autograd and nn.EmbeddingBag in tests/package/test_safe_files_and_inputs.py);
    the table's row gradients match too; no host fallback, one compile for a steady loop."""
    cpu, xla = collection("cpu", combiner), collection(DEV, combiner)
    met.clear_all()
    for step in range(3):
        ids, w, pids, mask, pw = _bags(step)
        grads, rows = [], []
        for ec, dev in ((cpu, torch.device("cpu")), (xla, DEV)):
            jw = w.detach().clone().requires_grad_()
            pwl = pw.clone().to(dev).requires_grad_()  # a leaf on the table's device
            out = ec({"f": tte.Jagged(ids, lengths=torch.tensor([4, 0, 3, 2]), weights=jw),
                      "s": tte.Jagged(ids[:3], lengths=torch.tensor([1, 1, 1, 0])),
                      "p": tte.Padded(pids.to(dev), mask.to(dev), pwl)})
            g = torch.linspace(-1, 1, 4 * D).reshape(4, D).to(dev)
            ((out["f"] * g).sum() + (out["p"] * g).sum() + out["s"].square().sum()).backward()
            if dev != torch.device("cpu"):
                torch_xla.sync()
            grads.append((jw.grad.cpu(), pwl.grad.cpu()))
            ids_, r = ec.row_grads()["t"]
            n = ec.tables.t.weight.shape[0]
            rows.append(torch.zeros(n + 1, D).index_add_(0, ids_.cpu(), r.cpu())[:V])
            ec.zero_grad()
        assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5), (grads[0][0], grads[1][0])
        assert torch.allclose(grads[0][1], grads[1][1], atol=1e-5)
        assert torch.allclose(rows[0], rows[1], atol=1e-5)
        if step == 0:
            compiles = met.counter_value("UncachedCompile")
    assert met.counter_value("UncachedCompile") == compiles  # steps 1 and 2 reuse step 0's graph
    assert met.executed_fallback_ops() == []


def test_device_resident_nonfinite_weights_are_counted_dropped_and_reported() -> None:
    """NaN/inf weights built on the device are screened like out-of-range ids: their ids train nothing,
    the table stays finite, check_ids() names the feature and the count; one compile, no fallback."""
    torch.manual_seed(0)
    t = tte.TableConfig(10, 3, name="t", combiner="mean")
    ec = tte.EmbeddingCollection({"p": tte.FeatureConfig(t, max_ids_per_bag=2), "q": tte.FeatureConfig(t, max_ids_per_bag=2)},
                                 device=DEV)
    opt = tte.optim.Adagrad(ec.parameters(), lr=0.5)
    opt.init_state()
    torch_xla.sync()
    w0 = ec.tables.t.weight.detach().cpu().clone()
    met.clear_all()
    for _ in range(3):
        ids = torch.tensor([[1, 2], [3, 4]], device=DEV)
        weights = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], device=DEV)
        q = tte.Padded(torch.tensor([[5, 11], [6, 7]], device=DEV), weights=torch.ones(2, 2, device=DEV))
        out = ec({"p": tte.Padded(ids, weights=weights), "q": q})
        (out["p"].sum() + out["q"].sum()).backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    assert met.counter_value("UncachedCompile") == 1
    assert torch.isfinite(out["p"].cpu()).all()
    assert ec.nonfinite_weight_counts() == {"p": 6, "q": 0} and ec.invalid_id_counts() == {"p": 0, "q": 3}
    model = torch.nn.ModuleDict({"emb": ec})
    with pytest.warns(UserWarning, match=r"Saving the embedding collection `emb` although 9 bad device input\(s\) "
                                         r"\(out-of-range ids, non-finite weights\) and 0 id\(s\) over"):
        model.state_dict()  # a save before check_ids() was ever called says so (and resets nothing)
    with pytest.raises(ValueError, match=r"^Out-of-range ids and non-finite per-id weights in device inputs since the "
                                         r"last check_ids\(\): Feature `q`: 3 id\(s\) outside \[0, 10\); Feature `p`: "
                                         r"6 NaN or inf weight\(s\)\. They were dropped"):
        ec.check_ids()
    ec.check_ids()  # reset
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.state_dict()  # checked: no warning
    assert met.executed_fallback_ops() == []
    w = ec.tables.t.weight.detach().cpu()
    assert torch.isfinite(w).all()
    changed = sorted(int(i) for i in torch.nonzero((w != w0).any(1)).flatten())
    assert changed == [1, 4, 5, 6, 7]  # ids 2 and 3 (NaN/inf weights) and 11 (out of range) trained nothing


def test_host_ids_with_device_weights_are_checked_on_the_host() -> None:
    ec = collection(DEV)
    before = ec.tables.t.weight.detach().cpu().clone()
    bad = tte.Padded(torch.tensor([[1, 2, 3]]), weights=torch.tensor([[1.0, float("nan"), 1.0]], device=DEV))
    empty = tte.Jagged(torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"Feature `p`: weights must be finite"):
        ec({"f": empty, "s": empty, "p": bad})
    assert torch.equal(ec.tables.t.weight.detach().cpu(), before) and ec.row_grads() == {}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_tables_combine_in_float32_on_xla(dtype: torch.dtype) -> None:
    outs = []
    for device in ("cpu", DEV):
        t = tte.TableConfig(V, D, name="t", combiner="mean", dtype=dtype)
        u = tte.TableConfig(V, D, name="u", combiner="sqrtn", dtype=dtype)
        ec = tte.EmbeddingCollection({"m": tte.FeatureConfig(t), "r": tte.FeatureConfig(u)}, device=device)
        with torch.no_grad():
            for table in (ec.tables.t, ec.tables.u):
                table.weight.copy_(torch.linspace(-0.5, 0.5, V * D).reshape(V, D).to(dtype))
        out = ec({"m": tte.Jagged(torch.tensor([1, 2]), lengths=torch.tensor([2]), weights=torch.tensor([4e4, 4e4])),
                  "r": tte.Jagged(torch.tensor([1, 2]), lengths=torch.tensor([2]), weights=torch.tensor([300.0, 300.0]))})
        outs.append({k: v.cpu() for k, v in out.items()})
    w = torch.linspace(-0.5, 0.5, V * D).reshape(V, D).to(dtype).double()
    assert torch.allclose(outs[1]["m"].double(), (w[1] + w[2]) / 2, atol=1e-2)  # float16 sums gave 0
    assert torch.allclose(outs[1]["r"].double(), (w[1] + w[2]) / 2**0.5, atol=1e-2)
    for k in outs[0]:
        assert outs[1][k].dtype == dtype and torch.allclose(outs[0][k].float(), outs[1][k].float(), atol=1e-2)


_LOAD_WITHOUT_XLA = r"""
import sys
sys.modules["torch_xla"] = None  # a host without torch_xla
import torch
try:
    torch.load(sys.argv[1], weights_only=True)
    print("loaded without map_location")
except Exception as e:
    print("failed:", type(e).__name__)
sd = torch.load(sys.argv[1], weights_only=True, map_location="cpu")
print("map_location=cpu:", sd["tables.t.weight"].device, sd["tables.t.weight"].sum().item())
"""


def test_raw_torch_save_of_an_xla_state_dict_needs_map_location(tmp_path: Path) -> None:
    """What docs/guide.md says: a raw torch.save of an XLA model's state_dict holds XLA tensors; without
    torch_xla it loads only with map_location="cpu" (tte.checkpoint.save writes host tensors instead)."""
    ec = collection(DEV)
    torch.save(ec.state_dict(), tmp_path / "raw.pt")
    out = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_XLA, str(tmp_path / "raw.pt")], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert "failed: NotImplementedError" in out
    total = float(ec.tables.t.weight.detach().cpu().sum())
    assert f"map_location=cpu: cpu {total}"[:28] in out


@pytest.mark.parametrize("wrong", ["table size", "optimizer"])
def test_a_failed_load_on_xla_changes_nothing(tmp_path: Path, wrong: str) -> None:
    """Item 4 on the device: the checks run on names, shapes and dtypes; no tensor is written."""

    def make(rows: int = V, adam: bool = True):
        torch.manual_seed(0)
        t = tte.TableConfig(rows, D, name="t")
        ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(t, max_ids_per_bag=4)}, device=DEV)
        opt = tte.optim.Adam(ec.parameters(), lr=0.1) if adam else tte.optim.Adagrad(ec.parameters(), lr=0.1)
        return ec, opt

    def train(ec, opt, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, V, (6,), generator=g)
        ec({"f": tte.Jagged(ids, lengths=torch.tensor([2, 4]))})["f"].square().sum().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()

    src, src_opt = make(V + 3 if wrong == "table size" else V, adam=wrong != "optimizer")
    train(src, src_opt, 0)
    tte.checkpoint.save(tmp_path / "bad.pt", model=src, optimizer=src_opt)
    ec, opt = make()
    train(ec, opt, 1)
    before_w = ec.tables.t.weight.cpu().clone()
    before_slots = {k: v.cpu().clone() for k, v in opt.state[ec.tables.t.weight].items()}
    with pytest.raises(tte.checkpoint.CheckpointMismatchError, match="nothing was loaded") as err:
        tte.checkpoint.load(tmp_path / "bad.pt", model=ec, optimizer=opt)
    assert ("model: size mismatch for tables.t.weight" in str(err.value)) == (wrong == "table size")
    assert ("saved by optimizer 'adagrad', loading into 'adam'" in str(err.value)) == (wrong == "optimizer")
    assert torch.equal(ec.tables.t.weight.cpu(), before_w)
    for k, v in opt.state[ec.tables.t.weight].items():
        assert torch.equal(v.cpu(), before_slots[k]), k
    assert met.executed_fallback_ops() == []


@pytest.mark.parametrize("stack", [True, False], ids=["stacked", "unstacked"])
def test_an_optimizer_built_before_moving_to_xla_refuses_to_step(stack: bool) -> None:
    """``.to(xla)`` gives every table a new parameter: an optimizer built on the CPU ones would train
    host tensors that nothing looks up. It raises at ``step()``; one built after the move trains."""
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({n: tte.FeatureConfig(tte.TableConfig(10, 4, name=n)) for n in "ab"},
                                 stack_tables=stack)
    stale = tte.optim.Adagrad(ec.parameters(), lr=0.1)
    ec.to(DEV)

    def step(opt: tte.optim.Adagrad) -> None:
        out = ec({n: torch.tensor([1, 2]) for n in "ab"})
        (out["a"].sum() + out["b"].sum()).backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"no longer (the table's|theirs): the table's weight parameter was replaced"):
        step(stale)
    ec.zero_grad()
    before = {k: v.cpu() for k, v in ec.state_dict().items()}
    step(tte.optim.Adagrad(ec.parameters(), lr=0.1))
    torch_xla.sync()
    assert all(not torch.equal(v.cpu(), before[k]) for k, v in ec.state_dict().items())
