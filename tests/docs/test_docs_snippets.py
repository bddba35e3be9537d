"""Every ```python block in README.md and docs/*.md runs (each file's blocks share one namespace).

A marker line right before a block sends it to a process with a device instead of this CPU test:

* ``<!-- xla -->``: needs an XLA device. ``tests/xla/test_docs_snippets_xla.py`` runs it with
  ``PJRT_DEVICE=CPU`` (one device).
* ``<!-- spmd -->``: needs torch_xla in SPMD mode. ``tests/xla_spmd/test_docs_snippets_spmd.py`` runs
  it with ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4``.

Those tests start ``python tests/docs/test_docs_snippets.py FILE MARKER``: a fresh process that starts
the XLA runtime (SPMD mode for ``spmd``) before any block runs a backward, as a script must, then
runs the file's unmarked blocks and its blocks with that marker, in file order and in one
namespace, so a marked block sees what the blocks before it defined (blocks with another marker are
left out). It stops after the last marked block and prints the indices of the marked blocks it
ran, which the test compares with the file.

Nothing is skipped silently: an unknown marker, a marker that is not directly followed by a
```python fence, Python under another fence name (```py), or a marker whose runner test does not
exist or does not run that marker fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: marker -> the test that runs the blocks it marks
RUNNERS = {
    "xla": ROOT / "tests" / "xla" / "test_docs_snippets_xla.py",
    "spmd": ROOT / "tests" / "xla_spmd" / "test_docs_snippets_spmd.py",
}
#: marker -> the device settings of its process (None: unset)
DEVICE_ENV: dict[str, dict[str, str | None]] = {
    "xla": {"CPU_NUM_DEVICES": None},  # one device
    "spmd": {"CPU_NUM_DEVICES": "4"},
}
FENCE = re.compile(r"^\s*```\s*([^\s`]*)")  # the language; indented fences (in lists) count too
MARKER = re.compile(r"^<!--\s*([\w-]+)\s*-->$")
#: fence names under which Python would not be run
PYTHON_ALIASES = {"py", "python3", "pycon", "ipython", "Python"}


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```python block: its index among the file's Python blocks, first line, marker and code."""

    index: int
    line: int
    marker: str | None
    code: str


def blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file; raises ``ValueError`` on a misplaced or unknown marker."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    out: list[Block] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        fence = FENCE.match(lines[i])
        marker = MARKER.match(stripped)
        if marker:
            if marker.group(1) not in RUNNERS:
                raise ValueError(f"{path.name}:{i + 1}: unknown marker {stripped!r} (known: {sorted(RUNNERS)})")
            nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            if nxt is None or nxt.group(1) != "python":
                raise ValueError(f"{path.name}:{i + 1}: marker {stripped!r} must be directly followed by a "
                                 "```python fence")
        elif fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), None)
            if end is None:
                raise ValueError(f"{path.name}:{i + 1}: unclosed code fence")
            lang = fence.group(1)
            if lang in PYTHON_ALIASES:
                raise ValueError(f"{path.name}:{i + 1}: a ```{lang} block is never run; use ```python")
            if lang == "python":
                prev = MARKER.match(lines[i - 1].strip()) if i else None
                code = textwrap.dedent("".join(lines[i + 1:end]))
                out.append(Block(len(out), i + 2, prev.group(1) if prev else None, code))
            i = end + 1
            continue
        i += 1
    return out


def marked_files(marker: str) -> list[Path]:
    """The docs files that hold at least one block with ``marker``."""
    return [p for p in FILES if any(b.marker == marker for b in blocks(p))]


def run_blocks(path: Path, selected: list[Block]) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for b in selected:
        try:
            exec(compile(b.code, f"{path.name}[block {b.index}, line {b.line}]", "exec"), namespace)  # noqa: S102
        except Exception as e:  # pragma: no cover - the message names the failing block
            raise AssertionError(f"{path.name} block {b.index} (line {b.line}) failed: {e!r}\n{b.code}") from e


def run_marked_file(path: Path, marker: str, cwd: Path) -> None:
    """Run ``path``'s unmarked and ``marker`` blocks in a fresh process (``PJRT_DEVICE=CPU`` and the
    marker's :data:`DEVICE_ENV`); fail unless it ran exactly the file's ``marker`` blocks. Called by
    the runner tests (:data:`RUNNERS`)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    env.pop("XLA_USE_SPMD", None)  # set by use_spmd() in the runner's process; the child sets its own
    for name, value in DEVICE_ENV[marker].items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, str(Path(__file__)), str(path), marker], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=600)
    if out.returncode:
        pytest.fail(f"{path.name}: the docs harness exited with {out.returncode}\n{out.stderr[-6000:]}", pytrace=False)
    want = [b.index for b in blocks(path) if b.marker == marker]
    assert out.stdout.strip().splitlines()[-1] == f"ran {marker} blocks {want}", out.stdout[-3000:]


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_python_blocks_run(path: Path) -> None:
    run_blocks(path, [b for b in blocks(path) if b.marker is None])


GUIDE = ROOT / "docs" / "guide.md"
#: The guide's setup sections (its introduction names them): every other section runs alone after them.
GUIDE_SETUP = (1, 4, 5)
SECTION = re.compile(r"^## (\d+)\. ")


def sections(path: Path) -> dict[int, list[Block]]:
    """The ```python blocks of each numbered ``## N.`` section of ``path``."""
    starts = [(i + 1, int(m.group(1))) for i, line in enumerate(path.read_text(encoding="utf-8").splitlines())
              if (m := SECTION.match(line))]
    out: dict[int, list[Block]] = {n: [] for _, n in starts}
    for b in blocks(path):
        owner = [n for line, n in starts if line < b.line]
        if owner:
            out[owner[-1]].append(b)
    return out


ALONE = [n for n, bs in sections(GUIDE).items() if n not in GUIDE_SETUP and any(b.marker is None for b in bs)]


@pytest.mark.parametrize("section", ALONE, ids=[f"section-{n}" for n in ALONE])
def test_guide_section_runs_alone(section: int) -> None:
    """A guide section runs in a fresh namespace after the setup sections only (the CPU blocks; a
    reader can copy it without the sections between)."""
    by_number = sections(GUIDE)
    setup = [b for n in GUIDE_SETUP if n < section for b in by_number[n]]
    run_blocks(GUIDE, [b for b in [*setup, *by_number[section]] if b.marker is None])


def _runner_assignments(runner: Path) -> dict[str, str]:
    """Top-level ``NAME = <source>`` assignments of a runner test (read, not imported: no torch_xla here)."""
    tree = ast.parse(runner.read_text(encoding="utf-8"))
    return {t.id: ast.unparse(node.value) for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


@pytest.mark.parametrize("marker", sorted(RUNNERS))
def test_marked_blocks_are_run_by_their_runner(marker: str) -> None:
    """Every file with a marked block is a case of the runner test for that marker (no block left unrun)."""
    runner = RUNNERS[marker]
    assert runner.is_file(), f"{runner} runs the `<!-- {marker} -->` blocks and is missing"
    assigned = _runner_assignments(runner)
    assert assigned.get("MARKER") == repr(marker), f"{runner.name} must set MARKER = {marker!r}"
    assert assigned.get("FILES") == "harness.marked_files(MARKER)", (
        f"{runner.name} must run every file with the marker: FILES = harness.marked_files(MARKER)")
    covered = marked_files(marker)
    for path in FILES:
        has = [b.index for b in blocks(path) if b.marker == marker]
        assert bool(has) == (path in covered), (path.name, has)


@pytest.mark.parametrize("text, message", [
    ("<!-- tpu -->\n```python\nx = 1\n```\n", "unknown marker"),
    ("<!-- xla -->\n\n```python\nx = 1\n```\n", "directly followed"),
    ("<!-- xla -->\n```bash\nls\n```\n", "directly followed"),
    ("<!-- xla -->\n```pythonx\nx = 1\n```\n", "directly followed"),
    ("```py\nx = 1\n```\n", "never run"),
    ("```python\nx = 1\n", "unclosed"),
], ids=["unknown marker", "blank line after marker", "marker before bash", "marker before pythonx", "py fence",
        "unclosed fence"])
def test_marker_rules(tmp_path: Path, text: str, message: str) -> None:
    """The parser refuses what would leave a block unrun."""
    path = tmp_path / "case.md"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        blocks(path)


def test_markers_and_indented_blocks_are_parsed(tmp_path: Path) -> None:
    path = tmp_path / "ok.md"
    path.write_text("```python\na = 1\n```\n<!-- spmd -->\n```python\nb = 2\n```\n"
                    "* item\n\n  ```python\n  if a:\n      c = 3\n  ```\n```python title=x.py\nd = 4\n```\n",
                    encoding="utf-8")
    assert [(b.marker, b.code) for b in blocks(path)] == [
        (None, "a = 1\n"), ("spmd", "b = 2\n"), (None, "if a:\n    c = 3\n"), (None, "d = 4\n")]


def main(argv: list[str]) -> None:
    """``python tests/docs/test_docs_snippets.py FILE MARKER``: run FILE's unmarked and MARKER blocks in order."""
    path, marker = Path(argv[0]), argv[1]
    if marker not in RUNNERS:
        raise SystemExit(f"unknown marker {marker!r}")
    found = blocks(path)
    marked = [b.index for b in found if b.marker == marker]
    if not marked:
        raise SystemExit(f"{path.name} has no `<!-- {marker} -->` block")
    # Start the XLA runtime before any block runs a backward, as a script must: the autograd engine
    # sizes its per-device queues at the first backward of the process, and an XLA backward after
    # a CPU one then fails (docs/guide.md, section 7). Under SPMD, use_spmd() comes first; the
    # blocks' own use_spmd() calls are then no-ops.
    import torch_xla
    import torch_xla.runtime as xr

    if marker == "spmd":
        xr.use_spmd()
        xr.global_runtime_device_count()
    else:
        torch_xla.device()
    run_blocks(path, [b for b in found[: marked[-1] + 1] if b.marker in (None, marker)])
    print(f"ran {marker} blocks {marked}")


if __name__ == "__main__":
    main(sys.argv[1:])
