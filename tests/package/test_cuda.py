"""Plain CUDA (no torch_xla): every optimizer trains the same on a CUDA device as on the CPU, a steady step
with host ids makes no host–device sync (``torch.cuda.set_sync_debug_mode("error")``), and a checkpoint
written on the GPU resumes on the CPU. Skipped where no GPU is visible (CI has none); run on a GPU machine with
``python -m pytest -q tests/package/test_cuda.py``. (tests/optim/test_sync_free_step.py checks the same step
with no GPU: forced on the CPU, and on the meta device.)
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from optim_registry import OPTIMIZER_INFOS, SYNC_FREE, OptimizerConfig, cases
from test_sync_free_step import _train as train_host_ids

import torch_tpu_embedding as tte
from torch_tpu_embedding.modules import assembly
from torch_tpu_embedding.optim._kernels import kernel_policy, row_update
from torch_tpu_embedding.optim._kernels.c_gather import join_library

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

DEFAULTS = [OptimizerConfig(info, info.name, info.default) for info in OPTIMIZER_INFOS]
Model = tuple[tte.EmbeddingCollection, torch.nn.Linear]


def build(dtype: torch.dtype) -> Model:
    """Three tables stacked by default, one shared by two features; sqrtn bags with padding, weighted
    mean bags (jagged), single ids; a dense head. Built on the CPU, so every copy starts equal."""
    torch.manual_seed(0)
    a = tte.TableConfig(300, 6, name="a", combiner="sqrtn", dtype=dtype)
    b = tte.TableConfig(120, 6, name="b", combiner="mean", dtype=dtype)
    c = tte.TableConfig(50, 4, name="c", dtype=dtype)
    ec = tte.EmbeddingCollection({
        "fa": tte.FeatureConfig(a, max_ids_per_bag=5), "fa1": tte.FeatureConfig(a),
        "fb": tte.FeatureConfig(b, max_ids_per_bag=4), "fc": tte.FeatureConfig(c)})
    return ec, torch.nn.Linear(22, 1).to(dtype)


def batch(s: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Batch ``s``: ids drawn on the CPU (the same on every device), with duplicates and empty bags."""
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(0, 300, (32, 5), generator=g)
    lengths = torch.randint(0, 5, (32,), generator=g)
    jag = torch.randint(0, 40, (int(lengths.sum()),), generator=g)  # few rows: many duplicates
    w = torch.rand(jag.shape, generator=g, dtype=dtype) + 0.5
    return {"fa": tte.Padded(ids.to(device), (ids % 7 != 0).to(device)),
            "fa1": torch.randint(0, 300, (32,), generator=g).to(device),
            "fb": tte.Jagged(jag.to(device), lengths=lengths.to(device), weights=w.to(device)),
            "fc": torch.randint(0, 50, (32,), generator=g).to(device)}


def train(model: Model, opt: Any, steps: range, device: torch.device, dtype: torch.dtype) -> None:
    ec, head = model
    for s in steps:
        out = ec(batch(s, device, dtype))
        x = torch.cat([out["fa"] * out["fa1"], out["fb"], out["fa1"], out["fc"]], dim=1)
        head(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def tensors(model: Model, opt: Any) -> list[tuple[str, torch.Tensor]]:
    """Every weight and every optimizer state tensor, named, on the CPU."""
    out = []
    for i, p in enumerate([*model[0].parameters(), *model[1].parameters()]):
        out.append((f"param {i}", p.detach().cpu()))
        out += [(f"param {i} {k}", v.detach().cpu()) for k, v in opt.state[p].items()
                if isinstance(v, torch.Tensor)]
    return out


def assert_same(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]], tol: float) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    for (n, x), (_, y) in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=lambda m, n=n: f"{n}: {m}")


def on(model: Model, device: str) -> Model:
    m = copy.deepcopy(model)
    return m[0].to(device), m[1].to(device)


@pytest.mark.parametrize("cfg", DEFAULTS, ids=str)
def test_cuda_trains_like_the_cpu(cfg: OptimizerConfig) -> None:
    """float64, 6 steps: CUDA's atomics sum duplicates in another order, hence 1e-10, not bitwise."""
    cpu, dev = torch.device("cpu"), torch.device("cuda")
    base = build(torch.float64)
    m_cpu, m_dev = on(base, "cpu"), on(base, "cuda")
    o_cpu = cfg.make([*m_cpu[0].parameters(), *m_cpu[1].parameters()])
    o_dev = cfg.make([*m_dev[0].parameters(), *m_dev[1].parameters()])
    train(m_cpu, o_cpu, range(6), cpu, torch.float64)
    train(m_dev, o_dev, range(6), dev, torch.float64)
    assert all(p.is_cuda for p in m_dev[0].parameters())
    assert_same(tensors(m_cpu, o_cpu), tensors(m_dev, o_dev), 1e-10)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Every host–device sync raises (a read of a value, a data-dependent shape, a blocking copy)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("cfg", cases(SYNC_FREE), ids=str)
def test_a_steady_step_makes_no_host_device_sync(cfg: OptimizerConfig) -> None:
    """Host ids (padded bags with padding, stacked tables), every optimizer with EMA, accumulation,
    ``skip_nonfinite``, clipping and without dedup: the steps after the first three run under
    ``set_sync_debug_mode("error")``, and give the CPU's results (float64; CUDA's atomics sum duplicates in
    another order, hence 1e-10). (Tables this small take the reference path: the kernel's test is below.)"""
    cpu = train_host_ids(cfg, "cpu")
    dev = train_host_ids(cfg, "cuda", no_sync)
    torch.testing.assert_close(_on_host(dev), cpu, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cfg", [c for c in cases(SYNC_FREE) if c.id in ("lazy_adam-options", "rowwise_adagrad",
                                                                         "ftrl-ema", "adafactor", "adafactor-ema")],
                         ids=str)
def test_a_steady_kernel_step_makes_no_host_device_sync(cfg: OptimizerConfig,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """As above on the compiled update (``Path.KERNEL``: Triton, the sentinel tail copied after it) from the third
    step on: compiled there, outside the check, and run by the steady steps under it (counted: the test cannot
    pass on the reference path). Adafactor's: statistics per member of the stacked group, summed over lanes."""
    ran: list[str] = []
    call = row_update.call

    def counted(fn: Any, args: tuple[Any, ...]) -> Any:
        ran.append(args[0].device.type)
        return call(fn, args)

    monkeypatch.setattr(row_update, "call", counted)
    before, enabled = kernel_policy.set_policy(2, 0), kernel_policy.set_enabled(True)  # (the suite turns it off)
    try:
        dev = train_host_ids(cfg, "cuda", no_sync)
    finally:
        kernel_policy.set_policy(*before)
        kernel_policy.set_enabled(enabled)
    assert ran.count("cuda") >= 2, ran
    cpu = train_host_ids(cfg, "cpu")
    # (float64: the kernel's fused arithmetic against the CPU's reference path)
    torch.testing.assert_close(_on_host(dev), cpu, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("cfg", [c for c in cases(SYNC_FREE) if c.id in ("sgd", "lazy_adam")], ids=str)
def test_host_ids_joined_in_c_travel_pinned_as_int32(cfg: OptimizerConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel library on (as a user's run has it): each batch's host ids are joined by the C pass straight into
    pinned memory, int32, and moved as one tensor without their masks; the steady steps make no sync and give the
    CPU's results."""
    monkeypatch.setattr(kernel_policy, "_ENABLED", True)
    if join_library() is None:
        pytest.skip("no C compiler builds the library here")
    moved: list[tuple[torch.dtype, bool]] = []
    real = assembly.upload
    monkeypatch.setattr(assembly, "upload", lambda t, d: (moved.append((t.dtype, t.is_pinned())), real(t, d))[1])
    dev = train_host_ids(cfg, "cuda", no_sync)
    assert moved and set(moved) == {(torch.int32, True)}, moved
    cpu = train_host_ids(cfg, "cpu")
    torch.testing.assert_close(_on_host(dev), cpu, rtol=1e-10, atol=1e-10)


def _on_host(x: Any) -> Any:
    """``x`` (tensors in dicts, tuples and lists) with every tensor copied to the CPU."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _on_host(v) for k, v in x.items()}
    return type(x)(_on_host(v) for v in x) if isinstance(x, (tuple, list)) else x


@pytest.mark.parametrize("cfg", DEFAULTS, ids=str)
def test_a_gpu_checkpoint_resumes_on_the_cpu(cfg: OptimizerConfig) -> None:
    """3 steps on the GPU, state saved, loaded into a CPU model and optimizer: 3 more steps there equal
    3 more on the GPU (float64, 1e-10)."""
    cpu, dev = torch.device("cpu"), torch.device("cuda")
    m_dev = on(build(torch.float64), "cuda")
    o_dev = cfg.make([*m_dev[0].parameters(), *m_dev[1].parameters()])
    train(m_dev, o_dev, range(3), dev, torch.float64)
    buf = io.BytesIO()
    torch.save({"ec": m_dev[0].state_dict(), "head": m_dev[1].state_dict(), "opt": o_dev.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, map_location="cpu", weights_only=True)
    m_cpu = build(torch.float64)
    m_cpu[0].load_state_dict(saved["ec"])
    m_cpu[1].load_state_dict(saved["head"])
    o_cpu = cfg.make([*m_cpu[0].parameters(), *m_cpu[1].parameters()])
    o_cpu.load_state_dict(saved["opt"])
    train(m_cpu, o_cpu, range(3, 6), cpu, torch.float64)
    train(m_dev, o_dev, range(3, 6), dev, torch.float64)
    assert_same(tensors(m_cpu, o_cpu), tensors(m_dev, o_dev), 1e-10)
