"""Writes this folder's fixture: a torch_xla SPMD checkpoint on 4 devices (``ckpt/``,
``tte.checkpoint.save_distributed`` after 5 steps of tests/_mp_worker.py's model in float64 with
RowWiseAdagrad: one slot of one value per row keeps the fixture small, about 320 KB) and ``expected.pt`` (``tte.checkpoint.save`` of the uninterrupted run
after 10 steps). tests/distributed/test_mp_from_spmd.py loads the checkpoint into 3 gloo processes (on torch 2.9 and
on torch 2.13) and checks that 5 more steps give ``expected.pt``.

Run on torch 2.9 with torch_xla 2.9 (``V=$(bash scripts/env.sh)``), from the repository root:
``PYTHONPATH=. $V/bin/python tests/data/mp_spmd4/make.py``.
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
#: the optimizer configuration of tests/_mp_worker.py
OPTIMIZER = "rowwise_adagrad"

if __name__ == "__main__":
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    script = ROOT / "tests" / "xla_spmd" / "_mp_interop_script.py"
    subprocess.run([sys.executable, str(script), "save", str(HERE), OPTIMIZER], env=env, check=True)
