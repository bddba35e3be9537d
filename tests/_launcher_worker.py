"""One rank of tests/distributed/test_rank_launcher.py (``suite_helpers.run_ranks``'s own checks).

Run as ``python tests/_launcher_worker.py MODE OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set. ``record``: joins a gloo group and writes ``OUT_DIR/rank<r>.json``, what the rank found at its
start (torch and the package imported already, a process group, its pid, environment and threads) and the group's
sum of the ranks; ``fail``: rank 1 prints a line and raises, rank 0 prints a line and leaves by ``os._exit``;
``hang``: rank 1 writes its pid and sleeps. :func:`rank`: ``record`` as a function of ``suite_helpers.start_ranks``.
"""

from __future__ import annotations

import sys

# (first: what this process imported before this module ran)
TORCH_BEFORE, PACKAGE_BEFORE = "torch" in sys.modules, "torch_tpu_embedding" in sys.modules

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def rank(rank: int, world: int, port: int, out: str, fail: bool) -> None:
    """``record`` as one rank of ``suite_helpers.start_ranks`` (rank 1 raises where ``fail``)."""
    if fail and rank == 1:
        raise ValueError("rank 1 of start_ranks fails on purpose")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _record(rank, world, Path(out))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "fail":
        print(f"rank {rank} before its end", flush=False)
        if rank == 1:
            raise ValueError("rank 1 fails on purpose")
        os._exit(3)
    if mode == "hang":
        if rank == 1:
            (out / "pid1").write_text(str(os.getpid()), encoding="utf-8")
            print("rank 1 sleeps", flush=False)
            time.sleep(600)
        return
    _record(rank, world, out)


def _record(rank: int, world: int, out: Path) -> None:
    record = {"torch_before": TORCH_BEFORE, "package_before": PACKAGE_BEFORE, "group_before": dist.is_initialized(),
              "pid": os.getpid(),
              "threads": torch.get_num_threads(), "argv": sys.argv, "main": __name__,
              "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "TTE_LAUNCHER_PROBE")}}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    total = torch.tensor([rank])
    dist.all_reduce(total)
    record["sum"] = int(total)
    (out / f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
