"""Fail unless this interpreter's torch is a CPU build and no nvidia-* distribution is installed.

scripts/env.sh runs it after building the torch 2.13 environment (.ci/requirements-torch213.txt): that
environment must never hold the multi-GB CUDA build of torch or the nvidia-* wheels it pulls, whatever
an index offers. Usage: python scripts/check_torch_cpu.py
"""

from __future__ import annotations

import importlib.metadata as md
import sys

import torch


def problems() -> list[str]:
    """What makes this environment other than CPU-only (empty when it is)."""
    found = []
    if torch.version.cuda is not None:
        found.append(f"torch {torch.__version__} is built with CUDA {torch.version.cuda}")
    nvidia = sorted({str(d.metadata["Name"]) for d in md.distributions()
                     if str(d.metadata["Name"]).lower().startswith("nvidia")})
    if nvidia:
        found.append(f"nvidia packages are installed: {', '.join(nvidia)}")
    return found


if __name__ == "__main__":
    bad = problems()
    if bad:
        sys.exit("this environment must hold torch's CPU build only: " + "; ".join(bad))
    print(f"torch {torch.__version__}: CPU build, no nvidia packages")
