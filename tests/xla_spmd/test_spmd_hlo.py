"""The optimized HLO of a training step on a row-sharded table (the id exchange): its collectives are three
all-to-alls (ids out, rows back, gradient rows out) plus small all-reduces (scalars, the dense head's
gradient), their sizes do not change with the device count at a fixed per-device batch, memory does not grow
with the vocabulary, no table is copied; one compilation; sharding kept.

The runs are subprocesses (XLA_FLAGS must be set before torch_xla starts) of _spmd_step_script.py, one per device
count; collectives are read with torch_tpu_embedding.xla.hlo, which counts tuple-form (multi-operand) collectives too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla")

from torch_tpu_embedding.xla.hlo import collectives, large_copies  # noqa: E402

SCRIPT = Path(__file__).with_name("_spmd_step_script.py")
ROOT = Path(__file__).parents[2]
D = 8
SMALL = 64 * 8  # bytes: every all-reduce of the step is at most this (scalars, the head's D + 1 gradient)


def runs(dump: Path, devices: int, *specs: tuple[int, str, int]) -> list[dict]:
    """One child process (XLA_FLAGS must be set before torch_xla starts) on ``devices`` devices: per ``(v, opt,
    slots)`` 20 steps of its own model; its step graph is the largest dump that run's steps added."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices),
           "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("XLA_USE_SPMD", None)  # set by use_spmd() in this process; the child calls use_spmd() itself
    args = [str(a) for v, opt, slots in specs for a in (v, opt, 20, slots)]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, check=True, capture_output=True,
                         text=True, timeout=600)
    results: list[dict] = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(specs), out.stdout
    for result in results:
        assert result["dumps"], result  # its steps compiled no graph (0 compiles: one shared with an earlier run)
        step = max(result["dumps"], key=os.path.getsize)  # the training step is the largest graph
        result["hlo"] = Path(step).read_text()
        report = Path(step.replace(".txt", "-memory-usage-report.txt")).read_text()
        result["temp"] = sum(
            int(float(m.group(1)) * {"B": 1, "KiB": 1024, "MiB": 2**20, "GiB": 2**30}[m.group(2)])
            for m in re.finditer(r"size ([\d.]+)(B|KiB|MiB|GiB), preallocated-temp", report)
        )
    return results


# The 4-device runs of the first two tests in one process (one torch_xla start-up, ~7 s, instead of three); their
# graphs differ (rows, optimizer), so each still compiles exactly one: a graph shared with an earlier run would
# count 0. (Not the last test's 192 slots at n = 4: that is the default capacity there, 48, hence the same graph.)
RUNS_4 = [(100_000, "adam", 0), (2_000_000, "adam", 0), (100_000, "adafactor-ema-accum", 0)]


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str, int], dict]:
    return dict(zip(RUNS_4, runs(tmp_path_factory.mktemp("spmd4"), 4, *RUNS_4), strict=True))


def check_step(result: dict, v: int, devices: int = 4) -> list[tuple[str, int]]:
    """The step's collectives as sorted ``(op, bytes per device)``, after checking them."""
    spec = "{devices=[%d,1]%s}" % (devices, ",".join(map(str, range(devices))))
    assert result["compiles"] == 1, result["compiles"]  # 20 steps, one graph
    assert result["fallbacks"] == []
    assert result["before"] == result["after"] == spec
    for name, s in result["slots"].items():
        if name not in ("step", "c", "r_sum"):  # small: replicated
            assert s.startswith("{devices=[%d" % devices), (name, s)  # slots (and per-shard buffers) row-sharded
    ops = collectives(result["hlo"])
    a2a = [c for c in ops if c[0] == "all-to-all"]
    assert len(a2a) == 3, ops  # ids out, rows back, gradient rows out: one routing for both features
    for op, shapes, size in ops:
        assert op in ("all-to-all", "all-reduce"), ops  # no all-gather of ids or rows
        if op == "all-reduce":
            assert size <= SMALL, (op, shapes)
    # No copy of a table shard: donated table and slots keep distinct sizes and stay in place.
    assert large_copies(result["hlo"], v // devices // 2) == []
    return sorted((op, size) for op, _, size in ops)


def test_row_sharded_adam_step_hlo_and_flat_memory(four: dict) -> None:
    small, large = 100_000, 2_000_000
    results = {v: four[(v, "adam", 0)] for v in (small, large)}
    for v, r in results.items():
        check_step(r, v)
    # Cost flat in the vocabulary: the same temporaries at 20x the rows.
    assert results[small]["temp"] == results[large]["temp"], (results[small]["temp"], results[large]["temp"])
    assert results[small]["temp"] < small * D * 4 // 4  # smaller than one table shard


def test_row_sharded_adafactor_with_ema_and_accumulation(four: dict) -> None:
    v = 100_000
    r = four[(v, "adafactor-ema-accum", 0)]
    check_step(r, v)
    assert r["slots"]["r"].startswith("{devices=[4]"), r["slots"]  # the row statistic is row-sharded
    assert r["slots"]["acc_ids"].startswith("{devices=[4,1]"), r["slots"]  # accumulation buffers per shard


def test_step_collectives_do_not_grow_with_the_device_count(tmp_path: Path) -> None:
    """16 examples per device (80 ids), n · capacity = 192 routing slots per device at n = 2 and n = 4: the
    step's collectives and their sizes are the same list."""
    slots, v = 192, 100_000
    per_n = {n: check_step(runs(tmp_path / f"n{n}", n, (v, "adam", slots))[0], v, devices=n) for n in (2, 4)}
    assert per_n[2] == per_n[4], per_n
    a2a = sorted(size for op, size in per_n[2] if op == "all-to-all")
    assert a2a == sorted([slots * 4, slots * D * 4, slots * D * 4])  # int32 ids, float32 rows
