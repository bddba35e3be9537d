"""The guide's torchrun scripts (docs/guide.md sections 14 and 15) run as a reader copies them, on 2 processes.

Each section's ```python blocks, as they stand and nothing else (a reader copies only them: no setup
section, no harness), are written to one file and run with ``python -m torch.distributed.run
--nproc_per_node=2`` (torchrun) under a timeout: the script must finish on both processes (before: section
15 overrode torchrun's MASTER_PORT and hung, each process saved to its own temporary directory; section 14
needed sections 1, 4 and 5 pasted in first). tests/docs/test_docs_snippets.py runs the same blocks alone,
as one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_docs_snippets as S
from suite_helpers import free_port

#: seconds a script may take on 2 processes of a loaded machine; a hang ends here, as a failure
HANG = 400


@pytest.mark.parametrize("section", [14, 15], ids=["section-14", "section-15"])
def test_guide_torchrun_script_runs_on_2_processes(section: int, tmp_path: Path) -> None:
    blocks = [b for b in S.sections(S.GUIDE)[section] if b.marker is None]
    assert blocks, section
    script = tmp_path / f"section{section}.py"
    script.write_text("\n".join(b.code for b in blocks), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(S.ROOT)])),
               OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(script)]
    try:
        out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=HANG)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"section {section} under torchrun hung (still running after {HANG} s)\n"
                    f"{(e.stdout or b'')[-3000:]!r}\n{(e.stderr or b'')[-3000:]!r}", pytrace=False)
    assert out.returncode == 0, f"section {section} under torchrun exited {out.returncode}\n{out.stderr[-6000:]}"
    assert not [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("tmp")], (
        "the script left its temporary directory behind")
