"""The package on torch 2.9 and on torch 2.13 (scripts/test.sh runs this file in both environments).

What differs between the two and how the package keeps one behaviour: the default table initializer
(torch 2.13's ``trunc_normal_`` draws by rejection, through full-size temporaries, and other values
from the same seed), the kernel update's sparse matrix (torch 2.13 warns when its invariant check is
left unset), and the second pinned environment itself (.ci/requirements-torch213.txt, built by
``scripts/env.sh torch213``: torch's CPU build only).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

import torch_tpu_embedding as tte

ROOT = Path(__file__).resolve().parents[2]
TORCH = Version(torch.__version__.split("+")[0])

# tte.default_initializer after torch.manual_seed(0) on a [2, 4] table (std 1/2, cut at ±1), recorded
# on torch 2.9.0, where it equals torch.nn.init.trunc_normal_ draw for draw.
_DRAW_64 = [[0.8160247291867254, 0.2598505009099082, -0.0486664309475528, 0.6453713784790055],
            [0.17712667083666522, 0.3825610614286257, -0.43302808628376377, -0.1820625907711769]]
_DRAW_32 = [[-0.004478256218135357, 0.34677475690841675, -0.6207736134529114, -0.5208547711372375],
            [-0.23919667303562164, 0.16325147449970245, -0.011852243915200233, 0.5835286974906921]]


# ------------------------------------------------------------------ the default initializer
@pytest.mark.parametrize(("dtype", "expected"), [(torch.float64, _DRAW_64), (torch.float32, _DRAW_32)])
def test_a_seed_draws_the_same_table_on_every_torch_version(dtype: torch.dtype, expected: list[list[float]]) -> None:
    torch.manual_seed(0)
    w = torch.empty(2, 4, dtype=dtype)
    tte.default_initializer(w)
    assert torch.equal(w, torch.tensor(expected, dtype=dtype))
    torch.manual_seed(0)  # and a table built from its config draws the same
    ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(2, 4, name="t", dtype=dtype))})
    assert torch.equal(ec.tables.t.weight.detach(), w)


@pytest.mark.skipif(TORCH >= Version("2.10"), reason=(
    f"torch {torch.__version__}'s trunc_normal_ draws by rejection (other values from the same seed); "
    "the recorded torch 2.9 draw above is the comparison there"))
def test_on_torch_2_9_the_draw_is_torch_trunc_normal() -> None:
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        torch.manual_seed(3)
        ours = tte.default_initializer(torch.empty(50, 16, dtype=dtype))
        torch.manual_seed(3)
        theirs = torch.nn.init.trunc_normal_(torch.empty(50, 16, dtype=dtype), 0.0, 0.25, -0.5, 0.5)
        assert torch.equal(ours, theirs), dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_draw_is_in_place_cut_at_two_std_with_the_truncated_spread(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    w = torch.empty(4096, 64, dtype=dtype)
    ptr = w.data_ptr()
    out = tte.default_initializer(w)
    assert out is w and w.data_ptr() == ptr
    std = 1 / math.sqrt(64)
    x = w.double()
    assert float(x.abs().max()) <= 2 * std
    # a normal cut at ±2σ: mean 0, std 0.8796σ (4096·64 draws: both well inside 2% of σ)
    assert abs(float(x.mean())) < 0.02 * std
    assert abs(float(x.std()) - 0.8796 * std) < 0.02 * std


# ------------------------------------------------------------------ the kernel update's duplicate sum
_ROW_SUMS = r"""
import warnings
import torch
import torch_tpu_embedding as tte
from torch_tpu_embedding.optim._kernels.row_sums import row_sums

ec = tte.EmbeddingCollection({"f": tte.FeatureConfig(tte.TableConfig(10, 4, name="t"), max_ids_per_bag=3)})
ec.tables.t.row_grad.keep_factored = True  # as the kernel path asks: the bags' rows kept factored
bags = tte.Padded(torch.tensor([[1, 2, 2], [3, 1, 0]]))  # padded bags: their rows kept factored (BagRows)
(ec({"f": bags})["f"] * torch.arange(8.0).view(2, 4)).sum().backward()
table = ec.tables.t
ids, rows = table.row_grad.collect()
want = torch.zeros(11, 4).index_add_(0, ids, rows)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sums = row_sums(table.row_grad, table.weight)
    assert sums is not None, "3 ids per bag summed by row_sums"
    got = sums.rows()
assert sums.ids.tolist() == [0, 1, 2, 3] and torch.equal(got, want[:4]), (sums.ids, got, want)
print([str(w.message) for w in caught])
"""


def test_the_kernel_duplicate_sum_is_bitwise_index_add_and_warns_nothing() -> None:
    # Its own process: torch warns once per process, so another test's call would hide a warning.
    out = subprocess.run([sys.executable, "-c", _ROW_SUMS], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------ the torch 2.13 environment
def _lock() -> list[Requirement]:
    lines = (ROOT / ".ci/requirements-torch213.txt").read_text().splitlines()
    return [Requirement(s) for s in lines if s.strip() and not s.startswith("#")]


def test_the_torch_2_13_environment_is_an_exact_cpu_only_lock() -> None:
    reqs = _lock()
    for r in reqs:  # one exact version each: installed with --no-deps, nothing else can come in
        assert [s.operator for s in r.specifier] == ["=="], str(r)
    names = {r.name.lower().replace("_", "-") for r in reqs}
    assert not {n for n in names if n.startswith("nvidia") or n == "torch-xla"}
    (torch_pin,) = [r for r in reqs if r.name == "torch"]
    version = Version(next(iter(torch_pin.specifier)).version)
    assert version.local == "cpu"  # PyPI's torch 2.13.0 is the CUDA build; "+cpu" matches only the CPU one
    assert (version.major, version.minor) == (2, 13)


def test_setup_py_admits_both_tested_torch_versions() -> None:
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    install = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))
    (torch_req,) = [Requirement(s) for s in install if Requirement(s).name == "torch"]
    (pin_213,) = [next(iter(r.specifier)).version for r in _lock() if r.name == "torch"]
    assert torch_req.specifier.contains("2.9.0") and torch_req.specifier.contains(pin_213)
    assert not torch_req.specifier.contains("2.8.0")


def _load_check_torch_cpu() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("check_torch_cpu", ROOT / "scripts/check_torch_cpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cpu_only_check_names_a_cuda_torch_and_nvidia_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _load_check_torch_cpu()
    dist = types.SimpleNamespace(metadata={"Name": "nvidia-cublas-cu12"})
    monkeypatch.setattr(mod.torch.version, "cuda", "12.8")
    monkeypatch.setattr(mod.md, "distributions", lambda: [dist])
    found = mod.problems()
    assert any("built with CUDA 12.8" in p for p in found) and any("nvidia-cublas-cu12" in p for p in found)
    monkeypatch.setattr(mod.torch.version, "cuda", None)
    monkeypatch.setattr(mod.md, "distributions", lambda: [types.SimpleNamespace(metadata={"Name": "numpy"})])
    assert mod.problems() == []


def _clone(tmp_path: Path) -> Path:
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    (clone / ".ci").mkdir()
    for rel in ("scripts/env.sh", ".ci/requirements.txt", ".ci/requirements-nodeps.txt",
                ".ci/requirements-torch213.txt"):
        (clone / rel).write_bytes((ROOT / rel).read_bytes())
    return clone


def _fake_python3(bin_dir: Path, log: Path, fail_on: str = "") -> None:
    """A stand-in ``python3`` whose ``-m venv DIR`` makes a stand-in ``DIR/bin/python`` that records
    its arguments (and the requirement files it is given) instead of installing; it fails on an
    argument containing ``fail_on``."""
    bin_dir.mkdir(parents=True)
    inner = (f'#!/bin/sh\necho "$@" >> {log}\n'
             f'for a in "$@"; do case "$a" in /dev/fd/*) cat "$a" >> {log}.req;; esac; done\n')
    if fail_on:
        inner += f'case "$*" in *{fail_on}*) exit 1;; esac\n'
    (bin_dir / "inner").write_text(inner)
    (bin_dir / "python3").write_text(
        f'#!/bin/sh\n[ "$1 $2" = "-m venv" ] || exit 3\nmkdir -p "$3/bin"\n'
        f'cp {bin_dir / "inner"} "$3/bin/python"\nchmod +x "$3/bin/python"\n')
    (bin_dir / "python3").chmod(0o755)


def test_env_sh_builds_the_torch_2_13_environment_from_its_lock_once(tmp_path: Path) -> None:
    clone, log = _clone(tmp_path), tmp_path / "pip.log"
    (clone / ".venv" / "bin").mkdir(parents=True)  # the README venv holds torch 2.9: never used for 2.13
    _fake_python3(tmp_path / "bin", log)
    env = {**os.environ, "TTE_ENV_CACHE": str(tmp_path / "cache"), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    key = hashlib.sha256((ROOT / ".ci/requirements-torch213.txt").read_bytes()).hexdigest()[:16]
    for _ in range(2):  # the second run finds the built environment and installs nothing
        out = subprocess.run(["bash", "scripts/env.sh", "torch213"], cwd=clone, env=env,
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == str(tmp_path / "cache" / f"venv-torch213-py3-{key}")
    calls = [c.split() for c in log.read_text().splitlines()]
    assert calls[0] == ["-m", "pip", "install", "-q", "--upgrade", "pip"]
    assert calls[1][:6] == ["-m", "pip", "install", "-q", "--no-deps", "--only-binary"] and calls[1][-2] == "-r"
    assert calls[2] == ["-m", "pip", "install", "-q", "--no-deps", "--only-binary", ":all:", "--extra-index-url",
                        "https://download.pytorch.org/whl/cpu", "torch==2.13.0+cpu"]
    assert calls[3:] == [["-m", "pip", "check"], ["scripts/check_torch_cpu.py"]]
    given = [s for s in (tmp_path / "pip.log.req").read_text().splitlines() if s and not s.startswith("#")]
    assert sorted(given) == sorted(str(r) for r in _lock() if r.name != "torch")


def test_env_sh_keeps_no_torch_2_13_environment_that_fails_the_cpu_check(tmp_path: Path) -> None:
    clone, log = _clone(tmp_path), tmp_path / "pip.log"
    _fake_python3(tmp_path / "bin", log, fail_on="check_torch_cpu")
    env = {**os.environ, "TTE_ENV_CACHE": str(tmp_path / "cache"), "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "scripts/env.sh", "torch213"], cwd=clone, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and out.stdout == ""
    assert list((tmp_path / "cache").glob("*/.complete")) == []


def test_env_sh_names_an_unknown_environment(tmp_path: Path) -> None:
    out = subprocess.run(["bash", "scripts/env.sh", "torch3"], cwd=_clone(tmp_path), capture_output=True, text=True)
    assert out.returncode == 2
    assert "must be torch29 or torch213, got 'torch3'" in out.stderr
