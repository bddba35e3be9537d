"""README.md's MovieLens figures are what ``examples/movielens.py`` prints (issue 29, item 8).

The README shows the last lines of a default run (random split, XLA, XLA:CPU here) for each CPU it
records (model name, cpu family, model and flags of ``/proc/cpuinfo``, and the cores the run had): valid
AUC, test AUC, log loss, best epoch and our model's compile count. The figures depend on the CPU (XLA:CPU
compiles for its vector instructions and splits a reduction over its threads, one per core, so float32
sums round differently, and early stopping turns a last-digit difference into another best epoch), so
README.md also states bands that every CPU's run must fall in. This test runs that command; on a CPU
README.md records, with as many cores, it fails when any printed figure differs from that CPU's lines
(the training time is the machine's and is not compared), and on every CPU when a figure falls outside
the bands. The run takes minutes (2 to 4 on the project's 2-core machines under load). It skips, as
tests/docs/test_movielens_example.py does, without recbole's ml-100k files or torch_xla.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "examples" / "movielens.py"
#: our model's row of the result table: valid AUC, test AUC, log loss, best epoch, time, compiles
ROW = re.compile(r"^ours \(Adagrad \+ FTRL \+ Adam\) +(\d\.\d{4}) +(\d\.\d{4}) +(\d\.\d{4}) +(\d+) +[\d.]+s +(\d+)$",
                 re.MULTILINE)
FINAL = re.compile(r"^test AUC (\d\.\d{4})  log loss (\d\.\d{4})  \(best epoch (\d+)\)$", re.MULTILINE)
#: the line naming the CPU of the run shown below it
CPU = re.compile(r"^On an? [^(\n]*\(`/proc/cpuinfo`: model name `([^`]+)`, cpu family (\d+), model (\d+),\s+"
                 r"flags ([a-z0-9_, ]+)\),\s+(\d+) cores?,", re.MULTILINE)
NAMES = ("valid AUC", "test AUC", "log loss", "best epoch", "compiles")
#: the bands sentence (whitespace joined into single spaces), one "<name> <low> to <high>" per figure
BANDS = re.compile(r"within these bands: valid AUC ([\d.]+) to ([\d.]+), test AUC ([\d.]+) to ([\d.]+), "
                   r"log loss ([\d.]+) to ([\d.]+), best epoch (\d+) to (\d+), compiles (\d+)\.")
#: the widest bands this test accepts: wide enough for another best epoch, narrow enough that a run which
#: learns less (``--short``: test AUC 0.7564) or an optimizer gone wrong cannot pass as another CPU's digits
WIDEST = {"valid AUC": 0.012, "test AUC": 0.012, "log loss": 0.025, "best epoch": 16}
#: the CPUs the project runs on: README.md must show a run of each (a substring of the model name)
PROJECT_CPUS = ("Intel(R) Xeon(R)", "AMD EPYC")


class Cpu(NamedTuple):
    model_name: str
    family: int
    model: int
    flags: frozenset[str]
    cores: int  # the CPUs the run could use (its affinity): XLA:CPU's threads


class Run(NamedTuple):
    """One CPU's run as README.md shows it: the table row (NAMES) and the last line."""
    cpu: Cpu
    row: dict[str, str]
    final: tuple[str, ...]


def printed(text: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """The one table row (by NAMES) and the one last line of a run in ``text``."""
    rows, finals = ROW.findall(text), FINAL.findall(text)
    assert len(rows) == 1 and len(finals) == 1, text
    return dict(zip(NAMES, rows[0], strict=True)), finals[0]


def readme_runs() -> list[Run]:
    """README.md's runs, one per CPU line: the text between a CPU line and the next (or the bands)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    cpus = list(CPU.finditer(text))
    assert cpus, "README.md must show a default MovieLens run under a line naming its CPU"
    bands_at = text.find("within these bands", cpus[-1].end())
    assert bands_at > 0, "README.md must state the bands after the runs"
    ends = [m.start() for m in cpus[1:]] + [bands_at]
    runs = []
    for m, end in zip(cpus, ends, strict=True):
        flags = frozenset(f.strip() for f in m.group(4).split(",") if f.strip())
        cpu = Cpu(m.group(1), int(m.group(2)), int(m.group(3)), flags, int(m.group(5)))
        runs.append(Run(cpu, *printed(text[m.end():end])))
    assert len(ROW.findall(text)) == len(FINAL.findall(text)) == len(runs), "a run shown without its CPU line"
    return runs


def readme_bands() -> dict[str, tuple[float, float]]:
    """README.md's bands (low, high) by NAMES; compiles: (n, n)."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    found = BANDS.findall(text)
    assert len(found) == 1, "README.md must state the bands of the MovieLens figures once"
    b = [float(x) for x in found[0]]
    return {"valid AUC": (b[0], b[1]), "test AUC": (b[2], b[3]), "log loss": (b[4], b[5]),
            "best epoch": (b[6], b[7]), "compiles": (b[8], b[8])}


def outside_bands(row: dict[str, str], bands: dict[str, tuple[float, float]]) -> dict[str, str]:
    """The figures of ``row`` that fall outside ``bands``."""
    return {k: v for k, v in row.items() if not bands[k][0] <= float(v) <= bands[k][1]}


def this_cpu() -> Cpu | None:
    """The running CPU from /proc/cpuinfo (its first processor) and the cores this process may run on, or None
    where there is none to read."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    try:
        return Cpu(fields["model name"], int(fields["cpu family"]), int(fields["model"]),
                   frozenset(fields["flags"].split()), len(os.sched_getaffinity(0)))
    except (KeyError, ValueError):
        return None


def _key(cpu: Cpu) -> tuple[str, int, int, int]:
    return cpu.model_name, cpu.family, cpu.model, cpu.cores


def recorded_run(cpu: Cpu | None, runs: list[Run]) -> Run | None:
    """README.md's run of ``cpu``: the same model name, family, model and cores, and every flag the README lists
    (on one core the AMD EPYC prints other digits than on two)."""
    if cpu is None:
        return None
    found = [r for r in runs if _key(r.cpu) == _key(cpu) and r.cpu.flags <= cpu.flags]
    assert len(found) <= 1, f"README.md shows {len(found)} runs for this CPU: {_key(cpu)}"
    return found[0] if found else None


def test_readme_figures_agree_with_each_other() -> None:
    """Each CPU's table row and last line state the same test AUC, log loss and epoch; each CPU appears
    once; the project's CPUs (an Intel Xeon, an AMD EPYC) are all shown; every run lies within the bands,
    and the bands are no wider than WIDEST."""
    runs, bands = readme_runs(), readme_bands()
    for run in runs:
        assert (run.row["test AUC"], run.row["log loss"], run.row["best epoch"]) == run.final, run
        assert not outside_bands(run.row, bands), (run, bands)
    keys = [_key(r.cpu) for r in runs]
    assert len(set(keys)) == len(keys), keys
    for name in PROJECT_CPUS:
        assert any(name in r.cpu.model_name for r in runs), f"README.md shows no run on the project's {name}"
    for name, widest in WIDEST.items():
        low, high = bands[name]
        assert 0 < high - low <= widest, (name, bands[name])
    assert len({r.row["compiles"] for r in runs}) == 1  # the number of graphs does not depend on the CPU


def test_recorded_run_matches_by_cpu() -> None:
    """A CPU matches README.md's run by its model name, family, model and cores with the listed flags; another
    CPU, another number of cores, or one without a listed flag, matches none."""
    runs = readme_runs()
    for run in runs:
        assert recorded_run(run.cpu._replace(flags=run.cpu.flags | {"sse2"}), runs) == run
        assert recorded_run(run.cpu._replace(model=run.cpu.model + 1000), runs) is None
        assert recorded_run(run.cpu._replace(cores=run.cpu.cores + 1), runs) is None
        assert recorded_run(run.cpu._replace(flags=frozenset({"sse2"})), runs) is None
    assert recorded_run(None, runs) is None


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
    row, final = printed(out.stdout)
    assert (row["test AUC"], row["log loss"], row["best epoch"]) == final, out.stdout
    cpu = this_cpu()
    outside = outside_bands(row, readme_bands())
    assert not outside, f"outside README.md's bands on {cpu and _key(cpu)}: {outside}\n{out.stdout}"
    run = recorded_run(cpu, readme_runs())
    if run is not None:  # a CPU README.md records: its exact digits
        assert row == run.row, f"README.md's run on {_key(run.cpu)}: {run.row}\n{out.stdout}"
