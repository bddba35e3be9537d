"""README.md's exact MovieLens figures are what ``examples/movielens.py`` prints (issue 29, item 8).

The README shows the last lines of a default run (random split, XLA, XLA:CPU here): valid AUC, test
AUC, log loss, best epoch and our model's compile count. This test runs that command and fails when
any printed figure differs from the README's (the training time is the machine's and is not
compared). The run takes minutes (about 2 on the project's 2-core machine under load). It skips,
as tests/docs/test_movielens_example.py does, without recbole's ml-100k files or torch_xla.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "examples" / "movielens.py"
#: our model's row of the result table: valid AUC, test AUC, log loss, best epoch, time, compiles
ROW = re.compile(r"^ours \(Adagrad \+ FTRL \+ Adam\) +(\d\.\d{4}) +(\d\.\d{4}) +(\d\.\d{4}) +(\d+) +[\d.]+s +(\d+)$",
                 re.MULTILINE)
FINAL = re.compile(r"^test AUC (\d\.\d{4})  log loss (\d\.\d{4})  \(best epoch (\d+)\)$", re.MULTILINE)


def readme_figures() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The README's table row and last line of the default run (as printed strings)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rows, finals = ROW.findall(text), FINAL.findall(text)
    assert len(rows) == 1 and len(finals) == 1, "README.md must show one default MovieLens run"
    return rows[0], finals[0]


def test_readme_figures_agree_with_each_other() -> None:
    """The table row and the last line of the README's run state the same test AUC, log loss, epoch."""
    row, final = readme_figures()
    assert (row[1], row[2], row[3]) == final


def test_readme_figures_are_what_the_example_prints(tmp_path: Path) -> None:
    if importlib.util.find_spec("torch_xla") is None:
        pytest.skip("torch_xla is not installed")
    spec = importlib.util.spec_from_file_location("movielens_readme_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    try:
        module.data_dir()
    except SystemExit as e:
        pytest.skip(str(e))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The README's command as a user runs it: none of the suite's settings (tests/conftest.py)
    for name in ("XLA_USE_SPMD", "CPU_NUM_DEVICES", "TTE_UPDATE_KERNEL", "MKL_CBWR"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, str(SCRIPT), "--no-progress"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout + out.stderr
    printed_rows, printed_finals = ROW.findall(out.stdout), FINAL.findall(out.stdout)
    assert len(printed_rows) == 1 and len(printed_finals) == 1, out.stdout
    row, final = readme_figures()
    names = ("valid AUC", "test AUC", "log loss", "best epoch", "compiles")
    assert dict(zip(names, printed_rows[0], strict=True)) == dict(zip(names, row, strict=True)), out.stdout
    assert printed_finals[0] == final, out.stdout
