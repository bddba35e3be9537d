"""Reading XLA's optimized HLO dumps: the collectives of a compiled step, their bytes, and copies.

Dump with ``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`` (set before torch_xla starts).
Under SPMD, ``DIR/*SyncTensorsGraph*after_optimizations.txt`` is the partitioned per-device program,
so the shapes in it are per-device shapes. Graphs named ``ReplicateShardedData`` come from ``.cpu()``
of a sharded tensor and are not part of a step. Pure text processing: no torch_xla needed.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable

__all__ = [
    "COLLECTIVES",
    "Collective",
    "collective_bytes",
    "collectives",
    "large_copies",
    "step_hlo_path",
]

#: Collective ops counted by :func:`collectives`.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
          "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_LINE = re.compile(
    r"=\s*(?P<type>\([^()]*\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(COLLECTIVES) + r")(?P<suffix>-start|-done)?\("
)
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_COPY = re.compile(r"=\s*\w+\[([\d,]*)\]\S*\s+copy\(")

#: ``(op, [(dtype, dims), ...], bytes)`` of one collective: its result (a tuple for the
#: multi-operand ``all-to-all``), per device.
Collective = tuple[str, list[tuple[str, tuple[int, ...]]], int]


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def collectives(hlo: str) -> list[Collective]:
    """Every collective of ``hlo`` with its result shapes and bytes (an async pair counted once, at
    its ``-done``)."""
    out: list[Collective] = []
    for m in _LINE.finditer(hlo):
        if m.group("suffix") == "-start":
            continue
        shapes = [(dt, _dims(dims)) for dt, dims in _SHAPE.findall(m.group("type"))]
        size = 0
        for dt, dims in shapes:
            count = 1
            for d in dims:
                count *= d
            size += count * _BYTES.get(dt, 4)
        out.append((m.group("op"), shapes, size))
    return out


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes per device moved by each kind of collective in ``hlo`` (sizes of their results)."""
    total: dict[str, int] = {}
    for op, _, size in collectives(hlo):
        total[op] = total.get(op, 0) + size
    return total


def large_copies(hlo: str, min_rows: int) -> list[tuple[int, ...]]:
    """Shapes of ``copy`` ops whose first dimension is at least ``min_rows`` (table-sized copies: the
    sign of mis-paired donated buffers)."""
    return [d for d in (_dims(x) for x in _COPY.findall(hlo)) if d and d[0] >= min_rows]


def step_hlo_path(dump_dir: str, exclude: Iterable[str] = ()) -> str:
    """The largest ``*SyncTensorsGraph*after_optimizations.txt`` in ``dump_dir`` not in ``exclude``
    (pass the files present before a phase to get the phase's step graph)."""
    skip = set(exclude)
    files = [f for f in glob.glob(os.path.join(dump_dir, "*SyncTensorsGraph*after_optimizations.txt"))
             if f not in skip]
    if not files:
        raise FileNotFoundError(f"No SyncTensorsGraph after_optimizations dump in {dump_dir}.")
    return max(files, key=os.path.getsize)
