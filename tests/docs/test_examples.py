"""The examples run and learn (short mode)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_quickstart_learns() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "60"],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", out.stdout)]
    assert len(losses) >= 2 and losses[-1] < 0.5 * losses[0], out.stdout


def test_every_example_prints_its_help() -> None:
    """Each example imports (its import paths hold on the torch it runs on) and its --help formats."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for script in sorted((ROOT / "examples").glob("*.py")):
        out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0 and out.stdout.startswith("usage:"), f"{script.name}: {out.stderr[-2000:]}"
