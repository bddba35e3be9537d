"""examples/movielens.py: learns in --short mode on XLA:CPU and on the CPU, resumes exactly, and its AUC
equals a brute-force pairwise count. The data tests skip when recbole's ml-100k files are not installed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "examples" / "movielens.py"
FINAL = re.compile(r"^test AUC ([\d.]+)  log loss ([\d.]+)  \(best epoch (\d+)\)$", re.MULTILINE)
# --short (half the training split, 3 epochs) measured 0.756 test AUC; chance is 0.5 and a constant
# prediction's log loss is 0.688 (55% of the ratings are >= 4).
MIN_SHORT_AUC = 0.72


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("movielens_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


movielens = _load_example()


@pytest.fixture(scope="module")
def data() -> None:
    try:
        movielens.data_dir()
    except SystemExit as e:
        pytest.skip(str(e))


def _run(tmp_path: Path, *args: str) -> str:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.pop("XLA_USE_SPMD", None)
    env.pop("CPU_NUM_DEVICES", None)
    out = subprocess.run([sys.executable, str(SCRIPT), "--no-progress", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _final(stdout: str) -> tuple[float, float, int]:
    m = FINAL.findall(stdout)
    assert len(m) == 1 and stdout.rstrip().endswith(FINAL.search(stdout).group(0)), stdout  # type: ignore[union-attr]
    auc, loss, epoch = m[0]
    return float(auc), float(loss), int(epoch)


def _epochs(stdout: str) -> list[int]:
    return [int(e) for e in re.findall(r"^\[torch_tpu_embedding\] epoch +(\d+) ", stdout, re.MULTILINE)]


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


def test_short_xla_learns_with_constant_compiles(data: None, tmp_path: Path) -> None:
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed")
    out = _run(tmp_path, "--short")  # the default device: XLA (XLA:CPU here)
    auc, loss, _ = _final(out)
    assert auc > MIN_SHORT_AUC and loss < 0.63, out
    assert "device xla:0" in out and _epochs(out) == [1, 2, 3], out
    # One training graph and one evaluation graph for our model, whatever the number of steps.
    m = re.search(r"XLA compilations: (\d+) in all \(training \+ evaluation of ours: (\d+)\)", out)
    assert m is not None and int(m.group(2)) <= 3, out
    _assert_png(tmp_path / "movielens_curve.png")  # the default --plot, in the working directory


def test_short_cpu_with_twin_and_exact_resume(data: None, tmp_path: Path) -> None:
    full = _run(tmp_path, "--short", "--device", "cpu", "--compare-torch", "--plot", "full.png")
    auc, loss, _ = _final(full)
    assert auc > MIN_SHORT_AUC and loss < 0.63, full
    assert re.search(r"^twin \(nn\.Embedding \+ torch\.optim\.Adam\) +0\.\d{4} +0\.\d{4}", full, re.MULTILINE), full
    _assert_png(tmp_path / "full.png")

    first = _run(tmp_path, "--short", "--device", "cpu", "--epochs", "1", "--save", "ckpt.pt", "--plot", "a.png")
    assert _epochs(first) == [1] and (tmp_path / "ckpt.pt").is_file(), first
    resumed = _run(tmp_path, "--short", "--device", "cpu", "--resume", "ckpt.pt", "--plot", "b.png")
    assert "continuing from epoch 2" in resumed and _epochs(resumed) == [2, 3], resumed
    # Weights, optimizer slots, history and the per-epoch shuffle all come back: the same numbers.
    assert _final(resumed) == _final(full), (full, resumed)
    later = r"\[torch_tpu_embedding\] epoch  [23]  (train loss \S+  valid AUC \S+  valid log loss \S+)"
    assert re.findall(later, resumed) == re.findall(later, full) != [], (full, resumed)
    _assert_png(tmp_path / "b.png")


@pytest.mark.parametrize("n,levels", [(7, 2), (50, 3), (400, 10), (1000, None)], ids=lambda v: str(v))
def test_auc_equals_pairwise_count_with_ties(n: int, levels: int | None) -> None:
    rng = np.random.default_rng(n)
    labels = rng.integers(0, 2, n)
    labels[:2] = [0, 1]  # both classes
    scores = rng.normal(size=n) if levels is None else rng.integers(0, levels, n).astype(np.float32)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    assert movielens.auc(labels, scores) == pytest.approx(pairs.mean(), abs=1e-12)


def test_auc_edges_and_log_loss() -> None:
    y = np.array([0, 0, 1, 1])
    assert movielens.auc(y, np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert movielens.auc(y, np.array([0.4, 0.3, 0.2, 0.1])) == 0.0
    assert movielens.auc(y, np.zeros(4)) == 0.5
    assert np.isnan(movielens.auc(np.ones(4), np.arange(4.0)))
    z = np.array([-12.0, -0.5, 0.0, 2.0, 12.0])
    t = np.array([0.0, 1.0, 1.0, 0.0, 1.0])
    p = 1.0 / (1.0 + np.exp(-z))
    expected = -np.mean(t * np.log(p) + (1 - t) * np.log1p(-p))
    assert movielens.log_loss(t, z) == pytest.approx(expected, rel=1e-9)
    # Saturated logits stay finite: -log(1 - sigmoid(40)) = 40 + log1p(exp(-40)).
    assert movielens.log_loss(np.array([1.0, 0.0]), np.array([40.0, 40.0])) == pytest.approx(20.0, rel=1e-12)


def test_missing_recbole_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(SystemExit, match=re.escape("pip install --no-deps recbole==1.2.1")):
        movielens.data_dir()
