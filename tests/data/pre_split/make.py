"""Writes the checkpoints in this folder with the code of commit a4a4da5 (before the optimizer core was
split into modules). ``tests/checkpoint/test_pre_split_checkpoints.py`` loads them with today's code and checks that
the loaded state is bitwise the saved one and that training on gives bitwise the results recorded here.

Run from the repository root (only to regenerate, which would no longer test the old code):
``python tests/data/pre_split/make.py``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/data: for `configs`
from pre_split.configs import CONFIGS, build, train  # noqa: E402

import torch_tpu_embedding as tte  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    for name in CONFIGS:
        model, opt = build(name)
        train(model, opt, 0, 5)
        tte.checkpoint.save(os.path.join(HERE, f"{name}.pt"), model=model, optimizer=opt, extra={"config": name})
        if name == "adam-dcp":
            tte.checkpoint.save_distributed(os.path.join(HERE, f"{name}.dcp"), model=model, optimizer=opt)
        train(model, opt, 5, 3)
        after: dict[str, Any] = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        torch.save(after, os.path.join(HERE, f"{name}.after.pt"))
        print(name, "written")


if __name__ == "__main__":
    main()
