"""The exact figures README.md and docs/ state about the code equal what the code does.

Each test finds the sentence that states a figure (whitespace-normalised, so a reflowed line still
matches), reads the number out of it, and compares it with the value in the code: a default, a
constant, a computed capacity, an API list or a pin. Changing either side alone fails here, naming
the doc. Values that live in modules importing torch_xla are read from their source (``ast``), so this
runs without torch_xla.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import torch_tpu_embedding as tte
from torch_tpu_embedding._util import heap, huge_pages, registry
from torch_tpu_embedding.checkpoint import logical_rows, publish
from torch_tpu_embedding.config import DEFAULT_REPLICATE_BELOW_BYTES
from torch_tpu_embedding.optim._core import update_paths
from torch_tpu_embedding.optim._kernels import additive, row_update
from torch_tpu_embedding.optim._kernels.c_rules_source import JOIN_IDS
from torch_tpu_embedding.routing import default_capacity

ROOT = Path(__file__).parents[2]
MIB = 1 << 20


def flat(name: str) -> str:
    """A doc's text with every run of whitespace made one space."""
    return " ".join((ROOT / name).read_text(encoding="utf-8").split())


def found(pattern: str, name: str, count: int = 1) -> list[re.Match[str]]:
    """The matches of ``pattern`` in doc ``name``; fails unless there are exactly ``count``."""
    matches = list(re.finditer(pattern, flat(name)))
    assert len(matches) == count, f"{name}: expected {count} match(es) of {pattern!r}, found {len(matches)}"
    return matches


def number(text: str) -> int:
    """``'16,384'`` → 16384, ``'2**20'`` → 1048576."""
    text = text.replace(",", "")
    if "**" in text:
        base, exp = text.split("**")
        return int(base) ** int(exp)
    return int(text)


def source_value(path: str, name: str) -> Any:
    """The literal a module assigns to ``name`` at its top level (``X = 512``, ``X = 4 << 20``), or the
    default argument of the call it assigns (``X = _env_count("X", 50)``), read from the source."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
                value = node.value
                if isinstance(value, ast.Call):
                    value = value.args[-1]
                return eval(compile(ast.Expression(value), path, "eval"), {})  # noqa: S307 - a literal expression
    raise AssertionError(f"{path} assigns no {name}")


def load_script(path: str) -> ModuleType:
    """A script of the repository imported by path (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ the update kernel's policy
def test_kernel_policy_defaults() -> None:
    """design.md and guide.md: the kernel is built from call ``TTE_KERNEL_AFTER`` (50), for tables of
    ``TTE_KERNEL_MIN_ELEMENTS`` (2**20) numbers or more."""
    after = source_value("torch_tpu_embedding/optim/_kernels/kernel_policy.py", "_AFTER")
    min_elements = source_value("torch_tpu_embedding/optim/_kernels/kernel_policy.py", "_MIN_ELEMENTS")
    design = found(r"`TTE_KERNEL_AFTER` \((\d+)\) and always when it holds fewer than `TTE_KERNEL_MIN_ELEMENTS` "
                   r"\((\d+\*\*\d+)\) numbers", "docs/design.md")[0]
    assert (number(design[1]), number(design[2])) == (after, min_elements)
    guide = found(r"The first (\d+) calls of the optimizer \(`TTE_KERNEL_AFTER`\), and every call for a table of "
                  r"fewer than (\d+\*\*\d+) numbers \(`TTE_KERNEL_MIN_ELEMENTS`\)", "docs/guide.md")[0]
    assert (number(guide[1]), number(guide[2])) == (after, min_elements)
    sgd_add = found(r"\(its `usable` and `policy`: call (\d+) on, tables of (\d+\*\*\d+) numbers or more\)",
                    "docs/design.md")[0]
    assert (number(sgd_add[1]), number(sgd_add[2])) == (after, min_elements)


def test_row_chunk_sizes() -> None:
    """design.md: the kernel's ranges of distinct ids, the reference path's row chunks, SGD's spread."""
    kernel = found(r"works a range of ([\d,]+) distinct ids at a time \((\d+) MB of (\d+)-wide rows, `chunk_rows`",
                   "docs/design.md")[0]
    assert number(kernel[1]) == row_update.chunk_rows(number(kernel[3]))
    assert number(kernel[2]) * MIB == number(kernel[1]) * number(kernel[3]) * 4  # float32 rows
    chunks = found(r"run in chunks of ([\d,]+) rows \(([\d,]+) with several torch threads\)", "docs/design.md")[0]
    assert (number(chunks[1]), number(chunks[2])) == (update_paths.ROW_CHUNK, update_paths.ROW_CHUNK_PARALLEL)
    spread = found(r"spreads it over the bag's ids by their gains ([\d,]+) rows at a time", "docs/design.md")[0]
    assert number(spread[1]) == additive.ADDITIVE_CHUNK
    device = found(r"(\d+) MiB of rows at a time, `ADDITIVE_DEVICE_BYTES`, ([\d,]+) rows of (\d+) float32",
                   "docs/design.md")[0]
    assert number(device[1]) * MIB == additive.ADDITIVE_DEVICE_BYTES == number(device[2]) * number(device[3]) * 4



def test_id_join_block() -> None:
    """design.md and benchmarks.md: the C join of host ids works 512 ids of a feature at a time, the widest bag it takes."""
    design = found(r"in blocks of (\d+) ids per feature", "docs/design.md")[0]
    bench = found(r"The pass works a block of (\d+) ids per feature at a time", "docs/benchmarks.md")[0]
    assert number(design[1]) == number(bench[1]) == JOIN_IDS


# ------------------------------------------------------------------ host memory
def test_host_memory_thresholds() -> None:
    """design.md and guide.md: huge pages from 32 MiB; glibc primed by one 31 MiB block (62 MiB trim)."""
    for doc in ("docs/design.md", "docs/guide.md"):
        for m in found(r"(\d+) MiB and more", doc):
            assert int(m[1]) * MIB == huge_pages.MIN_BYTES, doc
    design = found(r"one (\d+) MiB block allocated and freed unwritten, which glibc's own adaptation turns into a "
                   r"(\d+) MiB mmap threshold and a (\d+) MiB trim threshold", "docs/design.md")[0]
    assert [int(design[i]) * MIB for i in (1, 2, 3)] == [heap.PRIME_BYTES, heap.PRIME_BYTES, 2 * heap.PRIME_BYTES]
    guide = found(r"freeing one (\d+) MiB block does .* blocks under (\d+) MiB then come from the heap and up to "
                  r"(\d+) MiB of freed heap is kept", "docs/guide.md")[0]
    assert [int(guide[i]) * MIB for i in (1, 2, 3)] == [heap.PRIME_BYTES, heap.PRIME_BYTES, 2 * heap.PRIME_BYTES]


def test_checkpoint_load_budget() -> None:
    """checkpoints.md: a load grows a rank's memory by at most one chunk; its buffer and reserve."""
    chunk = found(r"at most one (\d+) MiB chunk \(`checkpoint/publish.CHUNK`\)", "docs/checkpoints.md")[0]
    assert int(chunk[1]) * MIB == publish.CHUNK
    buffer = found(r"`BUFFER` = `CHUNK` − `RESERVE` = ([\d.]+) MiB", "docs/checkpoints.md")[0]
    assert float(buffer[1]) * MIB == publish.BUFFER == publish.CHUNK - publish.RESERVE
    reserve = found(r"`RESERVE` \((\d+) KiB\)", "docs/checkpoints.md")[0]
    assert int(reserve[1]) * 1024 == publish.RESERVE
    window = found(r"a mapping of at most (\d+) MiB that `window_rows` sizes, .* and ([\d.]+) MiB charged for the "
                   r"ownership's temporaries, computed (\d+) ids at a time", "docs/checkpoints.md")[0]
    assert int(window[1]) * MIB == logical_rows.WINDOW_BYTES
    assert float(window[2]) * MIB == logical_rows._PIECE * logical_rows._LOCATE_BYTES
    assert int(window[3]) == logical_rows._PIECE


# ------------------------------------------------------------------ placement on a mesh
def test_replicate_below_bytes_default() -> None:
    """sharding.md and guide.md: ``"auto"`` replicates tables below 4 MiB."""
    for m in [*found(r"replicated below `replicate_below_bytes` \((\d+) MiB\)", "docs/sharding.md"),
              *found(r"replicated below (\d+) MiB \(`replicate_below_bytes`\)", "docs/guide.md", count=2)]:
        assert int(m[1]) * MIB == DEFAULT_REPLICATE_BELOW_BYTES


def test_row_alignment() -> None:
    """sharding.md and checkpoints.md: sharded tables get rows up to a multiple of ``lcm(512, devices)``,
    and on 6 or 768 devices that block is 1,536."""
    spmd = source_value("torch_tpu_embedding/xla/sharding.py", "ROW_ALIGNMENT")
    groups = source_value("torch_tpu_embedding/distributed/sharding.py", "ROW_ALIGNMENT")
    stated = found(r"rows up to a multiple of `lcm\((\d+), devices\)` \(`ROW_ALIGNMENT`\)", "docs/sharding.md")[0]
    assert int(stated[1]) == spmd == groups
    odd = found(r"the device count above (\d+); ([\d,]+) for 6 or 768 devices", "docs/sharding.md")[0]
    assert int(odd[1]) == spmd and number(odd[2]) == math.lcm(spmd, 6) == math.lcm(spmd, 768)
    ckpt = found(r"\(`torch_tpu_embedding\.xla\.sharding\.ROW_ALIGNMENT`; any device count dividing (\d+)\)",
                 "docs/checkpoints.md")[0]
    assert int(ckpt[1]) == spmd


def test_default_capacity_table() -> None:
    """sharding.md's table of ``n·k / N`` under the default capacity, its n = 8 / n = 2 byte ratio, and the
    capacities its worked examples quote, as ``routing.default_capacity`` computes them now."""
    text = flat("docs/sharding.md")
    header = found(r"\| ids per device `N` \| ((?:n = \d+ \| )+)bytes n = 8 / n = 2 \|", "docs/sharding.md")[0]
    ns = [int(n) for n in re.findall(r"n = (\d+)", header[1])]
    rows = re.findall(r"\| ([\d,]+) ((?:\| [\d.]+ )+)\|", text[header.end():header.end() + 1000])
    assert len(rows) == 5, rows
    for n_ids, cells in rows:
        big_n = number(n_ids)
        values = cells.replace("|", " ").split()
        want = [f"{default_capacity(big_n, n) * n / big_n:.2f}" for n in ns]
        want.append(f"{default_capacity(big_n, 8) * 8 / (default_capacity(big_n, 2) * 2):.2f}")
        assert values == want, (big_n, values, want)
    checked = found(r"n = 2, k = (\d+) gives 2·\d+·516 = ([\d,]+) bytes, n = 8, k = (\d+) gives ([\d,]+) bytes",
                    "docs/sharding.md")[0]
    k2, k8 = default_capacity(576, 2), default_capacity(576, 8)
    assert (int(checked[1]), int(checked[3])) == (k2, k8)
    assert (number(checked[2]), number(checked[4])) == (2 * k2 * 516, 8 * k8 * 516)
    pod = found(r"id exchange, default `k = (\d+)`", "docs/sharding.md")[0]
    assert int(pod[1]) == default_capacity(26_624, 256)
    small = found(r"on 256 chips the default is `k = (\d+)`", "docs/sharding.md")[0]
    assert int(small[1]) == default_capacity(576, 256)
    ranks = found(r"`routing\.default_capacity` \((\d+), overflow probability 1e-6\)", "docs/sharding.md")[0]
    assert int(ranks[1]) == default_capacity(26_624, 64)


def test_dlrm_example_flags() -> None:
    """sharding.md's list of ``examples/dlrm_synthetic.py``'s placements and optimizers."""
    dlrm = load_script("examples/dlrm_synthetic.py")
    placements = found(r"`--placement \{([\w,]+)\}` \(every table; `(\w+)`, also accepted, is for process groups",
                       "docs/sharding.md")[0]
    assert [*placements[1].split(","), placements[2]] == list(tte.PLACEMENTS)
    left_out = found(r"`--optimizer` \(tables: any `tte\.optim` name but `(\w+)`\)", "docs/sharding.md")[0]
    assert set(dlrm.TABLE_LR) == set(registry.OPTIMIZER_NAMES) - {left_out[1]}
    dense = found(r"`--dense-optimizer \{([\w,-]+)\}`", "docs/sharding.md")[0]
    assert tuple(dense[1].split(",")) == tuple(dlrm.DENSE_OPTIMIZERS)


# ------------------------------------------------------------------ README
def test_readme_names_every_optimizer() -> None:
    """README.md's optimizer bullet names every optimizer the registry holds, and no other."""
    bullet = found(r"\* Optimizers \(`tte\.optim`\): (.*?) with factored .*? and (\w+) \(FBGEMM's", "README.md")[0]
    named = set(re.findall(r"[A-Z]\w+", bullet[1].replace("TPU ", ""))) | {bullet[2]}
    classes = {registry.optimizer_class(name).__name__ for name in registry.OPTIMIZER_NAMES}
    assert named == classes


def _pins(path: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / path).read_text(encoding="utf-8").splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            out[name.lower()] = version
    return out


@pytest.mark.parametrize("pattern", [
    r"the pinned torch ([\d.]+) and torch_xla ([\d.]+)",
    r"\(`\.ci/requirements\.txt`: torch ([\d.]+), torch_xla ([\d.]+),",
], ids=["movielens runs", "ci pins"])
def test_readme_torch_pins(pattern: str) -> None:
    """README.md's torch and torch_xla versions are the CI pins."""
    m = found(pattern, "README.md")[0]
    pins = _pins(".ci/requirements.txt")
    assert (m[1], m[2]) == (pins["torch"], pins["torch_xla"])


def test_readme_torch213_and_recbole_pins() -> None:
    """README.md's torch 2.13 lock and the recbole version the example asks for."""
    torch213 = found(r"`torch==([\w.+]+)`, so pip never pulls the CUDA build", "README.md")[0]
    assert torch213[1] == _pins(".ci/requirements-torch213.txt")["torch"]
    recbole = found(r"--no-deps recbole==([\d.]+)", "README.md")[0]
    assert f"recbole=={recbole[1]}" in source_value("examples/movielens.py", "RECBOLE_INSTALL")


def test_import_graph_limits() -> None:
    """design.md: at most 12 files at the top of the package and 15 modules in a subpackage."""
    m = found(r"at most (\d+) files at the top of the package and (\d+) modules in a subpackage", "docs/design.md")[0]
    script = load_script("scripts/import_graph.py")
    assert (int(m[1]), int(m[2])) == (script.MAX_TOP_FILES, script.MAX_SUBPACKAGE_MODULES)


# ------------------------------------------------------------------ reliability.md's case counts
@pytest.mark.parametrize(("pattern", "test_file", "cases"), [
    (r"`tests/modules/test_bad_inputs\.py` has (\d+) cases", "tests/modules/test_bad_inputs.py", "CASES"),
    (r"`tests/package/test_safe_files_and_inputs\.py::test_input_is_never_converted_silently`, (\d+) cases",
     "tests/package/test_safe_files_and_inputs.py", "INPUT_CASES"),
    (r"`tests/package/test_safe_files_and_inputs\.py::test_save_refuses_extras_load_cannot_read`, (\d+) cases",
     "tests/package/test_safe_files_and_inputs.py", "BAD_EXTRAS"),
], ids=["bad inputs", "never converted silently", "extras load cannot read"])
def test_reliability_case_counts(pattern: str, test_file: str, cases: str) -> None:
    """reliability.md's counts of the cases these tests are parametrized over."""
    m = found(pattern, "docs/reliability.md")[0]
    assert int(m[1]) == len(getattr(load_script(test_file), cases))


# ------------------------------------------------------------------ configs
@pytest.mark.parametrize("doc", ["docs/configs.md", "docs/optimizers.md"])
def test_optimizer_names_a_table_config_accepts(doc: str) -> None:
    """The names ``TableConfig(optimizer=...)`` accepts, as configs.md and optimizers.md list them."""
    listed = found(r"`((?:'\w+' \\?\| )+'\w+')`", doc)[0]
    assert tuple(re.findall(r"'(\w+)'", listed[1])) == registry.OPTIMIZER_NAMES


def test_config_dtypes_and_combiners() -> None:
    """configs.md's table: the dtypes a table may have and the combiners, as ``TableConfig`` checks them."""
    from torch_tpu_embedding import config

    dtypes = found(r"\| `dtype` \| float32 \(default\), ((?:\w+, )+\w+) \|", "docs/configs.md")[0]
    assert ["float32", *dtypes[1].split(", ")] == [str(d).removeprefix("torch.") for d in config._FLOAT_DTYPES]
    combiners = found(r"\| `combiner` \| `\"(\w+)\"` \(default\), ((?:`\"\w+\"`, )+`\"\w+\"`);", "docs/configs.md")[0]
    assert [combiners[1], *re.findall(r"\"(\w+)\"", combiners[2])] == list(config.COMBINERS)
    assert config.TableConfig(4, 2).combiner == combiners[1] and config.TableConfig(4, 2).dtype == torch.float32


def test_meta_build_chunk() -> None:
    """guide.md: a table built on the meta device is drawn 4 MiB of rows at a time (``CHUNK_BYTES``)."""
    from torch_tpu_embedding.modules import deferred_init

    m = found(r"(\d+) MiB of rows at a time \(`torch_tpu_embedding\.modules\.deferred_init\.CHUNK_BYTES`\)",
              "docs/guide.md")[0]
    assert int(m[1]) * MIB == deferred_init.CHUNK_BYTES


def test_exchange_bytes_follow_the_default_capacity() -> None:
    """sharding.md's measured exchange bytes per device are ``n·k · (4 + 2·64·4)`` plus 24 bytes of scalar
    all-reduces with ``k = default_capacity(N, n)``: if the capacity rule changes, these HLO figures are
    stale (rerun ``benchmarks/spmd_scaling.py``)."""
    per_slot = 4 + 2 * 64 * 4
    row = found(r"\| (\d) \| ([\d,]+) \(k = (\d+)\) \| [\d,]+ \(k = \d+\) \|", "docs/sharding.md", count=3)
    for m in row:
        n, k = int(m[1]), int(m[3])
        assert k == default_capacity(576, n) and number(m[2]) == n * k * per_slot + 24, m[0]
    for examples, pattern in [(256, r"\(`N = 2,304`\), the default capacity gives ([\d,]+), ([\d,]+) and ([\d,]+) bytes"),
                              (1024, r"\(`N = 9,216`, the per-chip batch of the pod below\) ([\d,]+), ([\d,]+) and "
                                     r"([\d,]+):")]:
        m = found(pattern, "docs/sharding.md")[0]
        big_n = 9 * examples
        assert [number(m[i]) for i in (1, 2, 3)] == [
            n * default_capacity(big_n, n) * per_slot + 24 for n in (2, 4, 8)], m[0]


def test_readme_counts_the_tensorflow_back_end_cases() -> None:
    """README.md: the CPU suite's live comparisons with Keras on its TensorFlow back end (skipped where
    TensorFlow is not installed), counted as pytest collects them."""
    import subprocess
    import sys

    m = found(r"Of the skipped CPU cases, (\d+) are the live comparison with Keras on its TensorFlow back end",
              "README.md")[0]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          "tests/optim/test_keras_reference.py"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    assert int(m[1]) == sum("tensorflow" in line for line in ids), ids


# ------------------------------------------------------------------ references between docs
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _headings(path: Path) -> list[str]:
    return [" ".join(m.group(1).split()) for m in re.finditer(r"^#+ (.*)$", path.read_text(encoding="utf-8"), re.M)]


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_cited_benchmark_sections_exist(doc: Path) -> None:
    """Every ``docs/benchmarks.md, "<section>"`` a figure points to names a heading of docs/benchmarks.md."""
    heads = _headings(ROOT / "docs" / "benchmarks.md")
    text = " ".join(doc.read_text(encoding="utf-8").split())
    cited = re.findall(r"benchmarks\.md`?,? \(?\"([^\"]+)\"", text)
    assert [c for c in cited if not any(c in h for h in heads)] == []


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_relative_links_resolve(doc: Path) -> None:
    """Relative Markdown links point to files of the repository (and their anchors to headings)."""
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.name}: {target}"
        if anchor and dest.suffix == ".md":
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in _headings(dest)}
            assert anchor in slugs, f"{doc.name}: {target}"


def test_default_capacity_docstring() -> None:
    """``routing.default_capacity``'s own worked examples (``help()`` shows them) are what it computes."""
    doc = " ".join(str(default_capacity.__doc__).split())
    rows = re.search(r"``n·k`` rows per device: at ``N = 576`` that is (\d+), (\d+) and (\d+) for ``n = 2, 4, 8``", doc)
    small = re.search(r"``N = 576, n = 256``: ``k`` = (\d+), ``n·k`` = ([\d.]+) N", doc)
    pod = re.search(r"``N = 26,624``: ``k`` = (\d+), ([\d.]+) N", doc)
    assert rows is not None and small is not None and pod is not None, doc
    assert [int(rows[i]) for i in (1, 2, 3)] == [n * default_capacity(576, n) for n in (2, 4, 8)]
    assert (int(small[1]), small[2]) == (default_capacity(576, 256), f"{256 * default_capacity(576, 256) / 576:.1f}")
    assert (int(pod[1]), pod[2]) == (default_capacity(26_624, 256),
                                     f"{256 * default_capacity(26_624, 256) / 26_624:.2f}")
