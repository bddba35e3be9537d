"""The CUDA row writes of :mod:`torch_tpu_embedding.optim._kernels.triton_rows`, checked with no GPU under Triton's
interpreter (``TRITON_INTERPRET=1``, CPU tensors).

The interpreter is chosen when a kernel is defined (at import), so :func:`test_the_triton_interpreter_run_passes` runs
this file's ``interpreted`` tests in a process of their own with it set; they skip in the suite's own process. They
check each kernel against torch's op (``index_add_``, a masked ``index_copy_``) and, on the accelerator's static-shape
path forced on the CPU (as tests/optim/test_sync_free_step.py forces it), that a step whose writes go through the
kernels (counted) gives the CPU's results: SGD's additive update, and the compiled row update's masked copy.
tests/package/test_cuda.py runs the same steps on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from optim_registry import SYNC_FREE, OptimizerConfig, cases
from test_sync_free_step import _train

import torch_tpu_embedding as tte
from torch_tpu_embedding._rows import dedup
from torch_tpu_embedding.optim._kernels import kernel_policy, triton_rows

triton = triton_rows.triton

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED or not triton_rows.available(torch.device("cpu")),
                                 reason="runs under TRITON_INTERPRET=1 (test_the_triton_interpreter_run_passes)")


@pytest.mark.skipif(INTERPRETED, reason="the interpreted run itself")
def test_the_triton_interpreter_run_passes() -> None:
    if triton_rows.triton is None:
        pytest.skip("triton is not installed (torch's CUDA builds bring it; the CI's torch 2.9 environment has it)")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "interpreted"], capture_output=True, text=True, timeout=900, env=env, cwd=root)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " skipped" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
    assert f"{_INTERPRETED_TESTS} passed" in done.stdout.splitlines()[-1], done.stdout[-2000:]


# ------------------------------------------------------------------ the kernels against torch's ops
@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["gains", "no gains", "broadcast", "one value"])
@pytest.mark.parametrize("dim", [5, 300])
def test_interpreted_add_rows_is_index_add(dtype: torch.dtype, form: str, dim: int) -> None:
    """Duplicates, the sentinel (padding) and the table's last row among the ids; ``dim`` 300 spans two column
    blocks. The interpreter adds in the ids' order, as the CPU's ``index_add_`` does: bitwise."""
    g = torch.Generator().manual_seed(0)
    rows, width, bags = 10, 3, 7
    ids = torch.randint(0, rows + 1, (bags * width,), generator=g)
    ids[:3] = torch.tensor([rows - 1, rows, rows - 1])
    src = torch.randn(bags, dim, generator=g, dtype=dtype)
    if form == "broadcast":  # one gradient row for every bag (row stride 0)
        src = src[:1].expand(bags, dim)
    if form == "one value":  # loss = out.sum(): one number for every element (strides 0, 0)
        src = torch.tensor(0.7, dtype=dtype).expand(bags, dim)
    gains = torch.rand(bags * width, generator=g, dtype=dtype) if form == "gains" else None
    table = torch.randn(rows, dim, generator=g, dtype=dtype)
    want = table.clone()
    spread = src.repeat_interleave(width, 0)
    spread = spread if gains is None else gains[:, None] * spread
    real = ids < rows
    want.index_add_(0, ids[real], spread[real])
    assert triton_rows.add_rows(table, ids, src, gains, width)
    assert torch.equal(table, want)


@interpreted
@pytest.mark.parametrize("shape", [(12, 6), (12,), (12, 300)])
def test_interpreted_copy_rows_writes_the_real_ids_alone(shape: tuple[int, ...]) -> None:
    """Sorted distinct ids with a sentinel tail (``dedup_static``'s): the real rows written, the tail nothing."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(*shape, generator=g)
    ids = torch.tensor([0, 3, 11, 12, 12, 12])
    src = torch.randn(6, *shape[1:], generator=g)
    want = table.clone()
    want[ids[:3]] = src[:3]
    assert triton_rows.copy_rows(table, ids, src, 12)
    assert torch.equal(table, want)


def test_kernels_refuse_what_they_cannot_take() -> None:
    """Checked before a launch (no GPU or interpreter needed): the caller then writes through torch."""
    t = torch.zeros(4, 3, dtype=torch.float16)
    assert not triton_rows.accepts_add(t, torch.tensor([0]), torch.ones(1, 3), None, 1)  # a 16-bit table
    t32 = torch.zeros(4, 3)
    assert not triton_rows.accepts_add(t32, torch.tensor([0], dtype=torch.int32), torch.ones(1, 3), None, 1)
    assert not triton_rows.accepts_add(t32, torch.tensor([0, 1, 2]), torch.ones(1, 3), None, 2)  # 3 ids > 1 bag × 2
    assert not triton_rows.accepts_add(t32.t(), torch.tensor([0]), torch.ones(1, 4), None, 1)  # columns not unit
    assert triton_rows.accepts_add(t32, torch.tensor([0, 1]), torch.ones(1, 3), None, 2)
    assert not triton_rows.available(torch.device("meta"))


@pytest.mark.skipif(triton_rows.triton is None or INTERPRETED, reason="needs triton (compiled, not interpreted)")
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_the_kernels_compile_for_hopper(dtype: str) -> None:
    """Each kernel compiled to an H100 / H200 binary (sm_90) with no GPU: the interpreter runs what Triton's
    compiler may refuse (it reads the annotations, and globals)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    common = {"ids": "*i64", "n": "i64", "bound": "i64", "dst_stride": "i64", "src_stride": "i64",
              "dst": f"*{dtype}", "src": f"*{dtype}", "DIM": "constexpr", "BLOCK_R": "constexpr", "BLOCK_D": "constexpr"}
    for has_gains in (True, False):
        sig = {**common, "gains": f"*{dtype}", "width": "i64", "HAS_GAINS": "constexpr"}
        sig = {k: sig[k] for k in triton_rows._add_rows_kernel.arg_names}
        src = ASTSource(fn=triton_rows._add_rows_kernel, signature=sig,
                        constexprs={"DIM": 128, "HAS_GAINS": has_gains, "BLOCK_R": 16, "BLOCK_D": 128})
        assert "atom" in triton.compile(src, target=target).asm["ptx"]
    # Triton makes an integer argument of 1 a constant (bags of one id): that specialisation compiles too
    sig = {**common, "gains": f"*{dtype}", "width": "constexpr", "HAS_GAINS": "constexpr"}
    sig = {k: sig[k] for k in triton_rows._add_rows_kernel.arg_names}
    src = ASTSource(fn=triton_rows._add_rows_kernel, signature=sig,
                    constexprs={"DIM": 64, "width": 1, "HAS_GAINS": False, "BLOCK_R": 16, "BLOCK_D": 64})
    assert "atom" in triton.compile(src, target=target).asm["ptx"]
    # the copies: float rows, and EMA's int32 step counts (one column)
    for dst, src_t, dim in ((f"*{dtype}", f"*{dtype}", 300), ("*i32", "*i32", 1)):
        sig = {k: {**common, "dst": dst, "src": src_t}[k] for k in triton_rows._copy_rows_kernel.arg_names}
        src = ASTSource(fn=triton_rows._copy_rows_kernel, signature=sig,
                        constexprs={"DIM": dim, "BLOCK_R": 16, "BLOCK_D": max(16, min(256, dim))})
        assert triton.compile(src, target=target).asm["ptx"]


# ------------------------------------------------------------------ the step through the kernels
_STEP_CASES = [c for c in cases(SYNC_FREE) if c.id in ("sgd", "sgd-accum2-skip", "lazy_adam-options",
                                                        "rowwise_adagrad", "ftrl-ema", "adagrad", "adafactor",
                                                        "adafactor-ema")]


@interpreted
@pytest.mark.parametrize("cfg", _STEP_CASES, ids=str)
def test_interpreted_sync_free_step_through_triton_gives_the_cpu_results(cfg: OptimizerConfig,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Five steps on the CPU's own path, then on the accelerator's forced on the CPU with the compiled row update
    from the third call (``set_policy(2, 0)``): the kernels of this module write (counted), and the results are
    the CPU's (float64; the compiled update's arithmetic against the reference path's, hence 1e-12)."""
    want_w, want_s = _train(cfg)
    calls: list[str] = []
    for name in ("add_rows", "copy_rows"):
        real = getattr(triton_rows, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> bool:
            done: bool = _real(*args)
            calls.append(_name if done else f"{_name} refused")
            return done

        monkeypatch.setattr(triton_rows, name, counted)
    monkeypatch.setattr(dedup, "HOST_READ_DEVICE_TYPES", set())
    before, enabled = kernel_policy.set_policy(2, 0), kernel_policy.set_enabled(True)
    try:
        got_w, got_s = _train(cfg)
    finally:
        kernel_policy.set_policy(*before)
        kernel_policy.set_enabled(enabled)
    # SGD adds each id's increment; the other rules sum the factored rows (add_rows, where there is no loss scale
    # and no accumulation window: their rows are multiplied out first) and copy the updated rows; so does SGD
    # with skip_nonfinite, which needs the summed rows.
    expected = {"add_rows"} if cfg.id == "sgd" else {"copy_rows"} if "accum" in cfg.id \
        or cfg.kwargs.get("loss_scale_factor") else {"add_rows", "copy_rows"}
    assert set(calls) == expected, calls
    for k, v in want_w.items():
        torch.testing.assert_close(got_w[k], v, rtol=1e-12, atol=1e-14, msg=lambda m, k=k: f"{k}: {m}")
    for key, slots in want_s.items():
        for slot, v in slots.items():
            torch.testing.assert_close(got_s[key][slot], v, rtol=1e-12, atol=1e-14, msg=lambda m, s=slot: f"{s}: {m}")


@interpreted
def test_interpreted_a_compiled_step_traces_torch_ops_not_a_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.compile(opt.step, fullgraph=True)`` the accelerator's SGD step is traced (torch's ops, in the
    user's graph): no Triton launch inside the trace, which dynamo cannot take."""
    calls: list[int] = []
    add = triton_rows.add_rows

    def counted(*args: Any) -> bool:
        calls.append(1)
        done: bool = add(*args)
        return done

    monkeypatch.setattr(triton_rows, "add_rows", counted)
    monkeypatch.setattr(dedup, "HOST_READ_DEVICE_TYPES", set())
    torch.manual_seed(0)
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10, 3, name="t", combiner="sum"),
                                                         max_ids_per_bag=2)})
    opt = tte.optim.SGD(ec.parameters(), lr=0.1)
    step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ec({"f": tte.Padded(torch.randint(0, 10, (8, 2), generator=g))})["f"].sum().backward()
        step()
    assert not calls


@interpreted
@pytest.mark.parametrize("name", ["sgd", "adagrad-clipnorm"])
def test_interpreted_deterministic_mode_adds_through_torch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.use_deterministic_algorithms(True)`` no atomic add of this module runs (CUDA's ``index_add_``
    is deterministic then); the copies of distinct rows still do, and the results are the CPU's."""
    want = _edge_run(_EDGE_OPTIMIZERS[name], static=False)
    calls: list[str] = []
    for fn in ("add_rows", "copy_rows"):
        real = getattr(triton_rows, fn)

        def counted(*args: Any, _real: Any = real, _fn: str = fn) -> bool:
            calls.append(_fn)
            done: bool = _real(*args)
            return done

        monkeypatch.setattr(triton_rows, fn, counted)
    before, enabled = kernel_policy.set_policy(2, 0), kernel_policy.set_enabled(True)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = _edge_run(_EDGE_OPTIMIZERS[name], static=True)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        kernel_policy.set_policy(*before)
        kernel_policy.set_enabled(enabled)
    assert "add_rows" not in calls and ("copy_rows" in calls) == (name != "sgd"), calls
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=lambda msg, i=i: f"tensor {i}: {msg}")


# ------------------------------------------------------------------ bag edges: empty unit bags, a frozen member
def _edge_run(make: Any, static: bool) -> list[torch.Tensor]:
    """Six steps on a stacked group of three tables: ``u`` sum bags of one id (no per-id gain) with empty bags,
    ``m`` padded mean bags, ``z`` frozen (its ids become the sentinel) from the fourth step; ``static``: the
    accelerator's path forced on the CPU. Returns every weight and optimizer state tensor."""
    saved = set(dedup.HOST_READ_DEVICE_TYPES)
    if static:
        dedup.HOST_READ_DEVICE_TYPES.clear()
    try:
        torch.manual_seed(0)
        u = tte.TableConfig(10, 3, name="u", combiner="sum", dtype=torch.float64)
        m = tte.TableConfig(12, 3, name="m", combiner="mean", dtype=torch.float64)
        z = tte.TableConfig(8, 3, name="z", combiner="sum", dtype=torch.float64)
        ec = tte.EmbeddingCollection({"fu": tte.FeatureConfig(u), "fm": tte.FeatureConfig(m, max_ids_per_bag=3),
                                      "fz": tte.FeatureConfig(z, max_ids_per_bag=2)})
        assert len(list(ec.parameters())) == 1  # one stacked group
        opt = make(ec.parameters())
        head = torch.linspace(-3.0, 5.0, 8 * 9, dtype=torch.float64).view(8, 9)
        g = torch.Generator().manual_seed(1)
        for step in range(6):
            if step == 3:
                ec.tables.z.requires_grad_(False)
            batch = {"fu": tte.Padded(torch.randint(0, 10, (8, 1), generator=g), torch.rand(8, 1, generator=g) > 0.5),
                     "fm": tte.Padded(torch.randint(0, 12, (8, 3), generator=g), torch.rand(8, 3, generator=g) > 0.3),
                     "fz": tte.Padded(torch.randint(0, 8, (8, 2), generator=g))}
            (ec(batch, concat=True) * head).sum().backward()
            opt.step()
            opt.zero_grad()
        return [*(p.detach().clone() for p in ec.parameters()),
                *(v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))]
    finally:
        dedup.HOST_READ_DEVICE_TYPES.clear()
        dedup.HOST_READ_DEVICE_TYPES.update(saved)


_EDGE_OPTIMIZERS = {
    "sgd": lambda ps: tte.optim.SGD(ps, lr=0.1),
    "adagrad-clipnorm": lambda ps: tte.optim.Adagrad(ps, lr=0.1, clipnorm=1.0),
    "lazyadam-global_clipnorm": lambda ps: tte.optim.LazyAdam(ps, lr=0.1, global_clipnorm=1.0),
    "rowwise_adagrad": lambda ps: tte.optim.RowWiseAdagrad(ps, lr=0.1),
}


@interpreted
@pytest.mark.parametrize("refuse", [False, True], ids=["triton copies", "torch copies"])
@pytest.mark.parametrize("name", list(_EDGE_OPTIMIZERS))
def test_interpreted_bag_edges_through_triton_give_the_cpu_results(name: str, refuse: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty unit bags and a frozen member add nothing to the duplicate sum (whose norms ``clipnorm`` and
    ``global_clipnorm`` take over every row); with the weight's copy refused by the kernel, torch copies it with
    the sink row's values. The CPU's results within 1e-12 (float64; norms summed in another order)."""
    want = _edge_run(_EDGE_OPTIMIZERS[name], static=False)
    calls: list[str] = []
    copy = triton_rows.copy_rows

    def copy_or_refuse(dst: torch.Tensor, ids: torch.Tensor, src: torch.Tensor, bound: int) -> bool:
        if refuse:
            calls.append("refused")
            return False
        calls.append("copy_rows")
        return copy(dst, ids, src, bound)

    add = triton_rows.add_rows

    def counted_add(*args: Any) -> bool:
        calls.append("add_rows")
        done: bool = add(*args)
        return done

    monkeypatch.setattr(triton_rows, "copy_rows", copy_or_refuse)
    monkeypatch.setattr(triton_rows, "add_rows", counted_add)
    before, enabled = kernel_policy.set_policy(2, 0), kernel_policy.set_enabled(True)
    try:
        got = _edge_run(_EDGE_OPTIMIZERS[name], static=True)
    finally:
        kernel_policy.set_policy(*before)
        kernel_policy.set_enabled(enabled)
    assert "add_rows" in calls, calls
    if name != "sgd":
        assert ("refused" if refuse else "copy_rows") in calls and ("copy_rows" if refuse else "refused") not in calls, \
            calls
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=lambda msg, i=i: f"tensor {i}: {msg}")


# ------------------------------------------------------------------ a launch that fails
class _Raising:
    """A kernel whose launches raise, as Triton's do for a kernel it cannot compile for the GPU or toolchain."""

    def __init__(self, after: int = 0, real: Any = None) -> None:
        self.after, self.real, self.calls = after, real, 0

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **meta: Any) -> None:
            self.calls += 1
            if self.calls > self.after:
                raise RuntimeError("PTXAS error: Internal Triton PTX codegen error (a stand-in)")
            self.real[grid](*args, **meta)
        return launch


@interpreted
@pytest.mark.parametrize("kernel", ["_add_rows_kernel", "_copy_rows_kernel"])
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
def test_interpreted_a_failed_launch_falls_back_to_torch(kernel: str, name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The first launch of a kernel raises: one RuntimeWarning, nothing written by it, the step's rows written by
    torch's ops from then on (no other launch), and the CPU's results."""
    want = _edge_run(_EDGE_OPTIMIZERS[name], static=False)
    fake = _Raising()
    monkeypatch.setattr(triton_rows, kernel, fake)
    monkeypatch.setattr(triton_rows, "_FAILED", [])
    before, enabled = kernel_policy.set_policy(2, 0), kernel_policy.set_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _edge_run(_EDGE_OPTIMIZERS[name], static=True)
    finally:
        kernel_policy.set_policy(*before)
        kernel_policy.set_enabled(enabled)
    used = kernel == "_add_rows_kernel" or name != "sgd"  # (SGD's step copies no rows)
    assert fake.calls == (1 if used else 0)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "Triton" in str(w.message)]
    assert len(said) == (1 if used else 0), said
    assert all("failed to compile or launch (RuntimeError: PTXAS error" in m and "TTE_TRITON=0" in m for m in said)
    assert bool(triton_rows._FAILED) == used and not triton_rows.available(torch.device("cpu")) == used
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=lambda msg, i=i: f"tensor {i}: {msg}")


@interpreted
def test_interpreted_a_launch_failing_after_some_pieces_adds_the_rest_through_torch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``add_pieces`` over three pieces whose second launch raises: the first piece added by the kernel, the rest
    by torch's ops, as ``index_add_`` of every real id (bitwise: one product and one add each, in order)."""
    g = torch.Generator().manual_seed(3)
    rows, dim = 9, 5
    table = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    pieces = []
    for width in (1, 2, 3):
        bags = 4
        ids = torch.randint(0, rows + 1, (bags * width,), generator=g)
        pieces.append((ids, torch.randn(bags * width, dim, generator=g, dtype=torch.float64)))
    want = table.clone()
    for ids, r in pieces:
        real = ids < rows
        want.index_add_(0, ids[real], r[real])
    monkeypatch.setattr(triton_rows, "_add_rows_kernel", _Raising(after=1, real=triton_rows._add_rows_kernel))
    monkeypatch.setattr(triton_rows, "_FAILED", [])
    with pytest.warns(RuntimeWarning, match="failed to compile or launch"):
        assert triton_rows.add_pieces(table, pieces, lambda t: t)
    assert torch.equal(table, want)
    assert not triton_rows.add_pieces(table, pieces, lambda t: t)  # off now: the caller adds through torch
    assert torch.equal(table, want)


_INTERPRETED_TESTS = 2 * 4 * 2 + 3 + len(_STEP_CASES) + 1 + 2 + 2 * len(_EDGE_OPTIMIZERS) + 4 + 1


def test_rows_view_of_slots_of_every_rank() -> None:
    """A slot as ``[rows, columns]``: 1-D as one column, >2-D flattened where that is a view (a copy would not be
    written back), an empty one included (no row to look at)."""
    assert triton_rows._rows_view(torch.zeros(4)).shape == (4, 1)
    assert triton_rows._rows_view(torch.zeros(4, 2, 3)).shape == (4, 6)
    assert triton_rows._rows_view(torch.zeros(0, 2, 3)).shape == (0, 6)
    assert triton_rows._rows_view(torch.zeros(4, 3, 2).transpose(1, 2)) is None
